"""``LowBitAdamW``: one AdamW for every state format and BF16 weight-update rule.

The optimizer is a drop-in ``torch.optim.Optimizer``. It owns the *front end*: parameter
groups, validation with errors that name the parameter, eager state creation with the
parameter's DTensor placements, the non-finite-gradient policy, and grouping of tensors
into launch *families*. The math runs in ``titan_lowbit.kernels.adamw_lowbit``: the fused
Triton kernel on CUDA, its op-for-op PyTorch reference elsewhere.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import operator
from typing import Any, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor, Shard

from titan_lowbit.kernels.adamw_interface import (
    UPDATE_NEAREST,
    WEIGHT_UPDATES,
    AdamWConfig,
    AdamWHyper,
    AdamWTensor,
)
from titan_lowbit.kernels.adamw_lowbit import MAX_TENSORS_PER_LAUNCH, FusedAdamW
from titan_lowbit.kernels.adamw_lowbit_ref import adamw_step_reference
from titan_lowbit.kernels.quant_maps import is_block_size, tensor_key

from .formats import STATE_FORMATS, StateFormat, block_of, param_format
from .hyperparams import check_one_value, hyper_value, shown
from .nonfinite import DeferredNonfiniteCheck, describe, precheck_launch, precheck_result
from .second_moment import restore_second_moments
from .state_dict import (
    EntrySpec,
    check_kind,
    check_step,
    check_structure,
    find_value_problems,
    value_error,
)
from .torch_flags import TORCH_FLAGS, check_torch_flags, with_torch_defaults

logger = logging.getLogger(__name__)

SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16)
_ARENA_ALIGN = 128  # bytes: every state tensor starts on a vector- and cache-line boundary
NONFINITE_POLICIES = ("raise", "skip", "ignore")
# Group options fixed once a group's states exist: they set the states' layout, or the kernel
# configuration cached in the step plan. The hyperparameters (lr, betas, eps, weight_decay)
# may change at any time (LR schedulers do) and are restored from a loaded state dict.
# maximize: the stored first moment is that of the gradient as given (see torch_flags).
FIXED_OPTIONS = ("state_format", "block_size", "weight_update", "min_quantized_numel", "decoupled_weight_decay",
                 "maximize")
# The optimizer's count of skipped steps (nonfinite_grad="skip"), kept in every param group
# so that torch.save and torch.distributed.checkpoint (which saves group keys, not extra
# attributes) carry it.
SKIPPED = "skipped_steps"
# The FIXED_OPTIONS titan_lowbit.optim.convert_state_dict converts between (the layout of
# the states), and the call the refusals name for it.
CONVERTIBLE_OPTIONS = ("state_format", "block_size", "weight_update", "min_quantized_numel")
CONVERT_CALL = "optimizer.load_state_dict(titan_lowbit.optim.convert_state_dict(state_dict, to=optimizer))"


def _fixed_value(group: dict[str, Any], key: str) -> Any:
    """A FIXED_OPTIONS value as it acts on the math: block_size 0 is the format's default."""
    if key == "block_size" and group.get("state_format") in STATE_FORMATS:
        return block_of(group["state_format"], group[key])
    return group[key]


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_GRAD, _DTYPE, _LAYOUT, _SHAPE = (operator.attrgetter(a) for a in ("grad", "dtype", "layout", "shape"))
_NONES = itertools.repeat(None)  # compared with a list by operator.is_not in one C-level map
_LOCAL_TENSOR, _SPEC, _PLACEMENTS = (operator.attrgetter(a) for a in ("_local_tensor", "_spec", "placements"))
# How a step plan's parameters reach their local tensors: "plain" (tensors or Parameters,
# their own local tensor), "dtensor" (DTensors over plain local shards: FSDP2, TP) or
# "other" (anything else, e.g. BitNet's wrapper subclass: per parameter through _local).
PLAIN, DTENSOR, OTHER = "plain", "dtensor", "other"


def _param_kind(params: list[torch.Tensor]) -> str:
    if all(type(p) in _PLAIN_TYPES for p in params):
        return PLAIN
    if all(type(p) is DTensor and type(p._local_tensor) is torch.Tensor for p in params):
        return DTENSOR
    return OTHER


def _all_type(tensors: list, cls: type) -> bool:
    """Every element is exactly of type ``cls`` (one C-level map)."""
    return all(map(operator.is_, map(type, tensors), itertools.repeat(cls)))


