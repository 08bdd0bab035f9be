"""What a step launches, computed once per set of parameters with gradients.

``build_step_plan`` validates the gradients and groups the parameters into launch
*families* (one kernel configuration, group and step count each); a family's parameters
are packed into a few multi-tensor launches of the fused kernel (``fused_launches``,
built on first use and kept across plans), each tensor seen through its [rows, cols]
view (``kernel_tensor``). Per step only cheap guards run (``StepPlan.local_grads``, the
launches' pointer checks), as C-level maps where the parameters allow.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Any, Optional, Protocol

import torch
from torch.distributed.tensor import DTensor, Shard

from titan_lowbit.kernels.adamw_interface import UPDATE_NEAREST, WEIGHT_UPDATES, AdamWConfig, AdamWTensor
from titan_lowbit.kernels.adamw_lowbit import MAX_TENSORS_PER_LAUNCH, FusedAdamW
from titan_lowbit.kernels.quant_maps import tensor_key

from .formats import param_format
from .tensors import PLAIN_TYPES, contiguous_stride, is_distributed, local


class PlanSource(Protocol):
    """What a step plan reads of its optimizer (``LowBitAdamW``): groups and states, each
    parameter's position (its stochastic-rounding key and non-finite flag), the seed, the
    launch options and the cache of packed launches, and the optimizer's checks of a
    gradient and of a parameter against its state (their errors name the parameter)."""

    param_groups: list[dict[str, Any]]
    state: dict[torch.Tensor, dict[str, Any]]
    seed: int
    launch_options: dict[str, int]
    _order: dict[torch.Tensor, int]
    _plans: dict[tuple, tuple]

    def _name(self, p: torch.Tensor) -> str: ...

    def _check_grad(self, p: torch.Tensor) -> torch.Tensor: ...

    def _check_state_fits(self, p: torch.Tensor, group: dict[str, Any]) -> None: ...


_DTYPE, _LAYOUT, _SHAPE = (operator.attrgetter(a) for a in ("dtype", "layout", "shape"))
_LOCAL_TENSOR, _SPEC, _PLACEMENTS = (operator.attrgetter(a) for a in ("_local_tensor", "_spec", "placements"))
# How a step plan's parameters reach their local tensors: "plain" (tensors or Parameters,
# their own local tensor), "dtensor" (DTensors over plain local shards: FSDP2, TP) or
# "other" (anything else, e.g. BitNet's wrapper subclass: per parameter through tensors.local).
PLAIN, DTENSOR, OTHER = "plain", "dtensor", "other"


def param_kind(params: list[torch.Tensor]) -> str:
    if all(type(p) in PLAIN_TYPES for p in params):
        return PLAIN
    if all(type(p) is DTensor and type(p._local_tensor) is torch.Tensor for p in params):
        return DTENSOR
    return OTHER


def all_type(tensors: list, cls: type) -> bool:
    """Every element is exactly of type ``cls`` (one C-level map)."""
    return all(map(operator.is_, map(type, tensors), itertools.repeat(cls)))


def local_ptrs(tensors: list[torch.Tensor], kind: str) -> list[int]:
    """``local(t).data_ptr()`` of every tensor (checked for every parameter at every step),
    through C-level maps where the step plan's ``kind`` allows (DTensors: if their local
    shards are still plain tensors)."""
    if kind == PLAIN:
        return list(map(torch.Tensor.data_ptr, tensors))
    if kind == DTENSOR:
        shards = list(map(_LOCAL_TENSOR, tensors))
        if all_type(shards, torch.Tensor):
            return list(map(torch.Tensor.data_ptr, shards))
    return [local(t).data_ptr() for t in tensors]


def picker(positions: list[int]):
    """``lambda xs: [xs[i] for i in positions]`` as one C-level ``itemgetter`` call."""
    if len(positions) == 1:
        i = positions[0]
        return lambda xs: [xs[i]]
    get = operator.itemgetter(*positions)
    return lambda xs: list(get(xs))


def build_step_plan(opt: PlanSource, with_grad: list[torch.Tensor]) -> StepPlan:
    """Validate the gradients fully and group the parameters into launch families; the
    step counts of all parameters become views of the plan's ``steps``. Rebuilt only when
    the set of parameters with gradients changes (or on load)."""
    grads = [opt._check_grad(p) for p in with_grad]
    group_of = {p: gi for gi, group in enumerate(opt.param_groups) for p in group["params"]}
    for p in with_grad:
        opt._check_state_fits(p, opt.param_groups[group_of[p]])
    all_params = [p for group in opt.param_groups for p in group["params"]]
    position = {p: i for i, p in enumerate(all_params)}
    steps = [float(opt.state[p]["step"]) for p in all_params]
    steps_buf = torch.tensor(steps, dtype=torch.float32)
    for i, p in enumerate(all_params):
        opt.state[p]["step"] = steps_buf[i]
    families: dict[tuple, Family] = {}
    for i, (p, g) in enumerate(zip(with_grad, grads)):
        if not g.numel():
            continue  # an empty parameter or local shard (FSDP2): nothing to update; its step still counts
        gi = group_of[p]
        key = (gi, kernel_config(p, g, opt.param_groups[gi]), local(p).device, int(steps[position[p]]))
        fam = families.setdefault(key, Family(gi, key[1], key[3], [], [], device=key[2]))
        fam.index.append(i)
        fam.params.append(p)
    for fam in families.values():
        fam.pick = picker(fam.index)
    return StepPlan(
        params=list(with_grad),
        expect=[(g.dtype, g.shape) for g in grads],
        families=list(families.values()),
        all_params=len(with_grad) == len(all_params),
        step_index=torch.tensor([position[p] for p in with_grad], dtype=torch.int64),
        steps=steps_buf,
    )


def kernel_config(p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> AdamWConfig:
    """What the kernel is compiled for to step ``p`` of ``group`` with ``grad``."""
    fmt, block = param_format(p, group)
    update = WEIGHT_UPDATES[group["weight_update"]] if p.dtype == torch.bfloat16 else UPDATE_NEAREST
    return AdamWConfig(m_codec=fmt.m_codec, v_codec=fmt.v_codec, state_bf16=fmt.plain_dtype == torch.bfloat16,
                       block=block, weight_update=update, decoupled=bool(group["decoupled_weight_decay"]),
                       param_dtype=p.dtype, grad_dtype=grad.dtype)


def fused_launches(opt: PlanSource, fam: Family, grads: list[torch.Tensor], kind: str) -> list[FusedAdamW]:
    """The cached plans of a family, pointed at this step's gradients, ready to launch
    (built on first use, and again whenever the set of parameters with gradients or
    the gradients' alignment changes). ``kind``: how the step plan's parameters reach
    their local tensors (``StepPlan.kind``)."""
    if fam.launches is None:
        fam.launches, fam.launches_param_ptrs = opt._plans.get(
            (fam.group, fam.cfg, tuple(map(id, fam.params))), (None, None))
    if fam.launches is not None and local_ptrs(fam.params, kind) != fam.launches_param_ptrs:
        fam.launches = None  # a parameter's storage was replaced (p.data = ...): rebuild
    if fam.launches is not None:
        if all(pl.point_at(pick(grads)) for pl, pick in fam.launches):
            return [pl for pl, _ in fam.launches]
    cfg = fam.cfg
    for p in fam.params:  # a parameter's storage may have been replaced by one of another shape
        opt._check_state_fits(p, opt.param_groups[fam.group])
    tensors = [kernel_tensor(opt, p, cfg) for p in fam.params]
    variants: dict[tuple[bool, bool], list[int]] = {}
    elems = opt.launch_options.get("elems_per_program")
    for i, t in enumerate(tensors):
        variants.setdefault(FusedAdamW.variant(cfg, t, grads[i], elems), []).append(i)
    chunks = [sel[c:c + MAX_TENSORS_PER_LAUNCH]
              for sel in variants.values() for c in range(0, len(sel), MAX_TENSORS_PER_LAUNCH)]
    fam.launches = [(FusedAdamW(cfg, [tensors[i] for i in sel], **opt.launch_options), picker(sel))
                    for sel in chunks]
    fam.launches_param_ptrs = local_ptrs(fam.params, kind)
    opt._plans[(fam.group, cfg, tuple(map(id, fam.params)))] = (fam.launches, fam.launches_param_ptrs)
    for pl, pick in fam.launches:
        if not pl.point_at(pick(grads)):
            raise RuntimeError("LowBitAdamW: a launch plan built for these gradients does not fit them")
    return [pl for pl, _ in fam.launches]


def kernel_tensor(opt: PlanSource, p: torch.Tensor, cfg: AdamWConfig) -> AdamWTensor:
    """The kernel's view of one parameter: local buffers and the [rows, cols] layout."""
    state = opt.state[p]
    loc = local(p)
    cols_sharded = isinstance(p, DTensor) and any(
        isinstance(pl, Shard) and pl.dim in (-1, p.dim() - 1) for pl in p.placements)
    if cfg.m_codec or cols_sharded:
        cols = loc.shape[-1] if loc.dim() else 1
        rows = loc.numel() // max(cols, 1)
    else:  # plain formats: one flat row
        rows, cols = 1, loc.numel()
    sr_base, sr_row_stride = global_index(p, rows, cols)
    if cfg.m_codec:
        m, v = local(state["exp_avg_codes"]), local(state["exp_avg_sq_codes"])
        if m.dtype != torch.uint8:
            m, v = m.view(torch.uint8), v.view(torch.uint8)
        ms, vs = local(state["exp_avg_absmax"]), local(state["exp_avg_sq_absmax"])
    else:
        m, v, ms, vs = local(state["exp_avg"]), local(state["exp_avg_sq"]), None, None
    extra = state.get("master", state.get("kahan_comp", state.get("master_remainder")))
    return AdamWTensor(param=loc, exp_avg=m, exp_avg_sq=v, exp_avg_scale=ms, exp_avg_sq_scale=vs,
                       extra=None if extra is None else local(extra), rows=rows, cols=cols,
                       sr_base=sr_base, sr_row_stride=sr_row_stride,
                       sr_key=tensor_key(opt.seed, opt._order[p]), flag_index=opt._order[p])


def global_index(p: torch.Tensor, rows: int, cols: int) -> tuple[int, int]:
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
    gstride = contiguous_stride(gshape)
    simple = (all(type(pl).__name__ in ("Shard", "Replicate") for pl in p.placements)
              and tuple(lshape[1:-1]) == gshape[1:-1])
    if not simple or len(gshape) == 0:
        return sum(o * s for o, s in zip(offset, gstride)), cols
    return sum(o * s for o, s in zip(offset, gstride)), gshape[-1]


@dataclasses.dataclass
class Family:
    """Parameters stepped by one kernel configuration (one or a few launches)."""

    group: int
    cfg: AdamWConfig
    step: int  # the family's step count before this step (bias correction, SR key)
    index: list[int]  # positions in the step plan's parameter list
    params: list[torch.Tensor]
    launches: Optional[list] = None  # [(FusedAdamW, picker of its positions in params)], built on first use
    launches_param_ptrs: Optional[list[int]] = None  # parameter storage the launches point at
    pick: Any = None  # picker(index), set once index is complete
    device: Optional[torch.device] = None  # where the family's local tensors live


@dataclasses.dataclass
class StepPlan:
    """What a step does for one set of parameters with gradients, computed once.

    Per step only the cheap guards in ``local_grads`` run; anything unexpected (a gradient of
    another dtype, shape or layout) goes through the full validation with its errors.
    """

    params: list[torch.Tensor]
    expect: list[tuple[torch.dtype, torch.Size]]
    families: list[Family]
    all_params: bool
    step_index: torch.Tensor  # positions of params among all parameters
    steps: torch.Tensor  # the step count of every parameter (CPU); each state's "step" is a view

    def __post_init__(self) -> None:
        # For the fast paths of local_grads and the launches' pointer checks: how the
        # parameters reach their local tensors, and what their gradients must look like,
        # as lists compared in one go.
        self.kind = param_kind(self.params)
        self.dtypes = [dtype for dtype, _ in self.expect]
        self.shapes = [shape for _, shape in self.expect]
        self.layouts = [torch.strided] * len(self.params)
        self.distributed = is_distributed(self.params)

    def same_params(self, with_grad: list[torch.Tensor]) -> bool:
        return len(with_grad) == len(self.params) and all(map(operator.is_, with_grad, self.params))

    def local_grads(self, opt: PlanSource, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The local gradients the kernels read, from ``grads`` (the ``.grad`` of
        ``self.params``, as ``_checked_plan`` read them): checked cheaply against what the
        plan was built for, fully (with the errors) where anything differs."""
        # The common cases in one pass per property, each a C-level map (the loop below,
        # which runs if anything does not match, took about 30% more of a step's host time
        # for plain tensors, about twice as much for DTensors): plain gradients, or DTensor
        # gradients placed like their DTensor parameters, whose local shards are then
        # checked as plain ones.
        plain = None
        if self.kind == PLAIN:
            plain = grads
        elif self.kind == DTENSOR and all_type(grads, DTensor) and (
                # FSDP2 builds each gradient on its parameter's spec object: identity first
                all(map(operator.is_, map(_SPEC, grads), map(_SPEC, self.params)))
                or list(map(_PLACEMENTS, grads)) == list(map(_PLACEMENTS, self.params))):
            plain = list(map(_LOCAL_TENSOR, grads))
        if plain is not None and (
                list(map(_DTYPE, plain)) == self.dtypes and list(map(_LAYOUT, plain)) == self.layouts
                and list(map(_SHAPE, plain)) == self.shapes and all(map(torch.Tensor.is_contiguous, plain))):
            return plain
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

