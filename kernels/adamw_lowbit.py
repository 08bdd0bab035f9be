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
    CODEC_NONE,
    DYN_MAGNITUDE_BITS,
    ENC_WINDOW,
    PACKED_4BIT_CODECS,
    TABLE_LUT,
    TABLE_MID,
    codec_tables,
    enc_size,
    encode_tables,
)
from .loops import kernel_range
from .optim_jit import (
    ENC_WORDS_MAX,
    _K_ENC_ROW,
    _K_TABLE_SIZE,
    _K_UPDATE_STOCHASTIC,
    _block_absmax,
    _block_offsets,
    _dequantize,
    _div,
    _land_weight,
    _ld,
    _load_raw,
    _load_weight,
    _smem_tables_store,
    _store_state,
    is_packed,
)


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


_K_TILE_BITS = tl.constexpr(TILE_BITS)
_K_TILE_MASK = tl.constexpr((1 << TILE_BITS) - 1)
# The iterator of the tile loop, whose bounds are run-time values (kernels/loops.py).
_range = kernel_range()
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
    buffers, and the masks (``_block_offsets``)."""
    tile = tl.load(tiles_ptr + t)
    slot = tile >> _K_TILE_BITS
    bidx = (tile & _K_TILE_MASK) * NB + tl.arange(0, NB)
    meta = meta_ptr + slot.to(tl.int64) * _K_META_STRIDE
    nblocks = tl.load(meta + _K_META_NBLOCKS).to(tl.int32)
    if EVEN:  # the row layout is not read
        cols, code_row, bpr = 0, 0, 1
    else:
        cols = _meta_offset(meta, _K_META_COLS, ALIGNED)
        code_row = _meta_offset(meta, _K_META_CODE_ROW, ALIGNED)
        bpr = tl.load(meta + _K_META_BPR).to(tl.int32)
    e_start, eoff, coff, bmask, emask, cmask = _block_offsets(bidx, nblocks, cols, code_row, bpr, QBLOCK, CBLOCK,
                                                              EVEN, ALIGNED)
    return slot, meta, bidx, e_start, eoff, coff, bmask, emask, cmask


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
    g_off = tl.load(grad_offsets_ptr + slot)
    if ALIGNED:
        g_off = tl.multiple_of(g_off, 16)
    g = _ld(g_base + g_off + eoff, emask, EVEN).to(tl.float32)
    pptr = p_base + _meta_offset(meta, _K_META_PARAM, ALIGNED) + eoff
    xptr = x_base + _meta_offset(meta, _K_META_EXTRA, ALIGNED) + eoff
    p = _load_weight(pptr, xptr, emask, UPDATE, EVEN, HW_CAST)
    m_base = m_base + _meta_offset(meta, _K_META_M, ALIGNED)
    v_base = v_base + _meta_offset(meta, _K_META_V, ALIGNED)
    m_raw, m_abs = _load_raw(m_base, ms_base + tl.load(meta + _K_META_MSCALE), eoff, coff, bidx, bmask, emask, cmask,
                             M_CODEC, EVEN)
    v_raw, v_abs = _load_raw(v_base, vs_base + tl.load(meta + _K_META_VSCALE), eoff, coff, bidx, bmask, emask, cmask,
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
    gidx = 0  # stochastic rounding's global element indices (only that rule reads them)
    key = 0
    if UPDATE == _K_UPDATE_STOCHASTIC:
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
    _land_weight(pptr, xptr, p, p_new, emask, gidx, key, UPDATE, EVEN, ST_EVEN, HW_CAST, SR_IDX32)


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
    PACKED: tl.constexpr = is_packed(M_CODEC)
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
    if cfg.m_codec in PACKED_4BIT_CODECS:
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
        packed_even = cfg.m_codec not in PACKED_4BIT_CODECS or t.cols % 2 == 0
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
