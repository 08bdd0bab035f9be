"""Optimizer health: the few numbers that show early that low-bit states hurt a run.

``optimizer_health(optimizers)`` reads the states and weights of ``LowBitAdamW`` and
``LowBitMuon`` optimizers right after a step and returns an ``OptimizerHealth``. Nothing
is computed during the step: the kernels stay as they are, and a training loop that asks
only on the steps it logs (torchtitan's ``[metrics] log_freq``) pays nothing on the
others. On the steps it asks, it reads every state once more in PyTorch ops (in chunks
of ``CHUNK_NUMEL`` elements, so the extra memory stays small).

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
import functools
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from titan_lowbit.kernels.adamw_interface import (
    UPDATE_KAHAN,
    UPDATE_MASTER,
    UPDATE_MASTER_REMAINDER,
    UPDATE_NEAREST,
    WEIGHT_UPDATES,
    AdamWConfig,
    AdamWHyper,
    AdamWTensor,
    hyper_scalars,
)
from titan_lowbit.kernels.adamw_lowbit_ref import (
    PACKED_4BIT,
    _load_moment,  # the reference step's own read of a moment: the same dequantization
    bf16_rne,
    div_rn,
    sqrt_rn,
    weight_fp32,
)
from titan_lowbit.kernels.quant_maps import CODEC_NONE, code_book

from .hyperparams import hyper_value
from .step_plan import kernel_config, kernel_tensor
from .tensors import local

# Elements read per chunk: bounds the temporaries of a health read (a few fp32 and int64
# copies of one chunk) however large a parameter is.
CHUNK_NUMEL = 1 << 22
# Weight updates whose fp32 weight is more than the bf16 one: their residual is measured.
RESIDUAL_UPDATES = (UPDATE_KAHAN, UPDATE_MASTER, UPDATE_MASTER_REMAINDER)
# The metrics' names in a logger (TensorBoard tags, W&B keys): this prefix and the field.
METRIC_PREFIX = "optimizer_health/"

# Partial sums (all-reduced with SUM) and maxima (with MAX): positions in their vectors.
_V_SMALLEST, _V_ENTRIES, _LOST, _NEAREST_ENTRIES, _RESIDUAL, _RESIDUAL_ENTRIES, _UPDATE_ENTRIES = range(7)
_MAX_UPDATE, _SKIPPED = range(2)
_N_SUMS, _N_MAXES = 7, 2


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


@functools.lru_cache(maxsize=None)
def smallest_codes(codec: int) -> tuple[int, ...]:
    """The codes of ``codec`` whose value has the smallest positive magnitude of its code
    book (``quant_maps.code_book``)."""
    book = code_book(codec).abs()
    floor = book[book > 0].min()
    return tuple(int(i) for i in torch.nonzero(book == floor).flatten())


def bf16_ulp(w: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at each element of ``w`` (fp32): ``2**(e - 7)`` for a
    normal value of exponent ``e``, bf16's subnormal spacing ``2**-133`` below."""
    exponent = (w.to(torch.float32).contiguous().view(torch.int32) & 0x7F800000).view(torch.float32)
    return torch.clamp(exponent * 2.0**-7, min=2.0**-133)


def counted_here(p: torch.Tensor) -> bool:
    """Whether this rank counts its local shard of ``p``: a shard replicated over a mesh
    dimension is counted on that dimension's rank 0 only (its copies hold the same values)."""
    if not isinstance(p, DTensor):
        return True
    return all(p.device_mesh.get_local_rank(d) == 0 for d, pl in enumerate(p.placements)
               if isinstance(pl, Replicate))


