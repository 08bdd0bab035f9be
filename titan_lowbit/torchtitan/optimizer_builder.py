"""torchtitan's ``build_optimizers_fn`` for titan_lowbit's optimizers.

``[optimizer] name`` keeps its meaning: ``Adam`` and ``AdamW`` go to the model's own
torchtitan builder, untouched, unless ``[lowbit] weight_update`` asks for a BF16 update
rule torch's AdamW does not have; every other valid name is a titan_lowbit optimizer
from :data:`titan_lowbit.optim.OPTIMIZERS` (``LowBitAdamW``) or
:data:`titan_lowbit.optim.MUON_OPTIMIZERS` (``LowBitMuon``: Muon for the hidden matrices,
its inner AdamW for the rest, with ``[optimizer] beta1``/``beta2``/``eps``), built into
torchtitan's own ``OptimizersContainer`` so checkpointing, LR schedulers and hooks work
as before.
"""

from __future__ import annotations

import functools
import zlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
    StateDictOptions,
)
from torchtitan.components.optimizer import (
    build_optimizers as torchtitan_build_optimizers,
    OptimizersContainer,
    OptimizersInBackwardContainer,
)
from torchtitan.tools.logging import logger

from titan_lowbit.config import LowBit, lowbit_of
from titan_lowbit.fqn_fragments import check_every_fragment_selects, selects
from titan_lowbit.optim.muon_groups import MOMENTUM_4BIT_FACTOR_RANK, MOMENTUM_4BIT_LEVELS, MOMENTUM_4BIT_OPTIONS
from titan_lowbit.torchtitan.fp32_init import hand_init_masters
from titan_lowbit.torchtitan.lowbit_optimizers import (
    FP32_ADAMW_STATE_BYTES,
    TORCH_OPTIMIZERS,
    is_lowbit,
    is_muon,
    muon_share,
    settled_step,
    state_bytes_per_param,
)

# titan_lowbit.optim (and with it Triton) is imported only when an optimizer name needs
# it, so a run with torch's Adam/AdamW loads no kernels.


def valid_optimizer_names() -> list[str]:
    from titan_lowbit.optim import MUON_OPTIMIZERS, OPTIMIZERS

    return sorted(set(TORCH_OPTIMIZERS) | set(OPTIMIZERS) | set(MUON_OPTIMIZERS))


def is_muon_name(name: str) -> bool:
    """Whether ``[optimizer] name`` builds a LowBitMuon."""
    from titan_lowbit.optim import MUON_OPTIMIZERS

    return name in MUON_OPTIMIZERS


# The [lowbit] keys that configure the Muon names only.
MUON_KEYS = ("muon_momentum", "muon_4bit_levels", "muon_4bit_factor_rank", "muon_adamw_fqns")
# Those of them that configure a 4-bit momentum, and LowBitMuon's option of each.
MUON_4BIT_KEYS = {"muon_4bit_levels": MOMENTUM_4BIT_LEVELS, "muon_4bit_factor_rank": MOMENTUM_4BIT_FACTOR_RANK}


def muon_keys_set(lowbit: LowBit) -> list[str]:
    """The ``[lowbit] muon_*`` keys whose value differs from the section's default."""
    defaults = LowBit()
    return [k for k in MUON_KEYS if getattr(lowbit, k) != getattr(defaults, k)]


def check_optimizer_name(name: str) -> None:
    if name not in valid_optimizer_names():
        raise ValueError(
            f"[optimizer] name = {name!r} is not a known optimizer; choose one of "
            f"{valid_optimizer_names()}"
        )


# The state format of the parameters [lowbit] fp32_states selects.
FP32_STATES_FORMAT = "fp32"


