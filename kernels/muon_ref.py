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

This is the only implementation so far (no fused Triton kernel yet): it runs on any
device, in the same ops on the GPU as on the CPU.
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


@dataclasses.dataclass
class MuonTensor:
    """One matrix and its state: plain local tensors."""

    param: torch.Tensor  # [rows, cols]
    momentum: torch.Tensor  # plain [rows, cols], or codes (4-bit: [rows, ceil(cols / 2)])
    momentum_scale: Optional[torch.Tensor]  # fp32 [rows, ceil(cols / block)] absmax, or None
    extra: Optional[torch.Tensor]  # the weight update's state (master, remainder, Kahan), or None
    sr_key: int = 0  # stochastic rounding: the tensor's key (its global index is row * cols + col)


@dataclasses.dataclass
class MuonHyper:
    lr: float
    momentum: float
    weight_decay: float
    ns_steps: int
    ns_coefficients: tuple[float, float, float]
    matched_rms: float
    step: int  # 1 on the first step


def load_momentum(cfg: MuonConfig, t: MuonTensor) -> torch.Tensor:
    """The momentum in fp32, ``[rows, cols]``."""
    rows, cols = t.param.shape
    if cfg.codec == CODEC_NONE:
        return t.momentum.to(torch.float32)
    return dequantize_blockwise(t.momentum, t.momentum_scale, cfg.codec, cfg.block, cols)


def store_momentum(cfg: MuonConfig, t: MuonTensor, m: torch.Tensor) -> None:
    if cfg.codec == CODEC_NONE:
        t.momentum.copy_(bf16_rne(m) if cfg.state_bf16 else m)
        return
    codes, absmax = quantize_blockwise(m, cfg.codec, cfg.block)
    t.momentum.copy_(codes)
    t.momentum_scale.copy_(absmax)


def muon_step_reference(cfg: MuonConfig, t: MuonTensor, grad: torch.Tensor, hyper: MuonHyper,
                        guarded: bool = True) -> bool:
    """Step one matrix in place. ``guarded``: where the new momentum or weight would hold
    an inf/nan, write neither and return False (the caller names the parameter); else
    write both and return True."""
    rows, cols = t.param.shape
    g = grad.to(torch.float32)
    p = weight_fp32(t.param, t.extra, cfg.weight_update, rows, cols)
    m = load_momentum(cfg, t).lerp(g, 1.0 - hyper.momentum)
    u = g.lerp(m, hyper.momentum) if cfg.nesterov else m
    o = newton_schulz(u, hyper.ns_steps, hyper.ns_coefficients).to(torch.float32)
    step_size = hyper.lr * update_scale(rows, cols, hyper.matched_rms)
    p_new = p * (1.0 - hyper.lr * hyper.weight_decay) - step_size * o
    if guarded and not bool(torch.isfinite(m).all() & torch.isfinite(p_new).all()):
        return False
    store_momentum(cfg, t, m)
    land_weight(t.param, t.extra, p, p_new, cfg.weight_update, (0, cols, t.sr_key, step_key(hyper.step)))
    return True
