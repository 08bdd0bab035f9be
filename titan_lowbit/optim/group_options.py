"""A param group's options: which are fixed once the group's states exist, and what
each option (and each parameter of the group) may be, checked with errors that name the
group and the fix.

Checked when a group is added, before every step (a scheduler or user code may have
changed a group since) and for every group of a state dict before it is loaded.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from titan_lowbit.kernels.adamw_interface import WEIGHT_UPDATES
from titan_lowbit.kernels.quant_maps import is_block_size

from .formats import STATE_FORMATS, block_of, param_format
from .hyperparams import check_one_value, hyper_value, shown
from .tensors import local
from .torch_flags import check_torch_flags

SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16)
NONFINITE_POLICIES = ("raise", "skip", "ignore")
# Group options fixed once a group's states exist: they set the states' layout, or the kernel
# configuration cached in the step plan. The hyperparameters (lr, betas, eps, weight_decay)
# may change at any time (LR schedulers do) and are restored from a loaded state dict.
# maximize: the stored first moment is that of the gradient as given (see torch_flags).
FIXED_OPTIONS = ("state_format", "block_size", "weight_update", "min_quantized_numel", "decoupled_weight_decay",
                 "maximize")
# The optimizer's count of skipped steps (nonfinite_grad="skip"), kept in every param group
# so that torch.save and torch.distributed.checkpoint (which saves group keys, not extra
# attributes) carry it.
SKIPPED = "skipped_steps"
# The FIXED_OPTIONS titan_lowbit.optim.convert_state_dict converts between (the layout of
# the states), and the call the refusals name for it.
CONVERTIBLE_OPTIONS = ("state_format", "block_size", "weight_update", "min_quantized_numel")
CONVERT_CALL = "optimizer.load_state_dict(titan_lowbit.optim.convert_state_dict(state_dict, to=optimizer))"


def fixed_value(group: dict[str, Any], key: str) -> Any:
    """A FIXED_OPTIONS value as it acts on the math: block_size 0 is the format's default."""
    if key == "block_size" and group.get("state_format") in STATE_FORMATS:
        return block_of(group["state_format"], group[key])
    return group[key]


def check_group(group: dict[str, Any], where: str) -> None:
    """Refuse a group whose option has a value LowBitAdamW cannot step with; ``where``
    names the group in the error."""
    check_lr(group, where)
    betas = group["betas"]
    if (not hasattr(betas, "__len__") or len(betas) != 2
            or not all(0.0 <= hyper_value(where, "betas", b) < 1.0 for b in betas)):
        raise ValueError(f"{where}: betas={betas!r}; each beta must lie in [0, 1)")
    if not hyper_value(where, "eps", group["eps"]) >= 0:
        raise ValueError(f"{where}: eps={shown(group['eps'])}; use eps >= 0")
    check_state_options(group, where)
    check_torch_flags(group, where)
    check_skipped(group, where)


def check_skipped(group: dict[str, Any], where: str) -> None:
    skipped = group.get(SKIPPED, 0)
    if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
        raise ValueError(f"{where}: {SKIPPED}={skipped!r}; the count of skipped steps is an int >= 0")


