"""bf16 weights initialized in fp32, whose fp32 values the master weights start from.

With bf16 weights (the 0.2 line's ``[lowbit] weight_dtype = "bfloat16"``, the 0.3 line's
``--training.dtype bfloat16``) the model's parameters are bf16 before it is sharded, so
torchtitan's ``init_weights`` would draw every weight in bf16: exactly on the bf16 grid.
With ``weight_update = "master"`` or ``"master_remainder"`` the fp32 masters would then
start on that grid too, and an early update smaller than half a bf16 step would move no
weight the forward sees (warmup's first steps), where an fp32-weight run's bf16 cast
moves a share of them in proportion to the update
(:mod:`titan_lowbit.optim.master_start`).

So for those two updates the model's ``init_weights`` is wrapped (:func:`wrap_init_weights`,
by each line's parallelize wrapper): it runs on fp32 stand-ins of the bf16 parameters
whose optimizer keeps masters (same DTensor mesh and placements: every rank draws its own
shard as torchtitan does in fp32), those bf16 weights become their rounding (to nearest,
ties away from zero, the master updates' rounding), and the fp32 values wait here until
the optimizers are built and take them (:func:`hand_init_masters`, which calls
``start_masters_from``). They cost 4 bytes per parameter between the initialization and
the building of the optimizers. Nothing here imports torchtitan: both lines use it.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

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


def init_in_fp32(model: nn.Module, init_weights, select: "Callable[[nn.Module], Iterable[nn.Parameter]] | None",
                 *args, **kwargs) -> None:
    """Run ``init_weights`` on fp32 stand-ins of ``model``'s bf16 parameters (those of
    ``select(model)``, asked now, or all when ``select`` is None), set each of those bf16
    weights to the rounding of its fp32 value and keep that value for the optimizer."""
    chosen = None if select is None else {id(p) for p in select(model)}
    slots = [(module, name, p) for module in model.modules()
             for name, p in module.named_parameters(recurse=False)
             if p.dtype == torch.bfloat16 and (chosen is None or id(p) in chosen)]
    stand_ins: dict[nn.Parameter, nn.Parameter] = {}
    for module, name, p in slots:
        module.register_parameter(name, stand_ins.setdefault(p, _fp32_stand_in(p)))  # tied weights share one
    try:
        init_weights(*args, **kwargs)
    finally:
        for module, name, p in slots:
            module.register_parameter(name, p)
    with torch.no_grad():
        for p, stand_in in stand_ins.items():
            master = local(stand_in).detach()
            local(p).copy_(bf16_away(master))
            _INIT_MASTERS[p] = master


def wrap_init_weights(model: nn.Module,
                      select: "Callable[[nn.Module], Iterable[nn.Parameter]] | None" = None) -> None:
    """Make ``model.init_weights`` initialize its bf16 parameters in fp32: those that
    ``select(model)`` returns when it runs (the parameters whose optimizer will keep fp32
    master weights), or every one when ``select`` is None. For runs whose updates keep
    masters only: the fp32 values wait for :func:`hand_init_masters`."""
    if getattr(model, "init_weights", None) is None:
        return
    model.init_weights = functools.partial(init_in_fp32, model, model.init_weights, select)


def hand_init_masters(optimizers) -> None:
    """Give each optimizer the fp32 initialization of its bf16 parameters whose group keeps
    master weights (``weight_update`` in ``MASTER_UPDATES``; kept only if a parameter's
    weight is unchanged at its first step: a checkpoint or pretrained weights loaded in
    between win), then forget them all."""
    for opt in optimizers:
        masters = {p: _INIT_MASTERS[p] for group in opt.param_groups
                   if group.get("weight_update") in MASTER_UPDATES
                   for p in group["params"] if p in _INIT_MASTERS}
        if masters:
            opt.start_masters_from(masters)
    _INIT_MASTERS.clear()
