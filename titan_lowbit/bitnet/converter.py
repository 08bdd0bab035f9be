"""torchtitan model converters for BitNet b1.58.

``bitnet``        swaps the weight of every ``nn.Linear`` (except those whose FQN contains
                  a ``[lowbit] bitnet_filter`` fragment) for a ``BitNetTrainingWeight`` and
                  its class for ``BitNetLinear`` (its forward also runs under tensor
                  parallelism); the modules, FQNs and state-dict keys stay as they are.
                  Its ``post_optimizer_hook`` precomputes every weight's scale with one
                  collective per sharded mesh dimension (``[lowbit]
                  bitnet_precompute_scale``). Unsharded weights keep their ternary
                  codes from one optimizer step to the next (``[lowbit]
                  bitnet_keep_codes``). Under ``compile.enable`` it makes
                  Inductor quantize rows in one pass where they fit
                  (``row_reductions``, ``[lowbit] bitnet_persistent_rows``).
``bitnet_subln``  model surgery for torchtitan's llama3 ``TransformerBlock``: an RMSNorm on
                  the input of every linear of the block (SubLN, as BitNet's BitLinear
                  normalizes its own input) and the block's ``attention_norm``/``ffn_norm``
                  removed. Kept separate so ``bitnet`` alone leaves the architecture as it is.

The two are independent and commute: ``bitnet_subln`` normalizes the input of every
linear of the block whether or not ``bitnet`` converts it (a filtered linear that lost
the block norm would otherwise see un-normalized input), and adds no ``nn.Linear``.
Write ``converters = ["bitnet_subln", "bitnet"]`` (either order gives the same model).
"""

from __future__ import annotations

import sys

import torch.nn as nn

from titan_lowbit.bitnet.linear import BitNetLinear
from titan_lowbit.bitnet.weight import (
    BitNetTrainingWeight,
    plain_weight_state_dict_hook,
    precompute_scales,
    refresh_ternary_codes,
    refresh_ternary_codes_hook,
)
from titan_lowbit.fqn_fragments import check_every_fragment_selects, selects
from titan_lowbit.kernels.private_apis import private_api_ok
from titan_lowbit.kernels.bitnet_quant import SUPPORTED_FLOAT_DTYPES

# The int8 tensor-core tile is 16 deep; a linear with fewer inputs or outputs is mostly
# padding on the GPU, and a tensor-wise ternary scale of a handful of values is noise.
MIN_FEATURES = 16
# The converter's settings when the job has no [lowbit] section; titan_lowbit/config.py
# takes its defaults for these keys from here.
DEFAULTS = {
    "bitnet_filter": ("output",),
    "bitnet_precompute_scale": True,
    "bitnet_keep_codes": False,
    "bitnet_int8_backward": True,
    "bitnet_persistent_rows": True,
}


def _lowbit_option(job_config, name: str):
    return getattr(getattr(job_config, "lowbit", None), name, DEFAULTS[name])


