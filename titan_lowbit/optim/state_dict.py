"""What ``LowBitAdamW.load_state_dict`` checks in a state dict before it changes anything
(``check_loadable``: the groups' options, then every parameter's state).

A loaded state goes straight into the fused step, which trusts it: a NaN scale, a missing
``step`` (bias correction and the stochastic-rounding stream restart at 0) or a state of
another shape would turn into wrong or non-finite weights with no error. So every entry of
every parameter's state is checked first, and a refusal names the parameter and the entry:

* structure: the entries the parameter's layout needs (``exp_avg_codes``, ``master``, ...,
  and ``step``), nothing else, each a tensor of the expected dtype and (global) shape; a
  DTensor state needs a DTensor entry with the same placements and local shape;
* ``step``: one finite, whole, non-negative number;
* values: scales (absmax) finite and >= 0; plain moments, master weights and Kahan
  compensation finite, second moments >= 0; codes that decode to a number (fp8: no NaN
  code; a second moment's codes not negative). These need a pass over the state, done
  per device with one host sync; under a process group every rank learns every rank's
  findings (one small all-reduce), so all ranks refuse together.

Values checked here are the loaded ones as given; under ``torch.distributed.checkpoint``
the loader has already written them into the optimizer's own tensors (it loads in place),
so there a refusal leaves the optimizer holding the checkpoint's values: load it again
from a good checkpoint, or build the optimizer afresh.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Protocol

import torch
from torch.distributed.tensor import DTensor

from titan_lowbit.kernels.quant_maps import CODEC_FP8_E4M3

from .formats import param_format, state_specs
from .group_options import CONVERT_CALL, CONVERTIBLE_OPTIONS, FIXED_OPTIONS, check_group, fixed_value
from .tensors import is_distributed, local
from .torch_flags import TORCH_FLAGS, with_torch_defaults

# How the values of an entry are checked (see value_problem).
SCALE = "scale"  # absmax: finite, >= 0
SIGNED = "signed"  # first moment, master weight, Kahan compensation: finite
SQUARE = "square"  # plain second moment: finite, >= 0
CODES = "codes"  # codes of a first moment
SQUARE_CODES = "square codes"  # codes of a second moment (decode to >= 0)


@dataclasses.dataclass(frozen=True)
class EntrySpec:
    """One tensor of a parameter's state as this optimizer holds it."""

    shape: tuple[int, ...]  # global shape (the parameter's, for a DTensor state)
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    check: str  # one of SCALE, SIGNED, SQUARE, CODES, SQUARE_CODES
    codec: int = 0  # the codes' codec (CODES / SQUARE_CODES)
    placements: Optional[tuple] = None  # a DTensor state's placements; None: the parameter's


def check_kind(key: str) -> str:
    """How the values of state entry ``key`` are checked."""
    if key.endswith("_absmax"):
        return SCALE
    if key.endswith("_codes"):
        return SQUARE_CODES if key.startswith("exp_avg_sq") else CODES
    return SQUARE if key == "exp_avg_sq" else SIGNED


