"""Quantization maps for optimizer states, and the counter-based hash for stochastic rounding.

This module is the single definition of every code book the low-bit AdamW kernels use. The
Triton kernel (``adamw_lowbit.py``) and the pure-PyTorch reference (``adamw_lowbit_ref.py``)
both read the constant tables built here, so the two cannot drift apart.

Codecs (``CODEC_*``) map a value ``x`` normalized by its block's absmax, ``x in [-1, 1]``, to
an integer code and back:

* ``CODEC_DYN8_SIGNED`` / ``CODEC_DYN8_UNSIGNED`` -- the dynamic-tree map of bitsandbytes'
  8-bit optimizers (Dettmers et al. 2021), first and second moment. After the optional sign
  bit, the ``M`` magnitude bits hold an integer ``p``. ``p = 0`` is zero. Otherwise the
  position ``k`` of ``p``'s highest set bit selects a decade, and the ``k`` bits below it a
  linear fraction inside that decade::

      value(p) = 10**(k - M + 1) * (0.1 + (f + 1) * 0.9 / 2**k),   p = 2**k + f,  k >= 1
      value(1) = 10**(1 - M)                                          (k = 0)

  so large magnitudes get fine steps and small ones a wide range (1e-6 .. 1 signed, 1e-7 .. 1
  unsigned). Our layout differs from bitsandbytes' table in one deliberate way: the top
  code of every decade is the decade's upper edge, so ``1.0`` (the block's absmax) is
  represented exactly. Encoding and decoding run on tables built here (see below).
* ``CODEC_DYN4_SIGNED`` -- the same tree with ``M = 3`` (4-bit, signed): the "dynamic
  exponent" map that arXiv 2309.01507 uses for the first moment.
* ``CODEC_LIN4_NOZERO`` -- 4-bit linear map without zero, ``value(j) = (j + 1) / 16``: the
  second-moment map of arXiv 2309.01507 (no zero, so ``1/sqrt(v)`` never explodes).
* ``CODEC_FP8_E4M3`` -- FP8 e4m3 (the ``float8_e4m3fn`` bit layout) of ``x * 448``.
* ``CODEC_NF4_SIGNED`` -- NormalFloat4 (QLoRA, Dettmers et al. 2023): 16 levels at quantiles
  of the standard normal, normalized to [-1, 1], so a block of normally distributed values
  puts about as many values near each level (see ``nf4_levels``). 8 positive levels (up to
  1), 7 negative (down to -1) and 0. Codes: a level's rank from 0 mod 16 (0 is code 0, the
  positive levels codes 1..8 ascending, the negative ones codes 9..15 from -1 up), so a
  zero byte is two zeros, as in the other 4-bit codecs. Encoded by counting the 15
  thresholds below ``x`` (``nf4_thresholds``): exactly the nearest level, ties toward 0.

Second moments are coded zero-free: the encoder of a second moment never codes a positive
value as 0, it gives the smallest positive code (code 1) to any positive value whose nearest
code is 0, and codes only an exact 0 (or a nan) as 0. The code books and the stored layout
are those above; only the encoder's rounding below the smallest code changes. Why: with
``v`` coded 0 and ``m`` not, the update is ``lr * m / eps`` (arXiv 2309.01507's zero-point
problem); a stored ``v`` is instead never below its true value by more than one code gap
(``v_true / v_stored`` at most 3.25 for the 8-bit map, at most 1.5 for fp8 e4m3 and the
4-bit linear map, which has no zero code). The 8-bit unsigned map (used for second moments
only) is zero-free through its tables: the midpoint below code 1 is 0, so the one midpoint
compare of the encoder gives code 1 to any positive value, at no cost. FP8 e4m3 codes both
moments, so the kernel raises a second moment's code to at least 1 where the value is
positive (``ZERO_FREE`` of ``_store_state`` in adamw_lowbit.py, ``zero_free`` of the
reference's ``quantize_blockwise``).

Stochastic rounding uses ``mix32`` (the 32-bit finalizer of MurmurHash3) keyed by the seed,
the parameter's position in the optimizer, the step and the element's global index.
"""

from __future__ import annotations

import functools

import torch