def param_groups(named_params: list[tuple[str, nn.Parameter]], fp32_states: list[str]) -> list[dict]:
    """LowBitAdamW's param groups for ``(name, parameter)`` pairs: the parameters that
    ``[lowbit] fp32_states`` selects (titan_lowbit.fqn_fragments) in a group of fp32
    states after the others, which keep the optimizer's own format; each in the
    parameters' order, and only the groups that have parameters. Both groups take every
    other option from the optimizer, so they step alike but for the states' format."""
    chosen = [(n, p) for n, p in named_params if selects(n, fp32_states)]
    rest = [(n, p) for n, p in named_params if not selects(n, fp32_states)]
    return ([{"params": rest}] if rest else []) + (
        [{"params": chosen, "state_format": FP32_STATES_FORMAT}] if chosen else [])


def rounding_seed(seed: int, names: list[str]) -> int:
    """The stochastic-rounding seed of an optimizer that holds only some of the model's
    parameters (one optimizer per model part under pipeline parallelism, one per parameter
    with ``[optimizer] early_step_in_backward``).

    LowBitAdamW keys a parameter's rounding noise by its seed and the parameter's position
    in that optimizer. Optimizers that each count positions from 0 would give different
    parameters the same noise; the CRC-32 of their parameters' names in the seed's high
    32 bits gives each its own keys. Every rank that holds the same parameters (FSDP, TP
    and HSDP peers of a stage) derives the same seed."""
    return seed ^ (zlib.crc32("\n".join(names).encode()) << 32)


class NamedParamsOptimizer:
    """Builds an optimizer from torchtitan's bare parameter list, adding the parameters'
    fully qualified names, so that every error and log line can name the parameter, and
    putting the parameters ``fp32_states`` selects in a param group of fp32 states
    (:func:`param_groups`). With ``seed_by_names`` each optimizer's seed is
    :func:`rounding_seed` of its parameters' names: for containers whose optimizers hold
    only part of the model."""

    def __init__(self, optimizer_cls: type[torch.optim.Optimizer], model_parts: list[nn.Module],
                 fp32_states: list[str] = (), seed_by_names: bool = False):
        self.optimizer_cls = optimizer_cls
        self.names = {p: n for m in model_parts for n, p in m.named_parameters()}
        self.fp32_states = list(fp32_states)
        self.seed_by_names = seed_by_names

    def __call__(self, params, **kwargs) -> torch.optim.Optimizer:
        named = [(self.names[p], p) for p in params]
        if self.seed_by_names:
            kwargs = {**kwargs, "seed": rounding_seed(kwargs["seed"], [n for n, _ in named])}
        return self.optimizer_cls(param_groups(named, self.fp32_states) if self.fp32_states else named,
                                  **kwargs)


def _params(model_parts: list[nn.Module]) -> list[nn.Parameter]:
    return [p for m in model_parts for p in m.parameters() if p.requires_grad]


def check_fp32_states(name: str, fp32_states: list[str], fqns: list[str]) -> None:
    """Refuse a ``[lowbit] fp32_states`` that would change nothing or everything: with
    fp32 states throughout (torch's names), a fragment that selects no parameter of
    ``fqns`` (all the model's trainable parameters), a selection of every parameter."""
    if not fp32_states:
        return
    if _fp32_states(name):
        raise ValueError(
            f"[lowbit] fp32_states = {fp32_states} keeps the selected parameters' optimizer "
            f"states in fp32, but [optimizer] name = {name!r} keeps every state in fp32 already. "
            f"Remove fp32_states, or choose a name of a low-bit format ({', '.join(_low_bit_names(name))}).")
    check_every_fragment_selects("fp32_states", fp32_states, fqns, "trainable parameter of the model")
    if all(selects(n, fp32_states) for n in fqns):
        raise ValueError(
            f"[lowbit] fp32_states = {fp32_states} selects every trainable parameter "
            f"({len(fqns)}), so none would keep [optimizer] name = {name!r}'s state format: "
            f"set [optimizer] name = {FP32_NAMES[is_muon_name(name)]} for fp32 states throughout, or "
            "select fewer parameters.")