def check_step(name: str, value: Any) -> float:
    """The step count of a loaded state, as a float; refused unless one finite, whole,
    non-negative number."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise ValueError(f"param '{name}': the state dict's 'step' is a tensor of shape "
                             f"{tuple(value.shape)}; it must hold one number (the parameter's step count)")
        if isinstance(value, DTensor):
            value = value.to_local()
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or value != int(value):
        raise ValueError(f"param '{name}': the state dict's 'step' is {value!r}; it must be a whole "
                         "number >= 0 (the parameter's step count). The state dict is damaged: load "
                         "another checkpoint")
    return float(value)


def check_structure(name: str, state: Any, specs: dict[str, EntrySpec], sharded: Optional[DTensor],
                    layout: str) -> None:
    """Refuse a parameter's loaded ``state`` whose entries are not those of ``specs``
    (plus ``step``), or not tensors of their dtype and shape. ``sharded``: the state
    tensor this optimizer holds for one entry placed like the parameter if it holds
    DTensors (placements compared, or with a spec's own ``placements``); ``layout``: the
    optimizer settings that gave ``specs``, for the errors."""
    if not isinstance(state, dict):
        raise ValueError(f"param '{name}': its state in the state dict is a {type(state).__name__}, not a "
                         "dict of state entries; the state dict is damaged or not an optimizer's")
    expected = set(specs) | {"step"}
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(
            f"param '{name}': the state dict's state for it has no {missing} (it has {sorted(state)}); "
            + ("without 'step' its bias correction and stochastic-rounding stream would restart at 0. "
               if "step" in missing else "")
            + f"The state dict is incomplete or was saved with other optimizer settings than {layout}: load "
            "a complete one saved with these settings, or start the optimizer state afresh")
    extra = sorted(set(state) - expected, key=str)
    if extra:
        raise ValueError(f"param '{name}': the state dict's state for it holds {extra}, which this "
                         f"optimizer's layout ({layout}) has no place for (it holds {sorted(expected)}): it "
                         "was saved with other optimizer settings; build the optimizer with those to load it")
    for key, spec in specs.items():
        value = state[key]
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"param '{name}': state entry '{key}' is a {type(value).__name__}, not a tensor")
        if value.dtype != spec.dtype or tuple(value.shape) != spec.shape:
            raise ValueError(
                f"param '{name}': the loaded optimizer state entry '{key}' is {value.dtype} of shape "
                f"{tuple(value.shape)}, which does not match {layout} (expected {spec.dtype} of shape "
                f"{spec.shape}): the parameter's shape or the optimizer settings differ from those the state "
                "dict was saved with; load with the model and optimizer settings it was saved with")
        if (sharded is not None) != isinstance(value, DTensor):
            have = "DTensor (sharded)" if sharded is not None else "plain tensor"
            raise ValueError(
                f"param '{name}': state entry '{key}' is a {type(value).__name__} where this optimizer holds a "
                f"{have}; load a sharded optimizer state through torch.distributed.checkpoint "
                "(set_optimizer_state_dict), which reshards it")
        placements = None if sharded is None else tuple(spec.placements or sharded.placements)
        if sharded is not None and (tuple(value.placements) != placements
                                    or tuple(value._local_tensor.shape) != spec.local_shape):
            raise ValueError(
                f"param '{name}': state entry '{key}' is sharded as {value.placements} with local shape "
                f"{tuple(value._local_tensor.shape)}, this optimizer's as {placements} with "
                f"{spec.local_shape}; load it through torch.distributed.checkpoint, which reshards it")


def value_problem(value: torch.Tensor, spec: EntrySpec) -> torch.Tensor:
    """A 0-d bool tensor on ``value``'s device: whether any element is invalid for its
    kind (no host sync)."""
    x = local(value)
    if spec.check in (CODES, SQUARE_CODES):
        if spec.codec != CODEC_FP8_E4M3:  # every code of the 8-bit and 4-bit maps decodes to a number
            return torch.zeros((), dtype=torch.bool, device=x.device)
        bits = x.view(torch.uint8)
        bad = (bits & 0x7F) == 0x7F  # e4m3fn's NaN codes
        if spec.check == SQUARE_CODES:  # a negative second moment (-0 is harmless)
            bad |= bits > 0x80
        return bad.any()
    bad = ~torch.isfinite(x)
    if spec.check in (SCALE, SQUARE):
        bad |= x < 0
    return bad.any()


def find_value_problems(checks: list[tuple[torch.Tensor, EntrySpec]], distributed: bool) -> list[bool]:
    """For every (loaded tensor, spec): whether its values are invalid, on any rank that
    holds a shard of it when ``distributed``: the flags are combined over each dimension of
    the DTensors' meshes, whose ranks all hold the same parameters and call this with the
    checks in the same order; ranks outside them (another pipeline stage, with other
    parameters and another number of checks) take no part. Without DTensors the ranks'
    copies are whole, and each rank's own flags are every rank's answer."""
    by_device: dict[torch.device, list[int]] = {}
    flags = [False] * len(checks)
    for i, (value, _) in enumerate(checks):
        if local(value).numel():
            by_device.setdefault(local(value).device, []).append(i)
    for idx in by_device.values():
        found = torch.stack([value_problem(*checks[i]) for i in idx]).cpu().tolist()
        for i, bad in zip(idx, found):
            flags[i] = bool(bad)
    meshes = list(dict.fromkeys(value.device_mesh for value, _ in checks if isinstance(value, DTensor)))
    if distributed and meshes:
        import torch.distributed as dist

        device = torch.device("cpu")
        if dist.get_backend() != "gloo":
            device = torch.device("cuda", torch.cuda.current_device())
        combined = torch.tensor(flags, dtype=torch.int32, device=device)
        for mesh in meshes:
            for dim in range(mesh.ndim):
                dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        flags = [bool(f) for f in combined.cpu().tolist()]
    return flags


PROBLEM = {
    SCALE: "non-finite or negative scales (absmax)",
    SIGNED: "non-finite values",
    SQUARE: "non-finite or negative second moments",
    CODES: "codes that decode to no number (NaN codes)",
    SQUARE_CODES: "codes that decode to no number or to a negative second moment",
}


def value_error(name: str, key: str, spec: EntrySpec) -> ValueError:
    return ValueError(
        f"param '{name}': state entry '{key}' of the state dict holds {PROBLEM[spec.check]} (on this or "
        "another rank); the next step would write non-finite weights. The checkpoint is damaged: load "
        "another one, or start the optimizer state afresh")


# ---------------------------------------------------------------------------------------
# the whole state dict against the optimizer
# ---------------------------------------------------------------------------------------
class LoadTarget(Protocol):
    """What the check of a state dict reads of the optimizer it is loaded into
    (``LowBitAdamW``): its groups, defaults and states, and the names its errors give."""

    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    state: dict[torch.Tensor, dict[str, Any]]

    def _name(self, p: torch.Tensor) -> str: ...

    def _group_desc(self, gi: int) -> str: ...


def require_state_dict(state_dict: Any) -> None:
    if not (isinstance(state_dict, dict) and "state" in state_dict and "param_groups" in state_dict):
        raise ValueError("LowBitAdamW.load_state_dict needs an optimizer state dict with 'state' and "
                         "'param_groups' (from LowBitAdamW.state_dict())")



def check_loadable(opt: LoadTarget, state_dict: dict[str, Any]
                   ) -> list[tuple[torch.Tensor, dict[str, torch.Tensor], float]]:
    """Raise, before anything changes, when ``state_dict`` does not fit this optimizer;
    else (parameter, its loaded state tensors, its step) for every parameter."""
    require_state_dict(state_dict)
    saved = state_dict["param_groups"]
    sizes = [len(g.get("params", ())) for g in saved]
    if sizes != [len(g["params"]) for g in opt.param_groups]:
        raise ValueError(f"the state dict has param groups of {sizes} parameters, this optimizer of "
                         f"{[len(g['params']) for g in opt.param_groups]}: build the optimizer with the "
                         "param groups the state dict was saved with")
    for gi, (s, g) in enumerate(zip(saved, opt.param_groups)):
        missing = [k for k in opt.defaults if k not in s and k not in TORCH_FLAGS]
        if missing:
            raise ValueError(f"param group {gi} of the state dict has no {missing}: it was not saved by "
                             "LowBitAdamW (torch.optim.AdamW's?). Load a LowBitAdamW state dict, start "
                             "the optimizer state afresh (load the model weights only), or convert a "
                             f"torch Adam/AdamW state dict explicitly: {CONVERT_CALL}")
        s = with_torch_defaults(s)
        for k in FIXED_OPTIONS:
            if fixed_value(s, k) != fixed_value(g, k):
                raise ValueError(
                    f"{opt._group_desc(gi)}: the state dict was saved with {k}={s[k]!r}, this optimizer "
                    f"was built with {k}={g[k]!r} (torch would silently go on with the saved one). Build "
                    f"the optimizer with {k}={s[k]!r} to resume it, or start the optimizer state afresh"
                    + (f", or convert the states into this optimizer's layout: {CONVERT_CALL}"
                       if k in CONVERTIBLE_OPTIONS else ""))
        check_group({**g, **s}, f"param group {gi} of the state dict")
    known = {i for g in saved for i in g["params"]}
    unknown = [k for k in state_dict["state"] if k not in known]
    if unknown:
        raise ValueError(f"the state dict holds state for parameter ids {unknown[:5]} that no param group "
                         "lists; it is damaged or not an optimizer state dict")
    loaded, checks, where = [], [], []
    for s, group in zip(saved, opt.param_groups):
        for key, p in zip(s["params"], group["params"]):
            name, state = opt._name(p), state_dict["state"].get(key)
            if not state:  # LowBitAdamW saves every parameter's state (made at construction)
                raise ValueError(
                    f"param '{name}': the state dict holds no optimizer state for it, so it "
                    "would restart from zero moments (and its master weight from the bf16 value) while "
                    "the others resume: the state dict is incomplete or not this optimizer's. Load a "
                    "complete one, or start the optimizer state afresh")
            sharded = next((v for v in opt.state[p].values() if isinstance(v, DTensor)), None)
            loaded.append(check_param_state(p, name, state, entry_specs(p, group), sharded, group, checks, where))
    params = [p for g in opt.param_groups for p in g["params"]]
    raise_value_problems(checks, where, is_distributed(params))
    return loaded


def check_param_state(p: torch.Tensor, name: str, state: Any, specs: dict[str, EntrySpec], sharded: Optional[DTensor],
                      group: dict[str, Any], checks: list, where: list
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
    """Check the structure and step of parameter ``p``'s loaded ``state`` against
    ``specs`` (``check_structure``, ``check_step``) and queue its value checks on
    ``checks`` and ``where`` (``raise_value_problems`` runs them all at once); returns
    (``p``, its loaded state tensors, its step)."""
    fmt, block = param_format(p, group)
    check_structure(name, state, specs, sharded,
                    f"state_format={fmt.name!r}, block {block}, weight_update={group['weight_update']!r}")
    step = check_step(name, state["step"])
    for k, spec in specs.items():
        checks.append((state[k], spec))
        where.append((name, k))
    return p, {k: state[k] for k in specs}, step


def raise_value_problems(checks: list[tuple[torch.Tensor, EntrySpec]], where: list[tuple[str, str]],
                         distributed: bool) -> None:
    """Raise ``value_error`` for the first queued (tensor, spec) whose values are invalid."""
    for (name, k), (_, spec), bad in zip(where, checks, find_value_problems(checks, distributed)):
        if bad:
            raise value_error(name, k, spec)


def load_with_checks(opt: torch.optim.Optimizer, state_dict: dict[str, Any], check, load, restore) -> None:
    """Run torch's ``Optimizer.load_state_dict`` on ``opt`` with its hooks in its order,
    ``check(state_dict)`` as the last pre-hook (it raises on anything that does not fit,
    before anything changes; the rest of torch's load then sees no state, which it would
    cast to the parameters' dtypes) and ``load()`` as the first post-hook (it puts the
    checked states in, so the user's post-hooks see them); if ``load`` raises,
    ``restore()`` puts the optimizer back as it was."""
    def pre_hook(_, checked_dict: dict[str, Any]) -> dict[str, Any]:
        check(checked_dict)
        return {**checked_dict, "state": {}}

    def post_hook(_) -> None:
        try:
            load()
        except BaseException:
            restore()
            raise

    hooks = (opt.register_load_state_dict_pre_hook(pre_hook),
             opt.register_load_state_dict_post_hook(post_hook, prepend=True))
    try:
        torch.optim.Optimizer.load_state_dict(opt, state_dict)
    finally:
        for hook in hooks:
            hook.remove()



def entry_specs(p: torch.Tensor, group: dict[str, Any]) -> dict[str, EntrySpec]:
    """What each state tensor of ``p`` must be, for checking a loaded state."""
    fmt, _ = param_format(p, group)
    codecs = {"exp_avg_codes": fmt.m_codec, "exp_avg_sq_codes": fmt.v_codec}
    return {k: EntrySpec(gshape, shape, dtype, check_kind(k), codecs.get(k, 0))
            for k, (shape, dtype, gshape) in state_specs(p, group).items()}