# Codec ids, shared by kernel and reference (compile-time constants in the kernel).
CODEC_NONE = 0
CODEC_DYN8_SIGNED = 1
CODEC_DYN8_UNSIGNED = 2
CODEC_DYN4_SIGNED = 3
CODEC_LIN4_NOZERO = 4
CODEC_FP8_E4M3 = 5
CODEC_NF4_SIGNED = 6
# Codec ids are 0 .. N_CODECS - 1: the rows of the stacked tables (codec_tables, encode_tables).
N_CODECS = 7
# The 4-bit codecs, stored two codes per byte (element 2i in the low nibble).
PACKED_4BIT_CODECS = (CODEC_DYN4_SIGNED, CODEC_LIN4_NOZERO, CODEC_NF4_SIGNED)

FP8_E4M3_MAX = 448.0
# The smallest positive code of every codec (magnitude bits p = 1); what a second moment's
# encoder writes for a positive value whose nearest code is 0 (see the module docstring).
# The 4-bit linear map has no zero code and needs no such rule.
SMALLEST_POSITIVE_CODE = 1

# Magnitude bits of the dynamic-tree codecs; the sign (if any) sits just above them.
DYN_MAGNITUDE_BITS = {CODEC_DYN8_SIGNED: 7, CODEC_DYN8_UNSIGNED: 8, CODEC_DYN4_SIGNED: 3}
DYN_SIGNED = {CODEC_DYN8_SIGNED: True, CODEC_DYN8_UNSIGNED: False, CODEC_DYN4_SIGNED: True}

# Dynamic-tree codecs run on tables (both in the kernel and in the reference):
#   decode: value = LUT[code]
#   encode: a = |x|; cand = ENC[bucket(a)]; p = cand + (a > MID[cand]); sign bit on top
# where bucket(a) is a's float32 bits >> enc_shift(codec) (its exponent and top
# ENC_MANT_BITS[codec] mantissa bits: one bucket per value for every a < 2, the only
# values encoded: normalized by the block's absmax), ENC[b] is the number of
# midpoints MID[p] = (value(p) + value(p + 1)) / 2 below the bucket's lower edge, and every
# bucket holds at most one midpoint (checked when the tables are built). So encode returns
# exactly the nearest code (ties to the smaller magnitude), with two table reads instead of
# a search. Layout of the float32 table of a codec (TABLE_SIZE entries):
#   [0:S)       decade thresholds 10**(k - M), k >= 1 (table construction only)
#   [S:2S)      offset of decade k
#   [3S:4S)     step of decade k: value(p) = offset + (f + 1) * step, p = 2**k + f
#   [LUT:+256)  value of every code (sign included; the kernel reads the first 2**M,
#               by magnitude)
#   [MID:+256)  midpoint above every magnitude code (+inf above the largest; 2**M used)
# NormalFloat4's table holds its 16 values by code at LUT and its 15 encode thresholds,
# ascending, at MID (``_nf4_table``); it has no encode buckets (its row of encode_tables
# is zeros).
TABLE_STRIDE = 8
TABLE_LUT = 4 * TABLE_STRIDE
TABLE_MID = TABLE_LUT + 256
TABLE_SIZE = TABLE_MID + 256
# Encode buckets per codec: the fewest mantissa bits that keep at most one midpoint in
# every bucket (checked when the tables are built), and the kernel's shared-memory window
# (the top ENC_WINDOW buckets; smaller values clamp into the window's first bucket, which
# changes no code because every codec's smallest midpoint lies above the window's lower
# edge, also checked). Small tables matter in shared memory: a table of at most 32 words
# is read without bank conflicts, and each program stores its tables once. The 4-bit
# dynamic map needs 1 bit, and its window is its whole table of 256 buckets (no clamp
# below; the kernel widens it to 1 KB of int32 words, whose reads need no byte
# extraction; the buckets its values use lie in a few consecutive words); the 8-bit maps
# 7 bits and 4096 buckets (floats from 2**-31 up).
ENC_MANT_BITS = {CODEC_DYN8_SIGNED: 7, CODEC_DYN8_UNSIGNED: 7, CODEC_DYN4_SIGNED: 1}
ENC_WINDOW = {CODEC_DYN8_SIGNED: 4096, CODEC_DYN8_UNSIGNED: 4096, CODEC_DYN4_SIGNED: 256}
ENC_ROW = 128 << max(ENC_MANT_BITS.values())  # row stride of the stacked encode tables