# The names of fp32 states throughout, for the AdamW names (False) and the Muon names (True).
FP32_NAMES = {False: '"AdamW" (or "Adam")', True: '"Muon"'}


def _fp32_states(name: str) -> bool:
    """Whether optimizer ``name`` keeps fp32 states (nothing quantized): torch's Adam / AdamW
    (also where a bf16 weight update builds them as LowBitAdamW), fp32 Muon."""
    from titan_lowbit.optim import MUON_OPTIMIZERS, OPTIMIZERS

    return {**OPTIMIZERS, **MUON_OPTIMIZERS}.get(name, {}).get("state_format") == FP32_STATES_FORMAT


def _low_bit_names(name: str) -> list[str]:
    """The names of ``name``'s family (AdamW / Adam, or Muon) whose states are quantized."""
    return [n for n in valid_optimizer_names() if is_muon_name(n) == is_muon_name(name) and not _fp32_states(n)]


def trainable_fqns(model_parts: list[nn.Module], parallel_dims) -> list[str]:
    """The FQNs of the whole model's trainable parameters. Under pipeline parallelism a
    rank holds some stages only: the names of every stage of the pp mesh (a collective)."""
    fqns = [n for m in model_parts for n, p in m.named_parameters() if p.requires_grad]
    if parallel_dims is not None and parallel_dims.pp_enabled:
        group = parallel_dims.get_mesh("pp").get_group()
        gathered: list[list[str] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, fqns, group=group)
        fqns = list(dict.fromkeys(n for part in gathered for n in part or []))
    return fqns


def check_combination(name: str, lowbit: LowBit, early_step_in_backward: bool,
                      model_parts: list[nn.Module]) -> None:
    """Refuse [optimizer] / [lowbit] settings that would be silently ignored or would
    not do what they say."""
    if lowbit.weight_update != "nearest" and not any(p.dtype == torch.bfloat16 for p in _params(model_parts)):
        raise ValueError(
            f"[lowbit] weight_update = {lowbit.weight_update!r} rounds AdamW's result into bf16 "
            "weights, but all parameters are fp32 (updated exactly). Set [lowbit] weight_dtype = "
            '"bfloat16" for full-BF16 training, or remove weight_update.'
        )
    if name in TORCH_OPTIMIZERS and lowbit.weight_update == "nearest":
        defaults = LowBit()
        ignored = [k for k in ("block_size", "min_quantized_numel", "nonfinite_grad", "health_metrics")
                   if getattr(lowbit, k) != getattr(defaults, k)]
        if ignored:
            raise ValueError(
                f"[lowbit] {', '.join(ignored)} set, but [optimizer] name = {name!r} is torch's "
                f"{name}, which has no such option. Remove {'them' if len(ignored) > 1 else 'it'}, or "
                f"choose a titan_lowbit optimizer "
                f"({', '.join(n for n in valid_optimizer_names() if n not in TORCH_OPTIMIZERS)})."
            )
    elif _fp32_states(name):
        defaults = LowBit()
        ignored = [k for k in ("block_size", "min_quantized_numel") if getattr(lowbit, k) != getattr(defaults, k)]
        if ignored:
            raise ValueError(
                f"[lowbit] {', '.join(ignored)} set, but [optimizer] name = {name!r} keeps fp32 states, "
                f"which are not quantized. Remove {'them' if len(ignored) > 1 else 'it'}, or choose a name "
                f"of a low-bit format ({', '.join(_low_bit_names(name))}).")
    if not is_muon_name(name) and (keys := muon_keys_set(lowbit)):
        raise ValueError(
            f"[lowbit] {', '.join(keys)} set, but [optimizer] name = {name!r} is not a Muon optimizer: "
            f"{'these keys configure' if len(keys) > 1 else 'this key configures'} the Muon names only "
            f"({', '.join(n for n in valid_optimizer_names() if is_muon_name(n))}). Choose one of them, or "
            f"remove {'them' if len(keys) > 1 else 'it'}."
        )
    if early_step_in_backward and is_muon_name(name):
        raise ValueError(
            f"[optimizer] early_step_in_backward = true steps each parameter on its own as its gradient "
            f"arrives, but [optimizer] name = {name!r} is Muon, which orthogonalises whole matrices and, "
            "sharded, gathers them from every rank in buckets within one step. Turn "
            "early_step_in_backward off for Muon, or choose an AdamW name."
        )
    if early_step_in_backward and lowbit.nonfinite_grad == "skip" and name not in TORCH_OPTIMIZERS:
        raise ValueError(
            "[lowbit] nonfinite_grad = 'skip' skips a whole optimizer step, but with [optimizer] "
            "early_step_in_backward each parameter steps on its own as its gradient arrives: the "
            "others would still step. Use nonfinite_grad = 'raise', or turn early_step_in_backward off."
        )


