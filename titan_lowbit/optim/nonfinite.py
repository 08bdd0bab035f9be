"""The non-finite check of ``nonfinite_grad="raise"`` (and the backstop of ``"skip"``), done
inside the step's kernels: nothing non-finite is written into a weight or a state.

Why deferred: deciding before a step whether any gradient holds an inf/nan costs one more
read of every gradient and a host sync (the ``"skip"`` policy still does that, because it
must skip the whole step). The fused kernels instead check each quantization block's new
moments and weight as they compute them and leave a block where one is inf/nan unwritten
(weights, moments, scales, extra state keep their values), so a non-finite value never
reaches the quantized state; they flag its tensor in a small table on the device, with
the kind of what they found (``NonfiniteGuard``: an inf/nan gradient, or an overflowing
update: a finite gradient whose square overflows fp32, a non-finite state or weight). This module copies
that table to the host behind the step's kernels and reads it at a later ``step()`` (or
``state_dict()``, or an explicit check), when the copy has long finished: the error then
names the parameter and the step, without the step ever waiting for the GPU.

Under a distributed run (DTensor parameters) the flags of all ranks are combined with one
small all-reduce queued after the kernels, so every rank raises at the same step.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Optional

import torch

from titan_lowbit.kernels.adamw_interface import AdamWHyper, NonfiniteGuard

# Steps whose flags may still be on their way to the host: the check waits for the older
# ones, so the error comes at most this many steps after the one that saw the inf/nan.
MAX_LAG = 2


@dataclasses.dataclass
class NonfiniteReport:
    """A step that met an inf/nan: ``indices`` (the flag indices of this rank's tensors
    where it did; empty if only another rank's did), the optimizer step number, and
    ``overflow``: the flag indices among them where the gradient was finite but the update
    was not (a square that overflows fp32, a non-finite state or weight)."""

    step: int
    indices: list[int]
    overflow: list[int] = dataclasses.field(default_factory=list)


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
            mine = [(f.abs() == self._tag).any() for f in (self._flags[d] for d in self._used)]
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
            mine = [int(i) for f in entry.flags for i in (f.abs() == entry.tag).nonzero().flatten()]
            over = [int(i) for f in entry.flags for i in (f == -entry.tag).nonzero().flatten()]
            bad = mine or (entry.world is not None and int(entry.world[0]) > 0)
            self._spare.append(entry)
            if bad:
                return NonfiniteReport(entry.step, sorted(set(mine)), sorted(set(over)))
        return None


# ---------------------------------------------------------------------------------------
# "skip": the check before the step, and what an error or a skip says
# ---------------------------------------------------------------------------------------
# The largest |g| whose square is finite in fp32 is just below 2**64 ((2**64)**2 = 2**128
# overflows, the float below it squares to a finite value): the one condition under which a
# finite gradient and finite state give a non-finite second moment.
SQUARE_OVERFLOW = 2.0**64
FOUND_GRAD, FOUND_SQUARE = 1, 2
_FOUND = {
    FOUND_GRAD: "non-finite gradient (inf/nan)",
    FOUND_SQUARE: "a finite gradient whose square overflows fp32 (|g| >= 2**64)",
}


def precheck_launch(grads: list[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """Launch the ``"skip"`` policy's check (no host sync yet): per device, one fused
    max-abs pass over the gradients, and per gradient a code: 0 (fine), FOUND_GRAD or
    FOUND_SQUARE. These are what makes a step from a valid state write an inf/nan: a state
    is checked when it is loaded (``state_dict.py``) and the kernels never write a
    non-finite one, so the check reads no state. A state damaged in memory is left to the
    kernels' guard, which raises: skipping steps would not repair it."""
    by_device: dict[torch.device, list[int]] = {}
    for i, g in enumerate(grads):
        by_device.setdefault(g.device, []).append(i)
    out = []
    for idx in by_device.values():
        idx[:] = [i for i in idx if grads[i].numel()]  # empty shards: nothing to check
        if not idx:
            continue
        g = torch.stack(torch._foreach_norm([grads[i] for i in idx], float("inf"), dtype=torch.float32))
        code = torch.where(g.isfinite(), torch.where(g < SQUARE_OVERFLOW, 0, FOUND_SQUARE), FOUND_GRAD)
        out.append((idx, code))
    return out


def precheck_result(flags: list[tuple[list[int], torch.Tensor]]) -> Optional[tuple[int, str]]:
    """(gradient index, what was found) of the first flagged gradient of
    ``precheck_launch``'s flags, or None (the host sync of the check)."""
    for idx, code in flags:
        host = code.cpu()
        if bool(host.any()):
            j = int(host.nonzero()[0])
            return idx[j], _FOUND[int(host[j])]
    return None


# fp32's largest finite number: an update past it is inf
FLOAT32_MAX = torch.finfo(torch.float32).max


def hyperparameter_overflow(hyper: AdamWHyper, decoupled: bool, weight_absmax: float) -> Optional[str]:
    """What in ``hyper`` (Python floats; ``step``: the step that overflowed) makes the update
    of a weight whose largest magnitude is ``weight_absmax`` overflow fp32, in the order the
    kernel computes it, or None if the hyperparameters cannot. An Adam step moves a weight
    by at most about ``lr * max(1, (1 - beta1) / sqrt(1 - beta2))`` (the first step by
    ``lr`` exactly), whatever the gradient's size."""
    lr, wd = abs(hyper.lr), abs(hyper.weight_decay)  # maximize negates both
    step_size = lr / (1.0 - hyper.beta1**hyper.step)
    if step_size > FLOAT32_MAX:
        return (f"lr={lr:g} makes the step size lr / (1 - beta1**{hyper.step}) = {step_size:.3g}, more than "
                f"fp32's largest number ({FLOAT32_MAX:.3g}): lower lr")
    if decoupled and (lr * wd > FLOAT32_MAX or abs(1.0 - lr * wd) * weight_absmax > FLOAT32_MAX):
        return (f"lr * weight_decay = {lr * wd:.3g} scales weights of up to {weight_absmax:.3g} by "
                f"1 - lr * weight_decay, past fp32's largest number ({FLOAT32_MAX:.3g}): lower lr or weight_decay")
    if not decoupled and wd * weight_absmax >= SQUARE_OVERFLOW:
        return (f"weight_decay={wd:g} adds up to weight_decay * |w| = {wd * weight_absmax:.3g} to the gradient "
                "(decoupled_weight_decay=False), whose square overflows fp32: lower weight_decay")
    bound = max(1.0, (1.0 - hyper.beta1) / math.sqrt(1.0 - hyper.beta2))
    decayed = abs(1.0 - lr * wd) * weight_absmax if decoupled else weight_absmax
    if lr * bound + decayed > FLOAT32_MAX:
        return (f"lr={lr:g}: an Adam step moves a weight by up to about {bound:.2g} x lr, which with weights of "
                f"up to {weight_absmax:.3g} passes fp32's largest number ({FLOAT32_MAX:.3g}): lower lr")
    return None


def describe(overflow: bool, state: dict[str, torch.Tensor], weight: torch.Tensor, hyper: AdamWHyper,
             decoupled: bool) -> str:
    """What an in-kernel flag found, for the error: a non-finite entry of a parameter's
    ``state`` or ``weight`` (local tensors; the flagged blocks were left as they were, so
    it is still there), else the kernel's kind (``overflow``: the first moment was finite,
    the second moment or the weight not), blaming the hyperparameters (``hyper``, the
    parameter's group's as Python floats, at the flagged step) where they overflow the
    update whatever the gradient."""
    for key, val in state.items():
        if key != "step" and val.is_floating_point() and not bool(val.float().isfinite().all()):
            return f"a non-finite optimizer state '{key}' (inf/nan)"
    if not bool(weight.float().isfinite().all()):
        return "a non-finite weight (inf/nan)"
    if overflow:
        cause = hyperparameter_overflow(hyper, decoupled, float(weight.detach().abs().max()) if weight.numel() else 0.0)
        if cause is not None:
            return f"an update that overflows: {cause}"
        return f"an update that overflows: {_FOUND[FOUND_SQUARE]} (or eps=0 with a zero gradient and moment)"
    return _FOUND[FOUND_GRAD]
