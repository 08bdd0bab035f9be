"""Pure-PyTorch reference of one Muon step on a 2-D weight, with a low-bit momentum.

Muon (Keller Jordan's description of the optimizer; Moonshot AI's "Muon is Scalable for
LLM Training", arXiv 2502.16982, for the update scale and weight decay), per matrix
``W`` of shape ``[rows, cols]`` with gradient ``G``, momentum ``beta`` and learning rate
``lr``::

    M <- beta * M + (1 - beta) * G            (momentum, kept as state)
    U <- (1 - beta) * G + beta * M            (Nesterov; plain momentum: U <- M)
    O <- NewtonSchulz5(U)                     (approximately U's orthogonal factor)
    W <- W * (1 - lr * wd) - lr * s * O,      s = matched_rms * sqrt(max(rows, cols))

``NewtonSchulz5`` normalises U by its Frobenius norm (so every singular value is at most
1), works on the wide orientation (transposed when rows > cols, so the Gram matrix is the
smaller one) and runs the quintic iteration ``X <- a X + (b A + c A A) X`` with
``A = X X^T`` five times, in bf16, with the published coefficients (3.4445, -4.7750,
2.0315), which drive every singular value into about [0.7, 1.2] rather than exactly to 1:
the update is close to U's orthogonal factor ``U V^T``.

The scale ``s``: an orthogonal ``[rows, cols]`` matrix has RMS ``1 / sqrt(max(rows,
cols))``, and AdamW's updates have an RMS of about 0.2 to 0.4 in practice; Moonshot's rule
``s = 0.2 * sqrt(max(rows, cols))`` gives the update the RMS ``0.2`` whatever the shape,
so Muon takes AdamW's learning rate and weight decay, and the matrices stepped by Muon
and the parameters stepped by AdamW in the same model move at matching rates.

The momentum is stored like AdamW's first moment (``adamw_lowbit_ref``): fp32, bf16 or
codes with one absmax per block along each row, in the first-moment codec of the state
format; every step dequantizes it, updates it in fp32 and requantizes it. The fp32 result
lands in the weight by the same rules (and the same code) as AdamW's step:
``adamw_lowbit_ref.land_weight``.

A 4-bit momentum may keep a rank-``k`` factor beside its codes (``factor_rank``, LowBitMuon's
``momentum_4bit_factor_rank``): ``P`` ``[rows, k]`` and ``R`` ``[cols, k]`` in bf16, and the
stored momentum is ``deq(codes) + F`` with ``F = P R^T`` (``factor_product``). The codes
then hold only the residual ``M - F``. Muon's momentum is dominated by a few directions
(the gradients of successive steps share them), and a 4-bit code of a block spends its
levels on its largest values: with those directions taken out, the codes' absmax per
block shrinks and so does every element's rounding error, which otherwise lives on for
about ``1 / (1 - beta)`` steps. At every step, from the new momentum ``M`` rounded to bf16
(``Mb``; bf16 because that is what a sharded matrix's owner receives of it), one subspace
iteration warm-started from the old column factor gives the new factor::

    Q = orth(R_old);  P = bf16(orth(Mb Q));  R = bf16(Mb^T P)      (``new_factor``)
    codes <- quant4(M - F(P, R))

``orth`` is the Q of a reduced QR in fp32; ``F(P, R) = P P^T Mb`` is ``Mb``'s part in the
span of ``P``, which the iteration moves toward ``Mb``'s top-``k`` left singular vectors.
The factor must come from ``M`` itself: one of the Nesterov input, or a step late, leaves
the codes a residual that the factor no longer fits. ``P`` starts at zero (the stored
momentum starts at zero, as without a factor) and ``R`` at a seeded random orthonormal
basis (``initial_col_factor``), so the first step needs no special case.

This is the pure-PyTorch twin of the fused kernels of ``muon_lowbit.py`` (the elementwise
phases; Newton-Schulz is these matmuls on either path): the same fp32 operations in the
same order, so that under ``TRITON_INTERPRET=1`` the two agree bit for bit; it is what runs
where there is no GPU. It comes in phases (``momentum_and_input``, ``newton_schulz``,
``new_weight``, ``new_factor``, ``write_step``) so that a sharded matrix
(``titan_lowbit.optim.muon_exchange``) runs the elementwise phases on its shard and
Newton-Schulz on the whole matrix, with the same ops as ``muon_step_reference``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from .adamw_lowbit_ref import bf16_rne, dequantize_blockwise, land_weight, quantize_blockwise, weight_fp32
from .quant_maps import CODEC_NONE, step_key

# The quintic Newton-Schulz iteration of the reference Muon: coefficients and steps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7  # added to the Frobenius norm: a zero momentum gives a zero update
# Moonshot's update RMS (arXiv 2502.16982): the update is scaled to this RMS, AdamW's.
MATCHED_RMS = 0.2


def newton_schulz(u: torch.Tensor, steps: int = NS_STEPS,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of a 2-D ``u``, in bf16 (returned so):
    close to the orthogonal factor of ``u``'s polar decomposition."""
    a, b, c = coefficients
    x = u.to(torch.bfloat16)
    wide = x.shape[0] <= x.shape[1]
    if not wide:
        x = x.T
    x = x / (x.norm() + NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + (c * gram) @ gram) @ x  # the reference's order of bf16 roundings
    return x if wide else x.T


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """Floating-point operations of ``newton_schulz`` on a ``[rows, cols]`` matrix, counted
    as its matmuls' 2 m n k: per step, on the wide orientation ``[r, c]`` (r <= c), the
    Gram matrix ``X X^T`` (2 r^2 c), ``A A`` (2 r^3) and ``B X`` (2 r^2 c). The elementwise
    operations (a few r^2 + r c per step) are left out."""
    r, c = min(rows, cols), max(rows, cols)
    return steps * (4 * r * r * c + 2 * r ** 3)