def build_lowbit_optimizers(
    model_parts: list[nn.Module],
    optimizer_config,
    parallel_dims,
    ft_manager=None,
    *,
    lowbit: LowBit,
    seed: int,
    base_builder: Callable[..., OptimizersContainer],
) -> OptimizersContainer:
    name = optimizer_config.name
    check_combination(name, lowbit, optimizer_config.early_step_in_backward, model_parts)
    if lowbit.fp32_states:
        check_fp32_states(name, list(lowbit.fp32_states), trainable_fqns(model_parts, parallel_dims))
    if name in TORCH_OPTIMIZERS and lowbit.weight_update == "nearest":
        return base_builder(model_parts, optimizer_config, parallel_dims, ft_manager)
    check_optimizer_name(name)

    if base_builder is not torchtitan_build_optimizers:
        raise NotImplementedError(
            f"[optimizer] name = {name!r}: this model's train spec builds its optimizers "
            f"with {getattr(base_builder, '__qualname__', base_builder)}, whose extra "
            "behaviour titan_lowbit cannot reproduce around its own optimizers; use "
            "Adam/AdamW for this model."
        )
    if optimizer_config.early_step_in_backward and parallel_dims is not None:
        # torchtitan's own builder refuses these for Adam/AdamW: the same for ours.
        for degree, key in (("pp", "pipeline_parallel_degree"), ("ep", "expert_parallel_degree")):
            if getattr(parallel_dims, f"{degree}_enabled"):
                raise NotImplementedError(
                    f"[optimizer] early_step_in_backward = true is not supported with [parallelism] "
                    f"{key} = {getattr(parallel_dims, degree)} (torchtitan supports optimizers in "
                    "backward without it, for torch's optimizers too); turn early_step_in_backward "
                    f"off, or set {key} = 1.")
    if ft_manager is not None and getattr(ft_manager, "enabled", False):
        raise NotImplementedError(
            f"[optimizer] name = {name!r} is not supported with torchft fault tolerance; "
            "disable [fault_tolerance] or use Adam/AdamW."
        )
    early = optimizer_config.early_step_in_backward
    pipelined = parallel_dims is not None and parallel_dims.pp_enabled
    shared = dict(lr=optimizer_config.lr, weight_decay=optimizer_config.weight_decay,
                  weight_update=lowbit.weight_update, block_size=lowbit.block_size,
                  min_quantized_numel=lowbit.min_quantized_numel, seed=seed,
                  nonfinite_grad=lowbit.nonfinite_grad)
    adamw_options = dict(betas=(optimizer_config.beta1, optimizer_config.beta2), eps=optimizer_config.eps)
    if is_muon_name(name):
        optimizer_cls, kwargs = _muon_optimizer(name, lowbit, model_parts, parallel_dims, shared, adamw_options)
    else:
        from titan_lowbit.optim import LowBitAdamW, OPTIMIZERS

        optimizer_cls, kwargs = LowBitAdamW, {**shared, **adamw_options, **OPTIMIZERS[name]}
    factory = NamedParamsOptimizer(optimizer_cls, model_parts, lowbit.fp32_states,
                                   seed_by_names=early or pipelined)
    if early:
        return LowBitOptimizersInBackwardContainer(model_parts, factory, kwargs)
    container = LowBitOptimizersContainer(model_parts, factory, kwargs)
    return container