def convert_to_bitnet(model: nn.Module, filter_fqns=DEFAULTS["bitnet_filter"],
                      int8_backward: bool = DEFAULTS["bitnet_int8_backward"],
                      keep_codes: bool = DEFAULTS["bitnet_keep_codes"]) -> list[str]:
    """Swap the weights of the model's nn.Linear layers for BitNet training weights.

    A layer is skipped when its FQN contains any fragment of ``filter_fqns``
    (``titan_lowbit.fqn_fragments``). Embeddings
    and every non-Linear module are never touched. State dicts keep plain tensors
    (``plain_weight_state_dict_hook``). ``keep_codes``: the model's forward first brings
    the ternary codes of its unsharded weights up to date and the layers use those
    (``refresh_ternary_codes``) instead of quantizing their weights in every forward.
    Returns the converted FQNs.
    """
    # one fragment, not its characters
    filter_fqns = [filter_fqns] if isinstance(filter_fqns, str) else list(filter_fqns)
    check_every_fragment_selects("bitnet_filter", filter_fqns, [n for n, _ in model.named_modules() if n],
                                 f"module of {type(model).__name__}")
    # Every name of every parameter: a weight shared by two modules (tied) cannot be
    # swapped in one of them without untying it.
    names_of: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(pname)
    # Linears whose weight their parent reads itself, not through F.linear.
    direct = {f"{n}.{c}" if n else c for n, m in model.named_modules()
              if isinstance(m, nn.MultiheadAttention) for c, _ in m.named_children()}
    converted, linears = [], 0
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        linears += 1
        if selects(name, filter_fqns):
            continue
        w = mod.weight
        if isinstance(w, BitNetTrainingWeight):
            # already converted (a second conversion): the same layer, unless asked for
            # another backward
            if w._int8_backward != int8_backward:
                raise ValueError(
                    f"BitNet: linear {name!r} was converted with int8_backward="
                    f"{w._int8_backward}; converting it again with int8_backward="
                    f"{int8_backward} would not change it. Convert once, with the setting wanted."
                )
            converted.append(name)
            continue
        if name in direct:
            raise ValueError(
                f"BitNet: linear {name!r} belongs to an nn.MultiheadAttention, which reads its "
                "weight itself (F.multi_head_attention_forward), not through F.linear: it would "
                f"stay a plain linear. Add {name!r} to [lowbit] bitnet_filter."
            )
        own = f"{name}.weight" if name else "weight"
        tied = [n for n in names_of.get(id(w), []) if n != own]
        if tied:
            raise ValueError(
                f"BitNet: the weight of linear {name!r} is shared with {tied} (tied weights); "
                "converting it would untie them, and the optimizer would update the shared "
                f"values twice. Add {name!r} to [lowbit] bitnet_filter, or untie the weights."
            )
        if min(mod.in_features, mod.out_features) < MIN_FEATURES:
            raise ValueError(
                f"BitNet: linear {name!r} is {mod.in_features}->{mod.out_features}; BitNet "
                f"layers need at least {MIN_FEATURES} inputs and outputs. Add {name!r} to "
                "[lowbit] bitnet_filter."
            )
        if w.dtype not in SUPPORTED_FLOAT_DTYPES:
            raise TypeError(
                f"BitNet: linear {name!r} has weight dtype {w.dtype}; BitNet weights must be "
                f"one of {[str(d) for d in SUPPORTED_FLOAT_DTYPES]}."
            )
        mod.weight = nn.Parameter(BitNetTrainingWeight(w.detach(), int8_backward),
                                  requires_grad=w.requires_grad)
        mod.register_state_dict_post_hook(plain_weight_state_dict_hook)
        if type(mod) is nn.Linear:
            # Same module, a forward that also handles tensor-parallel shards; a subclass
            # of nn.Linear keeps its own class (and is refused under TP).
            mod.__class__ = BitNetLinear
            mod.bitnet_name = name
        converted.append(name)
    if not converted:
        raise ValueError(
            f"converter 'bitnet' found no nn.Linear to convert in {type(model).__name__} "
            f"({linears} nn.Linear layers, all excluded by [lowbit] bitnet_filter = "
            f"{filter_fqns})" if linears else
            f"converter 'bitnet' found no nn.Linear layers in {type(model).__name__}; "
            "remove 'bitnet' from [model] converters."
        )
    if keep_codes and not getattr(model, "_bitnet_keeps_codes", False):
        model.register_forward_pre_hook(refresh_ternary_codes_hook)
        model._bitnet_keeps_codes = True
    return converted


# torchtitan's converters that swap nn.Linear modules for low-precision ones
# (quantize.linear.float8, quantize.linear.mx); quantize.grouped_mm.* touch MoE experts only.
LINEAR_CONVERTER_PREFIX = "quantize.linear."


class BitNetConverter:
    """``[model] converters = ["bitnet"]``: BitNet b1.58 linear layers (arXiv 2402.17764)."""

    def __init__(self, job_config, parallel_dims):
        names = list(getattr(getattr(job_config, "model", None), "converters", None) or [])
        clash = [n for n in names if n.startswith(LINEAR_CONVERTER_PREFIX)]
        if clash:
            raise ValueError(
                f"[model] converters = {names}: 'bitnet' and {clash} both replace the math of "
                "the nn.Linear layers (ternary weights x int8 activations against low-precision "
                "floats). In a layer both convert, the low-precision linear computes with its own "
                "kernels and reads the BitNet weight as a plain latent tensor: BitNet would "
                "silently not apply. Use one of them."
            )
        self.filter_fqns = list(_lowbit_option(job_config, "bitnet_filter"))
        self.precompute_scale = bool(_lowbit_option(job_config, "bitnet_precompute_scale"))
        self.int8_backward = bool(_lowbit_option(job_config, "bitnet_int8_backward"))
        self.keep_codes = bool(_lowbit_option(job_config, "bitnet_keep_codes"))
        self.converted: list[str] = []
        compiling = bool(getattr(getattr(job_config, "compile", None), "enable", False))
        # Inductor's choices are a private API of torch (kernels/private_apis.py): the module
        # that replaces them is imported only with a tested torch.
        if (compiling and _lowbit_option(job_config, "bitnet_persistent_rows")
                and private_api_ok("torch")):
            from titan_lowbit.bitnet import row_reductions

            row_reductions.install()

    def convert(self, model: nn.Module) -> None:
        self.converted = convert_to_bitnet(model, self.filter_fqns, self.int8_backward,
                                           self.keep_codes)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """After each optimizer step: every sharded weight's scale, one collective per
        sharded mesh dimension in all; the unsharded weights' kept codes (here, while the
        GPU still runs the optimizer step, rather than in the next forward's pre-hook,
        which then finds them fresh)."""
        parts = model if isinstance(model, (list, tuple)) else [model]
        if self.precompute_scale:
            precompute_scales(p for part in parts for p in part.parameters())
        if self.keep_codes:
            refresh_ternary_codes(p for part in parts for p in part.parameters())