def update_scale(rows: int, cols: int, matched_rms: float = MATCHED_RMS) -> float:
    """The factor that gives an orthogonal ``[rows, cols]`` update the RMS ``matched_rms``."""
    return matched_rms * math.sqrt(max(rows, cols))


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """How one matrix's state is stored and its weight updated."""

    codec: int  # the momentum's codec (CODEC_NONE: plain)
    state_bf16: bool  # plain momentum: bf16 (True) or fp32
    block: int  # quantization block along a row
    weight_update: int  # adamw_interface.UPDATE_*
    nesterov: bool
    factor_rank: int = 0  # k of the momentum's factor beside its codes (0: none; codes only)


@dataclasses.dataclass
class MuonTensor:
    """One matrix and its state: plain local tensors."""

    param: torch.Tensor  # [rows, cols]
    momentum: torch.Tensor  # plain [rows, cols], or codes (4-bit: [rows, ceil(cols / 2)])
    momentum_scale: Optional[torch.Tensor]  # fp32 [rows, ceil(cols / block)] absmax, or None
    extra: Optional[torch.Tensor]  # the weight update's state (master, remainder, Kahan), or None
    sr_key: int = 0  # stochastic rounding: the tensor's key
    # Stochastic rounding's global element index of element (r, c) is sr_base + r * sr_row_stride
    # + c: a whole matrix's row * cols + col (sr_row_stride None: cols); a shard's, the index of
    # the same element in the whole matrix, so sharded and whole round alike.
    sr_base: int = 0
    sr_row_stride: Optional[int] = None
    # The momentum's factor (MuonConfig.factor_rank > 0): bf16 P [rows, k] and R [cols, k] of
    # the rows and columns held here (a shard's: the whole matrix's rows and columns of it).
    row_factor: Optional[torch.Tensor] = None
    col_factor: Optional[torch.Tensor] = None


@dataclasses.dataclass
class MuonHyper:
    lr: float
    momentum: float
    weight_decay: float
    ns_steps: int
    ns_coefficients: tuple[float, float, float]
    matched_rms: float
    step: int  # 1 on the first step


