"""Fused Triton kernels of Muon's elementwise phases with a low-bit momentum.

Newton-Schulz needs the whole update matrix between reading the momentum and writing the
weight, so one Muon step of a matrix is two kernels around it (one launch per matrix
each; the Newton-Schulz matmuls of the same matrix cost far more than a launch):

Math, per element, all in fp32 (the twin is ``muon_ref.py``, phase by phase)::

    momentum kernel   (muon_ref.momentum_and_input, store_momentum)
        g = grad;  m = dequant(momentum)                  (plain formats: m = load(m))
        m = m + (1 - beta) * (g - m)                      M <- beta M + (1 - beta) G
        u = m + (1 - beta) * (g - m)   (Nesterov; else u = m)
        U = bf16_rne(u)                                   Newton-Schulz's input, written
        momentum <- requant(m), each block's new absmax   (quantized formats; plain: m,
                                                           bf16_rne(m) for a bf16 state)
    O = NewtonSchulz5(U)                                  (PyTorch: muon_ref.newton_schulz)
    weight kernel     (muon_ref.new_weight, the weight part of write_step)
        p = the fp32 weight (fp32 param, master, rebuilt master_remainder, or bf16 widened)
        p_new = p * (1 - lr * wd) - (lr * s) * O           s = matched_rms * sqrt(max(rows, cols))
        weight <- p_new by the weight-update rule (adamw_lowbit.py's math block; stochastic
                  rounding keyed by the element's index in the whole matrix, so a shard
                  rounds as the whole matrix does)

With a momentum factor (``Muon4bit``'s rank-k ``P`` [rows, k], ``R`` [cols, k], bf16) the
stored momentum is ``dequant(momentum) + F`` with ``F[i, j] = sum_l P[i, l] * R[j, l]``
(l ascending, fp32), and the new factor comes from the whole new momentum, which only
the matrix's owner sees (``muon_exchange``). So the momentum kernel runs twice, around
the owner's work::

    INPUT launch      m = dequant(momentum) + F(P, R);  m, u as above
                      U = bf16_rne(u), Mw = bf16_rne(m) written; nothing stored
                      (guarded: flag <- 1 if a block of m holds an inf/nan)
    (the owner: O = NewtonSchulz5(U), the new factor P', R' from Mw)
    STORE launch      m recomputed as in the INPUT launch (the state is unchanged)
                      momentum <- requant(m - F(P', R')); U, Mw not written
                      (guarded: staged, flag <- 1 if a block of m - F(P', R') holds an inf/nan)

The non-finite guard is the reference's, per *matrix*: where the new momentum or weight
of any element is not finite, neither is written. No launch can see the whole matrix, so
a guarded step (a 1-element int32 ``flag``, zero on entry) runs

    momentum kernel   writes the new momentum into a staging copy (same layout), not the
                      state; flag <- 1 if a block of m holds an inf/nan
    weight kernel, CHECK launch: flag <- 1 if a block of p_new holds an inf/nan
    (sharded: the flag is agreed over the matrix's ranks here)
    weight kernel, WRITE launch: if flag, nothing; else the weight, and the staged
                      momentum copied into the state

with no host sync. Unguarded, the momentum kernel writes the state in place and the
WRITE launch writes the weight.

Under ``TRITON_INTERPRET=1`` (numpy: no fused multiply-adds) with the bf16/fp8 roundings in
integer arithmetic (``HW_CAST`` off), kernels and reference agree bit for bit. On a GPU the
compiler fuses multiply-adds and the kernels use the hardware casts and reciprocal: values
agree to an ulp, and a code or a bf16 rounding can differ where a value sits on a boundary
(as for the AdamW kernel). The code tables of the 8-bit and 4-bit codecs are read with
``tl.gather`` on every device (the AdamW kernel's shared-memory table copy, a private-API
path, is not used here).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from .adamw_lowbit import interpreting
from .muon_ref import MuonConfig, MuonHyper, MuonTensor, new_factor, newton_schulz, update_scale
from .optim_jit import (
    _K_CODEC_NONE,
    _K_ENC_ROW,
    _K_TABLE_SIZE,
    _K_UPDATE_STOCHASTIC,
    _bf16_rne,
    _block_absmax,
    _block_offsets,
    _dequantize,
    _land_weight,
    _ld,
    _load_raw,
    _load_weight,
    _st,
    _store_state,
    is_packed,
)
from .quant_maps import PACKED_4BIT_CODECS, codec_tables, encode_tables, step_key

# Elements per program and warps of both kernels (the AdamW kernel's shape for quantized
# states; not tuned for these kernels).
ELEMS_PER_PROGRAM = 1024
NUM_WARPS = 4


@triton.jit
def _factor(p_ptr, r_ptr, bidx, bpr, bmask, emask, QBLOCK: tl.constexpr, RANK: tl.constexpr):
    """F = P R^T on NB blocks [NB, QBLOCK] of a matrix (``bpr`` blocks per row): per
    element sum_l P[row, l] * R[col, l], l ascending, in fp32 (muon_ref's order)."""
    row = bidx // bpr
    col = (bidx - row * bpr)[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    f = tl.zeros((bidx.shape[0], QBLOCK), dtype=tl.float32)
    for l in tl.static_range(RANK):
        p_l = tl.load(p_ptr + row * RANK + l, mask=bmask, other=0).to(tl.float32)
        r_l = tl.load(r_ptr + col * RANK + l, mask=emask, other=0).to(tl.float32)
        f = f + p_l[:, None] * r_l
    return f


# The momentum kernel's launches (PHASE): the single launch of a momentum without a
# factor; the INPUT and STORE launches of a step with one (module docstring).
PHASE_WHOLE, PHASE_INPUT, PHASE_STORE = 0, 1, 2
_K_PHASE_INPUT = tl.constexpr(PHASE_INPUT)
_K_PHASE_STORE = tl.constexpr(PHASE_STORE)


@triton.jit
def _muon_momentum_kernel(g_ptr, m_ptr, ms_ptr, out_ptr, outs_ptr, u_ptr, mw_ptr, flag_ptr, tables_ptr,
                          enc_tables_ptr, fp_ptr, fr_ptr, np_ptr, nr_ptr,
                          cols, code_row, bpr, nblocks, one_minus_beta,
                          CODEC: tl.constexpr, NESTEROV: tl.constexpr, GUARD: tl.constexpr, EVEN: tl.constexpr,
                          ALIGNED: tl.constexpr, HW_CAST: tl.constexpr, QBLOCK: tl.constexpr, NB: tl.constexpr,
                          PHASE: tl.constexpr, RANK: tl.constexpr):
    """The momentum phase of NB blocks of one matrix: read momentum (m_ptr, its absmax at
    ms_ptr; RANK > 0: plus the factor of fp_ptr, fr_ptr) and gradient. PHASE_WHOLE: write
    the Newton-Schulz input (u_ptr, bf16) and the requantized new momentum (out_ptr,
    outs_ptr: the state itself, or a staging copy). PHASE_INPUT: write the Newton-Schulz
    input and the new momentum in bf16 (mw_ptr), store nothing. PHASE_STORE: store the new
    momentum less the new factor (np_ptr, nr_ptr). GUARD (WHOLE and INPUT): flag a block
    whose new momentum is not finite."""
    PACKED: tl.constexpr = is_packed(CODEC)
    CBLOCK: tl.constexpr = QBLOCK // 2 if PACKED else QBLOCK
    bidx = tl.program_id(0) * NB + tl.arange(0, NB)
    _, eoff, coff, bmask, emask, cmask = _block_offsets(bidx, nblocks, cols, code_row, bpr, QBLOCK, CBLOCK,
                                                        EVEN, ALIGNED)
    tab = tables_ptr + CODEC * _K_TABLE_SIZE
    etab = enc_tables_ptr + CODEC * _K_ENC_ROW
    g = _ld(g_ptr + eoff, emask, EVEN).to(tl.float32)
    raw, absmax = _load_raw(m_ptr, ms_ptr, eoff, coff, bidx, bmask, emask, cmask, CODEC, EVEN)
    m = _dequantize(raw, absmax, tab, CODEC, HW_CAST, -1)
    if RANK > 0:
        m = m + _factor(fp_ptr, fr_ptr, bidx, bpr, bmask, emask, QBLOCK, RANK)
    m = m + one_minus_beta * (g - m)
    if PHASE != _K_PHASE_STORE:
        if NESTEROV:
            u = m + one_minus_beta * (g - m)
        else:
            u = m
        _st(u_ptr + eoff, _bf16_rne(u, HW_CAST), emask, EVEN)
    if PHASE == _K_PHASE_INPUT:
        _st(mw_ptr + eoff, _bf16_rne(m, HW_CAST), emask, EVEN)
    if PHASE == _K_PHASE_STORE:
        m = m - _factor(np_ptr, nr_ptr, bidx, bpr, bmask, emask, QBLOCK, RANK)
    # nan-propagating, as the reference's amax: a nan momentum (an unguarded step) is
    # stored as the reference stores it
    m_abs = _block_absmax(m, emask, EVEN, True)
    if GUARD:
        tl.store(flag_ptr + bidx * 0, 1, mask=bmask & ~(m_abs < float("inf")))
    if PHASE != _K_PHASE_INPUT:
        _store_state(m, m_abs, out_ptr, outs_ptr, 0, tab, etab, eoff, coff, bidx, bmask, emask, cmask,
                     CODEC, NB, QBLOCK, EVEN, HW_CAST, -1)


# key and the stochastic-rounding offsets change between steps and shards: without
# do_not_specialize Triton would compile a variant per divisibility class of each.
@triton.jit(do_not_specialize=["sr_base", "sr_row", "key"])
def _muon_weight_kernel(o_ptr, p_ptr, x_ptr, flag_ptr, sm_ptr, sms_ptr, m_ptr, ms_ptr,
                        cols, code_row, bpr, nblocks, decay, step_size, sr_base, sr_row, key,
                        UPDATE: tl.constexpr, CODEC: tl.constexpr, WRITE: tl.constexpr, GUARD: tl.constexpr,
                        COMMIT: tl.constexpr, EVEN: tl.constexpr, ALIGNED: tl.constexpr, SR_IDX32: tl.constexpr,
                        HW_CAST: tl.constexpr, QBLOCK: tl.constexpr, NB: tl.constexpr):
    """The weight phase of NB blocks of one matrix, from the Newton-Schulz result O
    (o_ptr, bf16): p_new = p * decay - step_size * O. WRITE off (the CHECK launch): flag a
    block where p_new is not finite, write nothing. WRITE on: unless GUARD and the flag is
    set, land p_new in the weight (p_ptr) and its extra state (x_ptr); COMMIT: and copy the
    staged new momentum (sm_ptr, sms_ptr) into the state (m_ptr, ms_ptr)."""
    PACKED: tl.constexpr = is_packed(CODEC)
    CBLOCK: tl.constexpr = QBLOCK // 2 if PACKED else QBLOCK
    bidx = tl.program_id(0) * NB + tl.arange(0, NB)
    _, eoff, coff, bmask, emask, cmask = _block_offsets(bidx, nblocks, cols, code_row, bpr, QBLOCK, CBLOCK,
                                                        EVEN, ALIGNED)
    pptr = p_ptr + eoff
    xptr = x_ptr + eoff
    p = _load_weight(pptr, xptr, emask, UPDATE, EVEN, HW_CAST)
    o = _ld(o_ptr + eoff, emask, EVEN).to(tl.float32)
    p_new = p * decay - step_size * o
    if not WRITE:
        ok = _block_absmax(p_new, emask, EVEN, True) < float("inf")
        tl.store(flag_ptr + bidx * 0, 1, mask=bmask & ~ok)
    else:
        ST_EVEN: tl.constexpr = EVEN and not GUARD
        if GUARD:
            keep = tl.load(flag_ptr + bidx * 0) == 0  # the matrix's flag, in every block's lane
            bmask = bmask & keep
            emask = emask & keep[:, None]
            cmask = cmask & keep[:, None]
        gidx = 0  # stochastic rounding's global element indices (only that rule reads them)
        if UPDATE == _K_UPDATE_STOCHASTIC:
            row = bidx // bpr
            g_start = sr_base + row.to(tl.int64) * sr_row + (bidx - row * bpr) * QBLOCK
            if SR_IDX32:
                g_start = g_start.to(tl.uint32)
            gidx = g_start[:, None] + tl.arange(0, QBLOCK)[None, :].to(g_start.dtype)
        _land_weight(pptr, xptr, p, p_new, emask, gidx, key.to(tl.uint32), UPDATE, EVEN, ST_EVEN, HW_CAST,
                     SR_IDX32)
        if COMMIT:  # the staged momentum, as stored (codes and absmax, or plain values)
            raw, absmax = _load_raw(sm_ptr, sms_ptr, eoff, coff, bidx, bmask, emask, cmask, CODEC, EVEN)
            if CODEC == _K_CODEC_NONE:
                _st(m_ptr + eoff, raw, emask, ST_EVEN)
            else:
                _st(ms_ptr + bidx, absmax, bmask, ST_EVEN)
                if PACKED:
                    _st(m_ptr + coff, raw, cmask, ST_EVEN)
                else:
                    _st(m_ptr + eoff, raw, emask, ST_EVEN)


# ----------------------------------------------------------------------------------------
# Host side: one matrix (or one shard of it) per launch
# ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class StagedMomentum:
    """A guarded step's new momentum, stored as the state stores it, until the weight
    kernel's WRITE launch copies it into the state (or, for a non-finite step, drops it)."""

    momentum: torch.Tensor
    scale: Optional[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class _Layout:
    rows: int
    cols: int
    code_row: int  # bytes (codes) or elements (plain) per row of the momentum
    bpr: int  # blocks per row
    nblocks: int
    nb: int  # blocks per program
    even: bool
    aligned: bool


def _layout(cfg: MuonConfig, t: MuonTensor, *others: Optional[torch.Tensor]) -> _Layout:
    """The block layout of a matrix's launches; ``others``: its other buffers of the launch
    (their alignment sets the ALIGNED hint)."""
    if cfg.block < 2 or cfg.block & (cfg.block - 1):
        raise ValueError(f"Muon's fused kernels need a power-of-two block_size >= 2, got {cfg.block}")
    rows, cols = t.param.shape
    if rows * cols >= 2**31:
        raise ValueError(f"a {rows}x{cols} Muon matrix (local shard) has 2**31 or more elements, past the fused "
                         "kernels' int32 offsets; shard it over more ranks")
    packed = cfg.codec in PACKED_4BIT_CODECS
    code_row = (cols + 1) // 2 if packed else cols
    bpr = -(-cols // cfg.block)
    nblocks = rows * bpr
    nb = max(1, ELEMS_PER_PROGRAM // cfg.block)
    even = cols % cfg.block == 0 and nblocks % nb == 0 and (not packed or cols % 2 == 0)
    bufs = (t.param, t.momentum, t.extra, *others)
    aligned = cols % 16 == 0 and code_row % 16 == 0 and all(x is None or x.data_ptr() % 64 == 0 for x in bufs)
    return _Layout(rows, cols, code_row, bpr, nblocks, nb, even, aligned)


def _stored(staged: StagedMomentum) -> tuple[torch.Tensor, torch.Tensor]:
    """(values or codes, scales) of a staged momentum; a plain one's values stand in for
    its scales (never read)."""
    return staged.momentum, staged.momentum if staged.scale is None else staged.scale


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return codec_tables(str(device)), encode_tables(str(device))


def _contiguous(x: torch.Tensor, what: str) -> torch.Tensor:
    if not x.is_contiguous():
        raise ValueError(f"Muon's fused kernels take contiguous tensors; the {what} is not (stride {x.stride()})")
    return x


def _factor_pair(factor: tuple[torch.Tensor, torch.Tensor], lay: _Layout, what: str) -> int:
    """The rank of a factor (P [rows, k], R [cols, k], contiguous) of a launch's matrix."""
    p, r = factor
    rank = p.shape[1] if p.dim() == 2 else -1
    if p.shape != (lay.rows, rank) or r.shape != (lay.cols, rank) or rank < 1:
        raise ValueError(f"the {what} factor of a {lay.rows}x{lay.cols} momentum must be P [rows, k] and "
                         f"R [cols, k] with k >= 1; got {tuple(p.shape)} and {tuple(r.shape)}")
    _contiguous(p, f"{what} factor's P")
    _contiguous(r, f"{what} factor's R")
    return rank


def _momentum_launch(cfg: MuonConfig, t: MuonTensor, grad: torch.Tensor, hyper: MuonHyper,
                     flag: Optional[torch.Tensor], stage: bool, phase: int,
                     factor: Optional[tuple[torch.Tensor, torch.Tensor]],
                     new_factor: Optional[tuple[torch.Tensor, torch.Tensor]]):
    """One launch of the momentum kernel (``flag``: the guard's, WHOLE and INPUT launches;
    ``stage``: the new momentum into a staging copy, not the state); returns (U or None,
    bf16 new momentum or None, staged momentum or None)."""
    grad = _contiguous(grad, "gradient")
    lay = _layout(cfg, t, grad)
    rank = 0 if factor is None else _factor_pair(factor, lay, "stored")
    if new_factor is not None and _factor_pair(new_factor, lay, "new") != rank:
        raise ValueError("the new momentum factor's rank differs from the stored one's")
    if rank and cfg.codec == _K_CODEC_NONE:
        raise ValueError("a momentum factor goes with a quantized momentum (the residual's codes)")
    u = mw = None
    if phase != PHASE_STORE:
        u = torch.empty(lay.rows, lay.cols, dtype=torch.bfloat16, device=grad.device)
    if phase == PHASE_INPUT:
        mw = torch.empty(lay.rows, lay.cols, dtype=torch.bfloat16, device=grad.device)
    scale = t.momentum_scale if t.momentum_scale is not None else t.momentum
    staged = None
    if stage:
        staged = StagedMomentum(torch.empty_like(t.momentum),
                                None if t.momentum_scale is None else torch.empty_like(t.momentum_scale))
    out, outs = (t.momentum, scale) if staged is None else _stored(staged)
    fp, fr = factor if factor is not None else (grad, grad)  # never read without a factor
    np_, nr = new_factor if new_factor is not None else (fp, fr)
    tables, enc = _tables(grad.device)
    _muon_momentum_kernel[(triton.cdiv(lay.nblocks, lay.nb),)](
        grad, t.momentum, scale, out, outs, grad if u is None else u, grad if mw is None else mw,
        grad if flag is None else flag, tables, enc, fp, fr, np_, nr,
        lay.cols, lay.code_row, lay.bpr, lay.nblocks, 1.0 - hyper.momentum,
        cfg.codec, cfg.nesterov, flag is not None, lay.even, lay.aligned,
        not interpreting(), cfg.block, lay.nb, phase, rank, num_warps=NUM_WARPS)
    return u, mw, staged


def momentum_and_input(cfg: MuonConfig, t: MuonTensor, grad: torch.Tensor, hyper: MuonHyper,
                       flag: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[StagedMomentum]]:
    """The momentum phase of ``t`` (a matrix or a shard): the Newton-Schulz input U
    (bf16, shaped like the parameter) and, with ``flag`` (a guarded step), the new momentum
    staged (the state is left as it is; ``flag`` set if the new momentum is not finite);
    without it the state is written in place and None returned."""
    u, _, staged = _momentum_launch(cfg, t, grad, hyper, flag, flag is not None, PHASE_WHOLE, None, None)
    return u, staged


def factored_input(cfg: MuonConfig, t: MuonTensor, grad: torch.Tensor, hyper: MuonHyper,
                   factor: tuple[torch.Tensor, torch.Tensor],
                   flag: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The INPUT launch of a momentum with a ``factor`` (P, R): (the Newton-Schulz input
    U, the new momentum in bf16), both shaped like the parameter; nothing is stored.
    ``flag`` (a guarded step): set if the new momentum is not finite."""
    u, mw, _ = _momentum_launch(cfg, t, grad, hyper, flag, False, PHASE_INPUT, factor, None)
    return u, mw


def store_factored(cfg: MuonConfig, t: MuonTensor, grad: torch.Tensor, hyper: MuonHyper,
                   factor: tuple[torch.Tensor, torch.Tensor], new_factor: tuple[torch.Tensor, torch.Tensor],
                   flag: Optional[torch.Tensor] = None) -> Optional[StagedMomentum]:
    """The STORE launch: the new momentum (recomputed from the unchanged state, its stored
    ``factor`` and ``grad``, as ``factored_input`` computed it) less ``new_factor``,
    requantized. With ``flag`` (a guarded step): into a staging copy, returned for the
    weight kernel's WRITE launch to commit, ``flag`` set if what is stored would not be
    finite; without it into the state in place (None returned)."""
    _, _, out = _momentum_launch(cfg, t, grad, hyper, flag, flag is not None, PHASE_STORE, factor, new_factor)
    return out


def _weight_launch(cfg: MuonConfig, t: MuonTensor, o: torch.Tensor, hyper: MuonHyper, shape: tuple[int, int],
                   flag: Optional[torch.Tensor], staged: Optional[StagedMomentum], write: bool) -> None:
    o = _contiguous(o, "Newton-Schulz output")
    lay = _layout(cfg, t, o)
    stride = lay.cols if t.sr_row_stride is None else t.sr_row_stride
    sr_idx32 = t.sr_base + (lay.rows - 1) * stride + lay.cols <= 2**32
    key = (t.sr_key ^ step_key(hyper.step)) & 0xFFFFFFFF
    extra = t.extra if t.extra is not None else t.param
    scale = t.momentum_scale if t.momentum_scale is not None else t.momentum
    sm, sms = (t.momentum, scale) if staged is None else _stored(staged)
    _muon_weight_kernel[(triton.cdiv(lay.nblocks, lay.nb),)](
        o, t.param, extra, o if flag is None else flag, sm, sms, t.momentum, scale,
        lay.cols, lay.code_row, lay.bpr, lay.nblocks,
        1.0 - hyper.lr * hyper.weight_decay, hyper.lr * update_scale(*shape, hyper.matched_rms),
        t.sr_base, stride, key,
        cfg.weight_update, cfg.codec, write,
        flag is not None, staged is not None, lay.even, lay.aligned, sr_idx32, not interpreting(),
        cfg.block, lay.nb, num_warps=NUM_WARPS)


def check_weight(cfg: MuonConfig, t: MuonTensor, o: torch.Tensor, hyper: MuonHyper, shape: tuple[int, int],
                 flag: torch.Tensor) -> None:
    """The weight kernel's CHECK launch: set ``flag`` if ``t``'s new weight from its part
    ``o`` of the orthogonalised update (of the whole matrix of ``shape``) is not finite."""
    _weight_launch(cfg, t, o, hyper, shape, flag, None, write=False)


def write_weight(cfg: MuonConfig, t: MuonTensor, o: torch.Tensor, hyper: MuonHyper, shape: tuple[int, int],
                 flag: Optional[torch.Tensor] = None, staged: Optional[StagedMomentum] = None) -> None:
    """The weight kernel's WRITE launch: land ``t``'s new weight and commit the ``staged``
    momentum, unless ``flag`` (a guarded step) is set."""
    _weight_launch(cfg, t, o, hyper, shape, flag, staged, write=True)


def muon_step_fused(cfg: MuonConfig, t: MuonTensor, grad: torch.Tensor, hyper: MuonHyper,
                    flag: Optional[torch.Tensor] = None) -> None:
    """Step one whole matrix in place (``muon_ref.muon_step_reference`` in the fused
    kernels). ``flag`` (int32, one element, zero on entry): the guarded step, which writes
    nothing where the new momentum or weight would hold an inf/nan and sets ``flag``;
    read it when convenient (no host sync here)."""
    if cfg.factor_rank:
        _factored_step(cfg, t, grad, hyper, flag)
        return
    u, staged = momentum_and_input(cfg, t, grad, hyper, flag)
    o = newton_schulz(u, hyper.ns_steps, hyper.ns_coefficients)
    del u
    shape = tuple(t.param.shape)
    if flag is not None:
        check_weight(cfg, t, o, hyper, shape, flag)
    write_weight(cfg, t, o, hyper, shape, flag, staged)


def commit_factor(t: MuonTensor, new: tuple[torch.Tensor, torch.Tensor], flag: Optional[torch.Tensor]) -> None:
    """Write the ``new`` factor into ``t``'s state, unless ``flag`` (a guarded step's) is
    set: decided on the device, no host sync."""
    for state, value in zip((t.row_factor, t.col_factor), new):
        state.copy_(value if flag is None else torch.where(flag.bool(), state, value))


def _factored_step(cfg: MuonConfig, t: MuonTensor, grad: torch.Tensor, hyper: MuonHyper,
                   flag: Optional[torch.Tensor]) -> None:
    """``muon_step_fused`` of a momentum with a factor: the INPUT launch, Newton-Schulz and
    the new factor from the new momentum in bf16 (``muon_ref.new_factor``, PyTorch ops), the
    STORE launch, the weight kernel's launches, the factor written where the step is."""
    factor = (t.row_factor, t.col_factor)
    u, mw = factored_input(cfg, t, grad, hyper, factor, flag)
    o = newton_schulz(u, hyper.ns_steps, hyper.ns_coefficients)
    del u
    new = new_factor(t.col_factor, mw)
    del mw
    staged = store_factored(cfg, t, grad, hyper, factor, new, flag)
    shape = tuple(t.param.shape)
    if flag is not None:
        check_weight(cfg, t, o, hyper, shape, flag)
    write_weight(cfg, t, o, hyper, shape, flag, staged)
    commit_factor(t, new, flag)