def _muon_optimizer(name: str, lowbit: LowBit, model_parts: list[nn.Module], parallel_dims,
                    shared: dict, adamw_options: dict) -> tuple[type, dict]:
    """LowBitMuon and its keyword arguments for Muon name ``name``: the options both parts
    share, ``[lowbit] muon_momentum`` for Muon, ``adamw_options`` ([optimizer] betas and
    eps) for its inner AdamW, and ``[lowbit] muon_adamw_fqns`` where it differs from
    LowBitMuon's own default (each of its fragments must then select a parameter)."""
    if parallel_dims is not None and parallel_dims.pp_enabled:
        raise NotImplementedError(
            f"[optimizer] name = {name!r} with [parallelism] pipeline_parallel_degree = {parallel_dims.pp}: "
            "Muon is not supported with pipeline parallelism yet (one optimizer per stage, each "
            "stepping its own matrices). Set pipeline_parallel_degree = 1, or choose an AdamW name.")
    from titan_lowbit.optim import LowBitMuon, MUON_OPTIMIZERS

    adamw_fqns = None
    if "muon_adamw_fqns" in muon_keys_set(lowbit):
        adamw_fqns = list(lowbit.muon_adamw_fqns)
        check_every_fragment_selects("muon_adamw_fqns", adamw_fqns,
                                     [n for m in model_parts for n, p in m.named_parameters() if p.requires_grad],
                                     "trainable parameter of the model")
    for key in [k for k in MUON_4BIT_KEYS if k in muon_keys_set(lowbit)]:
        if MUON_OPTIMIZERS[name]["state_format"] != "4bit":
            four_bit = [n for n, o in MUON_OPTIMIZERS.items() if o["state_format"] == "4bit"]
            raise ValueError(
                f"[lowbit] {key} = {getattr(lowbit, key)!r} {MOMENTUM_4BIT_OPTIONS[MUON_4BIT_KEYS[key]][1]}, but "
                f"[optimizer] name = {name!r} keeps a {MUON_OPTIMIZERS[name]['state_format']} one. Choose "
                f"{' or '.join(four_bit)}, or remove it.")
    return LowBitMuon, {**shared, "momentum": lowbit.muon_momentum, "adamw_fqns": adamw_fqns,
                        **{option: getattr(lowbit, key) for key, option in MUON_4BIT_KEYS.items()},
                        "adamw_options": adamw_options, **MUON_OPTIMIZERS[name]}


class LowBitOptimizersContainer(OptimizersContainer):
    """torchtitan's container (one optimizer per model part, as under pipeline
    parallelism) whose step settles the non-finite checks of every part before it steps
    any (``lowbit_optimizers.settled_step``)."""

    def step(self, *args, **kwargs) -> None:
        # Each optimizer's own step, as torchtitan's container steps them; not through
        # OptimizersContainer.step, which torch may have wrapped with the step hooks too
        # (once any plain container exists): this container's hooks would run twice.
        settled_step(self.optimizers, lambda: [opt.step(*args, **kwargs) for opt in self.optimizers],
                     lambda i: f"model part {i}", "model parts")


