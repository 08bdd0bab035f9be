"""Fused multi-tensor AdamW with low-bit optimizer states, in Triton.

One launch steps MANY tensors: a tile table lists, per tile (a few quantization blocks of
one tensor), one int32 ``(tensor slot << TILE_BITS) | tile``; a metadata table lists, per
tensor slot, its buffer offsets and layout; each program steps ``tiles`` consecutive
entries of the tile table. A model of 200 tensors costs one launch per *family* (same
state format, weight update, dtypes and param group), not one per tensor.

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
              bf16, STOCHASTIC:    p = bf16(truncate(bits(p_new) + (hash(idx) >> 16)))   (NaN -> 0x7FC0)
                                   hash(idx) = mix32(((lo32(idx) ^ tensor_key ^ step_key) + hi32(idx) * GOLDEN32))
              bf16, KAHAN:         s = (p_new - p) + c;  p' = bf16_rne(p + s);  c = bf16_rne(s - (p' - p))
              bf16, MASTER_REMAINDER: MASTER's fp32 master w (below), held as the bf16 weight p and an
                                   int16 remainder r: w = bits(p) << 16 + r (r sign-extended, mod 2**32);
                                   r = low 16 bits of w, p = bf16_away(w)
              bf16, MASTER:        the math above runs on the fp32 master w; w = p_new; p = bf16_away(w)
                                   bf16_away(w) = (bits(w) + 0x8000) >> 16: nearest, ties away from zero
                                   (a NaN w gives a quiet NaN p), the rounding a 16-bit remainder can
                                   pair with exactly (_master_split); both modes use it, so they give
                                   the same weights, masters and states
              v is zero-free: a positive v is never coded 0 (quant_maps.py)
    guard:    (NonfiniteGuard) a block where the step would write a non-finite value (new m,
              v or p_new not finite) is not written at all (weight, moments, their absmax,
              extra state keep their values) and flags[tensor] = tag (m not finite: an
              inf/nan gradient) or -tag (m finite, v or p_new not: an overflowing update)

The pure-PyTorch twin of this kernel is ``adamw_lowbit_ref.py``; both use the codec tables of
``quant_maps.py`` (dynamic-tree codes: value table to decode, bucket table + one midpoint
compare to encode). On a GPU each program copies the tables it reads into shared memory once
and reads them there with PTX loads (``_smem_tables_store``, ``smem_layout``; with a tested
Triton, as they rely on how Triton lays out shared memory: ``private_apis.py``); under the
interpreter, and with any other Triton, ``tl.gather`` reads them (same entries). Under ``TRITON_INTERPRET=1`` (numpy: exact division and sqrt, no fused
multiply-adds) and with the bf16/fp8 roundings done in integer arithmetic (``HW_CAST`` off),
kernel and reference agree bit for bit. On a GPU the kernel uses the hardware casts (same
rounding: nearest even), the fast division/sqrt, and the compiler fuses multiply-adds: values
agree to an ulp, and a code can differ by one step where a value sits on a rounding boundary.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .private_apis import private_api_ok

from .adamw_interface import (  # noqa: F401  (the kernel's interface, re-exported)
    UPDATE_KAHAN,
    UPDATE_MASTER,
    UPDATE_MASTER_REMAINDER,
    UPDATE_NEAREST,
    UPDATE_STOCHASTIC,
    WEIGHT_UPDATES,
    AdamWConfig,
    AdamWHyper,
    AdamWTensor,
    NonfiniteGuard,
    hyper_scalars,
)
from .quant_maps import (
    CODEC_DYN4_SIGNED,
    CODEC_DYN8_SIGNED,
    CODEC_DYN8_UNSIGNED,
    CODEC_FP8_E4M3,
    CODEC_LIN4_NOZERO,
    CODEC_NONE,
    DYN_MAGNITUDE_BITS,
    ENC_ROW,
    ENC_WINDOW,
    GOLDEN32,
    TABLE_LUT,
    TABLE_MID,
    TABLE_SIZE,
    codec_tables,
    enc_shift,
    enc_size,
    encode_tables,
)
from .loops import kernel_range


# Columns of the per-tensor metadata table (int64).
META_PARAM, META_M, META_V, META_MSCALE, META_VSCALE, META_EXTRA = 0, 1, 2, 3, 4, 5
META_COLS, META_BPR, META_NBLOCKS, META_CODE_ROW, META_SR_BASE, META_SR_ROW, META_SR_KEY = 6, 7, 8, 9, 10, 11, 12
META_FLAG = 13  # the tensor's entry in the non-finite guard's flag table
META_STRIDE = 16

# Elements one program handles (several quantization blocks); tuned on an H100.
# Launch shape (elements per program, warps), measured on an H100 (docs/optimizer.md):
# quantized formats are bound by their codec arithmetic and like small programs; plain
# fp32/bf16 states are bound by memory and like bigger ones.
LAUNCH_QUANTIZED = (1024, 4)
LAUNCH_PLAIN = (2048, 8)
# Register cap of launches with the non-finite guard. Left to itself the compiler gives
# several guarded families more than 64 registers (72 for 8-bit states with bf16 weights:
# fewer resident programs per SM, 9% slower on an H100); capped at 64 none spills and the
# guard costs 0 to 7% of the unguarded step (docs/design_notes.md, "Measured and not kept").
GUARD_MAXNREG = 64
# Tiles one program steps, in order (quantized, plain formats); measured on an H100.
TILES_QUANTIZED = 8
TILES_PLAIN = 1


def launch_shape(cfg: "AdamWConfig", elems_per_program: Optional[int] = None,
                 num_warps: Optional[int] = None) -> tuple[int, int]:
    """The (elements per program, warps) a family launches with; None = the default."""
    elems, warps = LAUNCH_PLAIN if cfg.m_codec == CODEC_NONE else LAUNCH_QUANTIZED
    return elems_per_program or elems, num_warps or warps

# A tile-table entry is one int32: (tensor slot << TILE_BITS) | tile index in the tensor.
TILE_BITS = 21
MAX_TENSORS_PER_LAUNCH = 1 << (31 - TILE_BITS)
# Triton compiles a kernel per alignment class of its pointer arguments (16 bytes); the
# launch cache of FusedAdamW keys on the pointers' remainders modulo this larger power of
# two, so it can only be stricter than Triton's own specialization.
_SPECIALIZE_ALIGN = 128


def interpreting() -> bool:
    """Whether the kernel runs under TRITON_INTERPRET (decided when it was decorated)."""
    return type(_adamw_lowbit_kernel).__name__ == "InterpretedFunction"



# The same constants as compile-time values for the @triton.jit code below.
_K_CODEC_DYN4_SIGNED = tl.constexpr(CODEC_DYN4_SIGNED)
_K_CODEC_DYN8_SIGNED = tl.constexpr(CODEC_DYN8_SIGNED)
_K_CODEC_DYN8_UNSIGNED = tl.constexpr(CODEC_DYN8_UNSIGNED)
_K_CODEC_FP8_E4M3 = tl.constexpr(CODEC_FP8_E4M3)
_K_CODEC_LIN4_NOZERO = tl.constexpr(CODEC_LIN4_NOZERO)
_K_CODEC_NONE = tl.constexpr(CODEC_NONE)
_K_TABLE_SIZE = tl.constexpr(TABLE_SIZE)
_K_TABLE_LUT = tl.constexpr(TABLE_LUT)
_K_TABLE_MID = tl.constexpr(TABLE_MID)
_K_GOLDEN32 = tl.constexpr(GOLDEN32)
_K_TILE_BITS = tl.constexpr(TILE_BITS)
_K_TILE_MASK = tl.constexpr((1 << TILE_BITS) - 1)
_K_ENC_ROW = tl.constexpr(ENC_ROW)
# The iterator of the tile loop, whose bounds are run-time values (kernels/loops.py).
_range = kernel_range()
# Encode windows of at most this many buckets are held as int32 words (in shared memory,
# and in the launch's table image): their reads then need no byte extraction.
ENC_WORDS_MAX = 256
_K_ENC_WORDS_MAX = tl.constexpr(ENC_WORDS_MAX)
# per dynamic-tree codec: magnitude bits M and 2**M magnitudes; encode buckets (shift,
# table size, shared-memory window)
_K_DYN8S_M = tl.constexpr(DYN_MAGNITUDE_BITS[CODEC_DYN8_SIGNED])
_K_DYN8S_NMAG = tl.constexpr(1 << DYN_MAGNITUDE_BITS[CODEC_DYN8_SIGNED])
_K_DYN8U_M = tl.constexpr(DYN_MAGNITUDE_BITS[CODEC_DYN8_UNSIGNED])
_K_DYN8U_NMAG = tl.constexpr(1 << DYN_MAGNITUDE_BITS[CODEC_DYN8_UNSIGNED])
_K_DYN4_M = tl.constexpr(DYN_MAGNITUDE_BITS[CODEC_DYN4_SIGNED])
_K_DYN4_NMAG = tl.constexpr(1 << DYN_MAGNITUDE_BITS[CODEC_DYN4_SIGNED])
_K_ENC8S_SHIFT = tl.constexpr(enc_shift(CODEC_DYN8_SIGNED))
_K_ENC8S_SIZE = tl.constexpr(enc_size(CODEC_DYN8_SIGNED))
_K_ENC8S_WINDOW = tl.constexpr(ENC_WINDOW[CODEC_DYN8_SIGNED])
_K_ENC8U_SHIFT = tl.constexpr(enc_shift(CODEC_DYN8_UNSIGNED))
_K_ENC8U_SIZE = tl.constexpr(enc_size(CODEC_DYN8_UNSIGNED))
_K_ENC8U_WINDOW = tl.constexpr(ENC_WINDOW[CODEC_DYN8_UNSIGNED])
_K_ENC4_SHIFT = tl.constexpr(enc_shift(CODEC_DYN4_SIGNED))
_K_ENC4_SIZE = tl.constexpr(enc_size(CODEC_DYN4_SIGNED))
_K_ENC4_WINDOW = tl.constexpr(ENC_WINDOW[CODEC_DYN4_SIGNED])
_K_UPDATE_NEAREST = tl.constexpr(UPDATE_NEAREST)
_K_UPDATE_STOCHASTIC = tl.constexpr(UPDATE_STOCHASTIC)
_K_UPDATE_KAHAN = tl.constexpr(UPDATE_KAHAN)
_K_UPDATE_MASTER = tl.constexpr(UPDATE_MASTER)
_K_UPDATE_MASTER_REMAINDER = tl.constexpr(UPDATE_MASTER_REMAINDER)
_K_META_PARAM = tl.constexpr(META_PARAM)
_K_META_M = tl.constexpr(META_M)
_K_META_V = tl.constexpr(META_V)
_K_META_MSCALE = tl.constexpr(META_MSCALE)
_K_META_VSCALE = tl.constexpr(META_VSCALE)
_K_META_EXTRA = tl.constexpr(META_EXTRA)
_K_META_COLS = tl.constexpr(META_COLS)
_K_META_BPR = tl.constexpr(META_BPR)
_K_META_NBLOCKS = tl.constexpr(META_NBLOCKS)
_K_META_CODE_ROW = tl.constexpr(META_CODE_ROW)
_K_META_SR_BASE = tl.constexpr(META_SR_BASE)
_K_META_SR_ROW = tl.constexpr(META_SR_ROW)
_K_META_SR_KEY = tl.constexpr(META_SR_KEY)
_K_META_FLAG = tl.constexpr(META_FLAG)
_K_META_STRIDE = tl.constexpr(META_STRIDE)


# ----------------------------------------------------------------------------------------
# Small device helpers (each has a twin in adamw_lowbit_ref.py)
# ----------------------------------------------------------------------------------------
@triton.jit
def _bf16_rne(x, HW_CAST: tl.constexpr):
    """fp32 -> bf16 round to nearest even: the hardware cast on a GPU; integer arithmetic
    under the interpreter (whose cast truncates), with the same result."""
    if HW_CAST:
        return x.to(tl.bfloat16)
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = x != x
    rounded = tl.where(nan, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _div(a, b, HW_CAST: tl.constexpr):
    """a / b: the fast hardware reciprocal-multiply on a GPU (b is a positive normal number
    here: eps-bounded denominators and block absmax values); exact under the interpreter."""
    if HW_CAST:
        return libdevice.fast_dividef(a, b)
    return tl.div_rn(a, b)


@triton.jit
def _recip(x, HW_CAST: tl.constexpr):
    """1 / x for the block scales: PTX ``rcp.approx.f32`` on a GPU (1 ulp, over the whole
    fp32 range, subnormals included: no slow path, unlike the correctly rounded division,
    which cost about 20 instructions per thread and 8 registers); exact under the
    interpreter. A code can then differ by one step where a value sits on a rounding
    boundary, as with the fused multiply-adds."""
    if HW_CAST:
        return tl.inline_asm_elementwise("rcp.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def _mix32_top(h, key):
    """MurmurHash3 fmix32 of ``h ^ key`` (uint32) without its last step ``h ^= h >> 16``,
    which leaves the top 16 bits as they are: those bits are mix32(h ^ key) >> 16, the only
    ones the caller uses. The first step is written ``h ^ (h >> 16) ^ (key ^ (key >> 16))``
    (the same value): one three-way xor per element, the key's part once per program."""
    h = h ^ (h >> 16) ^ (key ^ (key >> 16))
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h


