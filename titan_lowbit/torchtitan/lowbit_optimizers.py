"""What both torchtitan lines share about titan_lowbit's optimizers inside torchtitan's
optimizer container: telling them apart from torch's, their state bytes, and one
container step that settles every optimizer's non-finite checks before any steps.

No torchtitan import: the 0.2 builder (``optimizer_builder``) and the 0.3 container
(``v03``) both use this module.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

FP32_ADAMW_STATE_BYTES = 8.0
# torch's optimizer names, which torchtitan builds itself on both lines (titan_lowbit steps
# them only where an option torch's lack asks for LowBitAdamW with fp32 states).
TORCH_OPTIMIZERS = ("Adam", "AdamW")


def is_lowbit(optimizer) -> bool:
    """Whether ``optimizer`` is titan_lowbit's LowBitAdamW (told by its interface, so that
    runs with torch's Adam/AdamW never import titan_lowbit.optim)."""
    return hasattr(optimizer, "state_bytes_per_param")


def is_muon(optimizer) -> bool:
    """Whether ``optimizer`` is titan_lowbit's LowBitMuon (told by its interface)."""
    return is_lowbit(optimizer) and hasattr(optimizer, "muon_params")


def muon_share(optimizer) -> str:
    """What a LowBitMuon steps with which part, for the start-up lines: its Muon matrices
    (count, share of its elements) and the parameters of its inner AdamW."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    muon = optimizer.muon_params()
    share = sum(p.numel() for p in muon) / max(sum(p.numel() for p in params), 1)
    return (f"Muon momentum for {len(muon)} matri{'ces' if len(muon) != 1 else 'x'} ({share:.1%} of the "
            f"elements), AdamW moments for the other {len(params) - len(muon)} params")


def check_muon_skip(optimizers: list[torch.optim.Optimizer], where: Callable[[int], str]) -> None:
    """Refuse ``nonfinite_grad="skip"`` for a LowBitMuon in a container of several
    optimizers: its skip decides over its own gradients in its own step, after the
    container's other optimizers may have stepped; a skip must hold for all of them."""
    if len(optimizers) < 2:
        return
    for i, opt in enumerate(optimizers):
        if is_muon(opt) and opt.nonfinite_grad == "skip":
            raise ValueError(
                f"{where(i)}: nonfinite_grad = 'skip' with Muon beside other optimizers in one container: "
                "Muon decides its skip over its own gradients in its own step, after the others may have "
                "stepped. Give the Muon name every parameter (its inner AdamW steps the ones Muon does not "
                "suit), or use nonfinite_grad = 'raise'.")


def state_bytes_per_param(optimizers: Iterable[torch.optim.Optimizer]) -> float:
    """Optimizer-state bytes per trainable parameter element, over all optimizers."""
    total_bytes = total_numel = 0.0
    for opt in optimizers:
        numel = sum(p.numel() for g in opt.param_groups for p in g["params"])
        if is_lowbit(opt):
            total_bytes += opt.state_bytes_per_param() * numel
        else:  # torch Adam/AdamW: exp_avg and exp_avg_sq in the parameter's dtype
            total_bytes += sum(
                2 * p.numel() * p.element_size() for g in opt.param_groups for p in g["params"]
            )
        total_numel += numel
    return total_bytes / max(total_numel, 1)


def settled_step(optimizers: list[torch.optim.Optimizer], step_all: Callable[[], None],
                 where: Callable[[int], str], what: str) -> None:
    """Step every optimizer of a container through ``step_all``, after settling the
    non-finite checks of all titan_lowbit optimizers among them.

    A container steps its optimizers one after another (one per model part under
    pipeline parallelism; one per optimizer name of the param groups on torchtitan 0.3),
    so a raise in the second, or a skip of it alone, would leave the first stepped and
    the model out of step with itself. ``raise``: the errors of earlier steps' in-kernel
    checks are raised before anything steps; ``skip``: this step's gradients of every
    titan_lowbit optimizer are checked first, and a non-finite one skips the step of
    every optimizer of the container (torch's too), counted by each titan_lowbit one.
    ``where(i)`` names optimizer ``i`` in messages, ``what`` (plural) all of them.

    A LowBitMuon takes part through its inner AdamW (``adamw``: the raise of an earlier
    step's in-kernel check); its Muon matrices raise in its own step, after stepping the
    rest, as LowBitMuon alone does. ``skip`` with a LowBitMuon among several optimizers
    is refused where the container is built (:func:`check_muon_skip`)."""
    lowbit = [(i, opt.adamw if is_muon(opt) else opt) for i, opt in enumerate(optimizers) if is_lowbit(opt)]
    lowbit = [(i, opt) for i, opt in lowbit if opt is not None]
    if len(optimizers) < 2 or not lowbit:
        step_all()
        return
    for i, opt in lowbit:
        try:
            opt.raise_pending_nonfinite()
        except FloatingPointError as e:
            raise FloatingPointError(f"{where(i)}: {e}; none of the {what} took this step") from None
    found = [(i, opt.find_nonfinite_grad()) for i, opt in lowbit]
    bad = [(i, name) for i, name in found if name is not None]
    if bad:
        i, name = bad[0]
        at = f"param '{name}' of {where(i)}" if name else "a parameter on another rank"
        for _, opt in lowbit:
            opt.count_skipped_step(at)
        return
    for _, opt in lowbit:
        opt.grads_checked = True
    try:
        step_all()
    finally:  # an optimizer that raised before its step left its flag set
        for _, opt in lowbit:
            opt.grads_checked = False
