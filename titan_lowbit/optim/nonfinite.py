"""The non-finite gradient check of ``nonfinite_grad="raise"``, done inside the step's kernels.

Why deferred: deciding before a step whether any gradient holds an inf/nan costs one more
read of every gradient and a host sync (the ``"skip"`` policy still does that, because it
must skip the whole step). The fused kernels instead check each quantization block's
gradient as they load it and leave a block that holds an inf/nan unwritten (weights,
moments, scales, extra state keep their values), so a non-finite value never reaches the
quantized state; they flag its tensor in a small table on the device. This module copies
that table to the host behind the step's kernels and reads it at a later ``step()`` (or
``state_dict()``, or an explicit check), when the copy has long finished: the error then
names the parameter and the step, without the step ever waiting for the GPU.

Under a distributed run (DTensor parameters) the flags of all ranks are combined with one
small all-reduce queued after the kernels, so every rank raises at the same step.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import torch

from titan_lowbit.kernels.adamw_lowbit import NonfiniteGuard

# Steps whose flags may still be on their way to the host: the check waits for the older
# ones, so the error comes at most this many steps after the one that saw the inf/nan.
MAX_LAG = 2


@dataclasses.dataclass
class NonfiniteReport:
    """A step with inf/nan gradients: ``indices`` (the flag indices of this rank's tensors
    that held one; empty if only another rank's did) and the optimizer step number."""

    step: int
    indices: list[int]


@dataclasses.dataclass
class _Pending:
    step: int
    tag: int
    flags: list[torch.Tensor]  # host copies of each device's flags
    world: Optional[torch.Tensor]  # host copy of the all-reduced "any rank flagged", or None
    done: Optional[torch.cuda.Event]  # recorded after the copies (None: already on the host)
    shapes: list  # (shape, on a GPU) of the sources the buffers were made for


class DeferredNonfiniteCheck:
    """Flags per device, a new tag per step, and the steps whose flags were not read yet."""

    def __init__(self) -> None:
        self._flags: dict[torch.device, torch.Tensor] = {}
        self._tag = 0
        self._used: list[torch.device] = []
        self._pending: collections.deque[_Pending] = collections.deque()
        self._spare: list[_Pending] = []  # read entries whose host buffers and event are reused

    def begin_step(self) -> None:
        self._tag = self._tag + 1 if self._tag < 2**31 - 1 else 1
        self._used = []

    def guard(self, device: torch.device, size: int) -> NonfiniteGuard:
        """This step's guard for the kernels on ``device`` (flag indices below ``size``)."""
        flags = self._flags.get(device)
        if flags is None or flags.numel() < size:
            flags = self._flags[device] = torch.zeros(size, dtype=torch.int32, device=device)
        if device not in self._used:
            self._used.append(device)
        return NonfiniteGuard(flags, self._tag)

    def end_step(self, step: int, distributed: bool) -> None:
        """Queue this step's flags for the host (and, distributed, combine all ranks')."""
        if not self._used and not distributed:
            return
        world = None
        if distributed:
            import torch.distributed as dist

            if dist.get_backend() == "gloo":
                dev = torch.device("cpu")
            elif self._used:
                dev = self._used[0]
            else:  # every local shard empty: nothing flagged here, but the collective is shared
                dev = torch.device("cuda", torch.cuda.current_device())
            mine = [(f == self._tag).any() for f in (self._flags[d] for d in self._used)]
            world = torch.stack(mine).any().to(device=dev, dtype=torch.int32).reshape(1) if mine \
                else torch.zeros(1, dtype=torch.int32, device=dev)
            dist.all_reduce(world, op=dist.ReduceOp.MAX)
        srcs = [self._flags[d] for d in self._used] + ([world] if world is not None else [])
        entry = self._reuse(srcs, world is not None)
        for dst, src in zip(entry.flags + ([entry.world] if world is not None else []), srcs):
            dst.copy_(src, non_blocking=src.is_cuda)
        if entry.done is not None:
            entry.done.record()
        entry.step, entry.tag = step, self._tag
        self._pending.append(entry)

    def _reuse(self, srcs: list[torch.Tensor], with_world: bool) -> _Pending:
        """A spare entry whose host buffers fit ``srcs`` (pinned where a source is on a
        GPU, so the copies do not wait for it), or a new one."""
        shapes = [(t.shape, t.is_cuda) for t in srcs]
        for i, e in enumerate(self._spare):
            if e.shapes == shapes:
                return self._spare.pop(i)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in srcs]
        world = host.pop() if with_world else None
        done = torch.cuda.Event() if any(t.is_cuda for t in srcs) else None
        return _Pending(0, 0, host, world, done, shapes)

    def pending(self) -> int:
        return len(self._pending)

    def clear(self) -> None:
        self._spare.extend(self._pending)
        self._pending.clear()

    def collect(self, wait: bool) -> Optional[NonfiniteReport]:
        """The first pending step that had an inf/nan gradient, if any; steps read are
        dropped. Reads those whose copies finished, and waits for all but the last
        ``MAX_LAG - 1`` (all with ``wait``)."""
        while self._pending:
            entry = self._pending[0]
            if entry.done is not None and not entry.done.query():
                if not wait and len(self._pending) < MAX_LAG:
                    return None
                entry.done.synchronize()
            self._pending.popleft()
            mine = [int(i) for f in entry.flags for i in (f == entry.tag).nonzero().flatten()]
            bad = mine or (entry.world is not None and int(entry.world[0]) > 0)
            self._spare.append(entry)
            if bad:
                return NonfiniteReport(entry.step, sorted(set(mine)))
        return None
