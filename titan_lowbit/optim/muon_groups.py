"""Which parameters ``LowBitMuon`` steps with Muon, and what a Muon param group holds.

Muon orthogonalises the update of a 2-D weight matrix; it does not suit parameters that
are not matrices (norms, biases, scalars, convolution filters) nor the embedding table
and the output head, whose rows are looked up or read one token at a time (the reference
Muon and Moonshot's Moonlight step both with AdamW). The rule, for a param group that
does not say ``use_muon`` itself: a parameter goes to Muon when it is 2-D and its name
(``named_parameters()``) contains none of the AdamW fragments
(``titan_lowbit.fqn_fragments``: substrings, as torchtitan's FQN filters match).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_lowbit.fqn_fragments import selects
from titan_lowbit.kernels.quant_maps import CODEC_DYN4_SIGNED, CODEC_NF4_SIGNED

from .formats import StateFormat
from .group_options import check_lr, check_skipped, check_state_options, fixed_value
from .hyperparams import hyper_value, shown
from .muon_exchange import split_dims

# Name fragments of the parameters Muon leaves to AdamW by default: the embedding tables
# (torchtitan's tok_embeddings, Hugging Face's embed_tokens) and the output head
# (torchtitan's output, Hugging Face's lm_head).
DEFAULT_ADAMW_FQNS = ("embed", "output", "lm_head")
# The levels of a 4-bit momentum (state format "4bit"; the other formats' momentum takes the
# format's first-moment codec). Muon requantizes its stored momentum at every step, and the
# error of each rounding lives on for about 1 / (1 - momentum) steps: QLoRA's NormalFloat4
# levels, dense where most of a block's values lie, halve the stored error of the dynamic
# map that AdamW4bit's first moment uses, and with it most of the loss it costs
# (docs/design_notes.md, "Muon's 4-bit momentum").
MOMENTUM_4BIT_LEVELS = "momentum_4bit_levels"
MOMENTUM_4BIT_CODECS = {"nf4": CODEC_NF4_SIGNED, "dynamic": CODEC_DYN4_SIGNED}
DEFAULT_MOMENTUM_4BIT_LEVELS = "nf4"
# What a state dict or checkpoint that records no momentum_4bit_levels was written with:
# the dynamic map, the only levels of the optimizers that did not record them.
UNRECORDED_MOMENTUM_4BIT_LEVELS = "dynamic"
# The rank k of a bf16 factor P R^T that a "4bit" momentum keeps beside its codes, which
# then hold only the residual (kernels.muon_ref: why, and the step's math); 0: none. A
# matrix keeps min(k, rows, cols). Default 0: the factor brings the 4-bit momentum's loss
# at 1B within 2% of fp32 Muon's but costs host time per matrix on a GPU, and a matrix
# whose columns are split over ranks cannot keep one yet (docs/muon.md).
MOMENTUM_4BIT_FACTOR_RANK = "momentum_4bit_factor_rank"
DEFAULT_MOMENTUM_4BIT_FACTOR_RANK = 0
# Options of a Muon group that a state dict or checkpoint may not record (written before
# they existed), and the value such a one was written with: no factor.
UNRECORDED_MUON_OPTIONS = {MOMENTUM_4BIT_LEVELS: UNRECORDED_MOMENTUM_4BIT_LEVELS, MOMENTUM_4BIT_FACTOR_RANK: 0}
# The options of a "4bit" momentum, their defaults and what each sets (for the refusal of
# one asked for beside another format).
MOMENTUM_4BIT_OPTIONS = {MOMENTUM_4BIT_LEVELS: (DEFAULT_MOMENTUM_4BIT_LEVELS, "sets the levels of a 4-bit momentum"),
                         MOMENTUM_4BIT_FACTOR_RANK: (DEFAULT_MOMENTUM_4BIT_FACTOR_RANK,
                                                     "keeps a factor beside a 4-bit momentum")}
# Options of a Muon group that an AdamW group has not, and those the two share.
MUON_ONLY_OPTIONS = ("momentum", "nesterov", "ns_steps", "ns_coefficients", "matched_rms", MOMENTUM_4BIT_LEVELS,
                     MOMENTUM_4BIT_FACTOR_RANK)
SHARED_OPTIONS = ("lr", "weight_decay", "state_format", "weight_update", "block_size", "min_quantized_numel")
# Options fixed once a Muon group's states exist (they set the states' layout).
MUON_FIXED_OPTIONS = ("state_format", "block_size", "weight_update", "min_quantized_numel", MOMENTUM_4BIT_LEVELS,
                      MOMENTUM_4BIT_FACTOR_RANK)
# The key that marks a param group as Muon's (True) or AdamW's (False), as the reference
# Muon's MuonWithAuxAdam marks them.
USE_MUON = "use_muon"


def momentum_codec(fmt: StateFormat, group: dict[str, Any]) -> int:
    """The codec of a Muon matrix's momentum in format ``fmt`` and param group ``group``."""
    if fmt.name == "4bit":
        return MOMENTUM_4BIT_CODECS[group[MOMENTUM_4BIT_LEVELS]]
    return fmt.m_codec


def factor_rank(p: torch.Tensor, fmt: StateFormat, group: dict[str, Any]) -> int:
    """The rank of the factor beside Muon matrix ``p``'s momentum in format ``fmt`` (its
    ``param_format``) and param group ``group``: ``momentum_4bit_factor_rank``, at most
    the matrix's smaller side, for a "4bit" momentum; 0 for any other."""
    if fmt.name != "4bit":
        return 0
    return min(group[MOMENTUM_4BIT_FACTOR_RANK], *p.shape)


