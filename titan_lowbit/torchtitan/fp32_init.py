"""bf16 weights initialized in fp32, whose fp32 values the master weights start from.

With ``[lowbit] weight_dtype = "bfloat16"`` the model is cast to bf16 before it is
sharded, so torchtitan's ``init_weights`` would draw every weight in bf16: exactly on the
bf16 grid. With ``weight_update = "master"`` or ``"master_remainder"`` the fp32 masters
would then start on that grid too, and an early update smaller than half a bf16 step
would move no weight the forward sees (warmup's first steps), where an fp32-weight run's
bf16 cast moves a share of them in proportion to the update
(:mod:`titan_lowbit.optim.master_start`).

So for those two updates the model's ``init_weights`` is wrapped: it runs on fp32
stand-ins of the bf16 parameters (same DTensor mesh and placements: every rank draws its
own shard as torchtitan does in fp32), the bf16 weights become their rounding (to nearest,
ties away from zero, the master updates' rounding), and the fp32 values wait here until
the optimizer builder hands them to the optimizers (``start_masters_from``). They cost
4 bytes per parameter between the initialization and the building of the optimizers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakTensorKeyDictionary

from titan_lowbit.kernels.adamw_lowbit_ref import bf16_away
from titan_lowbit.optim.master_start import MASTER_UPDATES
from titan_lowbit.optim.tensors import local

_INIT_MASTERS = WeakTensorKeyDictionary()  # bf16 parameter -> its fp32 initialization (local shard)


def _fp32_stand_in(p: nn.Parameter) -> nn.Parameter:
    """An uninitialized fp32 parameter laid out as ``p`` (a DTensor on p's mesh and
    placements, with p's local shard shape)."""
    loc = local(p)
    data = torch.empty(loc.shape, dtype=torch.float32, device=loc.device)
    if isinstance(p, DTensor):
        data = DTensor.from_local(data, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return nn.Parameter(data, requires_grad=p.requires_grad)


def init_in_fp32(model: nn.Module, init_weights, *args, **kwargs) -> None:
    """Run ``init_weights`` on fp32 stand-ins of ``model``'s bf16 parameters, set each bf16
    weight to the rounding of its fp32 value and keep that value for the optimizer."""
    slots = [(module, name, p) for module in model.modules()
             for name, p in module.named_parameters(recurse=False) if p.dtype == torch.bfloat16]
    stand_ins: dict[nn.Parameter, nn.Parameter] = {}
    for module, name, p in slots:
        module._parameters[name] = stand_ins.setdefault(p, _fp32_stand_in(p))  # tied weights share one
    try:
        init_weights(*args, **kwargs)
    finally:
        for module, name, p in slots:
            module._parameters[name] = p
    with torch.no_grad():
        for p, stand_in in stand_ins.items():
            master = local(stand_in).detach()
            local(p).copy_(bf16_away(master))
            _INIT_MASTERS[p] = master


def wrap_init_weights(model: nn.Module, weight_update: str) -> None:
    """Make ``model.init_weights`` initialize in fp32 for the updates that keep fp32
    master weights (a no-op for the others)."""
    if weight_update not in MASTER_UPDATES or getattr(model, "init_weights", None) is None:
        return
    model.init_weights = functools.partial(init_in_fp32, model, model.init_weights)


def hand_init_masters(optimizers) -> None:
    """Give each optimizer the fp32 initialization of its bf16 parameters (kept only if a
    parameter's weight is unchanged at its first step: a checkpoint or pretrained weights
    loaded in between win), then forget them all."""
    for opt in optimizers:
        masters = {p: _INIT_MASTERS[p] for group in opt.param_groups for p in group["params"]
                   if p in _INIT_MASTERS}
        if masters:
            opt.start_masters_from(masters)
    _INIT_MASTERS.clear()
