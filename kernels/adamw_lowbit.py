"""Fused multi-tensor AdamW with low-bit optimizer states, in Triton.

One launch steps MANY tensors: a tile table lists, per program, (tensor slot, first
quantization block); a metadata table lists, per tensor slot, its pointers and layout. A
model of 200 tensors costs one launch per *family* (same state format, weight update and
dtypes), not one per tensor.

Math, per element, all in fp32 (llm.c style; names as in the code)::

    layout:   the local tensor is viewed as [rows, cols]; quantization blocks of QBLOCK
              elements run along cols inside one row (the last block of a row may be short)
    dequant:  m = decode_m(m_code) * m_absmax[block]            (plain formats: m = load(m))
              v = decode_v(v_code) * v_absmax[block]
    L2:       g = g + wd * p                                      (only if not DECOUPLED)
    moments:  m = beta1 * m + (1 - beta1) * g
              v = beta2 * v + (1 - beta2) * (g * g)
    update:   step_size = lr * inv_bc1                            inv_bc1 = 1 / (1 - beta1**t)
              denom = sqrt(v) * inv_sqrt_bc2 + eps               inv_sqrt_bc2 = 1/sqrt(1 - beta2**t)
              p_new = p * (1 - lr * wd) - step_size * (m / denom)  (decay only if DECOUPLED)
    requant:  m_absmax[block] = max |m| over the block's valid elements (new, in-kernel)
              m_code = encode_m(m * (1 / m_absmax))               (absmax 0 -> codes of 0)
              same for v
    weight:   fp32 param:          p = p_new
              bf16, NEAREST:       p = bf16_rne(p_new)
              bf16, STOCHASTIC:    p = bf16(truncate(bits(p_new) + (hash(key, idx) & 0xFFFF)))
              bf16, KAHAN:         s = (p_new - p) + c;  p' = bf16_rne(p + s);  c = bf16_rne(s - (p' - p))
              bf16, MASTER:        the math above runs on the fp32 master w; w = p_new; p = bf16_rne(w)

The pure-PyTorch twin of this kernel is ``adamw_lowbit_ref.py``; both use the codec tables of
``quant_maps.py``. Divisions and square roots are correctly rounded (``div_rn``/``sqrt_rn``)
and bf16 rounding is done in integer arithmetic, so under ``TRITON_INTERPRET=1`` kernel and
reference agree bit for bit; on a GPU the compiler may fuse multiply-adds (1-ulp differences).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .quant_maps import (
    CODEC_DYN4_SIGNED,
    CODEC_DYN8_SIGNED,
    CODEC_DYN8_UNSIGNED,
    CODEC_FP8_E4M3,
    CODEC_LIN4_NOZERO,
    CODEC_NONE,
    TABLE_SIZE,
    TABLE_STRIDE,
    codec_tables,
    step_key,
)

# Weight-update ids (compile-time constants in the kernel).
UPDATE_NEAREST = 0
UPDATE_STOCHASTIC = 1
UPDATE_KAHAN = 2
UPDATE_MASTER = 3
WEIGHT_UPDATES = {"nearest": UPDATE_NEAREST, "stochastic": UPDATE_STOCHASTIC,
                  "kahan": UPDATE_KAHAN, "master": UPDATE_MASTER}

# Columns of the per-tensor metadata table (int64).
META_PARAM, META_M, META_V, META_MSCALE, META_VSCALE, META_EXTRA = 0, 1, 2, 3, 4, 5
META_COLS, META_BPR, META_NBLOCKS, META_CODE_ROW, META_SR_BASE, META_SR_ROW, META_SR_KEY = 6, 7, 8, 9, 10, 11, 12
META_STRIDE = 16

# Elements one program handles (several quantization blocks); tuned on an H100.
DEFAULT_ELEMS_PER_PROGRAM = 2048
DEFAULT_NUM_WARPS = 8


# ----------------------------------------------------------------------------------------
# Small device helpers (each has a twin in adamw_lowbit_ref.py)
# ----------------------------------------------------------------------------------------
@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16 round-to-nearest-even in integer arithmetic (same bits on every backend)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = x != x
    rounded = tl.where(nan, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mix32(h):
    """MurmurHash3 fmix32 on uint32."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    return h