class _Partial:
    """A rank's partial sums and maxima: host numbers where the host knows them (element
    counts), device scalars otherwise, gathered into one vector of each at the end (few
    device ops per chunk, one host sync for all)."""

    def __init__(self) -> None:
        self.sums: list[list] = [[] for _ in range(_N_SUMS)]
        self.maxes: list[list] = [[] for _ in range(_N_MAXES)]

    def add(self, index: int, value: "torch.Tensor | float") -> None:
        self.sums[index].append(value)

    def max(self, index: int, value: "torch.Tensor | float") -> None:
        self.maxes[index].append(value)

    def vectors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(sums, maxima) as float64 vectors on ``device`` (0 where nothing was added)."""
        def total(values: list, reduce, host_reduce) -> torch.Tensor:
            parts = [v.to(device=device, dtype=torch.float64).reshape(()) for v in values
                     if isinstance(v, torch.Tensor)]
            host = [float(v) for v in values if not isinstance(v, torch.Tensor)]
            if host:
                parts.append(torch.tensor(host_reduce(host), dtype=torch.float64, device=device))
            return reduce(torch.stack(parts)) if parts else torch.zeros((), dtype=torch.float64, device=device)

        return (torch.stack([total(v, torch.sum, sum) for v in self.sums]),
                torch.stack([total(v, torch.max, max) for v in self.maxes]))


def _row_chunks(t: AdamWTensor, quantized: bool) -> Iterator[AdamWTensor]:
    """``t`` in pieces of at most CHUNK_NUMEL elements (at least one row): whole rows of
    the block layout (quantized), or flat ranges (plain states, read element by element)."""
    if not quantized:
        flat = dict(param=t.param.reshape(-1), exp_avg=t.exp_avg.reshape(-1), exp_avg_sq=t.exp_avg_sq.reshape(-1),
                    extra=None if t.extra is None else t.extra.reshape(-1))
        n = t.rows * t.cols
        for a in range(0, n, CHUNK_NUMEL):
            b = min(n, a + CHUNK_NUMEL)
            yield dataclasses.replace(t, **{k: None if v is None else v[a:b] for k, v in flat.items()},
                                      rows=1, cols=b - a)
        return
    step = max(1, CHUNK_NUMEL // max(t.cols, 1))
    for r in range(0, t.rows, step):
        rows = slice(r, min(t.rows, r + step))
        yield dataclasses.replace(
            t, param=t.param.reshape(t.rows, t.cols)[rows], exp_avg=t.exp_avg.reshape(t.rows, -1)[rows],
            exp_avg_sq=t.exp_avg_sq.reshape(t.rows, -1)[rows],
            exp_avg_scale=t.exp_avg_scale.reshape(t.rows, -1)[rows],
            exp_avg_sq_scale=t.exp_avg_sq_scale.reshape(t.rows, -1)[rows],
            extra=None if t.extra is None else t.extra.reshape(t.rows, t.cols)[rows], rows=rows.stop - rows.start)


def _codes(cfg: AdamWConfig, t: AdamWTensor) -> torch.Tensor:
    """The second-moment codes of ``t`` (int32, ``[rows, cols]``; 4-bit unpacked, padding dropped)."""
    c = t.exp_avg_sq.reshape(t.rows, -1).view(torch.uint8).to(torch.int32)
    if cfg.v_codec in PACKED_4BIT:
        c = torch.stack([c & 15, c >> 4], dim=-1).view(t.rows, -1)
    return c[:, :t.cols]


def _add_residual(acc: _Partial, param: torch.Tensor, extra: torch.Tensor, update: int, rows: int,
                  cols: int) -> None:
    """Sum of ``|fp32 weight - bf16 weight| / ulp`` of a bf16 weight and its extra state."""
    w = param.reshape(rows, cols)
    if update == UPDATE_KAHAN:  # what rounding lost, kept to be added back
        residual = extra.reshape(rows, cols).to(torch.float32)
    else:  # the master weight (whole or rebuilt from its remainder) beyond the bf16 weight
        residual = weight_fp32(w, extra, update, rows, cols) - w.to(torch.float32)
    acc.add(_RESIDUAL, (residual.abs() / bf16_ulp(w)).sum(dtype=torch.float64))
    acc.add(_RESIDUAL_ENTRIES, rows * cols)


def _add_adamw_chunk(acc: _Partial, cfg: AdamWConfig, t: AdamWTensor, scalars: dict[str, float], lr: float,
                     sign: float) -> None:
    m = _load_moment(cfg, t, t.exp_avg, t.exp_avg_scale, cfg.m_codec)
    v = _load_moment(cfg, t, t.exp_avg_sq, t.exp_avg_sq_scale, cfg.v_codec)
    w = weight_fp32(t.param, t.extra, cfg.weight_update, t.rows, t.cols)
    # the reference step's update over lr: step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps) / lr
    update = sign * scalars["inv_bc1"] * div_rn(m, sqrt_rn(v) * scalars["inv_sqrt_bc2"] + scalars["eps"])
    if cfg.decoupled:
        update = update + scalars["wd"] * w
    acc.max(_MAX_UPDATE, update.abs().max())
    acc.add(_UPDATE_ENTRIES, t.rows * t.cols)
    if cfg.v_codec != CODEC_NONE:
        codes = _codes(cfg, t)
        smallest = functools.reduce(torch.logical_or, [codes == c for c in smallest_codes(cfg.v_codec)])
        acc.add(_V_SMALLEST, smallest.sum(dtype=torch.float64))
        acc.add(_V_ENTRIES, t.rows * t.cols)
    if cfg.param_dtype != torch.bfloat16:
        return
    if cfg.weight_update == UPDATE_NEAREST:
        delta = -lr * update
        lost = (delta != 0) & (bf16_rne(w + delta) == t.param.reshape(t.rows, t.cols))
        acc.add(_LOST, lost.sum(dtype=torch.float64))
        acc.add(_NEAREST_ENTRIES, t.rows * t.cols)
    elif cfg.weight_update in RESIDUAL_UPDATES:
        _add_residual(acc, t.param, t.extra, cfg.weight_update, t.rows, t.cols)


def _add_adamw(acc: _Partial, opt) -> None:
    """A LowBitAdamW's parameters that have taken a step."""
    acc.max(_SKIPPED, opt.skipped_steps)
    for gi, group in enumerate(opt.param_groups):
        where = f"param group {gi}"
        lr = hyper_value(where, "lr", group["lr"])
        wd = hyper_value(where, "weight_decay", group["weight_decay"])
        sign = -1.0 if group["maximize"] else 1.0  # maximize: Adam on the negated gradient
        for p in group["params"]:
            step = int(opt.state[p]["step"])
            if step == 0 or not local(p).numel() or not counted_here(p):
                continue
            cfg = kernel_config(p, p, group)
            scalars = hyper_scalars(AdamWHyper(
                lr=lr, beta1=hyper_value(where, "betas", group["betas"][0]),
                beta2=hyper_value(where, "betas", group["betas"][1]), eps=hyper_value(where, "eps", group["eps"]),
                weight_decay=wd, step=step))
            for chunk in _row_chunks(kernel_tensor(opt, p, cfg), cfg.m_codec != CODEC_NONE):
                _add_adamw_chunk(acc, cfg, chunk, scalars, lr, sign)