def is_block_size(bs) -> bool:
    """A valid quantization block size (the optimizer's block_size): 0 for the format's
    default, or a power of two >= 2 (the kernel's block is a tl.arange); an int."""
    return isinstance(bs, int) and not isinstance(bs, bool) and (bs == 0 or (bs >= 2 and not bs & (bs - 1)))


def enc_shift(codec: int) -> int:
    """Right shift of a float32's bits that leaves its bucket index (exponent and top bits)."""
    return 23 - ENC_MANT_BITS[codec]


def enc_size(codec: int) -> int:
    """Buckets of a codec's encode table: every float32 in [0, 2)."""
    return 128 << ENC_MANT_BITS[codec]


def _dyn_decade(k: int, M: int) -> tuple[float, float]:
    """(offset, step) of decade ``k`` of a dynamic-tree map with ``M`` magnitude bits."""
    if k == 0:
        return 0.0, 10.0 ** (1 - M)
    return 10.0 ** (k - M), 0.9 * 10.0 ** (k - M + 1) / 2**k


def dyn_decode_arith(code: torch.Tensor, tab: torch.Tensor, M: int, signed: bool) -> torch.Tensor:
    """Decode dynamic-tree codes arithmetically in fp32: what fills the LUT."""
    c = code.to(torch.int32)
    p = c & ((1 << M) - 1)
    k = ((p.to(torch.float32).view(torch.int32) >> 23) & 0xFF) - 127
    k = torch.clamp(k, min=0)
    f = p - (torch.ones_like(k) << k)
    kl = k.long()
    off = tab[TABLE_STRIDE + kl]
    step = tab[3 * TABLE_STRIDE + kl]
    val = off + (f + 1).to(torch.float32) * step
    val = torch.where(p == 0, torch.zeros_like(val), val)
    if signed:
        val = torch.where(((c >> M) & 1) != 0, -val, val)
    return val


def enc_bucket(x: torch.Tensor, codec: int) -> torch.Tensor:
    """Bucket index (int64) of float32 values with ``|x| < 2`` in ``codec``'s encode table:
    ``|x|``'s bits >> enc_shift, computed as ``(bits(x) >> enc_shift) & (size - 1)`` (the
    mask drops the sign bit and the exponent's top bit, which is 0 below 2), as the kernel
    does."""
    idx = (x.contiguous().view(torch.int32) >> enc_shift(codec)) & (enc_size(codec) - 1)
    return idx.to(torch.int64)