def _normalize_input(module: nn.Module, args):
    return (module.bitnet_input_norm(args[0]), *args[1:])


class RemovedBlockNorm(nn.Identity):
    """Stands where a block's attention_norm / ffn_norm was: passes input through.

    The block's ``init_weights`` still calls ``reset_parameters`` on it; that resets the
    per-linear input norms that replaced it (held unregistered, so their parameters keep
    one FQN each, under the linear they normalize).
    """

    def __init__(self, replaced_by: list[nn.Module]):
        super().__init__()
        object.__setattr__(self, "_input_norms", list(replaced_by))

    def reset_parameters(self) -> None:
        for norm in self._input_norms:
            norm.reset_parameters()


def insert_subln(model: nn.Module) -> list[str]:
    """SubLN surgery on every llama3 TransformerBlock; returns the normalized linears' FQNs.

    Imports nothing of torchtitan: a model holding torchtitan's blocks has loaded their
    module, and a model without it has none to rewrite."""
    llama3 = sys.modules.get("torchtitan.models.llama3.model.model")
    block_cls = getattr(llama3, "TransformerBlock", None)
    blocks = [(n, m) for n, m in model.named_modules()
              if block_cls is not None and isinstance(m, block_cls)]
    if not blocks:
        raise ValueError(
            f"converter 'bitnet_subln' rewrites torchtitan llama3 TransformerBlocks, and "
            f"{type(model).__name__} has none; remove 'bitnet_subln' from [model] converters."
        )
    done = []
    for bname, block in blocks:
        if isinstance(block.attention_norm, RemovedBlockNorm):
            raise ValueError(f"converter 'bitnet_subln' was applied twice to block {bname!r}")
        eps = block.attention_norm.eps
        halves = {"attention": [], "feed_forward": []}
        for lname, lin in block.named_modules():
            if not isinstance(lin, nn.Linear):
                continue
            half = "attention" if lname.startswith("attention.") else "feed_forward"
            norm = nn.RMSNorm(lin.in_features, eps=eps, device=lin.weight.device,
                              dtype=block.attention_norm.weight.dtype)
            lin.bitnet_input_norm = norm
            lin.register_forward_pre_hook(_normalize_input)
            halves[half].append(norm)
            done.append(f"{bname}.{lname}")
        block.attention_norm = RemovedBlockNorm(halves["attention"])
        block.ffn_norm = RemovedBlockNorm(halves["feed_forward"])
    return done


class BitNetSubLNConverter:
    """``[model] converters = ["bitnet_subln", "bitnet"]``: per-linear input RMSNorms (SubLN)."""

    def __init__(self, job_config, parallel_dims):
        if parallel_dims is not None and getattr(parallel_dims, "tp_enabled", False):
            raise NotImplementedError(
                "converter 'bitnet_subln' does not support tensor parallelism (torchtitan's "
                "TP plan names the block norms it removes); set tensor_parallel_degree = 1."
            )
        checkpoint = getattr(job_config, "checkpoint", None)
        if getattr(checkpoint, "enable", False) and getattr(checkpoint, "last_save_in_hf", False):
            # torchtitan's llama3 state-dict adapter maps every layer key to a Hugging Face
            # name and fails on one it does not know, at the end of training.
            raise NotImplementedError(
                "converter 'bitnet_subln' adds per-linear input norms that have no Hugging Face "
                "llama name (and removes the block norms that have one): [checkpoint] "
                "last_save_in_hf = true would fail at the last save. Set last_save_in_hf = false "
                "(the DCP checkpoint keeps everything)."
            )

    def convert(self, model: nn.Module) -> None:
        insert_subln(model)

    def post_optimizer_hook(self, model) -> None:
        """No state to refresh: the norms are ordinary parameters."""
        return None


CONVERTERS: dict[str, type] = {"bitnet": BitNetConverter, "bitnet_subln": BitNetSubLNConverter}