def factor_product(row_factor: torch.Tensor, col_factor: torch.Tensor) -> torch.Tensor:
    """``F = P R^T`` in fp32, ``[rows, cols]``, of a factor ``P`` ``[rows, k]``, ``R``
    ``[cols, k]``: per element, from 0.0, ``F[i, j] += fp32(P[i, l]) * fp32(R[j, l])`` for
    ``l = 0 .. k-1`` in that order, each product rounded to fp32 before it is added (no
    fused multiply-add, no matmul's order of sums). So a kernel can give the same bits, and
    a shard's ``F`` (its rows of ``P``, its columns of ``R``) is the whole matrix's ``F``
    on its rows and columns, bit for bit."""
    p, r = row_factor.to(torch.float32), col_factor.to(torch.float32)
    f = torch.zeros(p.shape[0], r.shape[0], dtype=torch.float32, device=p.device)
    for l in range(p.shape[1]):
        f = f + p[:, l, None] * r[None, :, l]
    return f


def orthonormal_columns(x: torch.Tensor) -> torch.Tensor:
    """The Q of the reduced QR decomposition of ``x`` ``[n, k]`` (n >= k), in fp32: ``k``
    orthonormal columns spanning ``x``'s (any others where ``x`` has a lower rank),
    row-major (the kernels read a factor so; LAPACK's Q comes column-major)."""
    return torch.linalg.qr(x.to(torch.float32), mode="reduced").Q.contiguous()


def initial_col_factor(cols: int, rank: int, key: int) -> torch.Tensor:
    """The column factor ``R`` a matrix's momentum starts with: a random orthonormal
    ``[cols, rank]`` basis (the Q of a Gaussian matrix's QR) in bf16, on the CPU, from a
    generator seeded with ``key`` (the matrix's: the optimizer's seed and the matrix's
    position), for the whole matrix: a shard takes its columns of it."""
    gen = torch.Generator().manual_seed(key)
    return bf16_rne(orthonormal_columns(torch.randn(cols, rank, generator=gen, dtype=torch.float32)))


def new_factor(col_factor: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, R) in bf16, the new factor of the whole new momentum ``m`` (fp32 ``[rows,
    cols]``): one subspace iteration on ``Mb`` (``m`` rounded to bf16) from the old column
    factor ``col_factor``: ``P = orth(Mb orth(R_old))``, ``R = Mb^T P`` with the stored
    (bf16) ``P``, so that ``F(P, R) = P P^T Mb``."""
    mb = bf16_rne(m).to(torch.float32)
    row = bf16_rne(orthonormal_columns(mb @ orthonormal_columns(col_factor)))
    return row, bf16_rne(mb.T @ row.to(torch.float32))


def load_momentum(cfg: MuonConfig, t: MuonTensor) -> torch.Tensor:
    """The momentum in fp32, ``[rows, cols]``: plain, or decoded from its codes, plus its
    factor's ``F`` where it keeps one."""
    rows, cols = t.param.shape
    if cfg.codec == CODEC_NONE:
        return t.momentum.to(torch.float32)
    m = dequantize_blockwise(t.momentum, t.momentum_scale, cfg.codec, cfg.block, cols)
    if cfg.factor_rank:
        m = m + factor_product(t.row_factor, t.col_factor)
    return m