@functools.lru_cache(maxsize=None)
def _dyn_tables(codec: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 table, uint8 encode table) of a dynamic-tree codec."""
    M = DYN_MAGNITUDE_BITS[codec]
    signed = DYN_SIGNED[codec]
    t = torch.zeros(TABLE_SIZE, dtype=torch.float64)
    for k in range(M):
        off, step = _dyn_decade(k, M)
        if k >= 1:
            t[k] = 10.0 ** (k - M)
        t[TABLE_STRIDE + k] = off
        t[3 * TABLE_STRIDE + k] = step
    t = t.to(torch.float32)
    n = 2 ** (M + 1) if signed else 2**M
    t[TABLE_LUT:TABLE_LUT + n] = dyn_decode_arith(torch.arange(n), t, M, signed)
    mags = t[TABLE_LUT:TABLE_LUT + 2**M].double()
    mids = ((mags[:-1] + mags[1:]) / 2).float()
    t[TABLE_MID:TABLE_MID + 2**M - 1] = mids
    t[TABLE_MID + 2**M - 1:] = float("inf")
    if not signed:  # the second moment's map: zero-free encoder (module docstring): MID[0] = 0
        t[TABLE_MID] = 0.0
    size, window = enc_size(codec), ENC_WINDOW[codec]
    if window & (window - 1) or window > size:
        raise AssertionError(f"codec {codec}: the kernel's window must be a power of two <= {size}")
    lower = (torch.arange(size, dtype=torch.int64) << enc_shift(codec)).to(torch.int32).view(torch.float32)
    upper = torch.cat([lower[1:], torch.tensor([2.0])])
    enc = torch.searchsorted(mids, lower, right=False)  # #mids < lower edge
    per_bucket = torch.searchsorted(mids, upper, right=False) - enc
    if int(per_bucket.max()) > 1:
        raise AssertionError(f"codec {codec}: an encode bucket holds {int(per_bucket.max())} midpoints")
    if int(enc[size - window]) != 0:
        raise AssertionError(f"codec {codec}: a midpoint below the kernel's bucket window")
    return t, torch.nn.functional.pad(enc, (0, ENC_ROW - size)).to(torch.uint8)


# ---------------------------------------------------------------------------------------
# NormalFloat4
# ---------------------------------------------------------------------------------------
# The quantile of the largest level: halfway between 1 - 1/(2*15) and 1 - 1/(2*16), the
# outermost of 15 and of 16 equal slices of probability (QLoRA's offset 0.9677083), so
# that the normal's quantile function stays finite at the ends.
NF4_OFFSET = (1 - 1 / (2 * 15) + 1 - 1 / (2 * 16)) / 2
NF4_POSITIVE = 8  # positive levels (1 included)
NF4_NEGATIVE = 7  # negative levels (-1 included); with 0, 16 in all
NF4_LEVELS = NF4_POSITIVE + NF4_NEGATIVE + 1


def nf4_levels() -> torch.Tensor:
    """NormalFloat4's 16 levels, ascending, float64 (the definition): the normal quantiles
    ``ndtri(p)`` at ``NF4_POSITIVE`` probabilities evenly spaced from ``NF4_OFFSET`` down to
    (not including) 0.5, their mirror images at ``NF4_NEGATIVE`` such probabilities, and 0,
    divided by the largest, ``ndtri(NF4_OFFSET)``. Asymmetric (8 positive levels, 7
    negative) so that 0 is a level and all 16 codes are used: -1, -0.6962, -0.5251, ...,
    -0.0911, 0, 0.0796, 0.1609, ..., 0.7230, 1."""
    def quantiles(n: int) -> torch.Tensor:
        p = torch.linspace(NF4_OFFSET, 0.5, n + 1, dtype=torch.float64)[:-1]
        return torch.special.ndtri(p)

    pos, neg = quantiles(NF4_POSITIVE), -quantiles(NF4_NEGATIVE)
    levels = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]) / pos[0]
    return levels.sort().values


def nf4_code_of_rank(rank: torch.Tensor) -> torch.Tensor:
    """The code of the level of ascending rank ``rank`` (0 .. 15; int tensor): its rank
    counted from 0's, mod 16, so that 0 is code 0 (``(rank - NF4_NEGATIVE) & 15``)."""
    return (rank - NF4_NEGATIVE) & (NF4_LEVELS - 1)


def nf4_thresholds(levels: torch.Tensor) -> torch.Tensor:
    """The 15 float32 encode thresholds between ascending float32 ``levels``: ``x > t[j]``
    exactly when a float32 ``x`` is nearer to level ``j + 1`` than to level ``j``, with ties
    toward 0. The midpoint ``m`` of two float32 levels is exact in float64; ``t[j]`` is the
    largest float32 ``<= m`` for a positive ``m`` (at a tie ``x > t`` fails: the level
    below, nearer to 0) and the largest float32 ``< m`` for a negative one (at a tie
    ``x > t`` holds: the level above, nearer to 0)."""
    lv = levels.double()
    mid = (lv[:-1] + lv[1:]) / 2
    t = mid.float()
    too_high = (t.double() > mid) | ((mid < 0) & (t.double() == mid))
    return torch.where(too_high, torch.nextafter(t, torch.tensor(-float("inf"))), t)