@triton.jit
def _bf16_stochastic(x, gidx, key, IDX32: tl.constexpr):
    """fp32 -> bf16 stochastic rounding: add 16 random bits below bf16's mantissa, truncate.
    The bits are mix32(lo ^ key + hi * GOLDEN32) >> 16 (the finalizer's best-mixed half),
    key = tensor_key ^ step_key; one mix32 round per element (the finalizer alone avalanches).
    IDX32: every global index of the launch is below 2**32 and gidx is its uint32 (hi = 0,
    so the hash is the same function with fewer instructions).
    Infinities stay infinite (their low half is zero: the sum cannot carry) and a finite
    value may round up to inf past bf16's largest value, as a cast would; a NaN, whose
    pattern the sum could carry into the sign bit, becomes bf16's quiet NaN 0x7FC0. Pure
    integer arithmetic, so the interpreter and the GPU give the same bits."""
    if IDX32:
        h = _mix32_top(gidx, key)
    else:
        lo = (gidx & 0xFFFFFFFF).to(tl.uint32)
        hi = (gidx >> 32).to(tl.uint32)
        h = _mix32_top((lo ^ key) + hi * _K_GOLDEN32, 0)
    bits = tl.where(x == x, x.to(tl.uint32, bitcast=True), 0x7FC00000)
    return ((bits + (h >> 16)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_away(x):
    """fp32 -> bf16 round to nearest, ties away from zero: ``(bits + 0x8000) >> 16``; a NaN
    gives bf16's quiet NaN of its high half, as ``_bf16_rne`` does. The bf16 weight of both
    fp32-master updates (MASTER, MASTER_REMAINDER): the rounding a 16-bit remainder can pair
    with exactly (``_master_split``), shared so that the two give the same weights. Integer
    arithmetic, so GPU and interpreter give the same bits."""
    bits = x.to(tl.uint32, bitcast=True)
    hi = tl.where(x == x, (bits + 0x8000) >> 16, (bits >> 16) | 0x40)
    return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _master_split(x):
    """fp32 master weight -> (bf16 weight, int16 remainder), exact: the remainder is x's low
    16 bits, the weight ``_bf16_away(x)``, its high half rounded to nearest by those bits,
    ties away from zero (the rounding up when the remainder is negative as an int16).
    Round to nearest even cannot be used: at a tie with an even high half it rounds down,
    with an odd one up, so an even bf16 value is the rounding of 2**16 + 1 fp32 values,
    more than 16 bits can tell apart. Finite values and infinities round trip bit for bit
    (a finite value past bf16's largest gives inf, rebuilt exactly); a NaN gives a quiet
    NaN weight and rebuilds as a NaN."""
    rem = (x.to(tl.uint32, bitcast=True) & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True)
    return _bf16_away(x), rem


@triton.jit
def _master_rebuild(w, rem):
    """(bf16 weight, int16 remainder) -> the fp32 master: ``bits(w) << 16 + rem`` with rem
    sign-extended, mod 2**32 (inverse of ``_master_split``)."""
    hi = w.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    return (hi + rem.to(tl.int32).to(tl.uint32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def _smem_read(byte_idx, OFF: tl.constexpr, WORD: tl.constexpr):
    """The int32 word (WORD) or zero-extended byte at ``global_smem + OFF + byte_idx``: a
    table stored in shared memory once per program by ``_smem_tables_store`` (PTX: Triton
    has no shared-memory load at computed addresses). OFF is added inside the asm, where
    ptxas folds it into the load's immediate offset (added outside, LLVM turns it into an
    OR, which costs an instruction per read)."""
    off = tl.full(byte_idx.shape, OFF, tl.int32)
    if WORD:
        out = tl.inline_asm_elementwise(
            "{ .reg .b32 a; mov.b32 a, global_smem; add.u32 a, a, $1; add.u32 a, a, $2; ld.shared.b32 $0, [a]; }",
            "=r,r,r", [byte_idx, off], dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = tl.inline_asm_elementwise(
            "{ .reg .b32 a; mov.b32 a, global_smem; add.u32 a, a, $1; add.u32 a, a, $2; ld.shared.u8 $0, [a]; }",
            "=r,r,r", [byte_idx, off], dtype=tl.int32, is_pure=True, pack=1)
    return out


@triton.jit
def _smem_tables_store(image_ptr, WORDS: tl.constexpr):
    """Store the launch's code tables (``smem_image``: WORDS int32 words, the first
    ``smem_gap`` bytes unused) at the start of the kernel's shared memory, once per
    program. The identity ``tl.gather`` is there for its side effect: Triton reserves
    shared memory for the gather's source (WORDS words); the other shared memory the
    kernel uses (layout conversions in the tile loop, from offset 0) stays inside the gap,
    so the tables stay intact for the program's life. ``FusedAdamW.launch`` checks the
    reservation of every compiled kernel."""
    words = tl.arange(0, WORDS)
    image = tl.gather(tl.load(image_ptr + words), words, 0)
    tl.debug_barrier()
    tl.inline_asm_elementwise(
        "{ .reg .b32 a; mov.b32 a, global_smem; mad.lo.u32 a, $1, 4, a; st.shared.b32 [a], $2; mov.b32 $0, 0; }",
        "=r,r,r", [words, image], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _lookup(table, idx, SIZE: tl.constexpr, AS_I32: tl.constexpr = False, SMEM: tl.constexpr = -1,
            OFF: tl.constexpr = 0):
    """table[idx] for a SIZE-entry table, through shared memory. SMEM >= 0: the table
    lies at byte offset SMEM + OFF of the kernel's shared memory, stored there once per program
    (``_smem_tables_store``); each element reads its entry with one shared load. SMEM < 0
    (the interpreter): tl.gather, which stores the table in shared memory at every call,
    between two barriers. Either way the same random reads from global memory would touch
    several L1 cache lines per warp and use a few bytes of each 32-byte sector.
    AS_I32: a byte table is held as int32 words (4x the space; the reads then need no
    byte extraction)."""
    if SMEM >= 0:
        if table.dtype.element_ty == tl.float32:
            out = _smem_read(idx * 4, SMEM + OFF, True).to(tl.float32, bitcast=True)
        elif AS_I32:
            out = _smem_read(idx * 4, SMEM + OFF, True)
        else:
            out = _smem_read(idx, SMEM + OFF, False)
    else:
        values = tl.load(table + tl.arange(0, SIZE))
        if AS_I32:
            values = values.to(tl.int32)
        out = tl.reshape(tl.gather(values, tl.reshape(idx, [idx.numel]), 0), idx.shape)
    return out


@triton.jit
def _dyn_encode(x, tab, etab, M: tl.constexpr, NMAG: tl.constexpr, SIGNED: tl.constexpr,
                SHIFT: tl.constexpr, SIZE: tl.constexpr, WINDOW: tl.constexpr, SMEM: tl.constexpr):
    """Nearest dynamic-tree code of x in [-1, 1]: bucket table (SIZE buckets, |x|'s float
    bits >> SHIFT; its shared-memory window of the top WINDOW buckets, smaller values clamp
    into the window's first bucket, whose candidate is 0; the 4-bit map's window is its
    whole table), then one midpoint compare (see quant_maps.py for why one compare is
    enough). NMAG = 2**M magnitudes. (The sign could come from x's bits in one instruction
    fewer, but the 8-bit kernel with bf16 weights + SR then needs 72 registers instead of
    64, a lower occupancy, and measured no faster.)"""
    LOW: tl.constexpr = SIZE - WINDOW
    bits = x.to(tl.int32, bitcast=True)
    # |x|'s bucket: the mask drops the sign bit and the exponent's top bit (0 for |x| < 2)
    idx = (bits >> SHIFT) & (SIZE - 1)
    if LOW > 0:
        idx = tl.maximum(idx - LOW, 0)  # the shared-memory window
    cand = _lookup(etab + LOW, idx, WINDOW, WINDOW <= _K_ENC_WORDS_MAX, SMEM, 8 * NMAG).to(tl.int32)
    p = cand + (tl.abs(x) > _lookup(tab + _K_TABLE_MID, cand, NMAG, False, SMEM, 4 * NMAG)).to(tl.int32)
    if SIGNED:
        p = p | ((x < 0).to(tl.int32) << M)
    return p


@triton.jit
def _dyn_decode(code, tab, M: tl.constexpr, NMAG: tl.constexpr, SIGNED: tl.constexpr, SMEM: tl.constexpr):
    """Value of a dynamic-tree code: one read of the codec's value table (its NMAG = 2**M
    magnitudes), sign bit moved onto the float."""
    c = code.to(tl.int32)
    if SIGNED:
        val = _lookup(tab + _K_TABLE_LUT, c & (NMAG - 1), NMAG, False, SMEM)
        return (val.to(tl.int32, bitcast=True) | ((c >> M) << 31)).to(tl.float32, bitcast=True)
    return _lookup(tab + _K_TABLE_LUT, c, NMAG, False, SMEM)


@triton.jit
def _lin4_encode(v, inv16):
    """Code of v >= 0 (the second moment) in a block with 16 / absmax = inv16: the nearest
    (j + 1) / 16 to v / absmax, ties down, is trunc(v * inv16 - 0.5). v * inv16 lies in
    [0, 16 + 16 ulp] (v <= absmax), so the code is in [0, 15] without a clamp. (A NaN
    converts to 0 on the GPU and to INT_MIN under the interpreter and in the reference,
    which packs into the same byte as code 0.)
    16 / absmax is exact, so this equals coding v * (1 / absmax) scaled by 16."""
    return (v * inv16 - 0.5).to(tl.int32)


@triton.jit
def _lin4_decode(code, absmax):
    """(code + 1) / 16 * absmax, as (code + 1) * (absmax / 16): the same product, one
    multiply per element (absmax / 16 is exact)."""
    return (code.to(tl.int32) + 1).to(tl.float32) * (absmax * 0.0625)[:, None]


@triton.jit
def _fp8_encode(x, HW_CAST: tl.constexpr):
    """x in [-1, 1] -> e4m3 bits of x * 448, round to nearest even (float8_e4m3fn layout):
    the hardware cast on a GPU, bit arithmetic under the interpreter (same codes)."""
    if HW_CAST:
        y = tl.minimum(tl.maximum(x * 448.0, -448.0), 448.0)
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
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
def _fp8_decode(code, HW_CAST: tl.constexpr):
    if HW_CAST:
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * (1.0 / 448.0)
    c = code.to(tl.int32)
    ce = (c >> 3) & 15
    mant = c & 7
    normal = ((ce + 120) << 23 | (mant << 20)).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * 0.001953125
    val = tl.where(ce == 0, sub, normal) * (1.0 / 448.0)
    return tl.where((c & 0x80) != 0, -val, val)


@triton.jit
def _decode(code, absmax, tab, CODEC: tl.constexpr, HW_CAST: tl.constexpr, SMEM: tl.constexpr):
    """Values of a tile's codes [NB, QBLOCK] in blocks with the given absmax [NB]."""
    if CODEC == _K_CODEC_LIN4_NOZERO:
        out = _lin4_decode(code, absmax)
    else:
        if CODEC == _K_CODEC_FP8_E4M3:
            val = _fp8_decode(code, HW_CAST)
        elif CODEC == _K_CODEC_DYN8_SIGNED:
            val = _dyn_decode(code, tab, _K_DYN8S_M, _K_DYN8S_NMAG, True, SMEM)
        elif CODEC == _K_CODEC_DYN8_UNSIGNED:
            val = _dyn_decode(code, tab, _K_DYN8U_M, _K_DYN8U_NMAG, False, SMEM)
        else:
            val = _dyn_decode(code, tab, _K_DYN4_M, _K_DYN4_NMAG, True, SMEM)
        out = val * absmax[:, None]
    return out


@triton.jit
def _encode(x, inv, tab, etab, CODEC: tl.constexpr, HW_CAST: tl.constexpr, SMEM: tl.constexpr):
    """Codes of a tile's values [NB, QBLOCK] in blocks with 1 / absmax = inv [NB]."""
    if CODEC == _K_CODEC_LIN4_NOZERO:
        codes = _lin4_encode(x, (inv * 16.0)[:, None])
    else:
        xn = x * inv[:, None]
        if CODEC == _K_CODEC_FP8_E4M3:
            codes = _fp8_encode(xn, HW_CAST)
        elif CODEC == _K_CODEC_DYN8_SIGNED:
            codes = _dyn_encode(xn, tab, etab, _K_DYN8S_M, _K_DYN8S_NMAG, True,
                                _K_ENC8S_SHIFT, _K_ENC8S_SIZE, _K_ENC8S_WINDOW, SMEM)
        elif CODEC == _K_CODEC_DYN8_UNSIGNED:
            codes = _dyn_encode(xn, tab, etab, _K_DYN8U_M, _K_DYN8U_NMAG, False,
                                _K_ENC8U_SHIFT, _K_ENC8U_SIZE, _K_ENC8U_WINDOW, SMEM)
        else:
            codes = _dyn_encode(xn, tab, etab, _K_DYN4_M, _K_DYN4_NMAG, True,
                                _K_ENC4_SHIFT, _K_ENC4_SIZE, _K_ENC4_WINDOW, SMEM)
    return codes


@triton.jit
def _ld(ptr, mask, EVEN: tl.constexpr):
    """Load, unmasked when the launch holds only whole tiles (EVEN)."""
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def _st(ptr, val, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, val)
    else:
        tl.store(ptr, val, mask=mask)


@triton.jit
def _max_nan(a, b):
    """maximum that returns nan if either is nan (the combine of _block_absmax's NAN)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _block_absmax(x, emask, EVEN: tl.constexpr, NAN: tl.constexpr):
    """max |x| over each block's valid elements [NB]; NAN: a block holding a nan gives nan
    (the plain maximum may drop it)."""
    a = tl.abs(x)
    if not EVEN:
        a = tl.where(emask, a, 0.0)
    if NAN:
        return tl.reduce(a, 1, _max_nan)
    else:
        return tl.max(a, axis=1)


@triton.jit
def _store_state(x, absmax, base, sbase, soff, tab, etab, eptr_off, cptr_off, bidx, bmask, emask, cmask,
                 CODEC: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, EVEN: tl.constexpr,
                 HW_CAST: tl.constexpr, SMEM: tl.constexpr, ZERO_FREE: tl.constexpr = False):
    """Store one moment of a tile: plain, or re-quantized with each block's new absmax
    (``_block_absmax`` of x; unused for plain states). ZERO_FREE (the second moment): a
    positive value is never coded 0 (quant_maps.py: the 8-bit unsigned map does it in its
    tables, fp8 here)."""
    if CODEC == _K_CODEC_NONE:
        if base.dtype.element_ty == tl.bfloat16:
            _st(base + eptr_off, _bf16_rne(x, HW_CAST), emask, EVEN)
        else:
            _st(base + eptr_off, x, emask, EVEN)
    else:
        if not EVEN:
            x = tl.where(emask, x, 0.0)
        # 1 / absmax; 0 for a block whose largest value is below fp32's smallest normal
        # (its reciprocal would overflow, and 0 * inf code a nan): its codes are those of 0
        # (far below eps, such a moment does not change the update)
        normal = absmax >= 1.1754943508222875e-38
        inv = tl.where(normal, _recip(tl.where(normal, absmax, 1.0), HW_CAST), 0.0)
        codes = _encode(x, inv, tab, etab, CODEC, HW_CAST, SMEM)
        if ZERO_FREE and CODEC == _K_CODEC_FP8_E4M3:
            codes = tl.maximum(codes, (x > 0).to(tl.int32))  # SMALLEST_POSITIVE_CODE
        _st(sbase + soff + bidx, absmax, bmask, EVEN)
        if CODEC == _K_CODEC_DYN4_SIGNED or CODEC == _K_CODEC_LIN4_NOZERO:
            lo, hi = tl.split(tl.reshape(codes, [NB, QBLOCK // 2, 2]))
            _st(base + cptr_off, (lo | (hi << 4)).to(tl.uint8), cmask, EVEN)
        else:
            _st(base + cptr_off, codes.to(tl.uint8), emask, EVEN)


@triton.jit
def _meta_offset(meta, COL: tl.constexpr, ALIGNED: tl.constexpr):
    """Element offset of one of a tensor's buffers from the launch's base pointer."""
    off = tl.load(meta + COL)
    if ALIGNED:
        off = tl.multiple_of(off, 16)
    return off


@triton.jit
def _tile_where(tiles_ptr, t, meta_ptr, QBLOCK: tl.constexpr, NB: tl.constexpr, CBLOCK: tl.constexpr,
                EVEN: tl.constexpr, ALIGNED: tl.constexpr):
    """Where tile ``t`` of the launch lies: its tensor's slot and metadata row, its first
    block, the element and code-byte offsets [NB, QBLOCK] / [NB, CBLOCK] inside the tensor's
    buffers, and the masks. EVEN launches hold rows of whole blocks: block b starts at
    element b * QBLOCK (no division by the blocks per row, ~8 instructions per element)."""
    tile = tl.load(tiles_ptr + t)
    slot = tile >> _K_TILE_BITS
    bidx = (tile & _K_TILE_MASK) * NB + tl.arange(0, NB)
    meta = meta_ptr + slot.to(tl.int64) * _K_META_STRIDE
    nblocks = tl.load(meta + _K_META_NBLOCKS).to(tl.int32)
    # Offsets inside one tensor are int32 (a launch's tensors have < 2**31 elements, checked
    # when the plan is built): half the registers and address arithmetic of int64.
    if EVEN:
        e_start = bidx * QBLOCK
        c_start = bidx * CBLOCK
    else:
        cols = _meta_offset(meta, _K_META_COLS, ALIGNED)
        code_row = _meta_offset(meta, _K_META_CODE_ROW, ALIGNED)
        bpr = tl.load(meta + _K_META_BPR).to(tl.int32)
        row = bidx // bpr
        cb = bidx - row * bpr
        e_start = row * cols.to(tl.int32) + cb * QBLOCK
        c_start = row * code_row.to(tl.int32) + cb * CBLOCK
    if ALIGNED:
        e_start = tl.multiple_of(e_start, 16)
        c_start = tl.multiple_of(c_start, 16)
    lane = tl.arange(0, QBLOCK)[None, :]
    eoff = e_start[:, None] + lane
    coff = c_start[:, None] + tl.arange(0, CBLOCK)[None, :]
    bmask = bidx < nblocks
    if EVEN:
        emask = bmask[:, None]
        cmask = bmask[:, None]
    else:
        col = cb[:, None] * QBLOCK + lane
        emask = bmask[:, None] & (col < cols)
        cmask = bmask[:, None] & ((cb[:, None] * CBLOCK + tl.arange(0, CBLOCK)[None, :]) < (cols + 1) // 2)
    return slot, meta, bidx, e_start, eoff, coff, bmask, emask, cmask


@triton.jit
def _load_raw(base, sbase, meta, SCOL: tl.constexpr, eoff, coff, bidx, bmask, emask, cmask,
              CODEC: tl.constexpr, EVEN: tl.constexpr):
    """One moment of a tile as stored: plain values [NB, QBLOCK], or codes (4-bit: packed
    bytes [NB, QBLOCK/2]) and the blocks' absmax [NB] (plain: a placeholder)."""
    if CODEC == _K_CODEC_NONE:
        return _ld(base + eoff, emask, EVEN), bmask
    else:
        absmax = _ld(sbase + tl.load(meta + SCOL) + bidx, bmask, EVEN)
        if CODEC == _K_CODEC_DYN4_SIGNED or CODEC == _K_CODEC_LIN4_NOZERO:
            codes = _ld(base + coff, cmask, EVEN)
        else:
            codes = _ld(base + eoff, emask, EVEN)
        return codes, absmax


@triton.jit
def _dequantize(raw, absmax, tab, CODEC: tl.constexpr, HW_CAST: tl.constexpr, SMEM: tl.constexpr):
    """fp32 values [NB, QBLOCK] of a moment loaded by _load_raw."""
    if CODEC == _K_CODEC_NONE:
        return raw.to(tl.float32)
    else:
        if CODEC == _K_CODEC_DYN4_SIGNED or CODEC == _K_CODEC_LIN4_NOZERO:
            packed = raw.to(tl.int32)
            codes = tl.interleave(packed & 15, packed >> 4)
        else:
            codes = raw
        return _decode(codes, absmax, tab, CODEC, HW_CAST, SMEM)


@triton.jit
def _step_tile(tiles_ptr, t, meta_ptr, grad_offsets_ptr, tab_m, tab_v, etab_m, etab_v,
               p_base, g_base, m_base, v_base, ms_base, vs_base, x_base,
               step_size, decay, inv_sqrt_bc2, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, wd,
               skey, flags_ptr, flag_tag, M_CODEC: tl.constexpr, V_CODEC: tl.constexpr, UPDATE: tl.constexpr,
               DECOUPLED: tl.constexpr, ALIGNED: tl.constexpr, EVEN: tl.constexpr,
               SR_DENSE: tl.constexpr, SR_IDX32: tl.constexpr, HW_CAST: tl.constexpr,
               QBLOCK: tl.constexpr, NB: tl.constexpr, CBLOCK: tl.constexpr,
               M_SMEM: tl.constexpr, V_SMEM: tl.constexpr, GUARD: tl.constexpr):
    """The AdamW step of tile ``t``: load gradient, weight (with fp32 master weights only
    the master: the bf16 copy is only written), extra state and both moments; dequantize,
    update in fp32, re-quantize with each block's new absmax, write states and weight.
    GUARD: blocks where a new moment or weight is not finite are not written, and flag
    their tensor (NonfiniteGuard)."""
    slot, meta, bidx, e_start, eoff, coff, bmask, emask, cmask = _tile_where(
        tiles_ptr, t, meta_ptr, QBLOCK, NB, CBLOCK, EVEN, ALIGNED)
    PARAM_BF16: tl.constexpr = p_base.dtype.element_ty == tl.bfloat16
    g_off = tl.load(grad_offsets_ptr + slot)
    if ALIGNED:
        g_off = tl.multiple_of(g_off, 16)
    g = _ld(g_base + g_off + eoff, emask, EVEN).to(tl.float32)
    pptr = p_base + _meta_offset(meta, _K_META_PARAM, ALIGNED) + eoff
    xptr = x_base + _meta_offset(meta, _K_META_EXTRA, ALIGNED) + eoff
    if PARAM_BF16 and UPDATE == _K_UPDATE_MASTER:
        p = _ld(xptr, emask, EVEN)
    elif PARAM_BF16 and UPDATE == _K_UPDATE_MASTER_REMAINDER:
        p = _master_rebuild(_ld(pptr, emask, EVEN), _ld(xptr, emask, EVEN))
    else:
        p = _ld(pptr, emask, EVEN).to(tl.float32)
    m_base = m_base + _meta_offset(meta, _K_META_M, ALIGNED)
    v_base = v_base + _meta_offset(meta, _K_META_V, ALIGNED)
    m_raw, m_abs = _load_raw(m_base, ms_base, meta, _K_META_MSCALE, eoff, coff, bidx, bmask, emask, cmask,
                             M_CODEC, EVEN)
    v_raw, v_abs = _load_raw(v_base, vs_base, meta, _K_META_VSCALE, eoff, coff, bidx, bmask, emask, cmask,
                             V_CODEC, EVEN)
    m = _dequantize(m_raw, m_abs, tab_m, M_CODEC, HW_CAST, M_SMEM)
    v = _dequantize(v_raw, v_abs, tab_v, V_CODEC, HW_CAST, V_SMEM)

    # ---- AdamW, fp32 -------------------------------------------------------------------
    if not DECOUPLED:
        g = g + wd * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    denom = tl.sqrt(v) * inv_sqrt_bc2 + eps
    upd = step_size * _div(m, denom, HW_CAST)
    if DECOUPLED:
        p_new = p * decay - upd
    else:
        p_new = p - upd

    # ---- guard: a block where the step would write a non-finite value is not written --
    # and flags its tensor: +tag where the new m is not finite (an inf/nan gradient, or a
    # non-finite m state), -tag where m is finite but the new v or weight is not (a
    # finite gradient whose square overflows, |g| >= 2**64; a non-finite v state or
    # weight; 0 / 0 with eps = 0). Found by the block absmaxes that the quantization takes
    # anyway, made nan-propagating: m's, and v's taken over v + p_new * 0 (the same value
    # where p_new is finite, nan where not: one multiply-add; the master weight is p_new,
    # the Kahan buffer follows from it). The flag is one masked store per block (no
    # reduction across warps). Stores are then always masked. (The codes computed for such
    # a block are never stored; the encoders mask every table index into range, so a nan
    # reads no memory outside the tables.)
    ST_EVEN: tl.constexpr = EVEN and not GUARD
    m_abs = _block_absmax(m, emask, EVEN, GUARD)
    if GUARD:
        v_abs = _block_absmax(v + p_new * 0.0, emask, EVEN, True)
        m_ok = m_abs < float("inf")
        ok = m_ok & (v_abs < float("inf"))
        tag = tl.where(m_ok, -flag_tag, flag_tag)
        tl.store(flags_ptr + tl.load(meta + _K_META_FLAG) + bidx * 0, tag, mask=bmask & ~ok)
        bmask = bmask & ok
        emask = emask & ok[:, None]
        cmask = cmask & ok[:, None]
    else:
        v_abs = _block_absmax(v, emask, EVEN, False)
    _store_state(m, m_abs, m_base, ms_base, tl.load(meta + _K_META_MSCALE), tab_m, etab_m, eoff, coff, bidx,
                 bmask, emask, cmask, M_CODEC, NB, QBLOCK, ST_EVEN, HW_CAST, M_SMEM)
    _store_state(v, v_abs, v_base, vs_base, tl.load(meta + _K_META_VSCALE), tab_v, etab_v, eoff, coff, bidx,
                 bmask, emask, cmask, V_CODEC, NB, QBLOCK, ST_EVEN, HW_CAST, V_SMEM, True)

    # ---- weight write ------------------------------------------------------------------
    if not PARAM_BF16:
        _st(pptr, p_new, emask, ST_EVEN)
    elif UPDATE == _K_UPDATE_NEAREST:
        _st(pptr, _bf16_rne(p_new, HW_CAST), emask, ST_EVEN)
    elif UPDATE == _K_UPDATE_STOCHASTIC:
        # global index of each element: SR_BASE + row * SR_ROW + column (SR_DENSE: the
        # launch's tensors are stored with their global rows, SR_ROW == cols, so that is
        # SR_BASE + the local element offset)
        sr_base = tl.load(meta + _K_META_SR_BASE)
        key = tl.load(meta + _K_META_SR_KEY).to(tl.uint32) ^ skey.to(tl.uint32)
        if SR_DENSE:
            g_start = sr_base + e_start.to(tl.int64)
        else:
            bpr = tl.load(meta + _K_META_BPR).to(tl.int32)
            srow = bidx // bpr
            g_start = sr_base + srow.to(tl.int64) * tl.load(meta + _K_META_SR_ROW) + (bidx - srow * bpr) * QBLOCK
        if SR_IDX32:
            g_start = g_start.to(tl.uint32)
        gidx = g_start[:, None] + tl.arange(0, QBLOCK)[None, :].to(g_start.dtype)
        p_out = _bf16_stochastic(p_new, gidx, key, SR_IDX32)
        _st(pptr, p_out, emask, ST_EVEN)
    elif UPDATE == _K_UPDATE_KAHAN:
        s = (p_new - p) + _ld(xptr, emask, EVEN).to(tl.float32)
        p_b = _bf16_rne(p + s, HW_CAST)
        _st(pptr, p_b, emask, ST_EVEN)
        _st(xptr, _bf16_rne(s - (p_b.to(tl.float32) - p), HW_CAST), emask, ST_EVEN)
    elif UPDATE == _K_UPDATE_MASTER_REMAINDER:
        p_b, rem = _master_split(p_new)
        _st(xptr, rem, emask, ST_EVEN)
        _st(pptr, p_b, emask, ST_EVEN)
    else:  # MASTER
        _st(xptr, p_new, emask, ST_EVEN)
        _st(pptr, _bf16_away(p_new), emask, ST_EVEN)


# skey changes at every step: without do_not_specialize, Triton compiles a second variant
# (skey divisible by 16) at the first step whose key is, a stall of about a second in the
# middle of a run.
@triton.jit(do_not_specialize=["skey", "flag_tag"])
def _adamw_lowbit_kernel(
    tiles_ptr, meta_ptr, grad_offsets_ptr, tables_ptr, enc_tables_ptr, smem_image_ptr, lr_ptr, flags_ptr,
    p_base, g_base, m_base, v_base, ms_base, vs_base, x_base, n_tiles, tiles,
    lr_value, inv_bc1, inv_sqrt_bc2, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, wd, skey, flag_tag,
    M_CODEC: tl.constexpr, V_CODEC: tl.constexpr, UPDATE: tl.constexpr,
    DECOUPLED: tl.constexpr, LR_IS_TENSOR: tl.constexpr, ALIGNED: tl.constexpr, EVEN: tl.constexpr,
    SR_DENSE: tl.constexpr, SR_IDX32: tl.constexpr, HW_CAST: tl.constexpr,
    QBLOCK: tl.constexpr, NB: tl.constexpr,
    M_SMEM: tl.constexpr, V_SMEM: tl.constexpr, SMEM_WORDS: tl.constexpr, GUARD: tl.constexpr,
):
    # Program i steps the tiles [i * tiles, (i + 1) * tiles) of the tile table, in order:
    # fewer, longer programs (measured 3-7% faster than one tile per program for the
    # quantized formats with bf16 weights, docs/optimizer.md). Loading the next tile while
    # computing this one was measured slower, and is not done.
    # Buffers are addressed as base pointer (a kernel argument, so the compiler knows its
    # alignment) + per-tensor element offset from the metadata table (+ hint when ALIGNED):
    # that is what lets Triton emit 16-byte vector loads for tensors it only sees through a
    # table. EVEN launches hold only whole tiles of whole blocks: no masks at all.
    PACKED: tl.constexpr = M_CODEC == _K_CODEC_DYN4_SIGNED or M_CODEC == _K_CODEC_LIN4_NOZERO
    CBLOCK: tl.constexpr = QBLOCK // 2 if PACKED else QBLOCK
    t0 = tl.program_id(0) * tiles
    t_end = tl.minimum(t0 + tiles, n_tiles)

    if LR_IS_TENSOR:
        lr = tl.load(lr_ptr).to(tl.float32)
    else:
        lr = lr_value
    step_size = lr * inv_bc1
    decay = 1.0 - lr * wd
    tab_m = tables_ptr + M_CODEC * _K_TABLE_SIZE
    tab_v = tables_ptr + V_CODEC * _K_TABLE_SIZE
    etab_m = enc_tables_ptr + M_CODEC * _K_ENC_ROW
    etab_v = enc_tables_ptr + V_CODEC * _K_ENC_ROW
    if SMEM_WORDS > 0:
        _smem_tables_store(smem_image_ptr, SMEM_WORDS)
    # _range: compiled, the loop range(t0, t_end) gives; it also runs under the
    # interpreter of every supported Triton (kernels/loops.py).
    for t in _range(t0, t_end):
        _step_tile(tiles_ptr, t, meta_ptr, grad_offsets_ptr, tab_m, tab_v, etab_m, etab_v,
                   p_base, g_base, m_base, v_base, ms_base, vs_base, x_base,
                   step_size, decay, inv_sqrt_bc2, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
                   wd, skey, flags_ptr, flag_tag, M_CODEC, V_CODEC, UPDATE, DECOUPLED, ALIGNED, EVEN,
                   SR_DENSE, SR_IDX32, HW_CAST, QBLOCK, NB, CBLOCK, M_SMEM, V_SMEM, GUARD)


# ----------------------------------------------------------------------------------------
# Host side: the tensors of one step, and the cached launch over many of them
# ----------------------------------------------------------------------------------------
# Shared-memory code tables (GPU launches). The kernel's shared memory starts with a gap
# left to Triton's own scratch: layout conversions inside the tile loop (block maxima,
# packed 4-bit codes, fp32 weights), which convert at most one tile of 4-byte values, so
# the gap is 4 bytes per element of a program's tile (tests/test_optim_kernels.py compiles
# every family and checks Triton's own need against it). The tables follow, one dynamic-tree
# codec after the other: value table (2**M words), midpoints (2**M words), encode window
# (bytes; the 4-bit map's 256 buckets as int32 words, as ``_dyn_encode`` reads them).


def smem_gap(tile_elems: int) -> int:
    """Bytes at the start of the kernel's shared memory left to Triton's own scratch."""
    return 4 * tile_elems


def enc_window_entry_bytes(codec: int) -> int:
    """Bytes per bucket of a codec's encode window as the kernel reads it (ENC_WORDS_MAX)."""
    return 4 if ENC_WINDOW[codec] <= ENC_WORDS_MAX else 1


def _smem_section_bytes(codec: int) -> int:
    if codec not in DYN_MAGNITUDE_BITS:
        return 0
    return 8 * (1 << DYN_MAGNITUDE_BITS[codec]) + ENC_WINDOW[codec] * enc_window_entry_bytes(codec)


def smem_layout(m_codec: int, v_codec: int, tile_elems: int) -> tuple[int, int, int]:
    """(byte offset of m's tables, of v's tables, words of the image) for programs of
    ``tile_elems`` elements: -1 for a codec without tables, and (-1, -1, 0) when neither
    moment has any (no shared memory for tables)."""
    gap = smem_gap(tile_elems)
    offsets, end = [], gap
    for codec in (m_codec, v_codec):
        size = _smem_section_bytes(codec)
        offsets.append(end if size else -1)
        end += -(-size // 16) * 16
    if end == gap:
        return -1, -1, 0
    return offsets[0], offsets[1], triton.next_power_of_2(end // 4)


@functools.lru_cache(maxsize=None)
def smem_image(m_codec: int, v_codec: int, tile_elems: int, device: str) -> torch.Tensor:
    """The int32 words ``_smem_tables_store`` copies into shared memory (``smem_layout``),
    built from the same ``quant_maps`` tables the tl.gather path and the reference read."""
    m_off, v_off, words = smem_layout(m_codec, v_codec, tile_elems)
    image = torch.zeros(4 * max(words, 1), dtype=torch.uint8)
    tables, enc = codec_tables("cpu"), encode_tables("cpu")
    for codec, off in ((m_codec, m_off), (v_codec, v_off)):
        if off < 0:
            continue
        nmag, window = 1 << DYN_MAGNITUDE_BITS[codec], ENC_WINDOW[codec]
        lut = tables[codec, TABLE_LUT:TABLE_LUT + nmag]
        mid = tables[codec, TABLE_MID:TABLE_MID + nmag]
        image[off:off + 8 * nmag] = torch.cat([lut, mid]).view(torch.uint8)
        low = enc_size(codec) - window
        buckets = enc[codec, low:low + window]
        if enc_window_entry_bytes(codec) == 4:
            buckets = buckets.to(torch.int32).view(torch.uint8)
        image[off + 8 * nmag:off + 8 * nmag + buckets.numel()] = buckets
    return image.view(torch.int32).to(device)


def code_row_elems(cfg: AdamWConfig, cols: int) -> int:
    """Elements (or bytes, for codes) per row of a moment's storage."""
    if cfg.m_codec in (CODEC_DYN4_SIGNED, CODEC_LIN4_NOZERO):
        return (cols + 1) // 2
    return cols


def _elem_offset(t: Optional[torch.Tensor], base: torch.Tensor) -> int:
    """Element offset of ``t`` from ``base`` (pointer difference in units of t's element)."""
    if t is None:
        return 0
    diff = t.data_ptr() - base.data_ptr()
    if diff % t.element_size():
        raise ValueError("optimizer buffers must be aligned to their element size")
    return diff // t.element_size()


class FusedAdamW:
    """A launch plan over many tensors of one family; built once, reused every step.

    The metadata and tile tables live on the device. Only the gradients can move between
    steps (``zero_grad(set_to_none=True)`` frees them); their offsets are re-uploaded when the
    pointers differ from the last step's, in one small host-to-device copy.
    """

    def __init__(self, cfg: AdamWConfig, tensors: Sequence[AdamWTensor],
                 elems_per_program: Optional[int] = None, num_warps: Optional[int] = None,
                 maxnreg: Optional[int] = None):
        if cfg.block & (cfg.block - 1) or cfg.block < 2:
            raise ValueError(f"block size must be a power of two >= 2, got {cfg.block}")
        if not tensors or len(tensors) > MAX_TENSORS_PER_LAUNCH:
            raise ValueError(f"FusedAdamW takes 1 to {MAX_TENSORS_PER_LAUNCH} tensors, got {len(tensors)}")
        self.cfg = cfg
        self.tensors = list(tensors)
        t0 = tensors[0]
        self.device = t0.param.device
        elems_per_program, self.num_warps = launch_shape(cfg, elems_per_program, num_warps)
        self.maxnreg = maxnreg  # a register cap for the compiler (None: its own, or GUARD_MAXNREG)
        self.nb = max(1, elems_per_program // cfg.block)
        # Base pointers: the first tensor's buffer of each role (the param stands in for
        # roles a family does not use; the kernel never touches those).
        self.bases = [x if x is not None else t0.param for x in (
            t0.param, t0.exp_avg, t0.exp_avg_sq, t0.exp_avg_scale, t0.exp_avg_sq_scale, t0.extra)]
        meta = torch.zeros(len(tensors), META_STRIDE, dtype=torch.int64)
        tiles = []
        aligned = True
        for slot, t in enumerate(tensors):
            bpr = -(-t.cols // cfg.block)
            nblocks = t.rows * bpr
            crow = code_row_elems(cfg, t.cols) if cfg.m_codec != CODEC_NONE else t.cols
            offs = [_elem_offset(x, b) for x, b in zip(
                (t.param, t.exp_avg, t.exp_avg_sq, t.exp_avg_scale, t.exp_avg_sq_scale, t.extra), self.bases)]
            meta[slot, META_PARAM:META_EXTRA + 1] = torch.tensor(offs)
            meta[slot, META_COLS] = t.cols
            meta[slot, META_BPR] = bpr
            meta[slot, META_NBLOCKS] = nblocks
            meta[slot, META_CODE_ROW] = crow
            meta[slot, META_SR_BASE] = t.sr_base
            meta[slot, META_SR_ROW] = t.sr_row_stride
            meta[slot, META_SR_KEY] = t.sr_key
            meta[slot, META_FLAG] = t.flag_index
            aligned &= self.is_aligned(cfg, t)
            ntiles = -(-nblocks // self.nb)
            if ntiles >= 1 << TILE_BITS or t.rows * t.cols >= 2**31:
                raise ValueError(f"a {t.rows}x{t.cols} tensor is too large for one launch (int32 indices)")
            tiles.append(torch.arange(ntiles, dtype=torch.int32) | (slot << TILE_BITS))
        self.aligned = aligned
        self.even = all(self.is_even(cfg, t, self.nb) for t in tensors)
        self.sr_dense = all(t.sr_row_stride == t.cols or t.rows == 1 for t in tensors)
        self.sr_idx32 = all(t.sr_base + (t.rows - 1) * t.sr_row_stride + t.cols <= 2**32 for t in tensors)
        self.meta = meta.to(self.device)
        self.tiles = torch.cat(tiles).to(self.device)
        self.n_tiles = self.tiles.numel()
        self.tiles_per_program = TILES_PLAIN if cfg.m_codec == CODEC_NONE else TILES_QUANTIZED
        self.tables = codec_tables(str(self.device))
        self.enc_tables = encode_tables(str(self.device))
        # Tables in shared memory once per program on the GPU, with a tested Triton (PTX at
        # Triton's shared-memory symbol: private_apis.py); else tl.gather, as under the interpreter.
        tile_elems = self.nb * cfg.block
        smem_tables = not interpreting() and private_api_ok("triton")
        self.smem = smem_layout(cfg.m_codec, cfg.v_codec, tile_elems) if smem_tables else (-1, -1, 0)
        self.smem_image = (smem_image(cfg.m_codec, cfg.v_codec, tile_elems, str(self.device))
                           if self.smem[2] else self.tables)
        self._smem_checked = False
        self._compiled: Optional[tuple] = None  # (specialization key, Triton's compiled kernel) of the last launch
        self._grad_ptrs: list[int] = []
        self._grad_base: Optional[torch.Tensor] = None
        self._grad_offsets = torch.zeros(len(tensors), dtype=torch.int64, device=self.device)

    @staticmethod
    def is_aligned(cfg: AdamWConfig, t: AdamWTensor, grad: Optional[torch.Tensor] = None) -> bool:
        """Whether a tensor can join a family compiled with 16-element alignment hints
        (vector loads): row lengths multiple of 16 and every buffer 64-byte aligned."""
        crow = code_row_elems(cfg, t.cols) if cfg.m_codec != CODEC_NONE else t.cols
        bufs = (t.param, t.exp_avg, t.exp_avg_sq, t.extra, grad)
        return t.cols % 16 == 0 and crow % 16 == 0 and all(x is None or x.data_ptr() % 64 == 0 for x in bufs)

    @staticmethod
    def is_even(cfg: AdamWConfig, t: AdamWTensor, nb: int) -> bool:
        """Whether a tensor splits into whole tiles of whole blocks (no masking needed)."""
        nblocks = t.rows * -(-t.cols // cfg.block)
        packed_even = cfg.m_codec not in (CODEC_DYN4_SIGNED, CODEC_LIN4_NOZERO) or t.cols % 2 == 0
        return t.cols % cfg.block == 0 and nblocks % nb == 0 and packed_even

    @classmethod
    def variant(cls, cfg: AdamWConfig, t: AdamWTensor, grad: Optional[torch.Tensor] = None,
                elems_per_program: Optional[int] = None) -> tuple[bool, bool]:
        """(aligned, even): the compile-time variant a tensor can join. Callers split a
        family by variant so that one ragged tensor does not slow down all the others."""
        nb = max(1, launch_shape(cfg, elems_per_program)[0] // cfg.block)
        return cls.is_aligned(cfg, t, grad), cls.is_even(cfg, t, nb)

    def point_at(self, grads: Sequence[torch.Tensor]) -> bool:
        """Point the plan at this step's gradients (uploading their offsets if they moved);
        False if their alignment does not fit this plan, so the caller can build one that
        fits."""
        ptrs = list(map(torch.Tensor.data_ptr, grads))
        if ptrs == self._grad_ptrs:
            return True
        if self.aligned and any(p % 64 for p in ptrs):
            return False
        esize = grads[0].element_size()
        offs = [(p - ptrs[0]) // esize for p in ptrs]
        host = torch.tensor(offs, dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self._grad_offsets.copy_(host, non_blocking=True)
        self._grad_ptrs = ptrs
        self._grad_base = grads[0]
        return True

    def step(self, grads: Sequence[torch.Tensor], hyper: AdamWHyper,
             guard: Optional[NonfiniteGuard] = None) -> bool:
        """Launch the step; returns False (and launches nothing) if the gradients' alignment
        does not fit this plan, so the caller can build one that fits."""
        if not self.point_at(grads):
            return False
        self.launch(hyper, guard)
        return True

    def launch(self, hyper: AdamWHyper, guard: Optional[NonfiniteGuard] = None) -> None:
        """Launch the step on the gradients the plan points at (``point_at``), checking
        them for inf/nan if ``guard`` is given.

        After the first launch the kernel Triton compiled for this plan is launched
        directly, without ``JITFunction.run``'s per-call argument binding and cache lookup
        (about half of a launch's host time): every argument is fixed by the plan except
        the gradient base and the lr tensor, whose alignment and dtype (what Triton
        specializes on) are the key of the cached kernel; any change goes through Triton
        again and caches what it returns.
        """
        cfg = self.cfg
        s = hyper_scalars(hyper)
        lr_is_tensor = isinstance(hyper.lr, torch.Tensor)
        lr_tensor = hyper.lr if lr_is_tensor else self.tables
        lr_value = 0.0 if lr_is_tensor else float(hyper.lr)
        flags, tag = (guard.flags, guard.tag) if guard is not None else (self.meta, 0)
        tiles = self.tiles_per_program
        m_smem, v_smem, smem_words = self.smem
        args = (
            self.tiles, self.meta, self._grad_offsets, self.tables, self.enc_tables, self.smem_image, lr_tensor,
            flags, self.bases[0], self._grad_base, *self.bases[1:], self.n_tiles, tiles,
            lr_value, s["inv_bc1"], s["inv_sqrt_bc2"], s["beta1"], s["one_minus_beta1"],
            s["beta2"], s["one_minus_beta2"], s["eps"], s["wd"], s["skey"], tag,
            # constexprs, in the kernel's order:
            cfg.m_codec, cfg.v_codec, cfg.weight_update, cfg.decoupled, lr_is_tensor,
            self.aligned, self.even, self.sr_dense, self.sr_idx32, not interpreting(), cfg.block, self.nb,
            m_smem, v_smem, smem_words, guard is not None,
        )
        grid = triton.cdiv(self.n_tiles, tiles)
        key = None
        if not interpreting() and private_api_ok("triton"):  # the launch cache: private_apis.py
            key = (lr_tensor.dtype, lr_tensor.data_ptr() % _SPECIALIZE_ALIGN, self._grad_base.dtype,
                   self._grad_base.data_ptr() % _SPECIALIZE_ALIGN, flags.data_ptr() % _SPECIALIZE_ALIGN,
                   guard is not None, torch.cuda.current_device())
            if self._compiled is not None and self._compiled[0] == key:
                self._compiled[1][(grid, 1, 1)](*args)
                return
        cap = self.maxnreg if self.maxnreg is not None else (GUARD_MAXNREG if guard is not None else None)
        opts = {} if cap is None or interpreting() else {"maxnreg": cap}
        kernel = _adamw_lowbit_kernel[(grid,)](*args, num_warps=self.num_warps, **opts)
        if key is not None:
            self._compiled = (key, kernel)
        if smem_words and not self._smem_checked:
            # The tables' shared memory is reserved by the identity gather in
            # _smem_tables_store; a compiler that folded it away would leave them
            # unreserved (checked once per plan, after its first launch).
            reserved = kernel.metadata.shared
            if reserved < 4 * smem_words:
                raise RuntimeError(
                    f"the fused AdamW kernel reserved {reserved} bytes of shared memory, less than "
                    f"the {4 * smem_words} its code tables need (triton {triton.__version__}); "
                    "this triton version is not supported by titan_lowbit's kernels")
            self._smem_checked = True
