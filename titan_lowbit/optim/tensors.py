"""The plain local tensors behind a parameter or a state: what the kernels update in place.

A parameter may be a plain tensor, a DTensor (FSDP2, TP: its local shard) or a wrapper
subclass (BitNet's training weight: its one inner tensor); its states are plain tensors or
DTensors placed like it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Placement

PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain local tensor the kernels update in place: a DTensor's local shard (without
    the overhead of ``to_local()``), and inside it the data of a wrapper subclass: its one
    inner tensor (e.g. BitNet's training weight, whose own ``data_ptr()`` is 0), or, where the
    wrapper carries more (torchao's float8 weight with a precomputed scale), the one inner
    tensor of the wrapper's own shape and dtype."""
    if type(t) in PLAIN_TYPES:  # the common case, checked for every parameter at every step
        return t
    if isinstance(t, DTensor):
        t = t._local_tensor
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, n) for n in names]
        if len(inner) > 1:
            inner = [x for x in inner if x.shape == t.shape and x.dtype == t.dtype]
        if len(inner) != 1:
            raise TypeError(f"LowBitAdamW cannot update a {type(t).__name__} holding the tensors "
                            f"{names}: it needs one inner tensor of the parameter's shape "
                            f"{tuple(t.shape)} and dtype {t.dtype}, the weight it updates in place")
        t = inner[0]
    return t


def is_distributed(params: list[torch.Tensor]) -> bool:
    """Whether a step's non-finite decision must be shared by all ranks: DTensor
    parameters in a process group of several ranks (every rank must take the same one)."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1 and any(isinstance(p, DTensor) for p in params))


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def like_param(p: torch.Tensor, local_state: torch.Tensor, global_shape: tuple[int, ...],
               placements: Optional[tuple[Placement, ...]] = None) -> torch.Tensor:
    """A state tensor placed like parameter ``p``: ``local_state`` itself, or a DTensor with
    ``p``'s mesh and placements (or ``placements`` on that mesh) over it."""
    if not isinstance(p, DTensor):
        return local_state
    return DTensor.from_local(local_state, p.device_mesh, p.placements if placements is None else placements,
                              run_check=False, shape=torch.Size(global_shape), stride=contiguous_stride(global_shape))
