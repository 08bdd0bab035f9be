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
from titan_lowbit.fqn_fragments import selects

from .group_options import check_lr, check_skipped, check_state_options
from .hyperparams import hyper_value, shown
from .muon_exchange import split_dims

# Name fragments of the parameters Muon leaves to AdamW by default: the embedding tables
# (torchtitan's tok_embeddings, Hugging Face's embed_tokens) and the output head
# (torchtitan's output, Hugging Face's lm_head).
DEFAULT_ADAMW_FQNS = ("embed", "output", "lm_head")
# Options of a Muon group that an AdamW group has not, and those the two share.
MUON_ONLY_OPTIONS = ("momentum", "nesterov", "ns_steps", "ns_coefficients", "matched_rms")
SHARED_OPTIONS = ("lr", "weight_decay", "state_format", "weight_update", "block_size", "min_quantized_numel")
# Options fixed once a Muon group's states exist (they set the states' layout).
MUON_FIXED_OPTIONS = ("state_format", "block_size", "weight_update", "min_quantized_numel")
# The key that marks a param group as Muon's (True) or AdamW's (False), as the reference
# Muon's MuonWithAuxAdam marks them.
USE_MUON = "use_muon"


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
    check_skipped(group, where)