@triton.jit
def _bf16_stochastic(x, gidx, tkey, skey):
    """fp32 -> bf16 stochastic rounding: add 16 random bits below bf16's mantissa, truncate."""
    lo = (gidx & 0xFFFFFFFF).to(tl.uint32)
    hi = (gidx >> 32).to(tl.uint32)
    h = _mix32(lo ^ tkey)
    h = _mix32(h ^ (hi + skey))
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + (h & 0xFFFF)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    finite = tl.abs(x) < float("inf")
    return tl.where(finite, rounded, _bf16_rne(x))


@triton.jit
def _dyn_encode(x, tab, M: tl.constexpr, SIGNED: tl.constexpr):
    """Nearest dynamic-tree code of x in [-1, 1] (see quant_maps.py)."""
    a = tl.abs(x)
    k = tl.zeros(x.shape, tl.int32)
    for j in tl.static_range(1, M):
        k += (a > tl.load(tab + j)).to(tl.int32)
    off = tl.load(tab + TABLE_STRIDE + k)
    inv_step = tl.load(tab + 2 * TABLE_STRIDE + k)
    q = tl.floor((a - off) * inv_step + 0.5).to(tl.int32)
    top = tl.full(x.shape, 1, tl.int32) << k
    q = tl.minimum(tl.maximum(q, 0), top)
    p = tl.where(q == 0, tl.where(k == 0, 0, top - 1), top + q - 1)
    if SIGNED:
        p = tl.where(x < 0, p | (1 << M), p)
    return p