@functools.lru_cache(maxsize=None)
def _nf4_table() -> torch.Tensor:
    """NormalFloat4's float32 table: the value of every code at LUT, the 15 thresholds at
    MID (module comment above ``TABLE_STRIDE``)."""
    levels = nf4_levels().float()
    t = torch.zeros(TABLE_SIZE, dtype=torch.float32)
    codes = nf4_code_of_rank(torch.arange(NF4_LEVELS))
    t[TABLE_LUT + codes] = levels
    t[TABLE_MID:TABLE_MID + NF4_LEVELS - 1] = nf4_thresholds(levels)
    return t


def codec_table(codec: int) -> torch.Tensor:
    """Float32 constant table of a codec (zeros for codecs that need none)."""
    if codec == CODEC_NF4_SIGNED:
        return _nf4_table().clone()
    if codec not in DYN_MAGNITUDE_BITS:
        return torch.zeros(TABLE_SIZE, dtype=torch.float32)
    return _dyn_tables(codec)[0].clone()


@functools.lru_cache(maxsize=None)
def codec_tables(device: str) -> torch.Tensor:
    """All codec tables stacked as ``[N_CODECS, TABLE_SIZE]`` float32 on ``device`` (cached)."""
    rows = [codec_table(c) for c in range(N_CODECS)]
    return torch.stack(rows).to(device)


@functools.lru_cache(maxsize=None)
def encode_tables(device: str) -> torch.Tensor:
    """All encode tables stacked as ``[N_CODECS, ENC_ROW]`` uint8 on ``device`` (cached;
    a codec's table fills the first ``enc_size(codec)`` entries of its row)."""
    rows = [_dyn_tables(c)[1] if c in DYN_MAGNITUDE_BITS else torch.zeros(ENC_ROW, dtype=torch.uint8)
            for c in range(N_CODECS)]
    return torch.stack(rows).to(device)


def code_book(codec: int) -> torch.Tensor:
    """Every code's value, float64, indexed by code: the definition the tests check against."""
    if codec in DYN_MAGNITUDE_BITS:
        M = DYN_MAGNITUDE_BITS[codec]
        signed = DYN_SIGNED[codec]
        n = 2 ** (M + 1) if signed else 2**M
        out = torch.zeros(n, dtype=torch.float64)
        for code in range(n):
            p = code & (2**M - 1)
            if p == 0:
                continue
            k = p.bit_length() - 1
            off, step = _dyn_decade(k, M)
            val = off + (p - 2**k + 1) * step
            out[code] = -val if (signed and code >> M) else val
        return out
    if codec == CODEC_LIN4_NOZERO:
        return torch.arange(1, 17, dtype=torch.float64) / 16.0
    if codec == CODEC_FP8_E4M3:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        return codes.view(torch.float8_e4m3fn).to(torch.float64) / FP8_E4M3_MAX
    if codec == CODEC_NF4_SIGNED:
        out = torch.empty(NF4_LEVELS, dtype=torch.float64)
        out[nf4_code_of_rank(torch.arange(NF4_LEVELS))] = nf4_levels()
        return out
    raise ValueError(f"codec {codec} has no code book")


# ---------------------------------------------------------------------------------------
# Counter-based hash for stochastic rounding (host side; the kernel and reference twins
# live in adamw_lowbit.py / adamw_lowbit_ref.py and must compute the same function).
# ---------------------------------------------------------------------------------------
MASK32 = 0xFFFFFFFF
MIX_C1 = 0x85EBCA6B
MIX_C2 = 0xC2B2AE35
GOLDEN32 = 0x9E3779B9


def mix32(h: int) -> int:
    """MurmurHash3's 32-bit finalizer: a bijection on uint32 with full avalanche."""
    h &= MASK32
    h ^= h >> 16
    h = (h * MIX_C1) & MASK32
    h ^= h >> 13
    h = (h * MIX_C2) & MASK32
    h ^= h >> 16
    return h


def tensor_key(seed: int, param_index: int) -> int:
    """Per-parameter key: the seed and the parameter's position among the optimizer's params."""
    return mix32(mix32(seed & MASK32) ^ ((seed >> 32) & MASK32) ^ mix32((param_index + 1) * GOLDEN32))


def step_key(step: int) -> int:
    """Per-step key (step counts from 1). Kept below 2**31 so it passes as an int32 scalar."""
    return mix32((step * GOLDEN32) ^ 0x5BD1E995) & 0x7FFFFFFF
