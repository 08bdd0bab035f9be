"""Pure-PyTorch reference of ``health_lowbit.py``: a parameter's partial health numbers.

What runs where there is no GPU (``titan_lowbit.optim.health`` on CPU tensors), and what
the tests compare the Triton kernel against under ``TRITON_INTERPRET=1``. The math is the
block at the top of ``health_lowbit.py``; the moments and the weight are read with the
AdamW step's own reference reads (``adamw_lowbit_ref``), so a health read sees the values
the step sees.

A read gives *partial rows*: float64 ``[n, N_HEALTH]`` with, per row, the largest
``|update| / lr`` (column MAX_UPDATE) and the sums of the other columns over the elements
the row covers; ``reduce_health`` folds any number of rows into one. The reference reads a
tensor in chunks of ``CHUNK_NUMEL`` elements (a few fp32 and int64 copies of one chunk
are its temporaries, however large the tensor) and gives one row per tensor.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Optional

import torch

from .adamw_interface import (
    UPDATE_KAHAN,
    UPDATE_MASTER,
    UPDATE_MASTER_REMAINDER,
    UPDATE_NEAREST,
    AdamWConfig,
    AdamWHyper,
    AdamWTensor,
    hyper_scalars,
)
from .adamw_lowbit_ref import _load_moment, bf16_rne, div_rn, sqrt_rn, weight_fp32
from .quant_maps import CODEC_NONE, PACKED_4BIT_CODECS, code_book

# Columns of a partial row: the largest |update| / lr (NaN if any is NaN); the number of
# second-moment codes at their code book's smallest positive value; the number of
# updates lost to rounding (bf16 weights, "nearest"); the sum of |residual| / ulp (bf16
# weights with kahan, master or master_remainder).
MAX_UPDATE, V_SMALLEST, LOST, RESIDUAL = range(4)
N_HEALTH = 4
# Elements the reference reads per chunk.
CHUNK_NUMEL = 1 << 22
# Weight updates whose fp32 weight is more than the bf16 one: their residual is measured.
RESIDUAL_UPDATES = (UPDATE_KAHAN, UPDATE_MASTER, UPDATE_MASTER_REMAINDER)


@dataclasses.dataclass(frozen=True)
class HealthHyper:
    """The scalars of a parameter's health read: its group's current lr and weight decay,
    the bias corrections of its last step, eps, and sign -1 for ``maximize``."""

    lr: float
    sign: float
    inv_bc1: float
    inv_sqrt_bc2: float
    eps: float
    wd: float

    @classmethod
    def of(cls, hyper: AdamWHyper, sign: float) -> "HealthHyper":
        s = hyper_scalars(hyper)
        return cls(lr=float(hyper.lr), sign=float(sign), inv_bc1=s["inv_bc1"], inv_sqrt_bc2=s["inv_sqrt_bc2"],
                   eps=s["eps"], wd=s["wd"])


def measures_lost(cfg: AdamWConfig) -> bool:
    """Whether a parameter's read counts updates lost to rounding: bf16 weights, nearest."""
    return cfg.param_dtype == torch.bfloat16 and cfg.weight_update == UPDATE_NEAREST


def measures_residual(param_dtype: torch.dtype, update: int) -> bool:
    """Whether a weight's read sums its residual: bf16 weights with kahan or an fp32 master."""
    return param_dtype == torch.bfloat16 and update in RESIDUAL_UPDATES


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


def reduce_health(rows: torch.Tensor) -> torch.Tensor:
    """Partial rows ``[n, N_HEALTH]`` -> one row ``[N_HEALTH]``: the largest MAX_UPDATE
    (NaN-propagating), the sums of the other columns (zeros for no rows)."""
    if not rows.shape[0]:
        return torch.zeros(N_HEALTH, dtype=torch.float64, device=rows.device)
    return torch.cat([rows[:, MAX_UPDATE].amax().reshape(1), rows[:, MAX_UPDATE + 1:].sum(dim=0)])


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
    if cfg.v_codec in PACKED_4BIT_CODECS:
        c = torch.stack([c & 15, c >> 4], dim=-1).view(t.rows, -1)
    return c[:, :t.cols]


def _residual_sum(param: torch.Tensor, extra: torch.Tensor, update: int, rows: int, cols: int) -> torch.Tensor:
    """Sum of ``|fp32 weight - bf16 weight| / ulp`` of a bf16 weight and its extra state (float64)."""
    w = param.reshape(rows, cols)
    if update == UPDATE_KAHAN:  # what rounding lost, kept to be added back
        residual = extra.reshape(rows, cols).to(torch.float32)
    else:  # the master weight (whole or rebuilt from its remainder) beyond the bf16 weight
        residual = weight_fp32(w, extra, update, rows, cols) - w.to(torch.float32)
    return (residual.abs() / bf16_ulp(w)).sum(dtype=torch.float64)


def _adamw_chunk(cfg: AdamWConfig, t: AdamWTensor, h: HealthHyper) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.float64, device=t.param.device)
    m = _load_moment(cfg, t, t.exp_avg, t.exp_avg_scale, cfg.m_codec)
    v = _load_moment(cfg, t, t.exp_avg_sq, t.exp_avg_sq_scale, cfg.v_codec)
    w = weight_fp32(t.param, t.extra, cfg.weight_update, t.rows, t.cols)
    # the reference step's update over lr: step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps) / lr
    update = (h.sign * h.inv_bc1) * div_rn(m, sqrt_rn(v) * h.inv_sqrt_bc2 + h.eps)
    if cfg.decoupled:
        update = update + h.wd * w
    row = [update.abs().max().double(), zero, zero, zero]
    if cfg.v_codec != CODEC_NONE:
        codes = _codes(cfg, t)
        smallest = functools.reduce(torch.logical_or, [codes == c for c in smallest_codes(cfg.v_codec)])
        row[V_SMALLEST] = smallest.sum(dtype=torch.float64)
    if measures_lost(cfg):
        delta = -h.lr * update
        lost = (delta != 0) & (bf16_rne(w + delta) == t.param.reshape(t.rows, t.cols))
        row[LOST] = lost.sum(dtype=torch.float64)
    elif measures_residual(cfg.param_dtype, cfg.weight_update):
        row[RESIDUAL] = _residual_sum(t.param, t.extra, cfg.weight_update, t.rows, t.cols)
    return torch.stack(row)


def adamw_health_reference(cfg: AdamWConfig, t: AdamWTensor, h: HealthHyper) -> torch.Tensor:
    """The partial row ``[1, N_HEALTH]`` of one AdamW parameter after a step."""
    rows = [_adamw_chunk(cfg, c, h) for c in _row_chunks(t, cfg.m_codec != CODEC_NONE)]
    return reduce_health(torch.stack(rows)).reshape(1, N_HEALTH)


def residual_health_reference(param: torch.Tensor, extra: Optional[torch.Tensor], update: int) -> torch.Tensor:
    """The partial row ``[1, N_HEALTH]`` of a bf16 weight's residual alone (column
    RESIDUAL; the others 0): a weight whose update only its step computes (Muon)."""
    row = torch.zeros(N_HEALTH, dtype=torch.float64, device=param.device)
    flat_p, flat_e = param.reshape(-1), extra.reshape(-1)
    for a in range(0, param.numel(), CHUNK_NUMEL):
        b = min(param.numel(), a + CHUNK_NUMEL)
        row[RESIDUAL] += _residual_sum(flat_p[a:b], flat_e[a:b], update, 1, b - a)
    return row.reshape(1, N_HEALTH)
