"""The types a hyperparameter (``lr``, ``betas``, ``eps``, ``weight_decay``) may have.

``torch.optim.AdamW`` takes any real number: a Python float or int, a NumPy scalar (an LR
scheduler whose lambda returns ``np.float32`` writes one into the param group at every
step), or a one-element tensor. ``LowBitAdamW`` takes the same, and reads each as a Python
float where the kernels need a scalar (``kernels.adamw_interface.hyper_scalars``), at every
step, so a value a scheduler writes later is read like the first. An ``lr`` tensor on a
GPU stays there: the fused kernel reads it on the device, without a host sync.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

ACCEPTED = "a float, an int, a NumPy scalar or a one-element tensor"


def check_one_value(where: str, key: str, value: torch.Tensor) -> None:
    """Refuse a hyperparameter tensor that is not one real number (without reading it)."""
    if value.numel() != 1 or value.is_complex():
        raise ValueError(f"{where}: {key} is a {value.dtype} tensor of shape {tuple(value.shape)}; a tensor "
                         "hyperparameter must hold one real number")


def hyper_value(where: str, key: str, value: Any) -> float:
    """``value`` as a Python float, or a ``ValueError`` naming ``key`` when it is not a
    real number of a type torch's AdamW takes (a tensor is read: a host sync on a GPU)."""
    if type(value) is float or type(value) is int:  # the common case, checked at every step
        return float(value)
    if isinstance(value, torch.Tensor):
        check_one_value(where, key, value)
        return float(value.item())
    if isinstance(value, numbers.Real):  # bool, NumPy scalars, fractions, ...
        return float(value)
    raise ValueError(f"{where}: {key}={value!r} is a {type(value).__name__}; use a number ({ACCEPTED})")


def shown(value: Any) -> str:
    """A hyperparameter as an error shows it: a one-element tensor by its number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return repr(value.item())
    return repr(value)