def _local_ptrs(tensors: list[torch.Tensor], kind: str) -> list[int]:
    """``_local(t).data_ptr()`` of every tensor (checked for every parameter at every step),
    through C-level maps where the step plan's ``kind`` allows (DTensors: if their local
    shards are still plain tensors)."""
    if kind == PLAIN:
        return list(map(torch.Tensor.data_ptr, tensors))
    if kind == DTENSOR:
        local = list(map(_LOCAL_TENSOR, tensors))
        if _all_type(local, torch.Tensor):
            return list(map(torch.Tensor.data_ptr, local))
    return [_local(t).data_ptr() for t in tensors]


def _picker(positions: list[int]):
    """``lambda xs: [xs[i] for i in positions]`` as one C-level ``itemgetter`` call."""
    if len(positions) == 1:
        i = positions[0]
        return lambda xs: [xs[i]]
    get = operator.itemgetter(*positions)
    return lambda xs: list(get(xs))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain local tensor the kernels update in place: a DTensor's local shard (without
    the overhead of ``to_local()``), and inside it the one inner tensor of a wrapper
    subclass (e.g. BitNet's training weight, whose own ``data_ptr()`` is 0)."""
    if type(t) in _PLAIN_TYPES:  # the common case, checked for every parameter at every step
        return t
    if isinstance(t, DTensor):
        t = t._local_tensor
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        if len(inner) != 1:
            raise TypeError(f"LowBitAdamW cannot update a {type(t).__name__} holding "
                            f"{len(inner)} tensors; it needs one plain tensor per parameter")
        t = getattr(t, inner[0])
    return t


def _is_distributed(params: list[torch.Tensor]) -> bool:
    """Whether a step's non-finite decision must be shared by all ranks: DTensor
    parameters in a process group of several ranks (every rank must take the same one)."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1 and any(isinstance(p, DTensor) for p in params))


def _require_state_dict(state_dict: Any) -> None:
    if not (isinstance(state_dict, dict) and "state" in state_dict and "param_groups" in state_dict):
        raise ValueError("LowBitAdamW.load_state_dict needs an optimizer state dict with 'state' and "
                         "'param_groups' (from LowBitAdamW.state_dict())")


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


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
        self._plans: dict[tuple, list[FusedAdamW]] = {}
        # The step counts of all parameters live in one CPU tensor; each state["step"] is a
        # 0-d view of it, so a step bumps them all with one op (rebuilt with the step plan).
        self._steps_buf: Optional[torch.Tensor] = None
        self._step_plan: Optional[_StepPlan] = None
        # Launch shape of the fused kernel (FusedAdamW's elems_per_program, num_warps, maxnreg);
        # empty = the kernel's tuned defaults. For benchmarks and tuning only.
        self.launch_options: dict[str, int] = {}
        self._fixed: list[tuple] = []  # each group's FIXED_OPTIONS values when it was added
        # bf16 parameters whose fp32 master weights are taken at their first step (see _take_masters)
        self._master_pending: set[torch.Tensor] = set()
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
    _CACHES = {"_plans": dict, "_step_plan": lambda: None, "_steps_buf": lambda: None,
               "_deferred": DeferredNonfiniteCheck}

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
            self._check_group(group, f"param group {gi}")
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
                self._check_param(p, group)
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

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
            check_one_value(where, "lr", lr)  # the kernels read it on its device: no host sync here
        elif not (0 <= hyper_value(where, "lr", lr) < math.inf):
            raise ValueError(f"{where}: lr={shown(lr)} is invalid; use a finite lr >= 0")
        betas = group["betas"]
        if (not hasattr(betas, "__len__") or len(betas) != 2
                or not all(0.0 <= hyper_value(where, "betas", b) < 1.0 for b in betas)):
            raise ValueError(f"{where}: betas={betas!r}; each beta must lie in [0, 1)")
        if not hyper_value(where, "eps", group["eps"]) >= 0:
            raise ValueError(f"{where}: eps={shown(group['eps'])}; use eps >= 0")
        wd = hyper_value(where, "weight_decay", group["weight_decay"])
        if not (wd >= 0 and math.isfinite(wd)):
            raise ValueError(f"{where}: weight_decay={shown(group['weight_decay'])}; use a finite weight_decay >= 0")
        if group["state_format"] not in STATE_FORMATS:
            raise ValueError(f"{where}: state_format={group['state_format']!r}; choose one of {list(STATE_FORMATS)}")
        if group["weight_update"] not in WEIGHT_UPDATES:
            raise ValueError(f"{where}: weight_update={group['weight_update']!r}; choose one of {list(WEIGHT_UPDATES)}")
        bs = group["block_size"]
        if not is_block_size(bs):
            raise ValueError(f"{where}: block_size={bs!r}; use 0 (the format's default) or a power of two >= 2")
        if not isinstance(group["min_quantized_numel"], int) or group["min_quantized_numel"] < 0:
            raise ValueError(f"{where}: min_quantized_numel={group['min_quantized_numel']!r}; use an int >= 0")
        check_torch_flags(group, where)
        skipped = group.get(SKIPPED, 0)
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise ValueError(f"{where}: {SKIPPED}={skipped!r}; the count of skipped steps is an int >= 0")

    def _format(self, p: torch.Tensor, group: dict[str, Any]) -> tuple[StateFormat, int]:
        """The effective state format and block size of a parameter."""
        return param_format(p, group)

    def _check_param(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        name = self._name(p)
        if p.is_complex():
            raise TypeError(f"param '{name}' is complex ({p.dtype}); LowBitAdamW steps real parameters only: "
                            "view it as real (torch.view_as_real) or use torch.optim.AdamW for it")
        if not p.is_floating_point():
            raise TypeError(f"param '{name}' has integer dtype {p.dtype}; only float32/bfloat16 parameters "
                            "can be optimized: exclude it from the optimizer")
        if p.dtype not in SUPPORTED_PARAM_DTYPES:
            raise TypeError(f"param '{name}' has dtype {p.dtype}; LowBitAdamW holds float32 or bfloat16 "
                            "parameters: cast the model to one of them")
        if p.is_sparse or (isinstance(p, DTensor) and p._local_tensor.is_sparse):
            raise TypeError(f"param '{name}' is sparse; LowBitAdamW needs dense parameters")
        if not _local(p).is_contiguous():
            raise ValueError(f"param '{name}' is not contiguous; LowBitAdamW updates parameters in place "
                             "and needs contiguous storage: call .contiguous() on it before building the optimizer")
        fmt, block = self._format(p, group)
        if isinstance(p, DTensor) and fmt.quantized and p.dim() >= 1:
            cols = p.shape[-1]
            shards = 1
            for mesh_dim, pl in enumerate(p.placements):
                if isinstance(pl, Shard) and pl.dim in (-1, p.dim() - 1):
                    shards *= p.device_mesh.size(mesh_dim)
            if shards > 1 and cols % (block * shards):
                fits = [b for b in (256, 128, 64, 32, 16, 8, 4, 2) if cols % (b * shards) == 0]
                hint = (f"set block_size={fits[0]} (it divides {cols} / {shards} shards)" if fits else
                        "shard another dimension, or use state_format='fp32'/'bf16' for it")
                raise ValueError(
                    f"param '{name}' ({tuple(p.shape)}) is sharded {shards} ways along its last dimension, which "
                    f"splits its {fmt.name} quantization blocks of {block}: {hint}")

    def _state_specs(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, tuple]:
        """State tensor name -> (local shape, dtype, global shape) of one parameter."""
        fmt, block = self._format(p, group)
        local = _local(p)
        shapes = fmt.state_shapes(tuple(local.shape), block)
        gshapes = fmt.state_shapes(tuple(p.shape), block)
        specs = {k: (shape, dtype, gshapes[k][0]) for k, (shape, dtype) in shapes.items()}
        if p.dtype == torch.bfloat16 and group["weight_update"] == "master":
            specs["master"] = (tuple(local.shape), torch.float32, tuple(p.shape))
        elif p.dtype == torch.bfloat16 and group["weight_update"] == "kahan":
            specs["kahan_comp"] = (tuple(local.shape), torch.bfloat16, tuple(p.shape))
        elif p.dtype == torch.bfloat16 and group["weight_update"] == "master_remainder":
            specs["master_remainder"] = (tuple(local.shape), torch.int16, tuple(p.shape))
        return specs

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
            dev = _local(p).device
            for key, (shape, dtype, gshape) in self._state_specs(p, group).items():
                align = max(1, _ARENA_ALIGN // dtype.itemsize)
                start = -(-used.get((dev, dtype), 0) // align) * align
                used[(dev, dtype)] = start + math.prod(shape)
                layout.append((p, key, shape, dtype, gshape, start))
        arenas = {(dev, dtype): torch.zeros(max(n, 1), dtype=dtype, device=dev) for (dev, dtype), n in used.items()}
        for p, key, shape, dtype, gshape, start in layout:
            arena = arenas[(_local(p).device, dtype)]
            local = arena[start:start + math.prod(shape)].view(shape)
            if key == "master":
                local.copy_(_local(p).detach())
                self._master_pending.add(p)
            self.state[p][key] = self._wrap(p, local, gshape)
        for p in todo:
            self.state[p]["step"] = torch.tensor(0.0)

    @staticmethod
    def _wrap(p: torch.Tensor, local: torch.Tensor, global_shape: tuple[int, ...]) -> torch.Tensor:
        if not isinstance(p, DTensor):
            return local
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape))

    def state_bytes_per_param(self) -> float:
        """Optimizer-state bytes per parameter element (local shards; ``step`` excluded)."""
        nbytes = numel = 0
        for group in self.param_groups:
            for p in group["params"]:
                numel += _local(p).numel()
                for key, val in self.state[p].items():
                    if key != "step" and isinstance(val, torch.Tensor):
                        loc = _local(val)
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
            _require_state_dict(state_dict)
        loaded: list = []
        before = (self.state, self.param_groups, self._master_pending)

        def check(_, checked_dict: dict[str, Any]) -> dict[str, Any]:
            loaded.extend(self._check_loadable(checked_dict))
            return {**checked_dict, "state": {}}

        def load(_) -> None:
            try:  # torch replaced the groups, never changed them: put them back
                self._load(before[0], loaded)
            except BaseException:
                self.state, self.param_groups, self._master_pending = before
                raise

        hooks = (self.register_load_state_dict_pre_hook(check),
                 self.register_load_state_dict_post_hook(load, prepend=True))
        try:
            super().load_state_dict(state_dict)
        finally:
            for hook in hooks:
                hook.remove()

    def _check_loadable(self, state_dict: dict[str, Any]) -> list[tuple[torch.Tensor, dict[str, torch.Tensor], float]]:
        """Raise, before anything changes, when ``state_dict`` does not fit this optimizer;
        else (parameter, its loaded state tensors, its step) for every parameter."""
        _require_state_dict(state_dict)
        saved = state_dict["param_groups"]
        sizes = [len(g.get("params", ())) for g in saved]
        if sizes != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"the state dict has param groups of {sizes} parameters, this optimizer of "
                             f"{[len(g['params']) for g in self.param_groups]}: build the optimizer with the "
                             "param groups the state dict was saved with")
        for gi, (s, g) in enumerate(zip(saved, self.param_groups)):
            missing = [k for k in self.defaults if k not in s and k not in TORCH_FLAGS]
            if missing:
                raise ValueError(f"param group {gi} of the state dict has no {missing}: it was not saved by "
                                 "LowBitAdamW (torch.optim.AdamW's?). Load a LowBitAdamW state dict, start "
                                 "the optimizer state afresh (load the model weights only), or convert a "
                                 f"torch Adam/AdamW state dict explicitly: {CONVERT_CALL}")
            s = with_torch_defaults(s)
            for k in FIXED_OPTIONS:
                if _fixed_value(s, k) != _fixed_value(g, k):
                    raise ValueError(
                        f"{self._group_desc(gi)}: the state dict was saved with {k}={s[k]!r}, this optimizer "
                        f"was built with {k}={g[k]!r} (torch would silently go on with the saved one). Build "
                        f"the optimizer with {k}={s[k]!r} to resume it, or start the optimizer state afresh"
                        + (f", or convert the states into this optimizer's layout: {CONVERT_CALL}"
                           if k in CONVERTIBLE_OPTIONS else ""))
            self._check_group({**g, **s}, f"param group {gi} of the state dict")
        known = {i for g in saved for i in g["params"]}
        unknown = [k for k in state_dict["state"] if k not in known]
        if unknown:
            raise ValueError(f"the state dict holds state for parameter ids {unknown[:5]} that no param group "
                             "lists; it is damaged or not an optimizer state dict")
        loaded, checks, where = [], [], []
        for s, group in zip(saved, self.param_groups):
            for key, p in zip(s["params"], group["params"]):
                name, state = self._name(p), state_dict["state"].get(key)
                if not state:  # LowBitAdamW saves every parameter's state (made at construction)
                    raise ValueError(
                        f"param '{name}': the state dict holds no optimizer state for it, so it "
                        "would restart from zero moments (and its master weight from the bf16 value) while "
                        "the others resume: the state dict is incomplete or not this optimizer's. Load a "
                        "complete one, or start the optimizer state afresh")
                specs = self._entry_specs(p, group)
                fmt, block = self._format(p, group)
                sharded = next((v for v in self.state[p].values() if isinstance(v, DTensor)), None)
                check_structure(name, state, specs, sharded,
                                f"state_format={fmt.name!r}, block {block}, weight_update={group['weight_update']!r}")
                step = check_step(name, state["step"])
                for k, spec in specs.items():
                    checks.append((state[k], spec))
                    where.append((name, k))
                loaded.append((p, {k: state[k] for k in specs}, step))
        params = [p for g in self.param_groups for p in g["params"]]
        for (name, k), (_, spec), bad in zip(where, checks, find_value_problems(checks, _is_distributed(params))):
            if bad:
                raise value_error(name, k, spec)
        return loaded

    def _entry_specs(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, EntrySpec]:
        """What each state tensor of ``p`` must be, for checking a loaded state."""
        fmt, _ = self._format(p, group)
        codecs = {"exp_avg_codes": fmt.m_codec, "exp_avg_sq_codes": fmt.v_codec}
        return {k: EntrySpec(gshape, shape, dtype, check_kind(k), codecs.get(k, 0))
                for k, (shape, dtype, gshape) in self._state_specs(p, group).items()}

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
                dst, src = _local(own[key]), _local(value)
                if dst.data_ptr() != src.data_ptr() or dst.device != src.device:  # DCP loads in place
                    dst.copy_(src)
            own["step"] = torch.tensor(step)
            self._master_pending.discard(p)  # a loaded master is kept
        restore_second_moments((self._name(p), self._format(p, g)[0], {k: _local(v) for k, v in self.state[p].items()
                                if isinstance(v, torch.Tensor)}) for g in self.param_groups for p in g["params"])
        self._deferred.clear()  # the loaded state replaces what any unread step did
        self._plans.clear()
        self._step_plan = None

    # ------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------
    def _check_grad(self, p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        name = self._name(p)
        if g.is_sparse or (isinstance(g, DTensor) and g._local_tensor.is_sparse):
            raise RuntimeError(f"param '{name}' has a sparse gradient; LowBitAdamW needs dense gradients "
                               "(e.g. nn.Embedding(sparse=False))")
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            # Tensor parallel can leave a gradient Replicate/Partial where its parameter is
            # Shard (e.g. a row-wise parallel embedding); the update needs the param's shard.
            g = g.redistribute(p.device_mesh, p.placements)
        lg = _local(g)
        if lg.dtype not in SUPPORTED_PARAM_DTYPES:
            raise TypeError(f"param '{name}' has a {lg.dtype} gradient; use float32 or bfloat16 gradients")
        if lg.shape != _local(p).shape:
            raise ValueError(f"param '{name}': gradient shape {tuple(lg.shape)} != parameter shape "
                             f"{tuple(_local(p).shape)}")
        return lg if lg.is_contiguous() else lg.contiguous()

    def _nonfinite_param(self, plan: "_StepPlan",
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
            if self._use_fused(_local(fam.params[0])):
                work.append((fam, hyper, guard, self._fused_launches(fam, fam_grads, plan.kind), None))
            else:
                for p in fam.params:
                    self._check_state_fits(p, group)
                work.append((fam, hyper, guard, None,
                             ([self._kernel_tensor(p, fam.cfg) for p in fam.params], fam_grads)))

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
            self._steps_buf.add_(1.0)
        else:
            self._steps_buf.index_add_(0, plan.step_index, torch.ones(len(plan.params)))
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
                             {k: _local(v) for k, v in self.state[p].items() if isinstance(v, torch.Tensor)},
                             _local(p), hyper, bool(group["decoupled_weight_decay"]))
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

    def _checked_plan(self) -> tuple[Optional["_StepPlan"], list]:
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
            plan = self._step_plan = self._build_step_plan(with_grad)
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
            self._check_group(group, f"param group {gi}")
            fixed = tuple(group[k] for k in FIXED_OPTIONS)
            if fixed != self._fixed[gi]:
                k, was, now = next((k, a, b) for k, a, b in zip(FIXED_OPTIONS, self._fixed[gi], fixed) if a != b)
                raise ValueError(f"{self._group_desc(gi)}: {k} was changed from {was!r} to {now!r} after the "
                                 "group's optimizer states were created, which fixed it; set it back, or build "
                                 f"a new optimizer with {k}={now!r}")

    def _take_masters(self, params: list[torch.Tensor]) -> None:
        """Copy the parameters into their fp32 master weights at their first step, not at
        construction: weights loaded after the optimizer was built (a model-only checkpoint,
        pretrained weights) would otherwise be overwritten by the stale copy. A master loaded
        from a state dict is kept (load_state_dict takes it off the pending set)."""
        for p in params:
            if p in self._master_pending:
                _local(self.state[p]["master"]).copy_(_local(p))
                self._master_pending.discard(p)

    def _build_step_plan(self, with_grad: list[torch.Tensor]) -> "_StepPlan":
        """Validate the gradients fully and group the parameters into launch families.
        Rebuilt only when the set of parameters with gradients changes (or on load)."""
        grads = [self._check_grad(p) for p in with_grad]
        group_of = {p: gi for gi, group in enumerate(self.param_groups) for p in group["params"]}
        for p in with_grad:
            self._check_state_fits(p, self.param_groups[group_of[p]])
        all_params = [p for group in self.param_groups for p in group["params"]]
        position = {p: i for i, p in enumerate(all_params)}
        steps = [float(self.state[p]["step"]) for p in all_params]
        self._steps_buf = torch.tensor(steps, dtype=torch.float32)
        for i, p in enumerate(all_params):
            self.state[p]["step"] = self._steps_buf[i]
        families: dict[tuple, _Family] = {}
        for i, (p, g) in enumerate(zip(with_grad, grads)):
            if not g.numel():
                continue  # an empty parameter or local shard (FSDP2): nothing to update; its step still counts
            gi = group_of[p]
            key = (gi, self._kernel_config(p, g, gi), _local(p).device, int(steps[position[p]]))
            fam = families.setdefault(key, _Family(gi, key[1], key[3], [], [], device=key[2]))
            fam.index.append(i)
            fam.params.append(p)
        for fam in families.values():
            fam.pick = _picker(fam.index)
        return _StepPlan(
            params=list(with_grad),
            expect=[(g.dtype, g.shape) for g in grads],
            families=list(families.values()),
            all_params=len(with_grad) == len(all_params),
            step_index=torch.tensor([position[p] for p in with_grad], dtype=torch.int64),
        )

    @staticmethod
    def _use_fused(t: torch.Tensor) -> bool:
        """The fused Triton kernel runs on CUDA tensors; the PyTorch reference elsewhere."""
        return t.is_cuda

    def _kernel_config(self, p: torch.Tensor, grad: torch.Tensor, gi: int) -> AdamWConfig:
        group = self.param_groups[gi]
        fmt, block = self._format(p, group)
        update = WEIGHT_UPDATES[group["weight_update"]] if p.dtype == torch.bfloat16 else UPDATE_NEAREST
        return AdamWConfig(m_codec=fmt.m_codec, v_codec=fmt.v_codec, state_bf16=fmt.plain_dtype == torch.bfloat16,
                           block=block, weight_update=update, decoupled=bool(group["decoupled_weight_decay"]),
                           param_dtype=p.dtype, grad_dtype=grad.dtype)

    def _fused_launches(self, fam: "_Family", grads: list[torch.Tensor], kind: str) -> list[FusedAdamW]:
        """The cached plans of a family, pointed at this step's gradients, ready to launch
        (built on first use, and again whenever the set of parameters with gradients or
        the gradients' alignment changes). ``kind``: how the step plan's parameters reach
        their local tensors (``_StepPlan.kind``)."""
        if fam.launches is None:
            fam.launches, fam.launches_param_ptrs = self._plans.get(
                (fam.group, fam.cfg, tuple(map(id, fam.params))), (None, None))
        if fam.launches is not None and _local_ptrs(fam.params, kind) != fam.launches_param_ptrs:
            fam.launches = None  # a parameter's storage was replaced (p.data = ...): rebuild
        if fam.launches is not None:
            if all(pl.point_at(pick(grads)) for pl, pick in fam.launches):
                return [pl for pl, _ in fam.launches]
        cfg = fam.cfg
        for p in fam.params:  # a parameter's storage may have been replaced by one of another shape
            self._check_state_fits(p, self.param_groups[fam.group])
        tensors = [self._kernel_tensor(p, cfg) for p in fam.params]
        variants: dict[tuple[bool, bool], list[int]] = {}
        elems = self.launch_options.get("elems_per_program")
        for i, t in enumerate(tensors):
            variants.setdefault(FusedAdamW.variant(cfg, t, grads[i], elems), []).append(i)
        chunks = [sel[c:c + MAX_TENSORS_PER_LAUNCH]
                  for sel in variants.values() for c in range(0, len(sel), MAX_TENSORS_PER_LAUNCH)]
        fam.launches = [(FusedAdamW(cfg, [tensors[i] for i in sel], **self.launch_options), _picker(sel))
                        for sel in chunks]
        fam.launches_param_ptrs = _local_ptrs(fam.params, kind)
        self._plans[(fam.group, cfg, tuple(map(id, fam.params)))] = (fam.launches, fam.launches_param_ptrs)
        for pl, pick in fam.launches:
            if not pl.point_at(pick(grads)):
                raise RuntimeError("LowBitAdamW: a launch plan built for these gradients does not fit them")
        return [pl for pl, _ in fam.launches]

    def _check_state_fits(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        """Refuse a parameter whose local shape, dtype or device no longer fits its state
        (``p.data`` replaced, a shard resized): its state would be read under another
        layout. Called before any parameter of the step is updated."""
        state, local = self.state[p], _local(p)
        specs = self._state_specs(p, group)
        have = {k: (tuple(_local(v).shape), _local(v).dtype, _local(v).device) for k, v in state.items() if k != "step"}
        want = {k: (shape, dtype, local.device) for k, (shape, dtype, _) in specs.items()}
        if have != want:
            raise ValueError(
                f"param '{self._name(p)}' is now {p.dtype} of (local) shape {tuple(local.shape)} on {local.device}, "
                f"which its optimizer state does not fit (it holds {have}, this parameter needs {want}): the "
                "parameter's shape, dtype or device changed after its state was made. No parameter was "
                "stepped. Build a new optimizer for the changed model (or load a state dict saved for it)")

    def _kernel_tensor(self, p: torch.Tensor, cfg: AdamWConfig) -> AdamWTensor:
        """The kernel's view of one parameter: local buffers and the [rows, cols] layout."""
        state = self.state[p]
        local = _local(p)
        cols_sharded = isinstance(p, DTensor) and any(
            isinstance(pl, Shard) and pl.dim in (-1, p.dim() - 1) for pl in p.placements)
        if cfg.m_codec or cols_sharded:
            cols = local.shape[-1] if local.dim() else 1
            rows = local.numel() // max(cols, 1)
        else:  # plain formats: one flat row
            rows, cols = 1, local.numel()
        sr_base, sr_row_stride = self._global_index(p, rows, cols)
        if cfg.m_codec:
            m, v = _local(state["exp_avg_codes"]), _local(state["exp_avg_sq_codes"])
            if m.dtype != torch.uint8:
                m, v = m.view(torch.uint8), v.view(torch.uint8)
            ms, vs = _local(state["exp_avg_absmax"]), _local(state["exp_avg_sq_absmax"])
        else:
            m, v, ms, vs = _local(state["exp_avg"]), _local(state["exp_avg_sq"]), None, None
        extra = state.get("master", state.get("kahan_comp", state.get("master_remainder")))
        return AdamWTensor(param=local, exp_avg=m, exp_avg_sq=v, exp_avg_scale=ms, exp_avg_sq_scale=vs,
                           extra=None if extra is None else _local(extra), rows=rows, cols=cols,
                           sr_base=sr_base, sr_row_stride=sr_row_stride,
                           sr_key=tensor_key(self.seed, self._order[p]), flag_index=self._order[p])

    @staticmethod
    def _global_index(p: torch.Tensor, rows: int, cols: int) -> tuple[int, int]:
        """(base, row stride) of the global element index used by stochastic rounding.

        For plain tensors, Replicate, Shard(0) and Shard(last dim) placements (and their
        combinations) the index is the element's position in the *global* parameter, so
        stochastic rounding is the same function of the global tensor however it is
        sharded. Other layouts (a middle dimension sharded, FSDP2+TP strided sharding of
        dim 0) use the shard's global offset plus the local index: reproducible for a fixed
        layout, but a different random stream after resharding.
        """
        if not isinstance(p, DTensor):
            return 0, cols
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        gshape = tuple(p.shape)
        lshape, offset = compute_local_shape_and_global_offset(gshape, p.device_mesh, p.placements)
        gstride = _contiguous_stride(gshape)
        simple = (all(type(pl).__name__ in ("Shard", "Replicate") for pl in p.placements)
                  and tuple(lshape[1:-1]) == gshape[1:-1])
        if not simple or len(gshape) == 0:
            return sum(o * s for o, s in zip(offset, gstride)), cols
        return sum(o * s for o, s in zip(offset, gstride)), gshape[-1]


@dataclasses.dataclass
class _Family:
    """Parameters stepped by one kernel configuration (one or a few launches)."""

    group: int
    cfg: AdamWConfig
    step: int  # the family's step count before this step (bias correction, SR key)
    index: list[int]  # positions in the step plan's parameter list
    params: list[torch.Tensor]
    launches: Optional[list] = None  # [(FusedAdamW, _picker of its positions in params)], built on first use
    launches_param_ptrs: Optional[list[int]] = None  # parameter storage the launches point at
    pick: Any = None  # _picker(index), set once index is complete
    device: Optional[torch.device] = None  # where the family's local tensors live


@dataclasses.dataclass
class _StepPlan:
    """What a step does for one set of parameters with gradients, computed once.

    Per step only the cheap guards in ``local_grads`` run; anything unexpected (a gradient of
    another dtype, shape or layout) goes through the full validation with its errors.
    """

    params: list[torch.Tensor]
    expect: list[tuple[torch.dtype, torch.Size]]
    families: list[_Family]
    all_params: bool
    step_index: torch.Tensor

    def __post_init__(self) -> None:
        # For the fast paths of local_grads and the launches' pointer checks: how the
        # parameters reach their local tensors, and what their gradients must look like,
        # as lists compared in one go.
        self.kind = _param_kind(self.params)
        self.dtypes = [dtype for dtype, _ in self.expect]
        self.shapes = [shape for _, shape in self.expect]
        self.layouts = [torch.strided] * len(self.params)
        self.distributed = _is_distributed(self.params)

    def same_params(self, with_grad: list[torch.Tensor]) -> bool:
        return len(with_grad) == len(self.params) and all(map(operator.is_, with_grad, self.params))

    def local_grads(self, opt: "LowBitAdamW", grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The local gradients the kernels read, from ``grads`` (the ``.grad`` of
        ``self.params``, as ``_checked_plan`` read them): checked cheaply against what the
        plan was built for, fully (with the errors) where anything differs."""
        # The common cases in one pass per property, each a C-level map (the loop below,
        # which runs if anything does not match, took about 30% more of a step's host time
        # for plain tensors, about twice as much for DTensors): plain gradients, or DTensor
        # gradients placed like their DTensor parameters, whose local shards are then
        # checked as plain ones.
        local = None
        if self.kind == PLAIN:
            local = grads
        elif self.kind == DTENSOR and _all_type(grads, DTensor) and (
                # FSDP2 builds each gradient on its parameter's spec object: identity first
                all(map(operator.is_, map(_SPEC, grads), map(_SPEC, self.params)))
                or list(map(_PLACEMENTS, grads)) == list(map(_PLACEMENTS, self.params))):
            local = list(map(_LOCAL_TENSOR, grads))
        if local is not None and (
                list(map(_DTYPE, local)) == self.dtypes and list(map(_LAYOUT, local)) == self.layouts
                and list(map(_SHAPE, local)) == self.shapes and all(map(torch.Tensor.is_contiguous, local))):
            return local
        out = []
        strided = torch.strided
        for p, g, (dtype, shape) in zip(self.params, grads, self.expect):
            if type(g) is DTensor:
                if g.placements != p.placements:
                    out.append(opt._check_grad(p))
                    continue
                g = g._local_tensor
            if g.dtype is not dtype or g.layout is not strided or g.shape != shape or not g.is_contiguous():
                raise_or_local = opt._check_grad(p)
                opt._check_state_fits(p, next(gr for gr in opt.param_groups if any(q is p for q in gr["params"])))
                if raise_or_local.dtype is not dtype:
                    raise TypeError(f"param '{opt._name(p)}': gradient dtype changed from {dtype} to "
                                    f"{raise_or_local.dtype} between steps; keep one gradient dtype")
                out.append(raise_or_local)
                continue
            out.append(g)
        return out
