"""A resume that converts the checkpoint's optimizer states into the run's layout, on
request: ``[lowbit] convert_optimizer_states = true`` (torchtitan 0.2 line).

Why this shape: torch.distributed.checkpoint loads into the tensors a state dict offers,
with their shapes and dtypes, resharding them as it goes. So the checkpoint's states are
loaded into optimizers of the checkpoint's own layout built over the run's parameters
(the "source": a LowBitAdamW with the saved state format, block size, update rule and
threshold, or torch's Adam/AdamW), exactly as torchtitan's container loads (flattened
``get_optimizer_state_dict`` keys, the optimizers' own load checks), and each source is
then converted into the run's optimizer by ``titan_lowbit.optim.convert_state_dict``
(one definition of every format: the kernels' PyTorch reference) and loaded by its
``load_state_dict``, which checks it as any other state dict. The model is loaded first,
so a master weight or remainder that the checkpoint lacks is built from the loaded
weights. For the time of the conversion the source states take memory beside the run's.

The weight dtype changes where no bit is lost (``convert.weight_dtype_problem``): fp32
weights into bf16 ones with an fp32 master, and back. Those weights are loaded in the
checkpoint's dtype (:func:`saved_dtype_weights`), and the source optimizer is built over
them, swapped into the model for its load (DCP names an optimizer's states by the
model's parameters), since a source's states depend on its weights' dtype (torch's
moments in the parameter dtype, a master beside bf16 weights only); the conversion then
sets the run's weights from them.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titan_lowbit.config import lowbit_of
from titan_lowbit.optim.muon_groups import USE_MUON
from titan_lowbit.torchtitan.lowbit_optimizers import is_lowbit
from titan_lowbit.torchtitan.optimizer_builder import FP32_STATES_FORMAT
from titan_lowbit.torchtitan.unrecorded_options import GROUP_ENTRY

FLATTENED = StateDictOptions(flatten_optimizer_state_dict=True)  # as torchtitan saves them
# An option every param group has: its entries (GROUP_ENTRY) name every parameter, in the
# optimizer's order.
ANY_GROUP_KEY = "lr"
# What each converted setting does to the states, for its log line.
EFFECT = {
    "optimizer": "moments dequantized to fp32 and stored in the new optimizer's format",
    "state_format": "moments dequantized to fp32 and requantized (one quantization of each moment)",
    "block_size": "moments dequantized to fp32 and requantized in blocks of the new size",
    "min_quantized_numel": "the parameters whose states change between fp32 and quantized are converted",
    "fp32_states": "those parameters' moments dequantized into fp32 states (exactly) or quantized "
                   "out of them into the optimizer's format",
    "weight_update": "fp32 master weights (or their remainders, or the Kahan compensation) from the "
                     "checkpoint's master weights where it kept them, else from its bf16 weights",
}


class Conversion(NamedTuple):
    """What a resume converts: the checkpoint's and the run's per-parameter optimizer
    layouts (``checkpoint.layouts``, block sizes resolved), and {model state key: the
    checkpoint's dtype} of the weights whose dtype changes."""

    saved: dict[str, dict[str, Any]]
    have: dict[str, dict[str, Any]]
    weight_dtypes: dict[str, torch.dtype]


def conversion_requested(manager) -> bool:
    """Whether the run asked for ``[lowbit] convert_optimizer_states`` (read from the
    trainer, which torchtitan registers with its CheckpointManager as ``train_state``)."""
    job_config = getattr(manager.states.get("train_state"), "job_config", None)
    return job_config is not None and bool(lowbit_of(job_config).convert_optimizer_states)


class _SavedStates(Stateful):
    """The optimizer entries of a checkpoint as torchtitan's OptimizersContainer saves
    them (one flattened optimizer state dict per model part), loaded into ``optimizers``."""

    def __init__(self, model_parts, optimizers):
        self.model_parts, self.optimizers = model_parts, optimizers

    def state_dict(self) -> dict[str, Any]:
        return {k: v for model, opt in zip(self.model_parts, self.optimizers)
                for k, v in get_optimizer_state_dict(model, opt, options=FLATTENED).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for model, opt in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(model, opt, optim_state_dict=state_dict, options=FLATTENED)


def fp32_selection(layouts: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """(the optimizer's own layout, the parameters ``[lowbit] fp32_states`` gave fp32
    states) of per-parameter layouts (``checkpoint.layouts``): the own layout is that of
    the parameters whose states are not fp32 (of all of them where every one is); a
    parameter is selected where its layout is the own one with fp32 states (for a Muon
    name, its matrices and its inner AdamW's parameters alike: their ``use_muon`` and
    the AdamW part's ``decoupled_weight_decay`` aside)."""
    values = list(layouts.values())
    own = next((lay for lay in values if lay.get("state_format") != FP32_STATES_FORMAT), values[0] if values else {})
    if own.get("state_format") in (None, FP32_STATES_FORMAT):
        return own, []

    def of_group(layout: dict[str, Any]) -> dict[str, Any]:
        if USE_MUON not in layout:
            return layout
        return {k: v for k, v in layout.items() if k not in (USE_MUON, "decoupled_weight_decay")}

    fp32 = of_group({**own, "state_format": FP32_STATES_FORMAT})
    return own, sorted(f for f, lay in layouts.items() if of_group(lay) == fp32)


def _frozen(layout: dict[str, Any]) -> tuple:
    return tuple(sorted(layout.items()))


def _param_fqns(model, optimizer) -> dict[torch.Tensor, str]:
    """{parameter: the FQN its checkpoint entries have} for ``optimizer``'s parameters:
    the flattened state dict lists its param-group entries in the optimizer's parameter
    order (the FQNs without the wrappers' levels that ``named_parameters`` shows)."""
    flat = get_optimizer_state_dict(model, optimizer, options=FLATTENED)
    suffix = "." + ANY_GROUP_KEY
    fqns = [k[len(GROUP_ENTRY):-len(suffix)] for k in flat if k.startswith(GROUP_ENTRY) and k.endswith(suffix)]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len(fqns) != len(params):
        raise ValueError(
            f"[lowbit] convert_optimizer_states: the optimizer has {len(params)} parameters but its "
            f"state dict names {len(fqns)} (parameters shared between modules): resume with the "
            "settings the checkpoint was written with, or start the optimizer afresh with "
            "--checkpoint.exclude_from_loading optimizer")
    return dict(zip(params, fqns))


def source_optimizer(run_optimizer, layout_of: dict[torch.Tensor, dict[str, Any]],
                     names: dict[torch.Tensor, str],
                     saved_weights: Optional[dict[torch.Tensor, torch.Tensor]] = None):
    """An optimizer of the checkpoint's layouts over the parameters of ``run_optimizer``,
    in its order, to load the states into: ``layout_of[p]`` is parameter ``p``'s layout in
    the checkpoint (``checkpoint.layouts``); ``saved_weights[p]``, where given, stands for
    ``p`` (its weight in the checkpoint's dtype). Each run group is split where the saved
    layout changes (``[lowbit] fp32_states`` selected other parameters), so that every
    group of the source has one layout, as the checkpoint's groups had."""
    hyper = ("lr", "betas", "eps", "weight_decay")
    saved_weights = saved_weights or {}

    def own(p):
        return saved_weights.get(p, p)

    params = [p for g in run_optimizer.param_groups for p in g["params"]]
    kinds = {layout_of[p]["optimizer"] for p in params}
    if len(kinds) > 1:
        raise ValueError(f"[lowbit] convert_optimizer_states: the checkpoint holds states of {sorted(kinds)} "
                         "for the parameters of one optimizer; convert a checkpoint written by one of them")
    first = layout_of[params[0]]
    decoupled = first.get("decoupled_weight_decay")
    if decoupled is None:
        decoupled = run_optimizer.param_groups[0].get("decoupled_weight_decay", True)
    if first["optimizer"] != "titan_lowbit":
        groups = [{"params": [own(p) for p in g["params"]], **{k: g[k] for k in hyper}}
                  for g in run_optimizer.param_groups]
        return (torch.optim.AdamW if decoupled else torch.optim.Adam)(groups)
    from titan_lowbit.optim import LowBitAdamW
    from titan_lowbit.optim.group_options import CONVERTIBLE_OPTIONS

    groups = [{"params": [(names[p], own(p)) for p in run], **{k: g[k] for k in hyper},
               **{k: layout[k] for k in CONVERTIBLE_OPTIONS}}
              for g in run_optimizer.param_groups
              for layout, run in ((dict(key), list(ps)) for key, ps in
                                  itertools.groupby(g["params"], key=lambda p: _frozen(layout_of[p])))]
    return LowBitAdamW(groups, decoupled_weight_decay=decoupled, seed=getattr(run_optimizer, "seed", 0))


def describe_changes(conversion: Conversion, run_dtypes: dict[str, torch.dtype]) -> list[str]:
    """One line per setting in which the checkpoint's per-parameter layouts
    ``conversion.saved`` differ from the run's ``conversion.have``: the optimizer's own
    layout, then the parameters that ``[lowbit] fp32_states`` moved into or out of fp32
    states (between torch's and titan_lowbit's optimizers one line with the new
    settings); then one per weight dtype change (``run_dtypes``: the run's dtype of the
    weights in ``conversion.weight_dtypes``)."""
    saved, have = conversion.saved, conversion.have
    (own_saved, fp32_saved), (own_have, fp32_have) = fp32_selection(saved), fp32_selection(have)
    if own_saved["optimizer"] != own_have["optimizer"]:
        settings = ", ".join(f"{k}={v!r}" for k, v in (own_have if own_have["optimizer"] == "titan_lowbit"
                                                       else own_saved).items() if k in EFFECT and k != "optimizer")
        lines = [f"optimizer {own_saved['optimizer']!r} -> {own_have['optimizer']!r} ({settings}): "
                 f"{EFFECT['optimizer']}"]
    else:
        lines = [f"{key} {own_saved[key]!r} -> {own_have[key]!r}: {EFFECT[key]}" for key in EFFECT
                 if key in own_saved and key in own_have and own_saved[key] != own_have[key]]
    into, out = sorted(set(fp32_have) - set(fp32_saved)), sorted(set(fp32_saved) - set(fp32_have))
    if into or out:
        lines.append(f"fp32_states: into fp32 states {into or 'none'}, out of them {out or 'none'}: "
                     f"{EFFECT['fp32_states']}")
    moves: dict[tuple, list[str]] = {}
    for key, dtype in conversion.weight_dtypes.items():
        moves.setdefault((dtype, run_dtypes[key]), []).append(key)
    for (was, now), keys in moves.items():
        effect = ("the fp32 weights kept exactly as master weights, the bf16 weights their rounding to "
                  "nearest" if now == torch.bfloat16 else "the fp32 weights are the checkpoint's master "
                  "weights, exactly")
        lines.append(f"weight dtype {was} -> {now} ({len(keys)} parameters): {effect}")
    return lines


def fitted_scheduler_state(state: dict[str, Any], groups: int) -> dict[str, Any]:
    """A saved LR scheduler state (torchtitan's container saves the first scheduler's and
    loads it into every one) with one per-group entry for each of ``groups`` param groups.
    The saved state has one entry per param group of the optimizer that wrote it, which
    may group the parameters otherwise (``[lowbit] fp32_states`` adds a group, a conversion
    may add or drop it, and under pipeline parallelism one model part may have a group
    that another lacks); torch's LambdaLR would fail to load more entries than it has
    groups, or stop at its next step with fewer. All groups of the 0.2 line share
    ``[optimizer] lr`` and the schedule, so one entry serves every group; differing
    values are refused. (DCP loads the list of base_lrs as saved, but the per-group
    lambdas' attributes in the shape of this rank's first scheduler.)"""
    fitted = dict(state)
    for key in ("base_lrs", "lr_lambdas"):  # the last lrs are recomputed by the next step
        values = state.get(key)
        if not isinstance(values, list) or len(values) in (0, groups):
            continue
        if any(v != values[0] for v in values):
            raise ValueError(
                f"the checkpoint's LR scheduler holds {key} {values} for {len(values)} param groups, "
                f"this run's optimizer has {groups}: resume with the [lowbit] fp32_states it was "
                "written with, or start the schedule afresh with --checkpoint.exclude_from_loading "
                "lr_scheduler")
        fitted[key] = [values[0]] * groups
    return fitted


class FittedLRSchedulers(Stateful):
    """torchtitan's LR scheduler container as DCP loads it: the saved state goes into each
    scheduler fitted to its optimizer's param groups (:func:`fitted_scheduler_state`)."""

    def __init__(self, container):
        self.container = container

    def state_dict(self) -> dict[str, Any]:
        return self.container.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for scheduler in self.container.schedulers:
            scheduler.load_state_dict(
                fitted_scheduler_state(copy.deepcopy(state_dict), len(scheduler.optimizer.param_groups)))


def saved_dtype_weights(state_dict: dict[str, Any], conversion: Conversion) -> dict[str, torch.Tensor]:
    """{key: a copy of the run's weight ``state_dict[key]`` in the checkpoint's dtype} for
    the weights whose dtype the conversion changes (a DTensor placed like the weight), for
    DCP to load the checkpoint's weights into exactly, and :func:`load_converted` to take
    them from."""
    return {key: state_dict[key].detach().to(dtype) for key, dtype in conversion.weight_dtypes.items()}


@contextlib.contextmanager
def _swapped(model: nn.Module, replace: dict[torch.Tensor, torch.Tensor]):
    """``model`` with each parameter ``p`` in ``replace`` registered as ``replace[p]``
    in its place, put back on leaving."""
    places = [(module, name, p) for module in model.modules()
              for name, p in module.named_parameters(recurse=False) if p in replace]
    try:
        for module, name, p in places:
            module.register_parameter(name, replace[p])
        yield
    finally:
        for module, name, p in places:
            module.register_parameter(name, p)


def load_converted(container, checkpoint_id: str, conversion: Conversion,
                   weights: Optional[dict[str, torch.Tensor]] = None) -> list[str]:
    """Load the optimizer states of ``checkpoint_id`` into the run's optimizers in
    ``container``, converted as ``conversion`` says; ``weights`` are the checkpoint's
    weights whose dtype changes (:func:`saved_dtype_weights`, loaded), from which the
    run's weights are set. Return the log lines naming each change. Every rank calls it
    (DCP's load and the optimizers' load checks are collective)."""
    from titan_lowbit.optim import convert_state_dict

    saved, weights = conversion.saved, weights or {}
    if set(weights) != set(conversion.weight_dtypes):
        raise ValueError(f"load_converted: weights for {sorted(weights)}, the conversion changes the dtype "
                         f"of {sorted(conversion.weight_dtypes)}")

    model_parts, optimizers = container.model_parts, list(container.optimizers)
    if len(optimizers) != len(model_parts):
        raise ValueError(
            "[lowbit] convert_optimizer_states converts one optimizer per model part; this run has "
            f"{len(optimizers)} optimizers for {len(model_parts)} model parts ([optimizer] "
            "early_step_in_backward): resume with the settings the checkpoint was written with, "
            "convert without early_step_in_backward, or start the optimizer afresh with "
            "--checkpoint.exclude_from_loading optimizer")
    names = {p: n for model in model_parts for n, p in model.named_parameters()}
    distinct = {_frozen(layout) for layout in saved.values()}
    sources, replaced, run_dtypes = [], [], {}
    for model, opt in zip(model_parts, optimizers):
        fqns = _param_fqns(model, opt) if len(distinct) > 1 or weights else {}
        if len(distinct) == 1:  # one layout for every parameter: no need to tell them apart
            layout_of = {p: dict(next(iter(distinct))) for g in opt.param_groups for p in g["params"]}
        else:
            layout_of = {}
            for p, fqn in fqns.items():
                if fqn not in saved:
                    raise ValueError(
                        f"[lowbit] convert_optimizer_states: param '{fqn}' has no optimizer entries in "
                        f"{checkpoint_id}: the checkpoint is incomplete or from another model")
                layout_of[p] = saved[fqn]
        replaced.append({p: nn.Parameter(weights[fqn], requires_grad=p.requires_grad)
                         for p, fqn in fqns.items() if fqn in weights})
        run_dtypes.update({fqn: p.dtype for p, fqn in fqns.items() if fqn in weights})
        sources.append(source_optimizer(opt, layout_of, names, replaced[-1]))
    untrained = sorted(set(weights) - set(run_dtypes))
    if untrained:
        raise ValueError(f"[lowbit] convert_optimizer_states: the weights {untrained[:4]} change dtype but "
                         "no optimizer of this run trains them; resume with the weight dtype the "
                         "checkpoint was written with")
    with contextlib.ExitStack() as stack:
        for model, replace in zip(model_parts, replaced):
            stack.enter_context(_swapped(model, replace))
        dcp.load({"optimizer": _SavedStates(model_parts, sources)}, checkpoint_id=checkpoint_id)
    for source, optimizer, replace in zip(sources, optimizers, replaced):
        optimizer.load_state_dict(convert_state_dict(source.state_dict(), to=optimizer, weights=replace))
        if is_lowbit(optimizer):
            optimizer.skipped_steps = source.skipped_steps if is_lowbit(source) else 0
    return describe_changes(conversion, run_dtypes)