@triton.jit
def _dyn_decode(code, tab, M: tl.constexpr, SIGNED: tl.constexpr):
    c = code.to(tl.int32)
    p = c & ((1 << M) - 1)
    k = ((p.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = tl.maximum(k, 0)
    f = p - (tl.full(p.shape, 1, tl.int32) << k)
    off = tl.load(tab + TABLE_STRIDE + k)
    step = tl.load(tab + 3 * TABLE_STRIDE + k)
    val = off + (f + 1).to(tl.float32) * step
    val = tl.where(p == 0, 0.0, val)
    if SIGNED:
        val = tl.where(((c >> M) & 1) != 0, -val, val)
    return val


@triton.jit
def _lin4_encode(x):
    q = tl.floor(tl.abs(x) * 16.0 - 0.5).to(tl.int32)
    return tl.minimum(tl.maximum(q, 0), 15)


@triton.jit
def _lin4_decode(code):
    return (code.to(tl.int32) + 1).to(tl.float32) * 0.0625


@triton.jit
def _fp8_encode(x):
    """x in [-1, 1] -> e4m3 bits of x * 448, round to nearest even (float8_e4m3fn layout)."""
    a = tl.minimum(tl.abs(x) * 448.0, 448.0)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    qexp = tl.maximum(e, -6) - 3
    inv_q = ((127 - qexp) << 23).to(tl.float32, bitcast=True)
    q = ((127 + qexp) << 23).to(tl.float32, bitcast=True)
    t = a * inv_q
    r = tl.floor(t + 0.5)
    r = tl.where((r - t == 0.5) & ((r.to(tl.int32) & 1) == 1), r - 1.0, r)
    val = r * q
    vbits = val.to(tl.int32, bitcast=True)
    normal = val >= 0.015625
    code = tl.where(normal, ((((vbits >> 23) & 0xFF) - 120) << 3) | ((vbits >> 20) & 7), r.to(tl.int32))
    return tl.where(x < 0, code | 0x80, code)


@triton.jit
def _fp8_decode(code):
    c = code.to(tl.int32)
    ce = (c >> 3) & 15
    mant = c & 7
    normal = ((ce + 120) << 23 | (mant << 20)).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * 0.001953125
    val = tl.where(ce == 0, sub, normal) * (1.0 / 448.0)
    return tl.where((c & 0x80) != 0, -val, val)


@triton.jit
def _decode(code, tab, CODEC: tl.constexpr):
    if CODEC == CODEC_LIN4_NOZERO:
        return _lin4_decode(code)
    elif CODEC == CODEC_FP8_E4M3:
        return _fp8_decode(code)
    elif CODEC == CODEC_DYN8_SIGNED:
        return _dyn_decode(code, tab, 7, True)
    elif CODEC == CODEC_DYN8_UNSIGNED:
        return _dyn_decode(code, tab, 8, False)
    else:
        return _dyn_decode(code, tab, 3, True)


@triton.jit
def _encode(x, tab, CODEC: tl.constexpr):
    if CODEC == CODEC_LIN4_NOZERO:
        return _lin4_encode(x)
    elif CODEC == CODEC_FP8_E4M3:
        return _fp8_encode(x)
    elif CODEC == CODEC_DYN8_SIGNED:
        return _dyn_encode(x, tab, 7, True)
    elif CODEC == CODEC_DYN8_UNSIGNED:
        return _dyn_encode(x, tab, 8, False)
    else:
        return _dyn_encode(x, tab, 3, True)


@triton.jit
def _load_state(meta, col_ptr: tl.constexpr, col_scale: tl.constexpr, tab, row, cb, col, qb, code_row,
                emask, CODEC: tl.constexpr, STATE_BF16: tl.constexpr, NB: tl.constexpr,
                QBLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Load one moment of a tile as fp32 [NB, QBLOCK] (plain or dequantized)."""
    base = tl.load(meta + col_ptr)
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    if CODEC == CODEC_NONE:
        off = row[:, None] * code_row + col
        if STATE_BF16:
            ptr = base.to(tl.pointer_type(tl.bfloat16))
        else:
            ptr = base.to(tl.pointer_type(tl.float32))
        return tl.load(ptr + off, mask=emask, other=0.0).to(tl.float32)
    else:
        ptr = base.to(tl.pointer_type(tl.uint8))
        bmask = (qb < tl.load(meta + META_NBLOCKS))
        sptr = tl.load(meta + col_scale).to(tl.pointer_type(tl.float32))
        absmax = tl.load(sptr + qb, mask=bmask, other=0.0)
        if CODEC == CODEC_DYN4_SIGNED or CODEC == CODEC_LIN4_NOZERO:
            half: tl.constexpr = QBLOCK // 2
            byte = cb[:, None] * half + tl.arange(0, half)[None, :]
            cols = tl.load(meta + META_COLS)
            bm = bmask[:, None] & (byte < (cols + 1) // 2)
            packed = tl.load(ptr + row[:, None] * code_row + byte, mask=bm, other=0).to(tl.int32)
            codes = tl.interleave(packed & 15, packed >> 4)
        else:
            codes = tl.load(ptr + row[:, None] * code_row + col, mask=emask, other=0)
        return _decode(codes, tab, CODEC) * absmax[:, None]


@triton.jit
def _store_state(meta, col_ptr: tl.constexpr, col_scale: tl.constexpr, tab, x, row, cb, col, qb, code_row,
                 emask, CODEC: tl.constexpr, STATE_BF16: tl.constexpr, NB: tl.constexpr,
                 QBLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Store one moment of a tile: plain, or re-quantized with the block's new absmax."""
    base = tl.load(meta + col_ptr)
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    if CODEC == CODEC_NONE:
        off = row[:, None] * code_row + col
        if STATE_BF16:
            tl.store(base.to(tl.pointer_type(tl.bfloat16)) + off, _bf16_rne(x), mask=emask)
        else:
            tl.store(base.to(tl.pointer_type(tl.float32)) + off, x, mask=emask)
    else:
        ptr = base.to(tl.pointer_type(tl.uint8))
        bmask = (qb < tl.load(meta + META_NBLOCKS))
        x = tl.where(emask, x, 0.0)
        absmax = tl.max(tl.abs(x), axis=1)
        inv = tl.div_rn(tl.full(absmax.shape, 1.0, tl.float32), tl.where(absmax > 0, absmax, 1.0))
        codes = _encode(x * inv[:, None], tab, CODEC)
        sptr = tl.load(meta + col_scale).to(tl.pointer_type(tl.float32))
        tl.store(sptr + qb, absmax, mask=bmask)
        if CODEC == CODEC_DYN4_SIGNED or CODEC == CODEC_LIN4_NOZERO:
            half: tl.constexpr = QBLOCK // 2
            lo, hi = tl.split(tl.reshape(codes, [NB, half, 2]))
            byte = cb[:, None] * half + tl.arange(0, half)[None, :]
            cols = tl.load(meta + META_COLS)
            bm = bmask[:, None] & (byte < (cols + 1) // 2)
            tl.store(ptr + row[:, None] * code_row + byte, (lo | (hi << 4)).to(tl.uint8), mask=bm)
        else:
            tl.store(ptr + row[:, None] * code_row + col, codes.to(tl.uint8), mask=emask)


@triton.jit
def _adamw_lowbit_kernel(
    tiles_ptr, meta_ptr, grads_ptr, tables_ptr, lr_ptr,
    lr_value, inv_bc1, inv_sqrt_bc2, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, wd, skey,
    M_CODEC: tl.constexpr, V_CODEC: tl.constexpr, STATE_BF16: tl.constexpr,
    PARAM_BF16: tl.constexpr, GRAD_BF16: tl.constexpr, UPDATE: tl.constexpr,
    DECOUPLED: tl.constexpr, LR_IS_TENSOR: tl.constexpr, ALIGNED: tl.constexpr,
    QBLOCK: tl.constexpr, NB: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = tl.load(tiles_ptr + 2 * pid).to(tl.int64)
    q0 = tl.load(tiles_ptr + 2 * pid + 1).to(tl.int64)
    meta = meta_ptr + slot * META_STRIDE
    cols = tl.load(meta + META_COLS)
    bpr = tl.load(meta + META_BPR)
    nblocks = tl.load(meta + META_NBLOCKS)
    code_row = tl.load(meta + META_CODE_ROW)
    if ALIGNED:
        cols = tl.multiple_of(cols, 16)
        code_row = tl.multiple_of(code_row, 16)

    qb = q0 + tl.arange(0, NB).to(tl.int64)
    row = qb // bpr
    cb = qb - row * bpr
    col = cb[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    emask = (qb < nblocks)[:, None] & (col < cols)
    eoff = row[:, None] * cols + col

    if LR_IS_TENSOR:
        lr = tl.load(lr_ptr).to(tl.float32)
    else:
        lr = lr_value
    step_size = lr * inv_bc1
    decay = 1.0 - lr * wd

    pbase = tl.load(meta + META_PARAM)
    gbase = tl.load(grads_ptr + slot)
    if ALIGNED:
        pbase = tl.multiple_of(pbase, 16)
        gbase = tl.multiple_of(gbase, 16)
    if PARAM_BF16:
        pptr = pbase.to(tl.pointer_type(tl.bfloat16))
    else:
        pptr = pbase.to(tl.pointer_type(tl.float32))
    if GRAD_BF16:
        gptr = gbase.to(tl.pointer_type(tl.bfloat16))
    else:
        gptr = gbase.to(tl.pointer_type(tl.float32))
    g = tl.load(gptr + eoff, mask=emask, other=0.0).to(tl.float32)
    p_stored = tl.load(pptr + eoff, mask=emask, other=0.0).to(tl.float32)

    if UPDATE == UPDATE_MASTER and PARAM_BF16:
        xptr = tl.load(meta + META_EXTRA).to(tl.pointer_type(tl.float32))
        p = tl.load(xptr + eoff, mask=emask, other=0.0)
    else:
        p = p_stored

    tab_m = tables_ptr + M_CODEC * TABLE_SIZE
    tab_v = tables_ptr + V_CODEC * TABLE_SIZE
    m = _load_state(meta, META_M, META_MSCALE, tab_m, row, cb, col, qb, code_row, emask,
                    M_CODEC, STATE_BF16, NB, QBLOCK, ALIGNED)
    v = _load_state(meta, META_V, META_VSCALE, tab_v, row, cb, col, qb, code_row, emask,
                    V_CODEC, STATE_BF16, NB, QBLOCK, ALIGNED)

    # ---- AdamW, fp32 -------------------------------------------------------------------
    if not DECOUPLED:
        g = g + wd * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    denom = tl.sqrt_rn(v) * inv_sqrt_bc2 + eps
    upd = step_size * tl.div_rn(m, denom)
    if DECOUPLED:
        p_new = p * decay - upd
    else:
        p_new = p - upd

    _store_state(meta, META_M, META_MSCALE, tab_m, m, row, cb, col, qb, code_row, emask,
                 M_CODEC, STATE_BF16, NB, QBLOCK, ALIGNED)
    _store_state(meta, META_V, META_VSCALE, tab_v, v, row, cb, col, qb, code_row, emask,
                 V_CODEC, STATE_BF16, NB, QBLOCK, ALIGNED)

    # ---- weight write ------------------------------------------------------------------
    if not PARAM_BF16:
        tl.store(pptr + eoff, p_new, mask=emask)
    elif UPDATE == UPDATE_NEAREST:
        tl.store(pptr + eoff, _bf16_rne(p_new), mask=emask)
    elif UPDATE == UPDATE_STOCHASTIC:
        gidx = tl.load(meta + META_SR_BASE) + row[:, None] * tl.load(meta + META_SR_ROW) + col
        tkey = tl.load(meta + META_SR_KEY).to(tl.uint32)
        tl.store(pptr + eoff, _bf16_stochastic(p_new, gidx, tkey, skey.to(tl.uint32)), mask=emask)
    elif UPDATE == UPDATE_KAHAN:
        cptr = tl.load(meta + META_EXTRA).to(tl.pointer_type(tl.bfloat16))
        c = tl.load(cptr + eoff, mask=emask, other=0.0).to(tl.float32)
        s = (p_new - p) + c
        p_b = _bf16_rne(p + s)
        c_new = _bf16_rne(s - (p_b.to(tl.float32) - p))
        tl.store(pptr + eoff, p_b, mask=emask)
        tl.store(cptr + eoff, c_new, mask=emask)
    else:  # MASTER
        xptr = tl.load(meta + META_EXTRA).to(tl.pointer_type(tl.float32))
        tl.store(xptr + eoff, p_new, mask=emask)
        tl.store(pptr + eoff, _bf16_rne(p_new), mask=emask)


# ----------------------------------------------------------------------------------------
# Host side: the tensors of one step, and the cached launch over many of them
# ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """What the kernel is compiled for: one launch family."""

    m_codec: int
    v_codec: int
    state_bf16: bool  # plain formats only: bf16 (True) or fp32 moments
    block: int  # quantization block (elements along a row)
    weight_update: int
    decoupled: bool
    param_dtype: torch.dtype
    grad_dtype: torch.dtype


@dataclasses.dataclass
class AdamWTensor:
    """One tensor's local view for the kernel: a [rows, cols] layout of plain tensors."""

    param: torch.Tensor
    exp_avg: torch.Tensor  # plain moment, or uint8 codes ([rows, cols] or packed [rows, ceil(cols/2)])
    exp_avg_sq: torch.Tensor
    exp_avg_scale: Optional[torch.Tensor]  # fp32 [rows, ceil(cols/block)] absmax, or None
    exp_avg_sq_scale: Optional[torch.Tensor]
    extra: Optional[torch.Tensor]  # fp32 master weights or bf16 Kahan compensation, or None
    rows: int
    cols: int
    sr_base: int = 0  # global index of local element (r, c) = sr_base + r * sr_row_stride + c
    sr_row_stride: int = 0
    sr_key: int = 0


@dataclasses.dataclass
class AdamWHyper:
    lr: "float | torch.Tensor"
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # 1 on the first step


def hyper_scalars(h: AdamWHyper) -> dict:
    """The per-step scalars both kernel and reference use (fp32 on device)."""
    return dict(
        inv_bc1=1.0 / (1.0 - h.beta1**h.step),
        inv_sqrt_bc2=1.0 / (1.0 - h.beta2**h.step) ** 0.5,
        beta1=h.beta1, one_minus_beta1=1.0 - h.beta1,
        beta2=h.beta2, one_minus_beta2=1.0 - h.beta2,
        eps=h.eps, wd=h.weight_decay, skey=step_key(h.step),
    )


def code_row_elems(cfg: AdamWConfig, cols: int) -> int:
    """Elements (or bytes, for codes) per row of a moment's storage."""
    if cfg.m_codec in (CODEC_DYN4_SIGNED, CODEC_LIN4_NOZERO):
        return (cols + 1) // 2
    return cols


class FusedAdamW:
    """A launch plan over many tensors of one family; built once, reused every step.

    The metadata and tile tables live on the device. Only the gradient pointers can change
    between steps (``zero_grad(set_to_none=True)`` frees them); they are re-uploaded when they
    differ from the last step's, in one small host-to-device copy.
    """

    def __init__(self, cfg: AdamWConfig, tensors: Sequence[AdamWTensor],
                 elems_per_program: int = DEFAULT_ELEMS_PER_PROGRAM, num_warps: int = DEFAULT_NUM_WARPS):
        if cfg.block & (cfg.block - 1) or cfg.block < 2:
            raise ValueError(f"block size must be a power of two >= 2, got {cfg.block}")
        self.cfg = cfg
        self.device = tensors[0].param.device
        self.num_warps = num_warps
        self.nb = max(1, elems_per_program // cfg.block)
        meta = torch.zeros(len(tensors), META_STRIDE, dtype=torch.int64)
        tiles = []
        aligned = True
        for slot, t in enumerate(tensors):
            bpr = -(-t.cols // cfg.block)
            nblocks = t.rows * bpr
            crow = code_row_elems(cfg, t.cols) if cfg.m_codec != CODEC_NONE else t.cols

            def ptr(x):
                return 0 if x is None else x.data_ptr()

            meta[slot, META_PARAM] = ptr(t.param)
            meta[slot, META_M] = ptr(t.exp_avg)
            meta[slot, META_V] = ptr(t.exp_avg_sq)
            meta[slot, META_MSCALE] = ptr(t.exp_avg_scale)
            meta[slot, META_VSCALE] = ptr(t.exp_avg_sq_scale)
            meta[slot, META_EXTRA] = ptr(t.extra)
            meta[slot, META_COLS] = t.cols
            meta[slot, META_BPR] = bpr
            meta[slot, META_NBLOCKS] = nblocks
            meta[slot, META_CODE_ROW] = crow
            meta[slot, META_SR_BASE] = t.sr_base
            meta[slot, META_SR_ROW] = t.sr_row_stride
            meta[slot, META_SR_KEY] = t.sr_key
            aligned &= t.cols % 16 == 0 and crow % 16 == 0
            aligned &= all(x is None or x.data_ptr() % 16 == 0 for x in
                           (t.param, t.exp_avg, t.exp_avg_sq, t.extra))
            for q0 in range(0, nblocks, self.nb):
                tiles.append((slot, q0))
        if len(tiles) >= 2**31 or max((t.rows * -(-t.cols // cfg.block) for t in tensors), default=0) >= 2**31:
            raise ValueError("tensor too large for the tile table (int32 block indices)")
        self.aligned = aligned
        self.n_tensors = len(tensors)
        self.meta = meta.to(self.device)
        self.tiles = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 2).to(self.device)
        self.n_programs = len(tiles)
        self.tables = codec_tables(str(self.device))
        self._grad_ptrs: list[int] = []
        self._grad_table = torch.zeros(len(tensors), dtype=torch.int64, device=self.device)

    def step(self, grads: Sequence[torch.Tensor], hyper: AdamWHyper) -> None:
        cfg = self.cfg
        ptrs = [g.data_ptr() for g in grads]
        if ptrs != self._grad_ptrs:
            aligned = all(p % 16 == 0 for p in ptrs)
            if not aligned and self.aligned:
                raise ValueError("gradient storage is not 16-byte aligned; rebuild the plan")
            host = torch.tensor(ptrs, dtype=torch.int64)
            if self.device.type == "cuda":
                host = host.pin_memory()
            self._grad_table.copy_(host, non_blocking=True)
            self._grad_ptrs = ptrs
        s = hyper_scalars(hyper)
        lr_is_tensor = isinstance(hyper.lr, torch.Tensor)
        lr_tensor = hyper.lr if lr_is_tensor else self._grad_table
        lr_value = 0.0 if lr_is_tensor else float(hyper.lr)
        _adamw_lowbit_kernel[(self.n_programs,)](
            self.tiles, self.meta, self._grad_table, self.tables, lr_tensor,
            lr_value, s["inv_bc1"], s["inv_sqrt_bc2"], s["beta1"], s["one_minus_beta1"],
            s["beta2"], s["one_minus_beta2"], s["eps"], s["wd"], s["skey"],
            M_CODEC=cfg.m_codec, V_CODEC=cfg.v_codec, STATE_BF16=cfg.state_bf16,
            PARAM_BF16=cfg.param_dtype == torch.bfloat16, GRAD_BF16=cfg.grad_dtype == torch.bfloat16,
            UPDATE=cfg.weight_update, DECOUPLED=cfg.decoupled, LR_IS_TENSOR=lr_is_tensor,
            ALIGNED=self.aligned, QBLOCK=cfg.block, NB=self.nb, num_warps=self.num_warps,
        )
