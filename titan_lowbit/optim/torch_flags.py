"""The flags of ``torch.optim.AdamW`` that ``LowBitAdamW`` takes, so that it drops in for it.

Every flag is accepted, as a constructor keyword and as a param-group key, at torch's
default value, and is kept in every param group as torch keeps it. A value other than the
default is either supported (``maximize``) or refused with a ``ValueError`` that says what
to use instead: never accepted and ignored.

``maximize`` costs nothing: the step runs with ``-lr`` and ``-weight_decay``, which is
Adam on the negated gradient exactly (the parameter update is the same bits; the stored
first moment is that of the gradient as given, the negation of torch's ``exp_avg``).
Because the stored moment depends on it, ``maximize`` is fixed once a group's states
exist, like the state layout.
"""

from __future__ import annotations

from typing import Any

# flag -> torch.optim.AdamW's default
TORCH_FLAGS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}

_INSTEAD = {
    "amsgrad": "LowBitAdamW has no AMSGrad variant (it would need a third state, the running maximum of the "
               "second moment); use torch.optim.AdamW(amsgrad=True) for it, or amsgrad=False",
    "foreach": "LowBitAdamW always steps all parameters with its own multi-tensor kernel (fused Triton on "
               "CUDA, its PyTorch reference elsewhere); leave foreach=None",
    "fused": "LowBitAdamW always steps all parameters with its own multi-tensor kernel (fused Triton on "
             "CUDA, its PyTorch reference elsewhere); leave fused=None",
    "capturable": "LowBitAdamW's step is not CUDA-graph capturable (its step counts live on the host); "
                  "leave capturable=False, or use torch.optim.AdamW(capturable=True)",
    "differentiable": "LowBitAdamW's step is not differentiable (its states are quantized); leave "
                      "differentiable=False, or use torch.optim.AdamW(differentiable=True)",
}


def check_torch_flags(group: dict[str, Any], where: str) -> None:
    """Refuse a param group whose torch flag has a value LowBitAdamW does not implement."""
    maximize = group.get("maximize", False)
    if not isinstance(maximize, bool):
        raise ValueError(f"{where}: maximize={maximize!r}; use True or False")
    for flag, instead in _INSTEAD.items():
        value, default = group.get(flag, TORCH_FLAGS[flag]), TORCH_FLAGS[flag]
        if (value is not None) if default is None else (value is None or bool(value)):
            raise ValueError(f"{where}: {flag}={value!r} is not supported: {instead}")


def with_torch_defaults(group: dict[str, Any]) -> dict[str, Any]:
    """A saved param group with torch's defaults for the flags it lacks (a state dict saved
    before LowBitAdamW kept them, as torch fills them in for its own old state dicts)."""
    return {**TORCH_FLAGS, **group}
