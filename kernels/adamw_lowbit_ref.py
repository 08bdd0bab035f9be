"""Pure-PyTorch reference of ``adamw_lowbit.py``: the same math, op for op.

This is what runs where there is no GPU (and what the tests compare the Triton kernel
against under ``TRITON_INTERPRET=1``). Every function mirrors a ``@triton.jit`` twin in
``adamw_lowbit.py`` with the same fp32 operations in the same order, so that on the
interpreter the two agree bit for bit. See the math block at the top of ``adamw_lowbit.py``.

Also exported: ``quantize_blockwise`` / ``dequantize_blockwise``, the row-wise block layout
used for the optimizer states (handy for tests and for inspecting a checkpoint).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .adamw_interface import (
    UPDATE_KAHAN,
    UPDATE_MASTER,
    UPDATE_MASTER_REMAINDER,
    UPDATE_NEAREST,
    UPDATE_STOCHASTIC,
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
    CODEC_NF4_SIGNED,
    CODEC_NONE,
    GOLDEN32,
    MASK32,
    MIX_C1,
    MIX_C2,
    NF4_LEVELS,
    NF4_NEGATIVE,
    PACKED_4BIT_CODECS,
    TABLE_LUT,
    TABLE_MID,
    codec_tables,
    enc_bucket,
    encode_tables,
)

_DYN = {CODEC_DYN8_SIGNED: (7, True), CODEC_DYN8_UNSIGNED: (8, False), CODEC_DYN4_SIGNED: (3, True)}


def _f32(x: float, device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=device)


def _i32_as_f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32).view(torch.float32)


def _f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def div_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 division (twin of ``tl.div_rn``). Computed in fp64 and rounded
    once more: for division and square root that double rounding is exact."""
    return (a.double() / b.double()).float()


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (twin of ``tl.sqrt_rn``); torch's fp32 CPU sqrt is
    not always correctly rounded (1 ulp off in about 0.6% of inputs, seen with torch 2.13)."""
    return torch.sqrt(x.double()).float()


# ---------------------------------------------------------------------------------------
# bf16 rounding
# ---------------------------------------------------------------------------------------
def bf16_rne(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, round to nearest even (twin of ``_bf16_rne``): torch's cast, which
    rounds the same way as the kernel's integer arithmetic (tests compare the two)."""
    return x.to(torch.bfloat16)


