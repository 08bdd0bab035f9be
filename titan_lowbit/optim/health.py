"""Optimizer health: the few numbers that show early that low-bit states hurt a run.

``optimizer_health(optimizers)`` reads the states and weights of ``LowBitAdamW`` and
``LowBitMuon`` optimizers right after a step and returns an ``OptimizerHealth``. Nothing
is computed during the step: the kernels stay as they are, and a training loop that asks
only on the steps it logs (torchtitan's ``[metrics] log_freq``) pays nothing on the
others. On the steps it asks, it reads every state once more: on a GPU in one fused
Triton kernel per parameter (``kernels/health_lowbit.py``), which writes a few partial
numbers per program, reduced on the device; elsewhere in its PyTorch reference
(``kernels/health_ref.py``), in chunks so that the extra memory stays small. Either way
one host sync at the end.

The numbers (``None`` where no parameter has what a number measures):

* ``max_update_over_lr``: the largest ``|update| / lr`` of any element, the update being
  the last step's AdamW update recomputed from the *stored* moments (dequantized as the
  step reads them), that step's bias corrections, and the weight decay of the current
  weight: ``|m_hat / (sqrt(v_hat) + eps) + wd * w|`` (decoupled weight decay; Adam with
  L2 has the decay inside ``m``). It differs from the update the kernel applied only by
  the rounding of the stored moments and by ``wd * lr * update`` in the decay term. Adam
  bounds it by about ``(1 - beta1) / sqrt(1 - beta2)`` plus ``wd * |w|``; far above, a
  second moment was stored too small.
* ``v_at_smallest_code``: of the quantized second-moment entries, the fraction stored at
  the smallest positive code of their code book (8-bit: 1e-7 of the block's absmax; fp8:
  e4m3's smallest subnormal, 2**-9 / 448 of it; 4-bit: 1/16 of it, its lowest code):
  entries whose block's range could not resolve them, so their ``v`` is held at the
  block's floor. Entries coded 0 (a ``v`` that is exactly 0) count in the denominator
  only. fp32/bf16 states: None.
* ``skipped_steps``: steps skipped for a non-finite gradient (``nonfinite_grad="skip"``).
* ``updates_lost_to_rounding``: of the bf16 weights with ``weight_update="nearest"``, the
  fraction whose update (as ``max_update_over_lr`` recomputes it, times the group's
  current lr) rounds away: ``bf16(w - lr * update) == w`` with a nonzero update.
* ``residual_over_ulp``: of the bf16 weights with ``kahan``, ``master`` or
  ``master_remainder``, the mean of ``|fp32 weight - bf16 weight| / ulp(bf16 weight)``,
  what the compensation, the master weight or the remainder holds beyond the bf16
  weight, in units of the weight's bf16 spacing (at most 0.5; about 0.25 when the
  residual is spread evenly).

LowBitMuon: its inner AdamW's parameters give every number; its Muon matrices give
``residual_over_ulp`` only (their update is an orthogonalised momentum that only the step
computes, and their momentum is a first moment, which has no smallest-code floor).

Sharded parameters (FSDP2, TP DTensors): each rank measures its local shards (a shard
replicated over a mesh dimension is counted on that dimension's rank 0 only) and the
partial sums and maxima are all-reduced over the default process group, so every rank
gets the same numbers: with several ranks, every rank must call ``optimizer_health``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from titan_lowbit.kernels.adamw_interface import WEIGHT_UPDATES, AdamWHyper
from titan_lowbit.kernels.health_lowbit import adamw_health, adamw_health_rows, residual_health, residual_health_rows
from titan_lowbit.kernels import health_ref as cols  # the partial rows' columns
from titan_lowbit.kernels.health_ref import (
    HealthHyper,
    adamw_health_reference,
    measures_lost,
    measures_residual,
    reduce_health,
    residual_health_reference,
)
from titan_lowbit.kernels.quant_maps import CODEC_NONE

from .hyperparams import hyper_value
from .step_plan import kernel_config, kernel_tensor
from .tensors import local

# The metrics' names in a logger (TensorBoard tags, W&B keys): this prefix and the field.
METRIC_PREFIX = "optimizer_health/"

# The denominators, counted on the host: elements read, v entries, bf16 weights with
# "nearest", bf16 weights with a residual.
_UPDATE_ENTRIES, _V_ENTRIES, _NEAREST_ENTRIES, _RESIDUAL_ENTRIES = range(4)
# The columns of the partial rows that are summed over ranks (MAX_UPDATE: maximized).
_SUMMED = (cols.V_SMALLEST, cols.LOST, cols.RESIDUAL)


@dataclasses.dataclass(frozen=True)
class OptimizerHealth:
    """The health numbers of one or more optimizers after a step (module docstring)."""

    max_update_over_lr: Optional[float]
    v_at_smallest_code: Optional[float]
    skipped_steps: int
    updates_lost_to_rounding: Optional[float]
    residual_over_ulp: Optional[float]

    def metrics(self) -> dict[str, float]:
        """The numbers that apply, keyed for a metric logger (``METRIC_PREFIX`` + name)."""
        return {METRIC_PREFIX + f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def summary(self) -> str:
        """The numbers that apply, for one log line."""
        shown = {"max_update_over_lr": "max update/lr {:.3g}", "v_at_smallest_code": "v at smallest code {:.3%}",
                 "skipped_steps": "skipped steps {}", "updates_lost_to_rounding": "updates lost to rounding {:.2%}",
                 "residual_over_ulp": "residual {:.3f} ulp"}
        return "  ".join(fmt.format(getattr(self, k)) for k, fmt in shown.items() if getattr(self, k) is not None)


def counted_here(p: torch.Tensor) -> bool:
    """Whether this rank counts its local shard of ``p``: a shard replicated over a mesh
    dimension is counted on that dimension's rank 0 only (its copies hold the same values)."""
    if not isinstance(p, DTensor):
        return True
    return all(p.device_mesh.get_local_rank(d) == 0 for d, pl in enumerate(p.placements)
               if isinstance(pl, Replicate))


