"""``LowBitAdamW``: one AdamW for every state format and BF16 weight-update rule.

The optimizer is a drop-in ``torch.optim.Optimizer``. It owns the *front end*: parameter
groups (their options and checks: ``group_options``), eager state creation with the
parameter's DTensor placements, state dicts (what a load must pass: ``state_dict``), the
non-finite-gradient policy (``nonfinite``) and the step, which launches what its
``step_plan`` packed. The math runs in ``titan_lowbit.kernels.adamw_lowbit``: the fused
Triton kernel on CUDA, its op-for-op PyTorch reference elsewhere.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from typing import Any, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor

from titan_lowbit.kernels.adamw_interface import WEIGHT_UPDATES, AdamWHyper  # WEIGHT_UPDATES: named here for users
from titan_lowbit.kernels.adamw_lowbit_ref import adamw_step_reference

from .formats import param_format, state_specs
from .group_options import (
    FIXED_OPTIONS,
    NONFINITE_POLICIES,
    SKIPPED,
    check_group,
    check_param,
    checked_local_grad,
)
from .hyperparams import hyper_value
from .master_start import take_start, write_start
from .nonfinite import DeferredNonfiniteCheck, describe, precheck_launch, precheck_result
from .second_moment import restore_second_moments
from .state_dict import check_loadable, load_with_checks, require_state_dict
from .step_plan import StepPlan, build_step_plan, fused_launches, kernel_tensor
from .tensors import like_param, local
from .torch_flags import TORCH_FLAGS

logger = logging.getLogger(__name__)

_ARENA_ALIGN = 128  # bytes: every state tensor starts on a vector- and cache-line boundary
_GRAD = operator.attrgetter("grad")
_NONES = itertools.repeat(None)  # compared with a list by operator.is_not in one C-level map


class LowBitAdamW(torch.optim.Optimizer):
    """AdamW (or Adam with L2, ``decoupled_weight_decay=False``) with low-bit states.

    Args:
        params: parameters, ``(name, parameter)`` pairs (names then appear in every error),
            or parameter groups (dicts); every option below except ``seed`` and
            ``nonfinite_grad`` can be set per group.
        lr: learning rate, a number or a one-element tensor (read on the device, no sync).
        betas, eps, weight_decay: as in ``torch.optim.AdamW``; each hyperparameter may be
            of any type torch takes (NumPy scalars, tensors: see ``hyperparams``).
        state_format: "fp32", "bf16", "8bit" (dynamic tree, block 256), "4bit" (dynamic
            exponent m / linear v, block 128) or "fp8" (e4m3, block 128).
        decoupled_weight_decay: True for AdamW, False for Adam (weight decay added to the
            gradient as L2).
        weight_update: how the fp32 result lands in a bf16 parameter: "nearest",
            "stochastic", "kahan" (bf16 compensation state), "master" (fp32 master weights
            as state) or "master_remainder" (the same fp32 master weights, bit for bit, held
            as the bf16 weight and an int16 remainder state: 2 bytes per element instead of
            4). With both, the weight is the master rounded to nearest with ties away from
            zero, the rounding a remainder can pair with exactly, so the two train bit for
            bit alike. fp32 parameters are always updated exactly.
        block_size: quantization block along the last dimension (power of two); 0 = the
            format's default.
        min_quantized_numel: parameters with fewer elements keep fp32 states.
        seed: key of the stochastic-rounding hash (with step and element index).
        nonfinite_grad: "raise" (default): the kernels check each block's new moments and
            weight as they compute them and leave a block where one would be inf/nan
            unwritten (an inf/nan gradient, a finite one whose square overflows fp32, a
            non-finite state: weight and states keep their values); a later ``step()`` or
            ``state_dict()`` (at most two steps on), or ``check_nonfinite()``, raises naming
            the parameter, what was found and the step, which the rest of the model did
            take. "skip": check all gradients (inf/nan, |g| >= 2**64) first (one more read
            of them and a host sync) and skip the whole step, counted in ``skipped_steps``;
            the kernels' check still guards the rest (a state damaged in memory: it raises). "ignore": no check; non-finite values reach the state.
        amsgrad, maximize, foreach, capturable, differentiable, fused: torch.optim.AdamW's
            flags, accepted at torch's defaults; ``maximize=True`` is supported, any other
            value is refused naming the flag (see ``torch_flags``).

    ``state_dict()`` holds plain tensors (DTensors when the parameters are) that
    ``torch.save`` writes and ``torch.load(weights_only=True)`` reads; ``load_state_dict``
    checks every entry before it changes anything (see ``state_dict``). The count of
    skipped steps is kept in every param group (``"skipped_steps"``) so checkpoints carry it.
    """

    def __init__(self, params: Iterable[Any], lr: "float | torch.Tensor" = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *,
                 state_format: str = "8bit", decoupled_weight_decay: bool = True, weight_update: str = "nearest",
                 block_size: int = 0, min_quantized_numel: int = 4096, seed: int = 0,
                 nonfinite_grad: str = "raise", maximize: bool = False, foreach: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None):
        if nonfinite_grad not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite_grad={nonfinite_grad!r}: choose one of {NONFINITE_POLICIES}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r}: use a non-negative int")
        self.seed = seed
        self.nonfinite_grad = nonfinite_grad
        self._deferred = DeferredNonfiniteCheck()  # nonfinite_grad="raise"
        # Set by a container that ran find_nonfinite_grad on all its optimizers: the next
        # step skips its own check.
        self.grads_checked = False
        self._names: dict[torch.Tensor, str] = {}
        self._order: dict[torch.Tensor, int] = {}
        self._plans: dict[tuple, tuple] = {}  # packed launches per family (step_plan.fused_launches)
        self._step_plan: Optional[StepPlan] = None
        # Launch shape of the fused kernel (FusedAdamW's elems_per_program, num_warps, maxnreg);
        # empty = the kernel's tuned defaults. For benchmarks and tuning only.
        self.launch_options: dict[str, int] = {}
        self._fixed: list[tuple] = []  # each group's FIXED_OPTIONS values when it was added
        # bf16 parameters whose fp32 master weights are taken at their first step (see _take_masters)
        self._master_pending: set[torch.Tensor] = set()
        # fingerprints of the weights whose masters start from given fp32 values (start_masters_from)
        self._master_offered: dict[torch.Tensor, torch.Tensor] = {}
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state_format=state_format,
                        decoupled_weight_decay=decoupled_weight_decay, weight_update=weight_update,
                        block_size=block_size, min_quantized_numel=min_quantized_numel, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable, differentiable=differentiable,
                        fused=fused)
        super().__init__(params, defaults)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient (``nonfinite_grad="skip"``), kept in
        every param group (all hold the same count)."""
        return max((g[SKIPPED] for g in self.param_groups), default=0)

    @skipped_steps.setter
    def skipped_steps(self, count: int) -> None:
        for group in self.param_groups:
            group[SKIPPED] = count

    # Rebuilt by the next step from the state; a copy or pickle leaves them behind.
    _CACHES = {"_plans": dict, "_step_plan": lambda: None, "_deferred": DeferredNonfiniteCheck}

    def __getstate__(self) -> dict[str, Any]:
        """All of this optimizer but its launch caches, so a ``copy.deepcopy`` or a pickle
        steps like the original. torch's Optimizer keeps only defaults, state and
        param_groups: a copy would lose the parameter names, the options fixed when each
        group was added and the master weights still to be taken."""
        own = {k: v for k, v in self.__dict__.items()
               if k not in self._CACHES and not k.startswith("_optimizer_")}  # torch's hooks
        return {**own, **super().__getstate__()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for name, make in self._CACHES.items():
            setattr(self, name, make())

    # ------------------------------------------------------------------------------------
    # groups, validation, state
    # ------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add and validate a group; on any error the optimizer is left as it was (torch
        would keep the bad group, and every later step would fail on it)."""
        gi = len(self.param_groups)
        count = self.skipped_steps
        if isinstance(param_group, dict) and param_group.get(SKIPPED, count) != count:
            raise ValueError(f"param group {gi}: {SKIPPED}={param_group[SKIPPED]!r}, but this optimizer skipped "
                             f"{count} steps; '{SKIPPED}' is the optimizer's own count (load_state_dict "
                             "restores it): remove it from the param group")
        super().add_param_group(param_group)
        group = self.param_groups[gi]
        group[SKIPPED] = count
        try:
            check_group(group, f"param group {gi}")
            names = group.get("param_names")
            seen: set[torch.Tensor] = set()
            for pi, p in enumerate(group["params"]):
                name = names[pi] if names else f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"
                if p in seen:  # torch only warns, and the parameter would be stepped twice per step
                    raise ValueError(f"param '{name}' is listed twice in param group {gi}; list each "
                                     "parameter once")
                seen.add(p)
                self._names[p] = name
                self._order[p] = len(self._order)
                check_param(p, group, name)
            self._init_states(group["params"], group)
        except BaseException:
            del self.param_groups[gi:]
            for p in group["params"]:
                for table in (self._names, self._order, self.state):
                    table.pop(p, None)
                self._master_pending.discard(p)
            raise
        self._fixed.append(tuple(group[k] for k in FIXED_OPTIONS))
        self._plans.clear()
        self._step_plan = None

    def _name(self, p: torch.Tensor) -> str:
        return self._names.get(p, f"parameter of shape {tuple(p.shape)}")

    def _group_desc(self, gi: int) -> str:
        params = self.param_groups[gi]["params"]
        names = [f"'{self._name(p)}'" for p in params[:3]] + (["..."] if len(params) > 3 else [])
        return f"param group {gi} ({len(params)} params: {', '.join(names)})"

    def _init_states(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """Create the group's states now (not at the first step), so a checkpoint can be
        loaded into them before training starts and DCP sees real tensors.

        The state tensors of a group of one dtype on one device are views into ONE zeroed
        buffer (an arena), each starting on a 128-byte boundary: the caching allocator would
        otherwise round many of them up (an 11 MiB tensor gets a 12 MiB block), which costs
        about 0.13 B/param for the 8-bit states of a 1B model -- more than the scales
        themselves. One arena per dtype, so that every state tensor has its storage's dtype
        (``torch.save`` refuses views of one storage in several dtypes), and an arena holds
        nothing but states: a saved state dict writes each arena once, padding included
        (under 128 bytes per state tensor). The kernels address every buffer by its pointer
        difference from the launch's base buffer of the same role, so the arenas need not
        be one allocation.
        """
        todo = [p for p in params if not self.state[p]]
        layout: list[tuple[torch.Tensor, str, tuple, torch.dtype, tuple, int]] = []
        used: dict[tuple[torch.device, torch.dtype], int] = {}  # elements
        for p in todo:
            dev = local(p).device
            for key, (shape, dtype, gshape) in state_specs(p, group).items():
                align = max(1, _ARENA_ALIGN // dtype.itemsize)
                start = -(-used.get((dev, dtype), 0) // align) * align
                used[(dev, dtype)] = start + math.prod(shape)
                layout.append((p, key, shape, dtype, gshape, start))
        arenas = {(dev, dtype): torch.zeros(max(n, 1), dtype=dtype, device=dev) for (dev, dtype), n in used.items()}
        for p, key, shape, dtype, gshape, start in layout:
            arena = arenas[(local(p).device, dtype)]
            view = arena[start:start + math.prod(shape)].view(shape)
            if key == "master":
                view.copy_(local(p).detach())
                self._master_pending.add(p)
            self.state[p][key] = like_param(p, view, gshape)
        for p in todo:
            self.state[p]["step"] = torch.tensor(0.0)

    def state_bytes_per_param(self) -> float:
        """Optimizer-state bytes per parameter element (local shards; ``step`` excluded)."""
        nbytes = numel = 0
        for group in self.param_groups:
            for p in group["params"]:
                numel += local(p).numel()
                for key, val in self.state[p].items():
                    if key != "step" and isinstance(val, torch.Tensor):
                        loc = local(val)
                        nbytes += loc.numel() * loc.element_size()
        return nbytes / max(numel, 1)

    # ------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load like torch, but check everything first, keep every state tensor's dtype,
        and on any error leave the optimizer exactly as it was.

        ``torch.optim.Optimizer.load_state_dict`` copies the saved group options over the
        ones this optimizer was built with, so an 8-bit checkpoint loaded into a 4-bit
        optimizer would silently go on as 8-bit: the FIXED_OPTIONS must match (the
        hyperparameters are restored from the checkpoint, as in torch). Torch also casts
        floating state to the parameter's dtype; our states have their own dtypes (fp32
        scales and master weights next to bf16 parameters). Every parameter's state is
        checked (entries, dtypes, shapes, ``step``, finite values: see ``state_dict``),
        then copied into this optimizer's own state tensors (moved, never cast), which
        keep their arenas; torch.distributed.checkpoint has loaded into those already.

        Torch's own ``load_state_dict`` runs, with its hooks in its order: the check runs
        as the last load pre-hook, on the state dict the user's pre-hooks returned (the
        rest of torch's load then sees it without state, which it would cast), and the
        states are loaded by the first post-hook, so the user's post-hooks see them.
        """
        if not isinstance(state_dict, dict):  # torch's load would fail on it with less to say
            require_state_dict(state_dict)
        loaded: list = []
        before = (self.state, self.param_groups, self._master_pending)

        def restore() -> None:  # torch replaced the groups, never changed them: put them back
            self.state, self.param_groups, self._master_pending = before

        load_with_checks(self, state_dict, lambda sd: loaded.extend(check_loadable(self, sd)),
                         lambda: self._load(before[0], loaded), restore)

    def _load(self, state: dict, loaded: list) -> None:
        """Put this optimizer's ``state`` back in place of the empty one torch's load made,
        with the ``loaded`` values (``_check_loadable``) copied in; the saved groups keep
        the FIXED_OPTIONS as built."""
        self.state = state
        count = max((g.get(SKIPPED, 0) for g in self.param_groups), default=0)
        for group, fixed in zip(self.param_groups, self._fixed):
            # The saved FIXED_OPTIONS act as the built ones (checked), but may be spelled
            # otherwise (block_size 0 for the default): keep the built spelling.
            for k, default in TORCH_FLAGS.items():
                group.setdefault(k, default)
            group.update(zip(FIXED_OPTIONS, fixed))
            group[SKIPPED] = count
        self._master_pending = set(self._master_pending)
        for p, values, step in loaded:
            own = state[p]
            for key, value in values.items():
                dst, src = local(own[key]), local(value)
                if dst.data_ptr() != src.data_ptr() or dst.device != src.device:  # DCP loads in place
                    dst.copy_(src)
            own["step"] = torch.tensor(step)
            self._master_pending.discard(p)  # a loaded master is kept
            self._master_offered.pop(p, None)
        restore_second_moments((self._name(p), param_format(p, g)[0], {k: local(v) for k, v in self.state[p].items()
                                if isinstance(v, torch.Tensor)}) for g in self.param_groups for p in g["params"])
        self._deferred.clear()  # the loaded state replaces what any unread step did
        self._plans.clear()
        self._step_plan = None

    # ------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------
    def _check_grad(self, p: torch.Tensor) -> torch.Tensor:
        return checked_local_grad(p, self._name(p), "LowBitAdamW")

    def _nonfinite_param(self, plan: StepPlan,
                         flags: list[tuple[list[int], torch.Tensor]]) -> tuple[Optional[str], str]:
        """(name of a parameter of ``plan`` whose step would write an inf/nan, '' if only
        another rank has one, None if none has; what was found) (the host sync of the check)."""
        found = precheck_result(flags)
        bad_local = None if found is None else found[0]
        params = plan.params
        if plan.distributed:
            # Every rank must take the same decision, or they step different models.
            device = params[0].device if not isinstance(params[0], DTensor) else params[0]._local_tensor.device
            backend_dev = device if torch.distributed.get_backend() != "gloo" else torch.device("cpu")
            any_bad = torch.tensor([0.0 if bad_local is None else 1.0], device=backend_dev)
            torch.distributed.all_reduce(any_bad, op=torch.distributed.ReduceOp.MAX)
            if bad_local is None and float(any_bad.item()) > 0:
                return "", "non-finite gradient or state"
        return (None, "") if found is None else (self._name(params[bad_local]), found[1])

    # A compiled function that calls step() runs the step eagerly (a graph break): the
    # step's host-side plan, the in-place kernel launches on states that are views of
    # arenas, and its host syncs are nothing Dynamo can trace.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        checked, self.grads_checked = self.grads_checked, False
        self.raise_pending_nonfinite()
        plan, raw_grads = self._checked_plan()
        if plan is None:
            return loss
        grads = plan.local_grads(self, raw_grads)

        # "skip": everything a launch needs is prepared before the non-finite check's host
        # sync (plans, pointer checks, gradient-offset uploads, scalars), so that after the
        # sync only the kernel launches remain: the GPU idles for them alone. (Not when
        # a container of several optimizers checked them all first: grads_checked.)
        check = precheck_launch(grads) if self.nonfinite_grad == "skip" and not checked else None
        guarded = self.nonfinite_grad != "ignore"  # "skip": the kernels' guard catches what its check cannot
        if guarded:
            self._deferred.begin_step()
            nflags = len(self._order)
        work = []
        for fam in plan.families:
            group = self.param_groups[fam.group]
            lr, wd = group["lr"], group["weight_decay"]
            if isinstance(lr, torch.Tensor) and lr.device != fam.device:
                lr = lr.item()  # the fused kernel reads an lr tensor on its own device only
            if group["maximize"]:  # Adam on the negated gradient, exactly (see torch_flags)
                lr, wd = -lr, -wd
            hyper = AdamWHyper(lr=lr, beta1=group["betas"][0], beta2=group["betas"][1],
                               eps=group["eps"], weight_decay=wd, step=fam.step + 1)
            fam_grads = fam.pick(grads)
            guard = self._deferred.guard(fam.device, nflags) if guarded else None
            if self._use_fused(local(fam.params[0])):
                work.append((fam, hyper, guard, fused_launches(self, fam, fam_grads, plan.kind), None))
            else:
                for p in fam.params:
                    self._check_state_fits(p, group)
                work.append((fam, hyper, guard, None,
                             ([kernel_tensor(self, p, fam.cfg) for p in fam.params], fam_grads)))

        if check is not None:
            bad, found = self._nonfinite_param(plan, check)
            if bad is not None:
                self.count_skipped_step((f"param '{bad}'" if bad else "a parameter on another rank") + f" ({found})")
                return loss

        if self._master_pending:
            self._take_masters(plan.params)
        for fam, hyper, guard, launches, reference in work:
            fam.step += 1
            if launches is not None:
                for pl in launches:
                    pl.launch(hyper, guard)
            else:
                adamw_step_reference(fam.cfg, *reference, hyper, guard)
        if guarded:
            self._deferred.end_step(int(self.state[plan.params[0]]["step"]) + 1, plan.distributed)
        # The step counts last: the kernels take theirs from the families (fam.step), and
        # this host-side op then runs while the GPU steps.
        if plan.all_params:
            plan.steps.add_(1.0)
        else:
            plan.steps.index_add_(0, plan.step_index, torch.ones(len(plan.params)))
        return loss

    def check_nonfinite(self) -> None:
        """Wait for the non-finite flags of every step launched so far and raise
        ``FloatingPointError`` naming a parameter whose gradient held an inf/nan
        (``nonfinite_grad="raise"``; ``step()`` and ``state_dict()`` do this on their own)."""
        self._raise_nonfinite(wait=True)

    def raise_pending_nonfinite(self) -> None:
        """The check that starts every ``step()``: raise for an earlier step whose
        in-kernel flags show an inf/nan gradient. Distributed, the previous step's flags
        are read on every rank (long on the host by now), so all ranks raise at the same
        step; alone, only what has arrived (and any older than the previous step). A
        container of several optimizers calls it on all of them before stepping any."""
        if self._deferred.pending():
            self._raise_nonfinite(wait=self._step_plan is not None and self._step_plan.distributed)

    def _raise_nonfinite(self, wait: bool) -> None:
        report = self._deferred.collect(wait)
        if report is None:
            return
        flagged = [(p, i) for p, i in self._order.items() if i in report.indices]
        where = (f"param '{self._name(flagged[0][0])}'" + (f" (and {len(flagged) - 1} more)" if len(flagged) > 1 else "")
                 if flagged else "a parameter on another rank")
        found = "a non-finite gradient or update"
        if flagged:
            p, index = flagged[0]
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            where_group = "the flagged parameter's group"
            hyper = AdamWHyper(lr=hyper_value(where_group, "lr", group["lr"]),
                               beta1=hyper_value(where_group, "betas", group["betas"][0]),
                               beta2=hyper_value(where_group, "betas", group["betas"][1]),
                               eps=hyper_value(where_group, "eps", group["eps"]),
                               weight_decay=hyper_value(where_group, "weight_decay", group["weight_decay"]),
                               step=report.step)
            found = describe(index in report.overflow,
                             {k: local(v) for k, v in self.state[p].items() if isinstance(v, torch.Tensor)},
                             local(p), hyper, bool(group["decoupled_weight_decay"]))
        raise FloatingPointError(
            f"{found} in {where} at optimizer step {report.step}: the blocks of its weight and optimizer "
            "state where that step would have written an inf/nan were left as they were, the rest of "
            "that step was applied. Fix the loss scale / learning rate (or load a good checkpoint) and "
            "resume, or build the optimizer with nonfinite_grad='skip' to skip steps with such gradients")

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, after the pending non-finite checks: a checkpoint is never
        written after a step that met an inf/nan gradient without the error."""
        self._raise_nonfinite(wait=True)
        return super().state_dict()

    def find_nonfinite_grad(self) -> Optional[str]:
        """The step's non-finite check of ``nonfinite_grad="skip"`` alone, for a container
        of several optimizers that must decide for all of them before stepping any (a skip
        of one after another stepped would leave the model parts out of step): the name of
        a parameter with an inf/nan gradient (or one whose square overflows, or a non-finite
        state scale), '' if only another rank has one, None if none has or the policy is
        another."""
        if self.nonfinite_grad != "skip":
            return None
        plan, raw_grads = self._checked_plan()
        if plan is None:
            return None
        return self._nonfinite_param(plan, precheck_launch(plan.local_grads(self, raw_grads)))[0]

    def _checked_plan(self) -> tuple[Optional[StepPlan], list]:
        """The step plan of the parameters that have gradients (None if none has), after
        every group's options were checked, and those parameters' ``.grad`` as read now
        (each read once per step: the common case, every parameter with a gradient and the
        plan's parameters unchanged, runs as three C-level maps)."""
        self._check_groups()
        params = [p for group in self.param_groups for p in group["params"]]
        grads = list(map(_GRAD, params))
        plan = self._step_plan
        if (plan is not None and plan.all_params and plan.same_params(params)
                and all(map(operator.is_not, grads, _NONES))):
            return plan, grads
        with_grad = [p for p, g in zip(params, grads) if g is not None]
        if not with_grad:
            return None, []
        if plan is None or not plan.same_params(with_grad):
            plan = self._step_plan = build_step_plan(self, with_grad)
        return plan, [g for g in grads if g is not None]

    def count_skipped_step(self, where: str) -> None:
        """A step skipped for a non-finite (or overflowing) gradient or a non-finite state
        scale (nonfinite_grad='skip')."""
        self.skipped_steps = self.skipped_steps + 1
        logger.warning(f"LowBitAdamW: skipped a step that would write an inf/nan, in {where} "
                       f"({self.skipped_steps} skipped so far)")

    def _check_groups(self) -> None:
        """Validate every group before a step touches anything: a scheduler or user code may
        have changed one since it was added (a beta of 1 would divide by zero halfway
        through the step, after other groups were updated)."""
        for gi, group in enumerate(self.param_groups):
            check_group(group, f"param group {gi}")
            fixed = tuple(group[k] for k in FIXED_OPTIONS)
            if fixed != self._fixed[gi]:
                k, was, now = next((k, a, b) for k, a, b in zip(FIXED_OPTIONS, self._fixed[gi], fixed) if a != b)
                raise ValueError(f"{self._group_desc(gi)}: {k} was changed from {was!r} to {now!r} after the "
                                 "group's optimizer states were created, which fixed it; set it back, or build "
                                 f"a new optimizer with {k}={now!r}")

    def start_masters_from(self, masters: "dict[torch.Tensor, torch.Tensor]") -> None:
        """Start the fp32 master weights of bf16 parameters (weight_update "master" or
        "master_remainder") from the given fp32 values (local shards), e.g. the fp32
        initialization the bf16 weights were rounded from, instead of from the weights
        themselves: small early updates then move the rounded weights as they move an
        fp32-weight run's bf16 cast (see ``master_start``). Each value must round to its
        parameter's weight (to nearest, ties away from zero). They are kept at the
        parameter's first step only if its weight has not changed since; a state dict
        loaded before then replaces them."""
        for p, master in masters.items():
            if p not in self._names:
                raise ValueError(f"start_masters_from: a parameter of shape {tuple(p.shape)} is not in this "
                                 "optimizer; give master weights only for its own parameters")
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            self._master_offered[p] = write_start(p, group, self.state[p], master, self._name(p))
            self._master_pending.add(p)

    def _take_masters(self, params: list[torch.Tensor]) -> None:
        """Take the parameters' fp32 master weights at their first step, not at
        construction: weights loaded after the optimizer was built (a model-only checkpoint,
        pretrained weights) would otherwise be overwritten by the stale copy. A master loaded
        from a state dict is kept (load_state_dict takes it off the pending set); one given
        to ``start_masters_from`` is kept if the weight is unchanged (``master_start``)."""
        for p in params:
            if p in self._master_pending:
                take_start(p, self.state[p], self._master_offered)
                self._master_pending.discard(p)

    @staticmethod
    def _use_fused(t: torch.Tensor) -> bool:
        """The fused Triton kernel runs on CUDA tensors; the PyTorch reference elsewhere."""
        return t.is_cuda

    def _check_state_fits(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        """Refuse a parameter whose local shape, dtype or device no longer fits its state
        (``p.data`` replaced, a shard resized): its state would be read under another
        layout. Called before any parameter of the step is updated."""
        state, loc = self.state[p], local(p)
        specs = state_specs(p, group)
        have = {k: (tuple(local(v).shape), local(v).dtype, local(v).device) for k, v in state.items() if k != "step"}
        want = {k: (shape, dtype, loc.device) for k, (shape, dtype, _) in specs.items()}
        if have != want:
            raise ValueError(
                f"param '{self._name(p)}' is now {p.dtype} of (local) shape {tuple(loc.shape)} on {loc.device}, "
                f"which its optimizer state does not fit (it holds {have}, this parameter needs {want}): the "
                "parameter's shape, dtype or device changed after its state was made. No parameter was "
                "stepped. Build a new optimizer for the changed model (or load a state dict saved for it)")