def momentum_to_store(m: torch.Tensor, factor: Optional[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """What ``store_momentum`` codes of the new momentum ``m`` (a whole matrix or a shard):
    ``m`` itself, or its residual ``m - F`` beside the new ``factor`` (P, R: the rows and
    columns of ``m``)."""
    return m if factor is None else m - factor_product(*factor)


def store_momentum(cfg: MuonConfig, t: MuonTensor, m: torch.Tensor) -> None:
    if cfg.codec == CODEC_NONE:
        t.momentum.copy_(bf16_rne(m) if cfg.state_bf16 else m)
        return
    codes, absmax = quantize_blockwise(m, cfg.codec, cfg.block)
    t.momentum.copy_(codes)
    t.momentum_scale.copy_(absmax)


def momentum_and_input(cfg: MuonConfig, t: MuonTensor, grad: torch.Tensor,
                       hyper: MuonHyper) -> tuple[torch.Tensor, torch.Tensor]:
    """(new momentum ``M``, Newton-Schulz input ``U``), both fp32 and elementwise: a shard
    of the matrix gives the shard of both. Both are the momentum moved toward the gradient
    by ``1 - beta``, ``x + (1 - beta) * (G - x)``: torch's ``lerp`` for ``beta >= 0.5`` (as
    the published Muon writes them) without its fused multiply-add, in the fused kernel's
    operations (``muon_lowbit``)."""
    g = grad.to(torch.float32)
    one_minus_beta = torch.tensor(1.0 - hyper.momentum, dtype=torch.float32, device=g.device)
    m = load_momentum(cfg, t)
    m = m + one_minus_beta * (g - m)
    return m, (m + one_minus_beta * (g - m) if cfg.nesterov else m)


def new_weight(cfg: MuonConfig, t: MuonTensor, o: torch.Tensor, hyper: MuonHyper,
               shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weight the step starts from, new fp32 weight) of ``t`` (a whole matrix or a
    shard) given its part ``o`` of the orthogonalised update of the whole matrix, whose
    ``shape`` sets the update's scale."""
    rows, cols = t.param.shape
    p = weight_fp32(t.param, t.extra, cfg.weight_update, rows, cols)
    step_size = hyper.lr * update_scale(*shape, hyper.matched_rms)
    return p, p * (1.0 - hyper.lr * hyper.weight_decay) - step_size * o.to(torch.float32)


def finite(*tensors: torch.Tensor) -> torch.Tensor:
    """0-d bool: whether ``tensors`` (the new momentum and weight, and what is stored of
    the momentum) hold no inf/nan (no host sync)."""
    ok = torch.isfinite(tensors[0]).all()
    for x in tensors[1:]:
        ok = ok & torch.isfinite(x).all()
    return ok


def write_step(cfg: MuonConfig, t: MuonTensor, stored: torch.Tensor, p: torch.Tensor, p_new: torch.Tensor,
               hyper: MuonHyper, factor: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    """Store the new momentum (``stored``: ``momentum_to_store`` of it) with its new
    ``factor`` where it keeps one, and land the new weight (its ``weight_update`` rule)."""
    cols = t.param.shape[1]
    if (factor is not None) != bool(cfg.factor_rank):
        raise ValueError(f"write_step: a momentum of factor_rank {cfg.factor_rank} is stored "
                         f"{'with its new factor' if cfg.factor_rank else 'without a factor'}")
    if factor is not None:
        t.row_factor.copy_(factor[0])
        t.col_factor.copy_(factor[1])
    store_momentum(cfg, t, stored)
    stride = cols if t.sr_row_stride is None else t.sr_row_stride
    land_weight(t.param, t.extra, p, p_new, cfg.weight_update, (t.sr_base, stride, t.sr_key, step_key(hyper.step)))


def muon_step_reference(cfg: MuonConfig, t: MuonTensor, grad: torch.Tensor, hyper: MuonHyper,
                        guarded: bool = True) -> bool:
    """Step one whole matrix in place. ``guarded``: where the new momentum or weight (or
    what would be stored of the momentum beside its factor) would hold an inf/nan, write
    nothing (momentum, factor, weight) and return False (the caller names the parameter);
    else write all and return True."""
    m, u = momentum_and_input(cfg, t, grad, hyper)
    o = newton_schulz(u, hyper.ns_steps, hyper.ns_coefficients)
    p, p_new = new_weight(cfg, t, o, hyper, tuple(t.param.shape))
    factor = new_factor(t.col_factor, m) if cfg.factor_rank else None
    stored = momentum_to_store(m, factor)
    if guarded and not bool(finite(m, p_new) if factor is None else finite(m, p_new, stored)):
        return False
    write_step(cfg, t, stored, p, p_new, hyper, factor)
    return True