def _add_muon_matrices(acc: _Partial, opt) -> None:
    """A LowBitMuon's Muon matrices: the residual of their bf16 weights."""
    acc.max(_SKIPPED, opt.skipped_steps)
    for group in opt.param_groups:
        update = WEIGHT_UPDATES[group["weight_update"]]
        if not group.get("use_muon") or update not in RESIDUAL_UPDATES:
            continue
        for p in group["params"]:
            loc = local(p)
            if loc.dtype != torch.bfloat16 or not loc.numel() or not counted_here(p):
                continue
            state = opt.state[p]
            extra = local(state.get("master", state.get("kahan_comp", state.get("master_remainder"))))
            flat_p, flat_e = loc.reshape(-1), extra.reshape(-1)
            for a in range(0, loc.numel(), CHUNK_NUMEL):
                b = min(loc.numel(), a + CHUNK_NUMEL)
                _add_residual(acc, flat_p[a:b], flat_e[a:b], update, 1, b - a)


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
    with torch.no_grad():
        for opt in optimizers:
            if hasattr(opt, "muon_params"):  # LowBitMuon: its Muon matrices, then its inner AdamW
                _add_muon_matrices(acc, opt)
                if opt.adamw is not None:
                    _add_adamw(acc, opt.adamw)
            else:
                _add_adamw(acc, opt)
    sums, maxes = acc.vectors(_device(optimizers))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "gloo":
            sums, maxes = sums.cpu(), maxes.cpu()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    values = torch.cat([sums, maxes]).tolist()  # the one host sync
    s, mx = values[:len(sums)], values[len(sums):]

    def ratio(num: int, den: int) -> Optional[float]:
        return s[num] / s[den] if s[den] else None

    return OptimizerHealth(
        max_update_over_lr=mx[_MAX_UPDATE] if s[_UPDATE_ENTRIES] else None,
        v_at_smallest_code=ratio(_V_SMALLEST, _V_ENTRIES),
        skipped_steps=int(mx[_SKIPPED]),
        updates_lost_to_rounding=ratio(_LOST, _NEAREST_ENTRIES),
        residual_over_ulp=ratio(_RESIDUAL, _RESIDUAL_ENTRIES),
    )