def check_lr(group: dict[str, Any], where: str) -> None:
    """Refuse a group's ``lr`` that is not a finite number >= 0 (a tensor lr off the CPU:
    not one real number)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
        check_one_value(where, "lr", lr)  # the kernels read it on its device: no host sync here
    elif not (0 <= hyper_value(where, "lr", lr) < math.inf):
        raise ValueError(f"{where}: lr={shown(lr)} is invalid; use a finite lr >= 0")


def check_state_options(group: dict[str, Any], where: str) -> None:
    """Refuse a group's weight decay or state layout options (``state_format``,
    ``weight_update``, ``block_size``, ``min_quantized_numel``) that no optimizer of this
    package steps with."""
    wd = hyper_value(where, "weight_decay", group["weight_decay"])
    if not (wd >= 0 and math.isfinite(wd)):
        raise ValueError(f"{where}: weight_decay={shown(group['weight_decay'])}; use a finite weight_decay >= 0")
    if group["state_format"] not in STATE_FORMATS:
        raise ValueError(f"{where}: state_format={group['state_format']!r}; choose one of {list(STATE_FORMATS)}")
    if group["weight_update"] not in WEIGHT_UPDATES:
        raise ValueError(f"{where}: weight_update={group['weight_update']!r}; choose one of {list(WEIGHT_UPDATES)}")
    bs = group["block_size"]
    if not is_block_size(bs):
        raise ValueError(f"{where}: block_size={bs!r}; use 0 (the format's default) or a power of two >= 2")
    if not isinstance(group["min_quantized_numel"], int) or group["min_quantized_numel"] < 0:
        raise ValueError(f"{where}: min_quantized_numel={group['min_quantized_numel']!r}; use an int >= 0")


def checked_local_grad(p: torch.Tensor, name: str, who: str) -> torch.Tensor:
    """The contiguous local gradient of parameter ``p`` (named ``name``) placed like it,
    refused naming the parameter unless dense, float32/bfloat16 and of its shape; ``who``:
    the optimizer, for the errors."""
    g = p.grad
    if g.is_sparse or (isinstance(g, DTensor) and g._local_tensor.is_sparse):
        raise RuntimeError(f"param '{name}' has a sparse gradient; {who} needs dense gradients "
                           "(e.g. nn.Embedding(sparse=False))")
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        # Tensor parallel can leave a gradient Replicate/Partial where its parameter is
        # Shard (e.g. a row-wise parallel embedding); the update needs the param's shard.
        g = g.redistribute(p.device_mesh, p.placements)
    lg = local(g)
    if lg.dtype not in SUPPORTED_PARAM_DTYPES:
        raise TypeError(f"param '{name}' has a {lg.dtype} gradient; use float32 or bfloat16 gradients")
    if lg.shape != local(p).shape:
        raise ValueError(f"param '{name}': gradient shape {tuple(lg.shape)} != parameter shape "
                         f"{tuple(local(p).shape)}")
    return lg if lg.is_contiguous() else lg.contiguous()


def check_param(p: torch.Tensor, group: dict[str, Any], name: str, optimizer: str = "LowBitAdamW") -> None:
    """Refuse a parameter ``optimizer`` (the class that checks it) cannot step, naming it
    and the fix."""
    if p.is_complex():
        raise TypeError(f"param '{name}' is complex ({p.dtype}); {optimizer} steps real parameters only: "
                        "view it as real (torch.view_as_real) or use torch.optim.AdamW for it")
    if not p.is_floating_point():
        raise TypeError(f"param '{name}' has integer dtype {p.dtype}; only float32/bfloat16 parameters "
                        "can be optimized: exclude it from the optimizer")
    if p.dtype not in SUPPORTED_PARAM_DTYPES:
        raise TypeError(f"param '{name}' has dtype {p.dtype}; {optimizer} holds float32 or bfloat16 "
                        "parameters: cast the model to one of them")
    if p.is_sparse or (isinstance(p, DTensor) and p._local_tensor.is_sparse):
        raise TypeError(f"param '{name}' is sparse; {optimizer} needs dense parameters")
    if not local(p).is_contiguous():
        raise ValueError(f"param '{name}' is not contiguous; {optimizer} updates parameters in place "
                         "and needs contiguous storage: call .contiguous() on it before building the optimizer")
    fmt, block = param_format(p, group)
    if isinstance(p, DTensor) and fmt.quantized and p.dim() >= 1:
        cols = p.shape[-1]
        shards = 1
        for mesh_dim, pl in enumerate(p.placements):
            if isinstance(pl, Shard) and pl.dim in (-1, p.dim() - 1):
                shards *= p.device_mesh.size(mesh_dim)
        if shards > 1 and cols % (block * shards):
            fits = [b for b in (256, 128, 64, 32, 16, 8, 4, 2) if cols % (b * shards) == 0]
            hint = (f"set block_size={fits[0]} (it divides {cols} / {shards} shards)" if fits else
                    "shard another dimension, or use state_format='fp32'/'bf16' for it")
            raise ValueError(
                f"param '{name}' ({tuple(p.shape)}) is sharded {shards} ways along its last dimension, which "
                f"splits its {fmt.name} quantization blocks of {block}: {hint}")