def muon_fixed_value(group: dict[str, Any], key: str) -> Any:
    """A MUON_FIXED_OPTIONS value as it acts on the states (``fixed_value``): the options
    of a 4-bit momentum (MOMENTUM_4BIT_OPTIONS) only with state format "4bit" (else None),
    and their UNRECORDED_MUON_OPTIONS value where a saved group does not record them."""
    if key in MOMENTUM_4BIT_OPTIONS:
        return group.get(key, UNRECORDED_MUON_OPTIONS[key]) if group.get("state_format") == "4bit" else None
    return fixed_value(group, key)


def suits_muon(p: torch.Tensor, name: Optional[str], adamw_fqns: Iterable[str]) -> bool:
    """Whether a parameter of a group without ``use_muon`` goes to Muon."""
    return p.dim() == 2 and not (name is not None and selects(name, adamw_fqns))


def check_muon_param(p: torch.Tensor, name: str) -> None:
    """Refuse a parameter Muon cannot step, naming it and the fix."""
    if p.dim() != 2:
        raise ValueError(f"param '{name}' has shape {tuple(p.shape)}; Muon orthogonalises 2-D matrices only: "
                         f"put it in a param group with {USE_MUON}=False (AdamW), or leave {USE_MUON} out "
                         "and the shape decides")
    split_dims(p, name)  # refuses placements the exchange cannot step


def check_muon_group(group: dict[str, Any], where: str) -> None:
    """Refuse a Muon group whose option has a value LowBitMuon cannot step with."""
    check_lr(group, where)
    beta = hyper_value(where, "momentum", group["momentum"])
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"{where}: momentum={shown(group['momentum'])}; it must lie in [0, 1)")
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"{where}: nesterov={group['nesterov']!r}; use True or False")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 100:
        raise ValueError(f"{where}: ns_steps={steps!r}; use an int in [1, 100] (the reference Muon: 5)")
    coefficients = group["ns_coefficients"]
    if (not hasattr(coefficients, "__len__") or len(coefficients) != 3
            or not all(math.isfinite(hyper_value(where, "ns_coefficients", c)) for c in coefficients)):
        raise ValueError(f"{where}: ns_coefficients={coefficients!r}; use three finite numbers (a, b, c)")
    rms = hyper_value(where, "matched_rms", group["matched_rms"])
    if not (0 < rms < math.inf):
        raise ValueError(f"{where}: matched_rms={shown(group['matched_rms'])}; use a finite number > 0")
    check_state_options(group, where)
    levels = group[MOMENTUM_4BIT_LEVELS]
    if levels not in MOMENTUM_4BIT_CODECS:
        raise ValueError(f"{where}: {MOMENTUM_4BIT_LEVELS}={levels!r}; choose one of {list(MOMENTUM_4BIT_CODECS)}")
    rank = group[MOMENTUM_4BIT_FACTOR_RANK]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{where}: {MOMENTUM_4BIT_FACTOR_RANK}={rank!r}; use an int >= 0 (0: no factor; a matrix "
                         "keeps min(rank, rows, cols))")
    check_skipped(group, where)


def check_4bit_options_asked(options: dict[str, Any], state_format: str, where: str) -> None:
    """Refuse an option of a 4-bit momentum (MOMENTUM_4BIT_OPTIONS) set to other than its
    default in ``options`` (the optimizer's arguments, or a param group as given) whose
    state format ``state_format`` is not "4bit": it would be ignored. A group that only
    inherits the option (e.g. one of fp32 states beside 4-bit ones) keeps it for nothing,
    harmlessly."""
    for key, (default, what) in MOMENTUM_4BIT_OPTIONS.items():
        value = options.get(key, default)
        if value != default and state_format != "4bit":
            raise ValueError(f"{where}: {key}={value!r} {what}, but state_format={state_format!r}: use "
                             "state_format='4bit', or remove it")


def check_factor_param(p: torch.Tensor, rank: int, name: str) -> None:
    """Refuse Muon matrix ``p`` whose momentum would keep a factor of rank ``rank`` > 0
    where it cannot yet: with its columns split over several ranks (tensor parallel's
    column sharding), where a matrix's owner would hold only its columns of the old column
    factor that the new factor starts from, and placed by FSDP2's strided shards (over
    tensor parallel), which the factor's placements do not follow yet. Rows split
    (FSDP2, HSDP, tensor parallel's row sharding) and replicas are fine: every rank holds
    the whole column factor."""
    if not rank or not isinstance(p, DTensor):
        return
    for pl, size in zip(p.placements, p.device_mesh.shape):
        if type(pl) not in (Shard, Replicate) or (size > 1 and type(pl) is Shard and pl.dim % p.dim() != 0):
            raise ValueError(f"param '{name}': {MOMENTUM_4BIT_FACTOR_RANK}={rank} (a factor beside the 4-bit "
                             "momentum) is not yet supported with a matrix's columns split over ranks, nor on "
                             f"FSDP2's strided shards (placements {tuple(p.placements)}): build the optimizer with "
                             f"{MOMENTUM_4BIT_FACTOR_RANK}=0, or shard the matrix by rows only")
