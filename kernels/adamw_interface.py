"""The host-side interface of the fused AdamW step: what a launch is compiled for, one
tensor's view, the per-step hyperparameters, the non-finite guard's flags, and the ids of
the weight-update rules. Plain torch: the Triton kernel (``adamw_lowbit.py``) and its
pure-PyTorch twin (``adamw_lowbit_ref.py``) both take these, and the reference imports
no Triton through them."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .quant_maps import step_key

# Weight-update ids (compile-time constants in the kernel).
UPDATE_NEAREST = 0
UPDATE_STOCHASTIC = 1
UPDATE_KAHAN = 2
UPDATE_MASTER = 3
UPDATE_MASTER_REMAINDER = 4
WEIGHT_UPDATES = {"nearest": UPDATE_NEAREST, "stochastic": UPDATE_STOCHASTIC,
                  "kahan": UPDATE_KAHAN, "master": UPDATE_MASTER,
                  "master_remainder": UPDATE_MASTER_REMAINDER}


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
    extra: Optional[torch.Tensor]  # fp32 master weights, int16 remainders, bf16 Kahan compensation, or None
    rows: int
    cols: int
    sr_base: int = 0  # global index of local element (r, c) = sr_base + r * sr_row_stride + c
    sr_row_stride: int = 0
    sr_key: int = 0
    flag_index: int = 0  # the tensor's entry in a NonfiniteGuard's flags


@dataclasses.dataclass
class NonfiniteGuard:
    """The step's check that it writes nothing non-finite, done on values the kernel
    computes anyway (no extra read, no host sync): a quantization block where a new first
    or second moment or weight would be inf/nan is not written (its weights, moments,
    absmax and extra state keep their values), and its tensor is flagged:
    ``flags[t.flag_index] = tag`` where the new first moment is not finite (an inf/nan
    gradient, or a non-finite first-moment state), ``-tag`` where it is finite but the
    second moment or the weight is not (a finite gradient whose square overflows fp32,
    ``|g| >= 2**64``; a non-finite second-moment state or weight; ``0 / 0`` with eps 0). A
    new tag per step, so the flags need no clearing: the caller reads them when it likes
    and compares their absolute value with the tag."""

    flags: torch.Tensor  # int32, on the tensors' device, one entry per flag_index
    tag: int  # 1 <= tag < 2**31


@dataclasses.dataclass
class AdamWHyper:
    lr: "float | torch.Tensor"
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # 1 on the first step


def hyper_scalars(h: AdamWHyper) -> dict:
    """The per-step scalars both kernel and reference use (fp32 on device). All Python
    floats, so an int hyperparameter (``weight_decay=0``) does not make Triton type the
    argument as an integer: the kernel's signature stays the same from step to step."""
    beta1, beta2 = float(h.beta1), float(h.beta2)
    return dict(
        inv_bc1=1.0 / (1.0 - beta1**h.step),
        inv_sqrt_bc2=1.0 / (1.0 - beta2**h.step) ** 0.5,
        beta1=beta1, one_minus_beta1=1.0 - beta1,
        beta2=beta2, one_minus_beta2=1.0 - beta2,
        eps=float(h.eps), wd=float(h.weight_decay), skey=step_key(h.step),
    )