class LowBitOptimizersInBackwardContainer(OptimizersInBackwardContainer):
    """torchtitan's container for ``[optimizer] early_step_in_backward`` (one optimizer per
    parameter, stepped by a hook as soon as the parameter's gradient is ready) whose state
    dict holds every optimizer's states. torchtitan's own pairs model parts with
    optimizers one to one: with one model part and an optimizer per parameter it would
    save and load the first parameter's states only, and a resumed run would start every
    other parameter's moments afresh."""

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def _model_part_of_each_optimizer(self) -> list[nn.Module]:
        part_of = {p: m for m in self.model_parts for p in m.parameters()}
        return [part_of[opt.param_groups[0]["params"][0]] for opt in self.optimizers]

    def state_dict(self) -> dict:
        return {k: v for model, opt in zip(self._model_part_of_each_optimizer(), self.optimizers)
                for k, v in get_optimizer_state_dict(model, opt, options=self._OPTIONS).items()}

    def load_state_dict(self, state_dict: dict) -> None:
        for model, opt in zip(self._model_part_of_each_optimizer(), self.optimizers):
            set_optimizer_state_dict(model, opt, optim_state_dict=state_dict, options=self._OPTIONS)


def _fp32_states_share(optimizers: OptimizersContainer, lowbit: LowBit) -> str:
    """What ``[lowbit] fp32_states`` selected, for the start-up line: the parameters in
    its fp32 group (:func:`param_groups`) and their share of all parameter elements."""
    if not lowbit.fp32_states:
        return ""
    groups = [g for opt in optimizers for g in opt.param_groups]
    chosen = [p for g in groups if g["state_format"] == FP32_STATES_FORMAT for p in g["params"]]
    total = sum(p.numel() for g in groups for p in g["params"])
    share = sum(p.numel() for p in chosen) / max(total, 1)
    return (f"; fp32 states for {len(chosen)} param{'s' if len(chosen) != 1 else ''}, {share:.1%} of the "
            "elements, by [lowbit] fp32_states")


def describe(optimizers: OptimizersContainer, optimizer_name: str, lowbit: LowBit, converters) -> str:
    """The one start-up line saying what titan_lowbit changed."""
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
    first = next(iter(optimizers))
    if is_muon(first):
        fmt = first.defaults["state_format"]
        opt_desc = (f"{optimizer_name} (titan_lowbit, state format {fmt}: {muon_share(first)}"
                    f"{_fp32_states_share(optimizers, lowbit)})")
    elif is_lowbit(first):
        fmt = first.defaults["state_format"]
        opt_desc = f"{optimizer_name} (titan_lowbit, state format {fmt}{_fp32_states_share(optimizers, lowbit)})"
    else:
        opt_desc = f"{optimizer_name} (torch, state in parameter dtype)"
    update = lowbit.weight_update if "bfloat16" in dtypes else "exact (fp32 weights)"
    per_param = state_bytes_per_param(optimizers)
    return (
        f"titan_lowbit: converters {list(converters) or 'none'}; optimizer {opt_desc}; "
        f"weights {'/'.join(dtypes)}, bf16 update {update}; optimizer state "
        f"{per_param:.3f} B/param vs {FP32_ADAMW_STATE_BYTES:.0f} for fp32 AdamW "
        f"({FP32_ADAMW_STATE_BYTES / max(per_param, 1e-9):.2f}x less)"
    )


def wrap_build_optimizers(base_builder, config_of: Callable[[list[nn.Module]], object]):
    """Wrap a train spec's ``build_optimizers_fn``; ``config_of(model_parts)`` returns
    the JobConfig the model parts were parallelized with."""

    @functools.wraps(base_builder)
    def build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None):
        job_config = config_of(model_parts)
        lowbit = lowbit_of(job_config)
        optimizers = build_lowbit_optimizers(
            model_parts,
            optimizer_config,
            parallel_dims,
            ft_manager,
            lowbit=lowbit,
            seed=job_config.debug.seed or 0,
            base_builder=base_builder,
        )
        hand_init_masters(optimizers)
        logger.info(describe(optimizers, optimizer_config.name, lowbit, job_config.model.converters))
        return optimizers

    build_optimizers.titan_lowbit_wrapped = True
    return build_optimizers