@dataclasses.dataclass
class _Read:
    """One parameter's read: how many partial rows the kernel writes, the kernel launch
    into a slice of that size, and the reference (one row); ``fused``: the kernel runs
    (the optimizer's own rule: CUDA tensors)."""

    rows: int
    kernel: Callable[[torch.Tensor], Any]
    reference: Callable[[], torch.Tensor]
    fused: bool


class _Partial:
    """A rank's reads and the numbers its host knows (element counts, skipped steps): the
    fused reads write their partial rows into one buffer, the reference reads give a row
    each; all of them fold into one row on the device (``reduce_health``), so the whole
    health read costs one host sync."""

    def __init__(self) -> None:
        self.entries = [0] * 4
        self.skipped = 0
        self.reads: list[_Read] = []

    def partials(self, device: torch.device) -> torch.Tensor:
        """The reduced row ``[N_HEALTH]`` of every read (zeros for none)."""
        fused = [r for r in self.reads if r.fused]
        parts = [r.reference().to(device) for r in self.reads if not r.fused]
        if fused:
            buf = torch.empty(sum(r.rows for r in fused), cols.N_HEALTH, dtype=torch.float64, device=device)
            start = 0
            for r in fused:
                r.kernel(buf[start:start + r.rows])
                start += r.rows
            parts.append(buf)
        if not parts:
            return torch.zeros(cols.N_HEALTH, dtype=torch.float64, device=device)
        return reduce_health(torch.cat(parts))


