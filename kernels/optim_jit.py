"""The ``@triton.jit`` device helpers of the fused optimizer kernels (``adamw_lowbit``,
``muon_lowbit``): bf16 roundings (nearest even, stochastic, the fp32-master split), the
state codecs (dequantize a block, encode it with its new absmax), loads and stores of a
tile, and how a new fp32 weight lands in a weight by its ``weight_update`` rule.

Each has a pure-PyTorch twin in ``adamw_lowbit_ref.py`` with the same fp32 operations in
the same order, so that under ``TRITON_INTERPRET=1`` kernel and reference agree bit for
bit (see the math block of ``adamw_lowbit.py``). A tile is ``NB`` quantization blocks of
``QBLOCK`` elements, each block inside one row; its codes are ``[NB, CBLOCK]`` bytes
(``CBLOCK = QBLOCK // 2`` for the packed 4-bit codecs).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .adamw_interface import (
    UPDATE_KAHAN,
    UPDATE_MASTER,
    UPDATE_MASTER_REMAINDER,
    UPDATE_NEAREST,
    UPDATE_STOCHASTIC,
)
from .quant_maps import (
    CODEC_DYN4_SIGNED,
    CODEC_DYN8_SIGNED,
    CODEC_DYN8_UNSIGNED,
    CODEC_FP8_E4M3,
    CODEC_LIN4_NOZERO,
    CODEC_NF4_SIGNED,
    CODEC_NONE,
    DYN_MAGNITUDE_BITS,
    ENC_ROW,
    ENC_WINDOW,
    GOLDEN32,
    NF4_LEVELS,
    NF4_NEGATIVE,
    PACKED_4BIT_CODECS,
    TABLE_LUT,
    TABLE_MID,
    TABLE_SIZE,
    enc_shift,
    enc_size,
)

# The constants the @triton.jit code below compiles in.
_K_CODEC_DYN4_SIGNED = tl.constexpr(CODEC_DYN4_SIGNED)
_K_CODEC_DYN8_SIGNED = tl.constexpr(CODEC_DYN8_SIGNED)
_K_CODEC_DYN8_UNSIGNED = tl.constexpr(CODEC_DYN8_UNSIGNED)
_K_CODEC_FP8_E4M3 = tl.constexpr(CODEC_FP8_E4M3)
_K_CODEC_LIN4_NOZERO = tl.constexpr(CODEC_LIN4_NOZERO)
_K_CODEC_NF4_SIGNED = tl.constexpr(CODEC_NF4_SIGNED)
_K_CODEC_NONE = tl.constexpr(CODEC_NONE)
_K_TABLE_SIZE = tl.constexpr(TABLE_SIZE)
_K_TABLE_LUT = tl.constexpr(TABLE_LUT)
_K_TABLE_MID = tl.constexpr(TABLE_MID)
_K_GOLDEN32 = tl.constexpr(GOLDEN32)
_K_ENC_ROW = tl.constexpr(ENC_ROW)
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
_K_NF4_LEVELS = tl.constexpr(NF4_LEVELS)
_K_NF4_NEGATIVE = tl.constexpr(NF4_NEGATIVE)
_K_UPDATE_NEAREST = tl.constexpr(UPDATE_NEAREST)
_K_UPDATE_STOCHASTIC = tl.constexpr(UPDATE_STOCHASTIC)
_K_UPDATE_KAHAN = tl.constexpr(UPDATE_KAHAN)
_K_UPDATE_MASTER = tl.constexpr(UPDATE_MASTER)
_K_UPDATE_MASTER_REMAINDER = tl.constexpr(UPDATE_MASTER_REMAINDER)


@triton.constexpr_function
def is_packed(codec):
    """Whether ``codec``'s codes are stored two per byte (quant_maps.PACKED_4BIT_CODECS):
    a compile-time constant in the kernels (``PACKED: tl.constexpr = is_packed(CODEC)``), a
    plain bool on the host."""
    return codec in PACKED_4BIT_CODECS


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
def _widen(x, HW_CAST: tl.constexpr):
    """x as fp32: the cast on a GPU; a bf16 x from its bits under the interpreter, whose
    bf16 -> fp32 conversion gets subnormals wrong (Triton 3.9: 1e-39 widens to 4.4e-39)."""
    if x.dtype == tl.bfloat16 and not HW_CAST:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


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
def _nf4_encode(x, tab):
    """NormalFloat4 code of x in [-1, 1]: the number n of the codec's 15 thresholds (at
    MID of its table, ascending) below x is the rank of x's nearest level, ties toward 0
    (quant_maps.nf4_thresholds); the code is (n - NF4_NEGATIVE) & 15. 15 compares against
    scalars read once per tile, no table lookup per element."""
    n = tl.zeros(x.shape, tl.int32)
    for j in tl.static_range(_K_NF4_LEVELS - 1):
        n += (x > tl.load(tab + _K_TABLE_MID + j)).to(tl.int32)
    return (n - _K_NF4_NEGATIVE) & (_K_NF4_LEVELS - 1)


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
        elif CODEC == _K_CODEC_NF4_SIGNED:
            # its value table is never in the shared-memory image (SMEM -1: tl.gather)
            val = _lookup(tab + _K_TABLE_LUT, code.to(tl.int32), _K_NF4_LEVELS, False, -1)
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
        elif CODEC == _K_CODEC_NF4_SIGNED:
            codes = _nf4_encode(xn, tab)
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
        if is_packed(CODEC):
            lo, hi = tl.split(tl.reshape(codes, [NB, QBLOCK // 2, 2]))
            _st(base + cptr_off, (lo | (hi << 4)).to(tl.uint8), cmask, EVEN)
        else:
            _st(base + cptr_off, codes.to(tl.uint8), emask, EVEN)



@triton.jit
def _block_offsets(bidx, nblocks, cols, code_row, bpr, QBLOCK: tl.constexpr, CBLOCK: tl.constexpr,
                   EVEN: tl.constexpr, ALIGNED: tl.constexpr):
    """Where blocks ``bidx`` [NB] of a [rows, cols] tensor lie (``bpr`` blocks per row,
    ``nblocks`` in all; codes ``code_row`` bytes per row): the first element of each, the
    element and code-byte offsets [NB, QBLOCK] / [NB, CBLOCK], and the masks of blocks,
    elements and code bytes. EVEN: rows of whole blocks and only whole tiles, so block b
    starts at element b * QBLOCK (no division by the blocks per row, ~8 instructions per
    element; cols, code_row and bpr are not read). ALIGNED: rows a multiple of 16 elements.
    Offsets inside one tensor are int32 (its host side checks it has < 2**31 elements):
    half the registers and address arithmetic of int64."""
    if EVEN:
        e_start = bidx * QBLOCK
        c_start = bidx * CBLOCK
    else:
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
    return e_start, eoff, coff, bmask, emask, cmask


@triton.jit
def _load_raw(base, sptr, eoff, coff, bidx, bmask, emask, cmask, CODEC: tl.constexpr, EVEN: tl.constexpr):
    """One moment of a tile as stored: plain values [NB, QBLOCK], or codes (4-bit: packed
    bytes [NB, QBLOCK/2]) and the blocks' absmax [NB] from the tensor's scales at ``sptr``
    (plain: a placeholder)."""
    if CODEC == _K_CODEC_NONE:
        return _ld(base + eoff, emask, EVEN), bmask
    else:
        absmax = _ld(sptr + bidx, bmask, EVEN)
        if is_packed(CODEC):
            codes = _ld(base + coff, cmask, EVEN)
        else:
            codes = _ld(base + eoff, emask, EVEN)
        return codes, absmax


@triton.jit
def _unpacked_codes(raw, CODEC: tl.constexpr):
    """The codes [NB, QBLOCK] of a quantized moment loaded by _load_raw: the packed 4-bit
    codecs hold two per byte (element 2i in the low nibble), the others one."""
    if is_packed(CODEC):
        packed = raw.to(tl.int32)
        return tl.interleave(packed & 15, packed >> 4)
    else:
        return raw


@triton.jit
def _dequantize(raw, absmax, tab, CODEC: tl.constexpr, HW_CAST: tl.constexpr, SMEM: tl.constexpr):
    """fp32 values [NB, QBLOCK] of a moment loaded by _load_raw."""
    if CODEC == _K_CODEC_NONE:
        return _widen(raw, HW_CAST)
    else:
        return _decode(_unpacked_codes(raw, CODEC), absmax, tab, CODEC, HW_CAST, SMEM)


# ----------------------------------------------------------------------------------------
# The weight: read in fp32, and the new fp32 weight landed (twins: weight_fp32, land_weight)
# ----------------------------------------------------------------------------------------
@triton.jit
def _load_weight(pptr, xptr, emask, UPDATE: tl.constexpr, EVEN: tl.constexpr, HW_CAST: tl.constexpr):
    """The fp32 weight a step starts from: an fp32 parameter itself; of a bf16 one, the fp32
    master (MASTER: the extra state; MASTER_REMAINDER: rebuilt from weight and remainder),
    else the bf16 weight widened (with fp32 master weights the bf16 copy is only written)."""
    PARAM_BF16: tl.constexpr = pptr.dtype.element_ty == tl.bfloat16
    if PARAM_BF16 and UPDATE == _K_UPDATE_MASTER:
        p = _ld(xptr, emask, EVEN)
    elif PARAM_BF16 and UPDATE == _K_UPDATE_MASTER_REMAINDER:
        p = _master_rebuild(_ld(pptr, emask, EVEN), _ld(xptr, emask, EVEN))
    else:
        p = _widen(_ld(pptr, emask, EVEN), HW_CAST)
    return p


@triton.jit
def _land_weight(pptr, xptr, p, p_new, emask, gidx, key, UPDATE: tl.constexpr, EVEN: tl.constexpr,
                 ST_EVEN: tl.constexpr, HW_CAST: tl.constexpr, SR_IDX32: tl.constexpr):
    """Write the new fp32 weight ``p_new`` (the step started from ``p``, ``_load_weight``)
    into the weight at ``pptr`` and its extra state at ``xptr`` by the weight-update rule
    (the math block of ``adamw_lowbit.py``); ``gidx``, ``key``: the global element indices
    and the tensor ^ step key of stochastic rounding (unused by the other rules). EVEN:
    whether loads need no mask; ST_EVEN: whether stores need none."""
    PARAM_BF16: tl.constexpr = pptr.dtype.element_ty == tl.bfloat16
    if not PARAM_BF16:
        _st(pptr, p_new, emask, ST_EVEN)
    elif UPDATE == _K_UPDATE_NEAREST:
        _st(pptr, _bf16_rne(p_new, HW_CAST), emask, ST_EVEN)
    elif UPDATE == _K_UPDATE_STOCHASTIC:
        _st(pptr, _bf16_stochastic(p_new, gidx, key, SR_IDX32), emask, ST_EVEN)
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