def _as_int(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 tensor of unsigned values below 2**width -> the same bit patterns as the
    signed ``dtype`` (int16 or int32) of that width."""
    width = torch.iinfo(dtype).bits
    return (bits - ((bits >> (width - 1)) << width)).to(dtype)


def bf16_away(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, round to nearest with ties away from zero (twin of ``_bf16_away``):
    ``(bits + 0x8000) >> 16``, a NaN gives bf16's quiet NaN of its high half. The bf16
    weight of both fp32-master updates ("master", "master_remainder")."""
    bits = _f32_bits(x).to(torch.int64) & MASK32
    hi = torch.where(torch.isnan(x), (bits >> 16) | 0x40, (bits + 0x8000) >> 16) & 0xFFFF
    return _as_int(hi, torch.int16).view(torch.bfloat16)


def master_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 master weights -> (bf16 weights, int16 remainders), bit exact (twin of
    ``_master_split``): the remainder is x's low 16 bits, the weight ``bf16_away(x)``, x's
    high half rounded to nearest by them, ties away from zero.
    ``master_rebuild(*master_split(x))`` is x bit for bit for every non-NaN fp32 value (a
    NaN stays a NaN)."""
    return bf16_away(x), _as_int(_f32_bits(x).to(torch.int64) & 0xFFFF, torch.int16)


def master_rebuild(w: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """(bf16 weights, int16 remainders) -> fp32 master weights, ``bits(w) << 16 + rem`` with
    rem sign-extended, mod 2**32 (twin of ``_master_rebuild``)."""
    hi = w.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((hi << 16) + rem.to(torch.int64)) & MASK32
    return _as_int(bits, torch.int32).view(torch.float32)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for int64 h in [0, 2**32) without int64 overflow."""
    lo = (h & 0xFFFF) * c
    hi = (((h >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def mix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 fmix32 on int64 tensors holding uint32 values (twin of ``_mix32``)."""
    h = h ^ (h >> 16)
    h = _mul32(h, MIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, MIX_C2)
    return h ^ (h >> 16)


def stochastic_bits(gidx: torch.Tensor, tkey: int, skey: int) -> torch.Tensor:
    """The 32 random bits of element ``gidx`` (int64 global index) for a tensor/step key:
    ``mix32(((lo ^ tkey ^ skey) + hi * GOLDEN32) mod 2**32)``."""
    h = (gidx & MASK32) ^ (tkey ^ skey)
    if gidx.numel() and int(gidx.max()) >> 32:  # indices past 2**32: add hi * GOLDEN32
        h = (h + _mul32((gidx >> 32) & MASK32, GOLDEN32)) & MASK32
    return mix32(h)


def bf16_stochastic(x: torch.Tensor, gidx: torch.Tensor, tkey: int, skey: int) -> torch.Tensor:
    """fp32 -> bf16 stochastic rounding (twin of ``_bf16_stochastic``): the top 16 bits of
    the element's hash added below bf16's mantissa, then truncated; a NaN becomes bf16's
    quiet NaN 0x7FC0."""
    r = (stochastic_bits(gidx, tkey, skey) >> 16).to(torch.int32)
    # int32 arithmetic on the float's bits: adding r < 2**16 to a non-NaN float's pattern
    # never carries past bit 31, and the arithmetic shift keeps the top 16 bits' pattern
    bits = torch.where(torch.isnan(x), torch.full_like(r, 0x7FC00000), _f32_bits(x))
    return ((bits + r) >> 16).to(torch.int16).view(torch.bfloat16)


# ---------------------------------------------------------------------------------------
# codecs
# ---------------------------------------------------------------------------------------
def _dyn_encode(x: torch.Tensor, codec: int, M: int, signed: bool) -> torch.Tensor:
    cand = encode_tables(str(x.device))[codec][enc_bucket(x, codec)].to(torch.int64)
    mid = codec_tables(str(x.device))[codec][TABLE_MID + cand]
    p = (cand + (x.abs() > mid).to(torch.int64)).to(torch.int32)
    if signed:
        p = torch.where(x < 0, p | (1 << M), p)
    return p


def _lut_decode(code: torch.Tensor, codec: int) -> torch.Tensor:
    """Values of codes read from the codec's value table (the dynamic-tree codecs and
    NormalFloat4)."""
    return codec_tables(str(code.device))[codec][TABLE_LUT + code.to(torch.int64)]


def _nf4_encode(x: torch.Tensor) -> torch.Tensor:
    """NormalFloat4 codes of x in [-1, 1] (twin of the kernel's): the number n of the 15
    thresholds below x, counted one compare at a time, is the rank of x's nearest level
    (ties toward 0, quant_maps.nf4_thresholds); its code is (n - NF4_NEGATIVE) & 15. A nan
    compares below every threshold (the code of -1; its block's absmax is nan too)."""
    thr = codec_tables(str(x.device))[CODEC_NF4_SIGNED][TABLE_MID:TABLE_MID + NF4_LEVELS - 1]
    n = torch.zeros(x.shape, dtype=torch.int32, device=x.device)
    for t in thr:
        n += (x > t).to(torch.int32)
    return (n - NF4_NEGATIVE) & (NF4_LEVELS - 1)


def _lin4_encode(v: torch.Tensor, inv16: "torch.Tensor | float" = 16.0) -> torch.Tensor:
    """Codes of v >= 0 in blocks with 16 / absmax = inv16 (16: v already normalized):
    trunc(v * inv16 - 0.5), in [0, 15] without a clamp (twin of the kernel's)."""
    return (v * inv16 - 0.5).to(torch.int32)


def _lin4_decode(code: torch.Tensor, absmax: "torch.Tensor | float" = 1.0) -> torch.Tensor:
    """(code + 1) / 16 * absmax, computed as (code + 1) * (absmax / 16) (twin of the kernel's)."""
    return (code.to(torch.int32) + 1).to(torch.float32) * (absmax * 0.0625)


def _fp8_encode(x: torch.Tensor) -> torch.Tensor:
    """e4m3 bits of x * 448, round to nearest even, saturating (twin of ``_fp8_encode``):
    torch's float8_e4m3fn cast, which the kernel's bit arithmetic matches (tested); the
    kernel codes an exact -0.0 as +0 (its sign test is x < 0), where the cast gives 0x80."""
    y = torch.clamp(x * 448.0, -448.0, 448.0)
    code = y.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    return torch.where(x == 0, 0, code)


def _fp8_decode(code: torch.Tensor) -> torch.Tensor:
    return code.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32) * (1.0 / 448.0)


def encode(x: torch.Tensor, codec: int) -> torch.Tensor:
    """Codes (int32) of normalized values ``x in [-1, 1]``."""
    if codec == CODEC_LIN4_NOZERO:
        return _lin4_encode(x)
    if codec == CODEC_FP8_E4M3:
        return _fp8_encode(x)
    if codec == CODEC_NF4_SIGNED:
        return _nf4_encode(x)
    M, signed = _DYN[codec]
    return _dyn_encode(x, codec, M, signed)


def decode(code: torch.Tensor, codec: int) -> torch.Tensor:
    """Normalized values (fp32) of codes."""
    if codec == CODEC_LIN4_NOZERO:
        return _lin4_decode(code)
    if codec == CODEC_FP8_E4M3:
        return _fp8_decode(code)
    return _lut_decode(code, codec)


# ---------------------------------------------------------------------------------------
# row-wise block layout
# ---------------------------------------------------------------------------------------
def quantize_blockwise(x: torch.Tensor, codec: int, block: int,
                       zero_free: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a [rows, cols] fp32 tensor in blocks of ``block`` along each row.

    Returns ``(codes, absmax)``: codes uint8 ``[rows, cols]`` (4-bit codecs: two per byte,
    element ``2i`` in the low nibble, ``[rows, ceil(cols / 2)]``, an odd row padded with the
    code of 0), absmax fp32 ``[rows, ceil(cols / block)]``. A block never spans two rows.
    ``zero_free``: a second moment, whose positive values are never coded 0 (quant_maps.py;
    the 8-bit unsigned map is zero-free through its tables, the flag acts on fp8).
    """
    rows, cols = x.shape
    bpr = -(-cols // block)
    xp = torch.zeros(rows, bpr * block, dtype=torch.float32, device=x.device)
    xp[:, :cols] = x
    xb = xp.view(rows, bpr, block)
    absmax = xb.abs().amax(dim=-1)
    normal = absmax >= torch.finfo(torch.float32).tiny  # below: the codes of 0 (as the kernel)
    inv = torch.where(normal, div_rn(torch.ones_like(absmax), torch.where(normal, absmax, torch.ones_like(absmax))),
                      torch.zeros_like(absmax))
    if codec == CODEC_LIN4_NOZERO:  # the kernel folds the 16 of the code book into 1 / absmax
        codes = _lin4_encode(xb, (inv * 16.0)[..., None]).view(rows, bpr * block)
    else:
        codes = encode(xb * inv[..., None], codec)
        if zero_free and codec == CODEC_FP8_E4M3:
            codes = torch.maximum(codes, (xb > 0).to(codes.dtype))  # SMALLEST_POSITIVE_CODE
        codes = codes.view(rows, bpr * block)
    if codec in PACKED_4BIT_CODECS:
        nbytes = (cols + 1) // 2
        pairs = codes[:, : 2 * nbytes].view(rows, nbytes, 2)
        packed = pairs[..., 0] | (pairs[..., 1] << 4)
        return packed.to(torch.uint8), absmax
    return codes[:, :cols].to(torch.uint8), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, codec: int, block: int,
                         cols: int) -> torch.Tensor:
    """Inverse of ``quantize_blockwise``: fp32 ``[rows, cols]``."""
    c = codes.to(torch.int32)
    if codec in PACKED_4BIT_CODECS:
        c = torch.stack([c & 15, c >> 4], dim=-1).view(c.shape[0], -1)
    c = c[:, :cols]
    scale = absmax.repeat_interleave(block, dim=1)[:, :cols]
    if codec == CODEC_LIN4_NOZERO:  # the kernel folds the 1/16 of the code book into absmax
        return _lin4_decode(c, scale)
    return decode(c, codec) * scale


# ---------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------
def _load_moment(cfg: AdamWConfig, t: AdamWTensor, state: torch.Tensor, scale: Optional[torch.Tensor],
                 codec: int) -> torch.Tensor:
    if codec == CODEC_NONE:
        return state.reshape(t.rows, t.cols).to(torch.float32)
    codes = state.reshape(t.rows, -1)
    return dequantize_blockwise(codes, scale.reshape(t.rows, -1), codec, cfg.block, t.cols)


def _block_cols(keep: torch.Tensor, n: int, per_block: int) -> torch.Tensor:
    """A [rows, blocks] mask spread over the n stored columns of a row, per_block of them
    per block (elements: block; packed 4-bit code bytes: block // 2)."""
    return keep.repeat_interleave(per_block, dim=1)[:, :n]


def _write(dst: torch.Tensor, new: torch.Tensor, keep: Optional[torch.Tensor]) -> None:
    """dst = new, except where ``keep`` (the guard's blocks with a non-finite gradient)."""
    new = new.reshape(keep.shape if keep is not None else dst.shape)
    if keep is not None:
        new = torch.where(keep, dst.reshape(keep.shape), new)
    dst.copy_(new.view(dst.shape))


def _blocks_all(cfg: AdamWConfig, t: AdamWTensor, ok: torch.Tensor) -> torch.Tensor:
    """[rows, blocks]: whether ``ok`` ([rows, cols]) holds for every element of a block."""
    bpr = -(-t.cols // cfg.block)
    padded = torch.ones(t.rows, bpr * cfg.block, dtype=torch.bool, device=ok.device)
    padded[:, :t.cols] = ok
    return padded.view(t.rows, bpr, cfg.block).all(dim=2)


def _store_moment(cfg: AdamWConfig, t: AdamWTensor, state: torch.Tensor, scale: Optional[torch.Tensor],
                  codec: int, x: torch.Tensor, keep: Optional[torch.Tensor], zero_free: bool = False) -> None:
    if codec == CODEC_NONE:
        val = bf16_rne(x) if cfg.state_bf16 else x
        _write(state, val, None if keep is None else _block_cols(keep, t.cols, cfg.block))
        return
    codes, absmax = quantize_blockwise(x, codec, cfg.block, zero_free)
    codes = codes.reshape(t.rows, -1)
    per_block = cfg.block // 2 if codec in PACKED_4BIT_CODECS else cfg.block
    _write(state, codes, None if keep is None else _block_cols(keep, codes.shape[1], per_block))
    _write(scale, absmax, keep)


# ---------------------------------------------------------------------------------------
# the weight: read in fp32, and the fp32 result landed in it (every optimizer's step)
# ---------------------------------------------------------------------------------------
def weight_fp32(param: torch.Tensor, extra: Optional[torch.Tensor], update: int, rows: int,
                cols: int) -> torch.Tensor:
    """The fp32 weight a step starts from, ``[rows, cols]``: an fp32 parameter itself, the
    fp32 master weights of a bf16 one (``master``: the state; ``master_remainder``: rebuilt
    from the weight and its remainder), else the bf16 weight widened."""
    bf16_param = param.dtype == torch.bfloat16
    if bf16_param and update == UPDATE_MASTER:
        return extra.reshape(rows, cols).clone()
    if bf16_param and update == UPDATE_MASTER_REMAINDER:
        return master_rebuild(param.reshape(rows, cols), extra.reshape(rows, cols))
    return param.reshape(rows, cols).to(torch.float32)


def land_weight(param: torch.Tensor, extra: Optional[torch.Tensor], p: torch.Tensor, p_new: torch.Tensor,
                update: int, stochastic: tuple[int, int, int, int], keep: Optional[torch.Tensor] = None) -> None:
    """Write the new fp32 weight ``p_new`` (``[rows, cols]``; the step started from ``p``,
    ``weight_fp32``) into ``param`` and its ``extra`` state by the weight-update rule
    ``update``: an fp32 parameter exactly; a bf16 one rounded to nearest, stochastically,
    with Kahan compensation, or from fp32 master weights (kept whole, or as a remainder).
    ``stochastic``: (global index of element (0, 0), row stride of the global index, tensor
    key, step key) of stochastic rounding. ``keep``: ``[rows, cols]`` elements left as they
    are (the non-finite guard's blocks), or None."""
    rows, cols = p_new.shape
    if param.dtype != torch.bfloat16:
        out = p_new
    elif update == UPDATE_NEAREST:
        out = bf16_rne(p_new)
    elif update == UPDATE_STOCHASTIC:
        sr_base, sr_row_stride, sr_key, skey = stochastic
        r = torch.arange(rows, dtype=torch.int64, device=p_new.device)[:, None]
        c = torch.arange(cols, dtype=torch.int64, device=p_new.device)[None, :]
        out = bf16_stochastic(p_new, sr_base + r * sr_row_stride + c, sr_key, skey)
    elif update == UPDATE_KAHAN:
        comp = extra.reshape(rows, cols).to(torch.float32)
        sum_ = (p_new - p) + comp
        out = bf16_rne(p + sum_)
        _write(extra, bf16_rne(sum_ - (out.to(torch.float32) - p)), keep)
    elif update == UPDATE_MASTER_REMAINDER:
        out, rem = master_split(p_new)
        _write(extra, rem, keep)
    else:
        _write(extra, p_new, keep)
        out = bf16_away(p_new)
    _write(param, out, keep)


def adamw_step_reference(cfg: AdamWConfig, tensors: Sequence[AdamWTensor], grads: Sequence[torch.Tensor],
                         hyper: AdamWHyper, guard: Optional[NonfiniteGuard] = None) -> None:
    """Step every tensor in place with the math of ``_adamw_lowbit_kernel`` (and its
    non-finite guard, if given)."""
    if not tensors:
        return
    s = hyper_scalars(hyper)
    dev = tensors[0].param.device
    if isinstance(hyper.lr, torch.Tensor):
        lr = hyper.lr.detach().to(device=dev, dtype=torch.float32).reshape(())
    else:
        lr = _f32(float(hyper.lr), dev)
    step_size = lr * _f32(s["inv_bc1"], dev)
    wd = _f32(s["wd"], dev)
    decay = 1.0 - lr * wd
    beta1, omb1 = _f32(s["beta1"], dev), _f32(s["one_minus_beta1"], dev)
    beta2, omb2 = _f32(s["beta2"], dev), _f32(s["one_minus_beta2"], dev)
    eps, isbc2 = _f32(s["eps"], dev), _f32(s["inv_sqrt_bc2"], dev)
    for t, grad in zip(tensors, grads):
        g = grad.reshape(t.rows, t.cols).to(torch.float32)
        p = weight_fp32(t.param, t.extra, cfg.weight_update, t.rows, t.cols)
        m = _load_moment(cfg, t, t.exp_avg, t.exp_avg_scale, cfg.m_codec)
        v = _load_moment(cfg, t, t.exp_avg_sq, t.exp_avg_sq_scale, cfg.v_codec)

        if not cfg.decoupled:
            g = g + wd * p
        m = beta1 * m + omb1 * g
        v = beta2 * v + omb2 * (g * g)
        denom = sqrt_rn(v) * isbc2 + eps
        upd = step_size * div_rn(m, denom)
        p_new = p * decay - upd if cfg.decoupled else p - upd

        keep = keep_elems = None  # [rows, blocks] / [rows, cols]: blocks left as they are
        if guard is not None:  # blocks where a new m, v or weight is not finite
            m_ok = _blocks_all(cfg, t, torch.isfinite(m))
            keep = ~(m_ok & _blocks_all(cfg, t, torch.isfinite(v) & torch.isfinite(p_new)))
            if bool(keep.any()):
                # the kernel's flag: +tag (m not finite) or -tag (m finite, v or p_new not);
                # its last block's store wins where both kinds are in one tensor
                guard.flags[t.flag_index] = -guard.tag if bool(m_ok[keep].flatten()[-1]) else guard.tag
                keep_elems = _block_cols(keep, t.cols, cfg.block)
            else:
                keep = None

        _store_moment(cfg, t, t.exp_avg, t.exp_avg_scale, cfg.m_codec, m, keep)
        _store_moment(cfg, t, t.exp_avg_sq, t.exp_avg_sq_scale, cfg.v_codec, v, keep, zero_free=True)

        land_weight(t.param, t.extra, p, p_new, cfg.weight_update, (t.sr_base, t.sr_row_stride, t.sr_key, s["skey"]),
                    keep_elems)
