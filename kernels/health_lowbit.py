"""Fused Triton read of a parameter's optimizer health (``titan_lowbit.optim.health``).

One launch per parameter reads its moments, weight and extra state once, in tiles of
quantization blocks as the AdamW step reads them (``optim_jit``'s loads, dequantization
and fp32 weight), and writes per program one partial row of ``N_HEALTH`` float64 numbers
(``health_ref``'s columns) into a buffer the caller reduces with ``reduce_health``: no
atomics, so the numbers do not depend on the order programs run in.

Math, per element of the parameter's [rows, cols] view, in fp32 (twin: ``health_ref.py``)::

    m = dequant_m(m codes, m absmax)     (plain formats: m = load(m)), as the step reads it
    v = dequant_v(v codes, v absmax)
    w = the fp32 weight the step starts from (fp32 param, master, rebuilt master_remainder,
        else the bf16 weight widened)
    u = (sign * inv_bc1) * div_rn(m, sqrt_rn(v) * inv_sqrt_bc2 + eps)
    u = u + wd * w                                     (decoupled weight decay only)
    MAX_UPDATE   max |u|                               (NaN if any u is NaN)
    V_SMALLEST   count of v codes in smallest_codes(v codec)          (quantized v only)
    LOST         count of (-lr) * u != 0 and bf16_rne(w + (-lr) * u) == weight
                                                       (bf16 weight, nearest)
    RESIDUAL     sum of div_rn(|r|, ulp(weight)) in float64          (bf16 weight with
                 r = kahan compensation, or fp32 master - weight      kahan / master /
                 ulp = max(2**(exponent(weight) - 7), 2**-133)        master_remainder)

Per program the maximum and the counts are exact, the residual sum is a float64 sum of
fp32 terms; ``reduce_health`` takes the maximum and the float64 sums over programs. A
residual-only launch (MOMENTS off: Muon's matrices, whose update only their step
computes) reads the weight and its extra state alone.

Every operation is the reference's, correctly rounded (``div_rn``, ``sqrt_rn``) and
compiled without fused multiply-adds (``enable_fp_fusion=False``), so each element's
``u``, code count, lost flag and residual term are the reference's bit for bit, under
``TRITON_INTERPRET=1`` and on a GPU alike (there with the hardware bf16/fp8 casts, which
round as the reference's casts do): the maximum and the counts equal the reference's
exactly, and the residual sum differs only by the order of its additions.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .adamw_interface import AdamWConfig, AdamWTensor
from .adamw_lowbit import interpreting, launch_shape
from .health_ref import (
    LOST,
    MAX_UPDATE,
    N_HEALTH,
    RESIDUAL,
    V_SMALLEST,
    HealthHyper,
    measures_lost,
    measures_residual,
    smallest_codes,
)
from .loops import kernel_range
from .optim_jit import (
    _K_CODEC_NONE,
    _K_TABLE_SIZE,
    _K_UPDATE_KAHAN,
    _bf16_rne,
    _block_absmax,
    _block_offsets,
    _dequantize,
    _ld,
    _load_raw,
    _load_weight,
    _max_nan,
    _unpacked_codes,
    _widen,
    is_packed,
)
from .quant_maps import CODEC_NONE, PACKED_4BIT_CODECS, codec_tables

# Tiles (of launch_shape's elements) one program reads: fewer partial rows, and per
# program the fixed cost of its setup spread over more elements.
TILES_PER_PROGRAM = 8
# The block of a residual-only read (its layout has no quantization blocks: any power of two).
RESIDUAL_BLOCK = 1024
# bf16's smallest spacing (its subnormals'), 2**-133, as fp32 bits (a float literal this
# small is typed fp64 by Triton 3.6), and the partial rows' columns (health_ref).
_K_BF16_MIN_ULP_BITS = tl.constexpr(0x00010000)
_K_MAX_UPDATE = tl.constexpr(MAX_UPDATE)
_K_V_SMALLEST = tl.constexpr(V_SMALLEST)
_K_LOST = tl.constexpr(LOST)
_K_RESIDUAL = tl.constexpr(RESIDUAL)
_K_N_HEALTH = tl.constexpr(N_HEALTH)
# The iterator of the tile loop, whose bounds are run-time values (kernels/loops.py).
_range = kernel_range()


@triton.jit
def _bf16_ulp(w):
    """The spacing of bf16 values at bf16 ``w`` (fp32): 2**(e - 7) for a normal value of
    exponent e, 2**-133 below (twin: ``health_ref.bf16_ulp``)."""
    exponent = ((w.to(tl.uint16, bitcast=True).to(tl.uint32) << 16) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.maximum(exponent * 0.0078125, tl.full([], _K_BF16_MIN_ULP_BITS, tl.int32).to(tl.float32, bitcast=True))


@triton.jit
def _health_tile(t, p_ptr, x_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, tab_m, tab_v, cols, code_row, bpr, nblocks,
                 update_scale, inv_sqrt_bc2, eps, wd, neg_lr,
                 M_CODEC: tl.constexpr, V_CODEC: tl.constexpr, UPDATE: tl.constexpr, DECOUPLED: tl.constexpr,
                 MOMENTS: tl.constexpr, LOST: tl.constexpr, RESIDUAL: tl.constexpr,
                 SMALL0: tl.constexpr, SMALL1: tl.constexpr, EVEN: tl.constexpr, ALIGNED: tl.constexpr,
                 HW_CAST: tl.constexpr, QBLOCK: tl.constexpr, NB: tl.constexpr):
    """The partial numbers of tile ``t``: (max |u|, v codes at the smallest code, updates
    lost, sum of residual / ulp), each 0 where its flag is off."""
    PACKED: tl.constexpr = is_packed(M_CODEC)
    CBLOCK: tl.constexpr = QBLOCK // 2 if PACKED else QBLOCK
    bidx = t * NB + tl.arange(0, NB)
    _, eoff, coff, bmask, emask, cmask = _block_offsets(bidx, nblocks, cols, code_row, bpr, QBLOCK, CBLOCK,
                                                        EVEN, ALIGNED)
    pptr = p_ptr + eoff
    xptr = x_ptr + eoff
    w = _load_weight(pptr, xptr, emask, UPDATE, EVEN, HW_CAST)
    umax = tl.zeros([], tl.float32)
    n_small = tl.zeros([], tl.int32)
    n_lost = tl.zeros([], tl.int32)
    res = tl.zeros([], tl.float64)
    if MOMENTS:
        m_raw, m_abs = _load_raw(m_ptr, ms_ptr, eoff, coff, bidx, bmask, emask, cmask, M_CODEC, EVEN)
        v_raw, v_abs = _load_raw(v_ptr, vs_ptr, eoff, coff, bidx, bmask, emask, cmask, V_CODEC, EVEN)
        m = _dequantize(m_raw, m_abs, tab_m, M_CODEC, HW_CAST, -1)
        v = _dequantize(v_raw, v_abs, tab_v, V_CODEC, HW_CAST, -1)
        u = update_scale * tl.div_rn(m, tl.sqrt_rn(v) * inv_sqrt_bc2 + eps)
        if DECOUPLED:
            u = u + wd * w
        umax = tl.reduce(_block_absmax(u, emask, EVEN, True), 0, _max_nan)
        if V_CODEC != _K_CODEC_NONE:
            codes = _unpacked_codes(v_raw, V_CODEC).to(tl.int32)
            small = (codes == SMALL0) | (codes == SMALL1)
            n_small = tl.sum(tl.sum((small & emask).to(tl.int32), 1), 0)
        if LOST:
            delta = neg_lr * u
            p = _ld(pptr, emask, EVEN)
            # compared as fp32 (-0 == +0, NaN != NaN): the interpreter compares bf16 bit patterns
            lost = (delta != 0) & (_widen(_bf16_rne(w + delta, HW_CAST), HW_CAST) == _widen(p, HW_CAST))
            n_lost = tl.sum(tl.sum((lost & emask).to(tl.int32), 1), 0)
    if RESIDUAL:
        p = _ld(pptr, emask, EVEN)
        if UPDATE == _K_UPDATE_KAHAN:
            r = _widen(_ld(xptr, emask, EVEN), HW_CAST)
        else:
            r = w - _widen(p, HW_CAST)
        term = tl.div_rn(tl.abs(r), _bf16_ulp(p))
        res = tl.sum(tl.sum(tl.where(emask, term, 0.0).to(tl.float64), 1), 0)
    return umax, n_small, n_lost, res


@triton.jit
def _health_kernel(out_ptr, p_ptr, x_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, tables_ptr,
                   cols, code_row, bpr, nblocks, n_tiles, tiles,
                   update_scale, inv_sqrt_bc2, eps, wd, neg_lr,
                   M_CODEC: tl.constexpr, V_CODEC: tl.constexpr, UPDATE: tl.constexpr, DECOUPLED: tl.constexpr,
                   MOMENTS: tl.constexpr, LOST: tl.constexpr, RESIDUAL: tl.constexpr,
                   SMALL0: tl.constexpr, SMALL1: tl.constexpr, EVEN: tl.constexpr, ALIGNED: tl.constexpr,
                   HW_CAST: tl.constexpr, QBLOCK: tl.constexpr, NB: tl.constexpr):
    """Program i reads the tiles [i * tiles, (i + 1) * tiles) of one parameter and writes
    row i of the partial rows at ``out_ptr`` (the math block above)."""
    pid = tl.program_id(0)
    t0 = pid * tiles
    t_end = tl.minimum(t0 + tiles, n_tiles)
    tab_m = tables_ptr + M_CODEC * _K_TABLE_SIZE
    tab_v = tables_ptr + V_CODEC * _K_TABLE_SIZE
    umax = tl.zeros([], tl.float32)
    n_small = tl.zeros([], tl.int32)
    n_lost = tl.zeros([], tl.int32)
    res = tl.zeros([], tl.float64)
    # _range: compiled, the loop range(t0, t_end) gives; it also runs under the
    # interpreter of every supported Triton (kernels/loops.py).
    for t in _range(t0, t_end):
        t_max, t_small, t_lost, t_res = _health_tile(
            t, p_ptr, x_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, tab_m, tab_v, cols, code_row, bpr, nblocks,
            update_scale, inv_sqrt_bc2, eps, wd, neg_lr, M_CODEC, V_CODEC, UPDATE, DECOUPLED, MOMENTS, LOST,
            RESIDUAL, SMALL0, SMALL1, EVEN, ALIGNED, HW_CAST, QBLOCK, NB)
        umax = _max_nan(umax, t_max)
        n_small += t_small
        n_lost += t_lost
        res += t_res
    row = out_ptr + pid.to(tl.int64) * _K_N_HEALTH
    tl.store(row + _K_MAX_UPDATE, umax.to(tl.float64))
    tl.store(row + _K_V_SMALLEST, n_small.to(tl.float64))
    tl.store(row + _K_LOST, n_lost.to(tl.float64))
    tl.store(row + _K_RESIDUAL, res)


# ----------------------------------------------------------------------------------------
# Host side: one launch per parameter, into a slice of the caller's partial rows
# ----------------------------------------------------------------------------------------
def _tiling(rows: int, cols: int, block: int, codec: int, elems: int) -> tuple:
    """(code_row, blocks per row, blocks, blocks per tile, tiles, even) of a [rows, cols] view."""
    if rows * cols >= 2**31:
        raise ValueError(f"a {rows}x{cols} tensor (local shard) has 2**31 or more elements, past the health "
                         "kernel's int32 offsets (as the fused step's)")
    packed = codec in PACKED_4BIT_CODECS
    code_row = (cols + 1) // 2 if packed else cols
    bpr = -(-cols // block)
    nblocks = rows * bpr
    nb = max(1, elems // block)
    even = cols % block == 0 and nblocks % nb == 0 and (not packed or cols % 2 == 0)
    return code_row, bpr, nblocks, nb, -(-nblocks // nb), even


def _aligned(cols: int, code_row: int, *bufs: Optional[torch.Tensor]) -> bool:
    return cols % 16 == 0 and code_row % 16 == 0 and all(x is None or x.data_ptr() % 64 == 0 for x in bufs)


def _programs(n_tiles: int) -> int:
    return -(-n_tiles // TILES_PER_PROGRAM)


def adamw_health_rows(cfg: AdamWConfig, t: AdamWTensor) -> int:
    """Partial rows ``adamw_health`` writes for ``t``."""
    return _programs(_tiling(t.rows, t.cols, cfg.block, cfg.m_codec, launch_shape(cfg)[0])[4])


def residual_health_rows(numel: int) -> int:
    """Partial rows ``residual_health`` writes for a weight of ``numel`` elements."""
    return _programs(_tiling(1, numel, RESIDUAL_BLOCK, CODEC_NONE, RESIDUAL_BLOCK)[4])


def _launch(out: torch.Tensor, cfg: AdamWConfig, t: AdamWTensor, h: Optional[HealthHyper], elems: int,
            warps: int) -> None:
    code_row, bpr, nblocks, nb, n_tiles, even = _tiling(t.rows, t.cols, cfg.block, cfg.m_codec, elems)
    grid = _programs(n_tiles)
    if out.shape != (grid, N_HEALTH) or out.dtype != torch.float64 or not out.is_contiguous():
        raise ValueError(f"the health kernel writes {grid} contiguous float64 rows of {N_HEALTH} here, "
                         f"got {tuple(out.shape)} {out.dtype}")
    for x in (t.param, t.exp_avg, t.exp_avg_sq, t.exp_avg_scale, t.exp_avg_sq_scale, t.extra):
        if x is not None and not x.is_contiguous():
            raise ValueError(f"the health kernel reads contiguous tensors; got one of stride {x.stride()}")
    moments = h is not None
    small = smallest_codes(cfg.v_codec) if moments and cfg.v_codec != CODEC_NONE else ()
    if len(small) > 2:
        raise ValueError(f"codec {cfg.v_codec} has {len(small)} smallest codes; the health kernel compares two")
    small = small + (-1,) * (2 - len(small))
    p, x = t.param, t.extra if t.extra is not None else t.param
    m = t.exp_avg if moments else p
    v = t.exp_avg_sq if moments else p
    ms = t.exp_avg_scale if t.exp_avg_scale is not None else m
    vs = t.exp_avg_sq_scale if t.exp_avg_sq_scale is not None else v
    aligned = _aligned(t.cols, code_row, p, t.extra, m, v)
    scalars = ((h.sign * h.inv_bc1, h.inv_sqrt_bc2, h.eps, h.wd, -h.lr) if moments else (0.0,) * 5)
    opts = {} if interpreting() else {"enable_fp_fusion": False}
    _health_kernel[(grid,)](
        out, p, x, m, v, ms, vs, codec_tables(str(p.device)),
        t.cols, code_row, bpr, nblocks, n_tiles, TILES_PER_PROGRAM, *scalars,
        cfg.m_codec, cfg.v_codec, cfg.weight_update, cfg.decoupled, moments,
        moments and measures_lost(cfg), measures_residual(cfg.param_dtype, cfg.weight_update),
        small[0], small[1], even, aligned, not interpreting(), cfg.block, nb,
        num_warps=warps, **opts)


def adamw_health(cfg: AdamWConfig, t: AdamWTensor, h: HealthHyper, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The partial rows of one AdamW parameter after a step (``adamw_health_rows`` of
    them, into ``out`` if given): ``health_ref.adamw_health_reference``'s numbers, per
    program."""
    if out is None:
        out = torch.empty(adamw_health_rows(cfg, t), N_HEALTH, dtype=torch.float64, device=t.param.device)
    _launch(out, cfg, t, h, *launch_shape(cfg))
    return out


def residual_health(param: torch.Tensor, extra: torch.Tensor, update: int,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The partial rows of a bf16 weight's residual alone (``residual_health_rows`` of
    them, into ``out`` if given): ``health_ref.residual_health_reference``'s numbers."""
    n = param.numel()
    if out is None:
        out = torch.empty(residual_health_rows(n), N_HEALTH, dtype=torch.float64, device=param.device)
    cfg = AdamWConfig(m_codec=CODEC_NONE, v_codec=CODEC_NONE, state_bf16=False, block=RESIDUAL_BLOCK,
                      weight_update=update, decoupled=False, param_dtype=param.dtype, grad_dtype=param.dtype)
    t = AdamWTensor(param=param.reshape(-1), exp_avg=param, exp_avg_sq=param, exp_avg_scale=None,
                    exp_avg_sq_scale=None, extra=extra.reshape(-1), rows=1, cols=n)
    _launch(out, cfg, t, None, RESIDUAL_BLOCK, launch_shape(cfg)[1])
    return out