def _add_adamw(acc: _Partial, opt) -> None:
    """A LowBitAdamW's parameters that have taken a step."""
    acc.skipped = max(acc.skipped, opt.skipped_steps)
    for gi, group in enumerate(opt.param_groups):
        where = f"param group {gi}"
        lr = hyper_value(where, "lr", group["lr"])
        wd = hyper_value(where, "weight_decay", group["weight_decay"])
        sign = -1.0 if group["maximize"] else 1.0  # maximize: Adam on the negated gradient
        for p in group["params"]:
            step = int(opt.state[p]["step"])
            loc = local(p)
            if step == 0 or not loc.numel() or not counted_here(p):
                continue
            cfg = kernel_config(p, p, group)
            h = HealthHyper.of(AdamWHyper(
                lr=lr, beta1=hyper_value(where, "betas", group["betas"][0]),
                beta2=hyper_value(where, "betas", group["betas"][1]), eps=hyper_value(where, "eps", group["eps"]),
                weight_decay=wd, step=step), sign)
            t = kernel_tensor(opt, p, cfg)
            n = loc.numel()
            acc.entries[_UPDATE_ENTRIES] += n
            acc.entries[_V_ENTRIES] += n if cfg.v_codec != CODEC_NONE else 0
            acc.entries[_NEAREST_ENTRIES] += n if measures_lost(cfg) else 0
            acc.entries[_RESIDUAL_ENTRIES] += n if measures_residual(cfg.param_dtype, cfg.weight_update) else 0
            fused = opt._use_fused(loc)
            acc.reads.append(_Read(
                rows=adamw_health_rows(cfg, t) if fused else 1, fused=fused,
                kernel=lambda out, cfg=cfg, t=t, h=h: adamw_health(cfg, t, h, out),
                reference=lambda cfg=cfg, t=t, h=h: adamw_health_reference(cfg, t, h)))


def _add_muon_matrices(acc: _Partial, opt) -> None:
    """A LowBitMuon's Muon matrices: the residual of their bf16 weights."""
    acc.skipped = max(acc.skipped, opt.skipped_steps)
    for group in opt.param_groups:
        update = WEIGHT_UPDATES[group["weight_update"]]
        if not group.get("use_muon"):
            continue
        for p in group["params"]:
            loc = local(p)
            if not measures_residual(loc.dtype, update) or not loc.numel() or not counted_here(p):
                continue
            state = opt.state[p]
            extra = local(state.get("master", state.get("kahan_comp", state.get("master_remainder"))))
            acc.entries[_RESIDUAL_ENTRIES] += loc.numel()
            fused = opt._use_fused(loc)
            acc.reads.append(_Read(
                rows=residual_health_rows(loc.numel()) if fused else 1, fused=fused,
                kernel=lambda out, loc=loc, extra=extra: residual_health(loc, extra, update, out),
                reference=lambda loc=loc, extra=extra: residual_health_reference(loc, extra, update)))


def _device(optimizers: list) -> torch.device:
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                return local(p).device
    return torch.device("cpu")


def optimizer_health(optimizers: "Iterable[Any]") -> OptimizerHealth:
    """The health of ``optimizers`` (LowBitAdamW / LowBitMuon; one or several, e.g. a
    container's model parts) after a step: partial results over their local states, one
    all-reduce of the sums and one of the maxima when a process group of several ranks is
    initialized (every rank must call it then), and one host sync."""
    optimizers = list(optimizers)
    acc = _Partial()
    for opt in optimizers:
        if hasattr(opt, "muon_params"):  # LowBitMuon: its Muon matrices, then its inner AdamW
            _add_muon_matrices(acc, opt)
            if opt.adamw is not None:
                _add_adamw(acc, opt.adamw)
        else:
            _add_adamw(acc, opt)
    device = _device(optimizers)
    with torch.no_grad():
        part = acc.partials(device)
    # sums: the summed columns, then the host's element counts; maxima: the largest
    # update, the skipped steps
    sums = torch.cat([part[list(_SUMMED)], torch.tensor(acc.entries, dtype=torch.float64, device=device)])
    maxes = torch.stack([part[cols.MAX_UPDATE], torch.tensor(float(acc.skipped), dtype=torch.float64, device=device)])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "gloo":
            sums, maxes = sums.cpu(), maxes.cpu()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    values = torch.cat([sums, maxes]).tolist()  # the one host sync
    s, mx = values[:len(sums)], values[len(sums):]
    counted, entries = dict(zip(_SUMMED, s)), s[len(_SUMMED):]

    def ratio(num: float, den: float) -> Optional[float]:
        return num / den if den else None

    return OptimizerHealth(
        max_update_over_lr=mx[0] if entries[_UPDATE_ENTRIES] else None,
        v_at_smallest_code=ratio(counted[cols.V_SMALLEST], entries[_V_ENTRIES]),
        skipped_steps=int(mx[1]),
        updates_lost_to_rounding=ratio(counted[cols.LOST], entries[_NEAREST_ENTRIES]),
        residual_over_ulp=ratio(counted[cols.RESIDUAL], entries[_RESIDUAL_ENTRIES]),
    )
