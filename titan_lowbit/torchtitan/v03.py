"""The torchtitan 0.3 line: titan_lowbit through 0.3's own mechanisms.

torchtitan 0.3 configures a run with Python (``Trainer.Config`` trees from a
``config_registry``), builds every component from its ``Config`` and lets any config node
be swapped by an ``@override`` factory named in ``--override.imports``. titan_lowbit
plugs in at those points, without touching torchtitan's module state:

- :class:`LowBitOptimizersContainer` is torchtitan's ``OptimizersContainer`` with
  titan_lowbit's optimizer names (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``, ``Adam*``)
  valid as a param group's ``optimizer_name``: "8-bit AdamW for the matrices, torch AdamW
  for norms and embeddings" is one config. A group's ``optimizer_kwargs`` take
  LowBitAdamW's per-group options (``weight_update``, ``block_size``,
  ``min_quantized_numel``); ``optimizer_factory_kwargs_by_name`` its per-optimizer ones
  (``nonfinite_grad``, ``seed``). A torch ``Adam``/``AdamW`` group given a bf16 update
  rule torch lacks is stepped by LowBitAdamW with fp32 states, as on the 0.2 line.
  The Muon names (``Muon``, ``Muon8bit``, ``Muon4bit``, ``MuonFp8``) are param-group
  names too, built as one ``LowBitMuon`` per model part (:func:`_build_muon`).
- :class:`BitNetLinear` is torchtitan's ``Linear`` with a BitNet b1.58 weight;
  :class:`BitNetConverter` (a ``ModelConfigConverter``) puts it in place of the
  ``Linear`` configs whose FQN matches its globs (default: every linear of the
  transformer layers, so the output head stays in high precision).
- :class:`LowBitTrainer` is torchtitan's ``Trainer`` that also takes the CPU path where
  there is no GPU (gloo, the kernels' PyTorch references), initializes bf16 weights whose
  param group keeps fp32 master weights in fp32 and starts the masters from that init
  (:mod:`titan_lowbit.torchtitan.fp32_init`), refuses what would not work,
  precomputes the sharded BitNet weights' scales after each optimizer step with one
  all-reduce, checks a checkpoint's optimizer layout before loading it and hands async
  saves optimizer states torch can stage (:class:`CheckedCheckpointManager`), and logs one
  line saying what titan_lowbit changed.
- :class:`HealthMetricsProcessor` is torchtitan's ``MetricsProcessor`` whose
  ``optimizer_health`` switch (``--metrics.optimizer_health`` in the ready configs) adds
  the titan_lowbit optimizers' health to every logged step, on the console and in
  torchtitan's loggers.
- ``@override`` factories for configs titan_lowbit did not write:
  :func:`lowbit_adamw` (every ``Adam``/``AdamW`` group becomes a titan_lowbit optimizer),
  :func:`lowbit_muon` (the low-bit AdamW groups become a Muon name), :func:`bitnet`
  (the transformer layers' linears become BitNet linears) and :func:`optimizer_health`
  (torchtitan's metrics processor becomes :class:`HealthMetricsProcessor`, switched on).

The ready configs are in :mod:`titan_lowbit.torchtitan.config_registry`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import create_mask
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchtitan.components.checkpointer import AsyncMode, CheckpointManager
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.override import derive, override
from torchtitan.models.common import RMSNorm
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.common.decoder_sharding import norm_config
from torchtitan.models.common.linear import Linear
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module
from torchtitan.trainer import Trainer

from titan_lowbit.bitnet.converter import convert_to_bitnet
from titan_lowbit.bitnet.linear import BitNetLinear as _BitNetForward
from titan_lowbit.bitnet.weight import local_training_weight, precompute_scales
from titan_lowbit.kernels.private_apis import private_api_ok
from titan_lowbit.optim.master_start import MASTER_UPDATES
from titan_lowbit.torchtitan import cpu_device, datasets
from titan_lowbit.torchtitan.fp32_init import hand_init_masters, wrap_init_weights
from titan_lowbit.torchtitan.health_metrics import OptimizerHealthLogging, lowbit_optimizers
from titan_lowbit.torchtitan.lowbit_optimizers import (
    FP32_ADAMW_STATE_BYTES,
    TORCH_OPTIMIZERS,
    check_muon_skip,
    is_lowbit,
    is_muon,
    muon_share,
    settled_step,
    state_bytes_per_param,
)
from titan_lowbit.torchtitan.lr_schedule import remember_schedule, schedule_change, write_schedule
from titan_lowbit.torchtitan.unrecorded_options import UnrecordedOptions, unrecorded_entries

logger = logging.getLogger(__name__)

# LowBitAdamW's options, by where torchtitan 0.3 passes them: a param group's
# optimizer_kwargs, or the optimizer's factory kwargs (one value per optimizer).
GROUP_OPTIONS = ("weight_update", "block_size", "min_quantized_numel")
OPTIMIZER_OPTIONS = ("nonfinite_grad", "seed")
# LowBitMuon's per-optimizer option beside those: the name fragments of the 2-D parameters
# its inner AdamW steps (default muon_groups.DEFAULT_ADAMW_FQNS).
MUON_OPTIMIZER_OPTIONS = (*OPTIMIZER_OPTIONS, "adamw_fqns")
# torchtitan's implementation switch, which it adds to every group: titan_lowbit's
# optimizers always run their own fused multi-tensor kernel.
IMPLEMENTATION_KEYS = ("fused", "foreach")


def _put(parent, attr, config) -> None:
    """Put ``config`` where ``traverse`` found a node: a list item or a dataclass field."""
    if isinstance(parent, list):
        parent[attr] = config
    else:
        setattr(parent, attr, config)


def lowbit_names() -> list[str]:
    """titan_lowbit's optimizer names (torch's Adam/AdamW are torchtitan's own)."""
    from titan_lowbit.optim import MUON_OPTIMIZERS, OPTIMIZERS

    return [n for n in OPTIMIZERS if n not in TORCH_OPTIMIZERS] + list(MUON_OPTIMIZERS)


def _checked_groups(name: str, param_groups: list[dict[str, Any]], fixed: dict[str, Any]) -> list[dict[str, Any]]:
    """The param groups torchtitan gathered under titan_lowbit's ``name`` without its
    implementation switch, refused where a group sets what the name fixes (``fixed``)
    or a bf16 update rule for fp32 weights."""
    groups = []
    for group in param_groups:
        group = {k: v for k, v in group.items() if k not in IMPLEMENTATION_KEYS}
        clash = sorted(set(fixed) & set(group))
        if clash:
            raise ValueError(
                f"optimizer {name!r}: optimizer_kwargs sets {clash}, which the name fixes "
                f"({fixed}); remove {'them' if len(clash) > 1 else 'it'}, or name the "
                "optimizer that has the format wanted"
            )
        if group.get("weight_update", "nearest") != "nearest" and not any(
                p.dtype == torch.bfloat16 for p in group["params"]):
            names = group.get("param_names") or []
            raise ValueError(
                f"optimizer {name!r}: weight_update = {group['weight_update']!r} rounds AdamW's result "
                f"into bf16 weights, but the group's parameters ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}) are all fp32 (updated exactly). Train in bf16 "
                "(--training.dtype bfloat16) for full-BF16 training, or remove weight_update."
            )
        groups.append(group)
    return groups


def _check_factory_kwargs(name: str, optimizer_kwargs: dict[str, Any], valid: tuple[str, ...],
                          group_options: tuple[str, ...]) -> None:
    unknown = sorted(set(optimizer_kwargs) - set(valid))
    if unknown:
        raise ValueError(
            f"optimizer_factory_kwargs_by_name[{name!r}] has {unknown}; {name} takes {list(valid)} there, "
            f"and the per-group options {list(group_options)} in a param group's optimizer_kwargs"
        )


def _build_lowbit(name: str, param_groups: list[dict[str, Any]], **optimizer_kwargs) -> torch.optim.Optimizer:
    """Build LowBitAdamW for the param groups torchtitan gathered under ``name``."""
    from titan_lowbit.optim import OPTIMIZERS, LowBitAdamW

    groups = _checked_groups(name, param_groups, OPTIMIZERS[name])
    _check_factory_kwargs(name, optimizer_kwargs, OPTIMIZER_OPTIONS, GROUP_OPTIONS)
    return LowBitAdamW(groups, **optimizer_kwargs, **OPTIMIZERS[name])


def _build_muon(name: str, param_groups: list[dict[str, Any]], **optimizer_kwargs) -> torch.optim.Optimizer:
    """Build LowBitMuon for the param groups torchtitan gathered under Muon name ``name``.

    torchtitan routes parameters to optimizer names by regex, but Muon's own rule (2-D
    matrices to Muon; norms, biases, embeddings and the head to AdamW) is by shape and
    name, and LowBitMuon keeps both parts in one optimizer. So a Muon name's group is
    handed to LowBitMuon whole and split there: its 2-D parameters whose FQN contains none
    of ``adamw_fqns`` go to Muon, the rest to the inner AdamW (two param groups in this
    optimizer, Muon's first); ``use_muon`` in a group's ``optimizer_kwargs`` says it
    instead. A group's ``optimizer_kwargs`` reach the part they belong to: ``betas`` and
    ``eps`` the inner AdamW, ``momentum`` (and LowBitMuon's other Muon options) Muon,
    ``lr``, ``weight_decay``, ``weight_update``, ``block_size`` and
    ``min_quantized_numel`` both. Groups of other names (e.g. torch's ``AdamW`` for norms
    and embeddings) stay as they are: a parameter routed there never reaches Muon."""
    from titan_lowbit.optim import MUON_OPTIMIZERS, LowBitMuon
    from titan_lowbit.optim.muon_groups import MUON_ONLY_OPTIONS

    groups = _checked_groups(name, param_groups, MUON_OPTIMIZERS[name])
    _check_factory_kwargs(name, optimizer_kwargs, MUON_OPTIMIZER_OPTIONS, (*GROUP_OPTIONS, *MUON_ONLY_OPTIONS))
    return LowBitMuon(groups, **optimizer_kwargs, **MUON_OPTIMIZERS[name])


def _wants_lowbit(group_options: dict[str, Any], optimizer_options: dict[str, Any]) -> bool:
    """Whether a torch ``Adam``/``AdamW`` group needs LowBitAdamW: a bf16 update rule
    other than torch's round-to-nearest, or the non-finite policy."""
    return group_options.get("weight_update", "nearest") != "nearest" or "nonfinite_grad" in optimizer_options


def _build_torch_or_lowbit(name: str, param_groups: list[dict[str, Any]], **optimizer_kwargs) -> torch.optim.Optimizer:
    """torch's Adam/AdamW, as torchtitan builds them, unless a group asks for an option
    torch's lacks (a bf16 update rule, the non-finite policy): then LowBitAdamW with fp32
    states, the same math with that option."""
    if any(_wants_lowbit(g, optimizer_kwargs) for g in param_groups):
        return _build_lowbit(name, param_groups, **optimizer_kwargs)
    for group in param_groups:
        ignored = [k for k in GROUP_OPTIONS if k in group and k != "weight_update"]
        if ignored:
            raise ValueError(
                f"optimizer {name!r} is torch's {name}, which has no option {', '.join(ignored)}; remove "
                f"{'them' if len(ignored) > 1 else 'it'}, or name a titan_lowbit optimizer ({', '.join(lowbit_names())})"
            )
    torch_groups = [{k: v for k, v in g.items() if k != "weight_update"} for g in param_groups]
    torch_kwargs = {k: v for k, v in optimizer_kwargs.items() if k != "seed"}
    return OptimizersContainer._resolve_optimizer_factory(name)(torch_groups, **torch_kwargs)


class LowBitOptimizersContainer(OptimizersContainer):
    """torchtitan 0.3's optimizer container with titan_lowbit's optimizer names.

    Everything else is torchtitan's: regex param groups (first match wins), one optimizer
    per name and model part, the flat FQN-keyed state dict for DCP. titan_lowbit's
    optimizers create their states when built, so torchtitan's zero-gradient, zero-lr
    initialisation step before a checkpoint save or load finds them and does nothing
    (weights, states and the stochastic-rounding stream stay as they are). Its step
    settles the non-finite checks of all titan_lowbit optimizers first
    (``lowbit_optimizers.settled_step``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        seed: int | None = None
        """Seed of the stochastic-rounding hash of every titan_lowbit optimizer (with the
        step and the element's global index). None: ``debug.seed`` (0 when that is
        unset) under titan_lowbit's trainer, else 0. An optimizer's own ``seed`` in
        ``optimizer_factory_kwargs_by_name`` wins."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        seed = 0 if config.seed is None else config.seed
        names = {pg.optimizer_name for pg in config.param_groups}
        factory_kwargs = {name: dict(kwargs) for name, kwargs in config.optimizer_factory_kwargs_by_name.items()}
        # torch's names too: LowBitAdamW steps them where a group asks for it
        for name in names & {*lowbit_names(), *TORCH_OPTIMIZERS}:
            factory_kwargs.setdefault(name, {}).setdefault("seed", seed)
        super().__init__(replace(config, optimizer_factory_kwargs_by_name=factory_kwargs),
                         model_parts=model_parts)
        check_muon_skip(self.optimizers, self._optimizer_name)
        hand_init_masters(self.optimizers)  # the fp32 init of the master weights (master_weight_params)
        if config.implementation != "fused" and any(is_lowbit(o) for o in self.optimizers):
            logger.info(f"titan_lowbit: optimizer implementation = {config.implementation!r} applies to "
                        "torch's optimizers; titan_lowbit's run their own fused kernel")
        logger.info(describe(self))

    def _optimizer_name(self, i: int) -> str:
        return f"optimizer {i} ({type(self.optimizers[i]).__name__})"

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        from titan_lowbit.optim import MUON_OPTIMIZERS

        if name in MUON_OPTIMIZERS:
            return functools.partial(_build_muon, name)
        if name in lowbit_names():
            return functools.partial(_build_lowbit, name)
        if name in TORCH_OPTIMIZERS:
            return functools.partial(_build_torch_or_lowbit, name)
        try:
            return OptimizersContainer._resolve_optimizer_factory(name)
        except NotImplementedError:
            raise ValueError(
                f"optimizer_name {name!r} is not a known optimizer; titan_lowbit's container knows "
                f"{sorted(set(lowbit_names()) | set(TORCH_OPTIMIZERS))} and torchtitan's own"
            ) from None

    def step(self, closure=None) -> None:
        assert closure is None, "OptimizersContainer does not support closures"
        # Each optimizer's own step, as torchtitan's container steps them; not through
        # OptimizersContainer.step, which torch may have wrapped with the step hooks too
        # (once any plain container exists): this container's hooks would run twice.
        settled_step(self.optimizers, lambda: [opt.step() for opt in self.optimizers], self._optimizer_name,
                     "optimizers")


def describe(optimizers: OptimizersContainer) -> str:
    """The one start-up line saying what titan_lowbit changed."""
    parts = []
    for opt in optimizers:
        params = [p for g in opt.param_groups for p in g["params"]]
        dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in params}))
        if is_lowbit(opt):
            updates = "/".join(sorted({g["weight_update"] for g in opt.param_groups}))
            fmt = "/".join(sorted({g["state_format"] for g in opt.param_groups}))
            update = updates if "bfloat16" in dtypes else "exact (fp32 weights)"
            muon = f" ({muon_share(opt)})" if is_muon(opt) else ""
            parts.append(f"{len(params)} params: titan_lowbit {fmt} states{muon}, weights {dtypes}, "
                         f"bf16 update {update}")
        else:
            parts.append(f"{len(params)} params: torch {type(opt).__name__}, weights {dtypes}")
    bitnet = sum(1 for m in optimizers.model_parts for p in m.parameters() if local_training_weight(p) is not None)
    per_param = state_bytes_per_param(optimizers)
    return (f"titan_lowbit: {'; '.join(parts)}; BitNet linears {bitnet}; optimizer state {per_param:.3f} "
            f"B/param vs {FP32_ADAMW_STATE_BYTES:.0f} for fp32 AdamW "
            f"({FP32_ADAMW_STATE_BYTES / max(per_param, 1e-9):.2f}x less)")


# ----------------------------------------------------------------------------------------
# BitNet
# ----------------------------------------------------------------------------------------
def _input_norm(config) -> "RMSNorm | None":
    return None if config.input_norm is None else config.input_norm.build()


def _parallelize_input_norm(module: nn.Module, parallel_dims) -> None:
    """Give a linear's SubLN input norm the sharding of torchtitan's block norms (replicated
    weight), so that FSDP2 shards it like them; the norm of a tensor-parallel linear's
    input would need the features of every TP rank."""
    if module.input_norm is None:
        return
    if parallel_dims.tp > 1:
        raise ValueError(
            "BitNet SubLN (BitNetSubLNConverter) with tensor parallelism: the input norm of a "
            "row-parallel linear needs the features of every TP rank; set "
            "--parallelism.tensor_parallel_degree 1 (as the 0.2 line's bitnet_subln does)."
        )
    module.input_norm._sharding_config = norm_config(enable_sp=False)


class SubLNLinear(Linear):
    """torchtitan's ``Linear`` whose input first passes its own RMSNorm (BitNet's SubLN:
    BitLinear normalizes its own input); see :class:`BitNetSubLNConverter`."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        input_norm: RMSNorm.Config | None = None

    def __init__(self, config: Config):
        super().__init__(config)
        self.input_norm = _input_norm(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x if self.input_norm is None else self.input_norm(x))

    def parallelize(self, parallel_dims) -> None:
        _parallelize_input_norm(self, parallel_dims)
        super().parallelize(parallel_dims)


class BitNetLinear(_BitNetForward, Linear):
    """torchtitan's ``Linear`` whose weight is a BitNet b1.58 training weight: ternary
    weight (abs-mean scale) x int8 activation (row abs-max) on int8 tensor cores, a
    straight-through gradient; its state dict holds the plain latent weight. With an
    ``input_norm`` (SubLN), its input first passes that RMSNorm."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        int8_backward: bool = True
        """Compute grad_input on int8 tensor cores (grad_output quantized row-wise);
        False computes it in the activation dtype."""
        input_norm: RMSNorm.Config | None = None

    def __init__(self, config: Config):
        Linear.__init__(self, config)
        self.input_norm = _input_norm(config)
        convert_to_bitnet(self, filter_fqns=[], int8_backward=config.int8_backward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BitNetForward.forward(self, x if self.input_norm is None else self.input_norm(x))

    def parallelize(self, parallel_dims) -> None:
        _parallelize_input_norm(self, parallel_dims)
        Linear.parallelize(self, parallel_dims)


class NoBlockNorm(Module):
    """Stands where a block's ``attention_norm`` / ``ffn_norm`` was under SubLN: the
    linears of the block normalize their own inputs."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config):
        super().__init__()

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (torchtitan's norm argument name)
        return input


BITNET_FQNS = ["layers.*"]


def to_bitnet(cfg: Linear.Config, int8_backward: bool = True) -> BitNetLinear.Config:
    """The BitNet linear config in place of a plain ``Linear`` config."""
    if isinstance(cfg, BitNetLinear.Config):
        if cfg.int8_backward != int8_backward:
            raise ValueError(
                f"BitNet: a linear converted with int8_backward={cfg.int8_backward} is converted "
                f"again with int8_backward={int8_backward}, which would not change it; convert once, "
                "with the setting wanted")
        return cfg
    if type(cfg) not in (Linear.Config, SubLNLinear.Config):
        raise ValueError(
            f"BitNet: {type(cfg).__qualname__} is a linear with math of its own (a float8/MX/NVFP4 "
            "or tensor-parallel variant); BitNet would replace it. Leave it out of the BitNet FQNs, "
            "or drop the other converter."
        )
    return derive(cfg, BitNetLinear.Config, int8_backward=int8_backward)


class BitNetConverter(ModelConfigConverter):
    """Model converter: the ``Linear`` configs whose FQN matches ``fqns`` become
    :class:`BitNetLinear` configs. Pass it to a model registry's ``converters``, e.g.
    ``model_registry("debugmodel", converters=[BitNetConverter.Config()])``."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        fqns: list[str] = field(default_factory=lambda: list(BITNET_FQNS))
        """FQN globs (fnmatch; ``*`` crosses dots) of the linears to convert; the default
        takes every linear of the transformer layers and leaves the output head."""
        int8_backward: bool = True

    def __init__(self, config: Config):
        self.config = config

    def convert(self, model_config):
        converted = []
        for fqn, cfg, parent, attr in list(model_config.traverse(Linear.Config)):
            if any(fnmatch(fqn, glob) for glob in self.config.fqns):
                new = to_bitnet(cfg, self.config.int8_backward)
                _put(parent, attr, new)
                converted.append(fqn)
        if not converted:
            raise ValueError(f"BitNetConverter: fqns = {self.config.fqns} match no Linear of "
                             f"{type(model_config).__qualname__}; fix the globs")
        _CONVERTED.append((model_config, converted))
        return model_config


# (model config, FQNs of its BitNet linears) for every BitNetConverter.convert: a converter
# listed after it (float8, MX, NVFP4) replaces every Linear config it matches, BitNet's
# included, and nothing else would tell (check_bitnet_kept).
_CONVERTED: list[tuple[object, list[str]]] = []


def check_bitnet_kept(model_config) -> None:
    """Refuse a model whose BitNet linears another converter replaced after BitNetConverter."""
    for converted_config, fqns in _CONVERTED:
        if converted_config is not model_config:
            continue
        now = {fqn: cfg for fqn, cfg, _, _ in model_config.traverse(Linear.Config)}
        lost = [f"{fqn} ({type(now.get(fqn)).__qualname__})" for fqn in fqns
                if not isinstance(now.get(fqn), BitNetLinear.Config)]
        if lost:
            raise ValueError(
                f"BitNet: a converter after BitNetConverter replaced {len(lost)} of its linears "
                f"({', '.join(lost[:2])}{', ...' if len(lost) > 2 else ''}): both replace the math of "
                "those layers, and BitNet would silently not apply. Use one of them, or narrow "
                "their FQNs to disjoint layers."
            )


class BitNetSubLNConverter(ModelConfigConverter):
    """Model converter for llama3: SubLN, an RMSNorm on the input of every linear of each
    transformer block (as BitNet's BitLinear normalizes its own input), and the block's
    ``attention_norm``/``ffn_norm`` removed. Independent of :class:`BitNetConverter` and
    commuting with it: a block's linears are normalized whether or not BitNet converts
    them (one left in high precision would otherwise see un-normalized input)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        pass

    def __init__(self, config: Config):
        self.config = config

    def convert(self, model_config):
        blocks = list(model_config.traverse(Llama3TransformerBlock.Config))
        if not blocks:
            raise ValueError(f"BitNetSubLNConverter rewrites llama3 transformer blocks, and "
                             f"{type(model_config).__qualname__} has none; remove the converter")
        for bfqn, block, _, _ in blocks:
            if isinstance(block.attention_norm, NoBlockNorm.Config):
                raise ValueError(f"BitNetSubLNConverter was applied twice to block {bfqn!r}")
            eps = block.attention_norm.eps
            for fqn, lin, parent, attr in list(block.traverse(Linear.Config)):
                norm = RMSNorm.Config(normalized_shape=lin.in_features, eps=eps,
                                      param_init={"weight": nn.init.ones_})
                if type(lin) is Linear.Config:
                    new = derive(lin, SubLNLinear.Config, input_norm=norm)
                elif type(lin) is BitNetLinear.Config:
                    new = replace(lin, input_norm=norm)
                else:
                    raise ValueError(
                        f"BitNetSubLNConverter: {bfqn}.{fqn} is a {type(lin).__qualname__}, a linear "
                        "with math of its own; SubLN normalizes the inputs of plain and BitNet linears")
                _put(parent, attr, new)
            block.attention_norm = NoBlockNorm.Config()
            block.ffn_norm = NoBlockNorm.Config()
        return model_config


@override(target=Linear.Config, fqns=["model_spec.model.layers.*", "layers.*"],
          description="titan_lowbit: BitNet b1.58 linears in the transformer layers")
def bitnet(cfg: Linear.Config, int8_backward: bool = True) -> BitNetLinear.Config:
    """``--override.imports titan_lowbit.torchtitan.v03.bitnet``: every linear of the
    transformer layers becomes a BitNet linear (the output head stays)."""
    return to_bitnet(cfg, int8_backward)


@override(target=OptimizersContainer.Config,
          description="titan_lowbit: low-bit AdamW states and bf16 update rules")
def lowbit_adamw(cfg: OptimizersContainer.Config, name: str = "AdamW8bit", seed: int | None = None,
                 nonfinite_grad: str | None = None, **group_options) -> LowBitOptimizersContainer.Config:
    """``--override.imports 'titan_lowbit.torchtitan.v03.lowbit_adamw={"name": "AdamW8bit",
    "weight_update": "master_remainder"}'``: every AdamW param group, torch's or titan_lowbit's
    (every Adam group for an ``Adam*`` name), becomes ``name`` with the given per-group
    options (``weight_update``, ``block_size``, ``min_quantized_numel``); other groups stay."""
    from titan_lowbit.optim import OPTIMIZERS

    if name not in OPTIMIZERS:
        raise ValueError(f"lowbit_adamw: name = {name!r}; choose one of {sorted(OPTIMIZERS)}")
    family = "AdamW" if OPTIMIZERS[name]["decoupled_weight_decay"] else "Adam"
    members = {n for n, options in OPTIMIZERS.items() if n.startswith(family)
               and options["decoupled_weight_decay"] == OPTIMIZERS[name]["decoupled_weight_decay"]}
    return _renamed(cfg, "lowbit_adamw", name, members, f"the {family} groups", group_options,
                    dict(nonfinite_grad=nonfinite_grad), seed)


@override(target=OptimizersContainer.Config,
          description="titan_lowbit: Muon with low-bit momentum")
def lowbit_muon(cfg: OptimizersContainer.Config, name: str = "Muon8bit", seed: int | None = None,
                nonfinite_grad: str | None = None, adamw_fqns: list[str] | None = None,
                **group_options) -> LowBitOptimizersContainer.Config:
    """``--override.imports 'titan_lowbit.torchtitan.v03.lowbit_muon={"name": "Muon8bit",
    "weight_update": "stochastic"}'``: the groups of titan_lowbit's AdamW names
    (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) become Muon name ``name``, or, in a config
    without any, the groups of torch's ``AdamW``; with the given per-group options
    (``weight_update``, ``block_size``, ``min_quantized_numel``, ``momentum`` and
    LowBitMuon's other Muon options). Other groups stay: in the ready configs, torch's
    AdamW keeps the norms, biases and embeddings, and the Muon name's inner AdamW steps the
    output head (``adamw_fqns``, default LowBitMuon's: embeddings and heads by name)."""
    from titan_lowbit.optim import MUON_OPTIMIZERS, OPTIMIZERS
    from titan_lowbit.optim.muon_groups import MUON_ONLY_OPTIONS

    if name not in MUON_OPTIMIZERS:
        raise ValueError(f"lowbit_muon: name = {name!r}; choose one of {sorted(MUON_OPTIMIZERS)}")
    lowbit_adamw_names = {n for n, o in OPTIMIZERS.items() if o["decoupled_weight_decay"] and n not in TORCH_OPTIMIZERS}
    present = {pg.optimizer_name for pg in cfg.param_groups}
    members = lowbit_adamw_names if present & lowbit_adamw_names else {"AdamW"}
    return _renamed(cfg, "lowbit_muon", name, members, f"the groups of {sorted(members)}", group_options,
                    dict(nonfinite_grad=nonfinite_grad, adamw_fqns=adamw_fqns), seed,
                    (*GROUP_OPTIONS, *MUON_ONLY_OPTIONS))


def _renamed(cfg: OptimizersContainer.Config, who: str, name: str, members: set[str], what: str,
             group_options: dict[str, Any], factory_options: dict[str, Any], seed: int | None,
             valid: tuple[str, ...] = GROUP_OPTIONS) -> LowBitOptimizersContainer.Config:
    """``cfg`` as a LowBitOptimizersContainer config whose param groups named one of
    ``members`` are named ``name``, with ``group_options`` over their optimizer_kwargs,
    ``factory_options`` (those not None) as ``name``'s factory kwargs and ``seed``; for
    override ``who``, which replaces ``what``."""
    unknown = sorted(set(group_options) - set(valid))
    if unknown:
        raise ValueError(f"{who}: unknown option(s) {unknown}; valid: name, seed, "
                         f"{', '.join(factory_options)}, {', '.join(valid)}")
    groups, matched = [], 0
    for pg in cfg.param_groups:
        if pg.optimizer_name in members:
            pg = replace(pg, optimizer_name=name, optimizer_kwargs={**pg.optimizer_kwargs, **group_options})
            matched += 1
        groups.append(pg)
    if not matched:
        raise ValueError(f"{who}: name = {name!r} replaces {what}, but the config's "
                         f"param groups use {sorted({pg.optimizer_name for pg in cfg.param_groups})}")
    factory = {k: dict(v) for k, v in cfg.optimizer_factory_kwargs_by_name.items()}
    for key, value in factory_options.items():
        if value is not None:
            factory.setdefault(name, {})[key] = value
    new = derive(cfg, LowBitOptimizersContainer.Config, param_groups=groups,
                 optimizer_factory_kwargs_by_name=factory)
    if seed is not None:
        new.seed = seed
    return new


# ----------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------
def _flat_keys(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """DCP's keys of a nested state dict (dict levels joined by dots, Stateful values by
    their state dicts), with their values."""
    out = {}
    for key, value in tree.items():
        if not isinstance(value, (dict, torch.Tensor)) and callable(getattr(value, "state_dict", None)):
            value = value.state_dict()  # a Stateful (the optimizer container), as DCP reads it
        if isinstance(value, dict):
            out.update(_flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _param_of(key: str, prefix: str) -> str:
    """The parameter FQN of a flat optimizer key: ``prefix`` + FQN + ``.`` + entry."""
    return key.removeprefix(prefix).rpartition(".")[0]


def optimizer_layout_problem(state_dict: dict[str, Any], metadata) -> str | None:
    """How the optimizer states a run would load differ from a checkpoint's (entries that
    one side has and the other lacks, or other global shapes), per parameter; None when
    they agree. An 8-bit checkpoint read by a 4-bit or fp32-state run (or back) differs
    there; DCP itself would stop at the first such entry without saying why.

    Only the parameters this rank's optimizers hold are compared (their param-group
    entries name them, with or without states): under pipeline parallelism a rank holds
    its stages' parameters, and the checkpoint every stage's."""
    saved = metadata.state_dict_metadata
    flat = _flat_keys(state_dict)
    want = {k: v for k, v in flat.items() if k.startswith("optimizer.state.")}
    have = {k for k in saved if k.startswith("optimizer.state.")}
    if not have:
        return None
    held = {_param_of(k, "optimizer.state.") for k in want}
    held |= {_param_of(k, "optimizer.param_groups.") for k in flat if k.startswith("optimizer.param_groups.")}
    params: dict[str, tuple[set, set]] = {}
    for key in set(want) | {k for k in have if _param_of(k, "optimizer.state.") in held}:
        fqn, _, entry = key.removeprefix("optimizer.state.").rpartition(".")
        mine, theirs = params.setdefault(fqn, (set(), set()))
        if key in want:
            mine.add(entry)
        if key in have:
            theirs.add(entry)
    shapes = [k for k in set(want) & have if isinstance(want[k], torch.Tensor)
              and isinstance(saved[k], TensorStorageMetadata) and tuple(want[k].shape) != tuple(saved[k].size)]
    differ = sorted(fqn for fqn, (mine, theirs) in params.items() if mine != theirs)
    lines = [f"param '{fqn}': the checkpoint holds {sorted(params[fqn][1]) or 'no optimizer state'}, this run "
             f"{sorted(params[fqn][0]) or 'no optimizer state'}" for fqn in differ[:3]]
    lines += [f"'{k}': {tuple(saved[k].size)} in the checkpoint, {tuple(want[k].shape)} in this run"
              for k in sorted(shapes)[:3]]
    if not lines:
        return None
    more = len(differ) + len(shapes) - len(lines)
    return "; ".join(lines) + (f" (and {more} more)" if more > 0 else "")


def async_stageable(tree: Any) -> Any:
    """``tree`` (a state dict to save; Stateful values by their state dicts) with a copy of
    every DTensor whose wrapper starts past its storage's first element, for torch's async
    save.

    titan_lowbit's optimizer states are views into one buffer per dtype (LowBitAdamW's
    arenas), and a DTensor over such a view takes the view's storage offset: its
    ``data_ptr()`` is not 0, which DCP's async staging (StateDictStager) takes for a plain
    tensor with storage of its own, and the save fails ("copy_() on an invalid python
    storage"). A copy starts at its storage's first element. It lives until torch has
    staged the state dict: for ``async``, the save call (torch stages before it returns)."""
    if isinstance(tree, DTensor):
        if tree.storage_offset() == 0:
            return tree
        return DTensor.from_local(tree.to_local().clone(), tree.device_mesh, tree.placements, run_check=False,
                                  shape=tree.shape, stride=tree.stride())
    if isinstance(tree, dict):
        return {k: async_stageable(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(async_stageable(v) for v in tree)
    if not isinstance(tree, torch.Tensor) and callable(getattr(tree, "state_dict", None)):
        return async_stageable(tree.state_dict())  # a Stateful, as DCP reads it
    return tree


class CheckedCheckpointManager(CheckpointManager):
    """torchtitan's checkpoint manager that, before DCP loads a checkpoint, compares its
    optimizer states with the run's and stops naming the parameters and the setting when
    they were written by another optimizer layout (name, state format, block size,
    weight_update): DCP would fail on the first missing key, or, where the shapes agree (8
    bit against fp8 codes), load bytes of another format. Every save carries the LR
    schedule's settings; an async one gets the optimizer states as torch can stage them
    (:func:`async_stageable`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized) -> None:
        if not from_hf and (warning := schedule_change(state_dict.get("lr_scheduler"), checkpoint_id)):
            logger.warning(warning)
        if not from_hf and "optimizer" in state_dict:
            metadata = FileSystemReader(checkpoint_id).read_metadata()
            problem = optimizer_layout_problem(state_dict, metadata)
            if problem:
                raise ValueError(
                    f"checkpoint {checkpoint_id} was written with another optimizer state layout: "
                    f"{problem}. Resume with the optimizer settings that wrote it (optimizer names, "
                    "block_size, min_quantized_numel, weight_update, momentum_4bit_factor_rank of the param "
                    "groups), or load the "
                    "model alone (--checkpoint.initial_load_path with --checkpoint.initial_load_model_only).")
            # a checkpoint from before a param-group option existed (unrecorded_options)
            if unrecorded := unrecorded_entries(state_dict["optimizer"].state_dict(), metadata.state_dict_metadata):
                state_dict = {**state_dict, "optimizer": UnrecordedOptions(state_dict["optimizer"], unrecorded)}
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False,
                 to_hf=False):
        # The schedule's settings go into the step folder before DCP starts writing: an
        # async save (--checkpoint.async_mode async) returns while its files are written in
        # the background. The folder counts as a checkpoint only once DCP's .metadata is
        # there, so a save that never finishes leaves nothing a resume would pick.
        if not to_hf:
            write_schedule(self.states.get("lr_scheduler"), checkpoint_id)
        if async_mode != AsyncMode.DISABLED:
            state_dict = async_stageable(state_dict)
        return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)


# ----------------------------------------------------------------------------------------
# optimizer health metrics
# ----------------------------------------------------------------------------------------
class HealthMetricsProcessor(OptimizerHealthLogging, MetricsProcessor):
    """torchtitan 0.3's MetricsProcessor that, with ``optimizer_health`` on, also logs the
    titan_lowbit optimizers' health at every logged step, to the console and torchtitan's
    loggers (:mod:`titan_lowbit.torchtitan.health_metrics`); off, it is torchtitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        optimizer_health: bool = False
        """At every step logged (``log_freq``), the titan_lowbit optimizers' health: largest
        update over lr, quantized second moments at their smallest code, skipped steps, bf16
        updates lost to rounding or the Kahan/master residual in ulps; a second console
        line and ``optimizer_health/*`` in TensorBoard / W&B (docs/health_metrics.md). One
        more read of the optimizer states on logged steps, nothing on the others."""

    def reports_health(self) -> bool:
        return self.config.optimizer_health

    # torchtitan's Trainer hands the processor its optimizer container by setting this
    # attribute once, after building the optimizers: the start-up moment to refuse a run
    # whose optimizers titan_lowbit cannot read.
    @property
    def optimizers(self) -> OptimizersContainer | None:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, container: OptimizersContainer | None) -> None:
        if container is not None and self.config.optimizer_health and not lowbit_optimizers(container):
            torch_names = sorted({type(opt).__name__ for opt in container})
            raise ValueError(
                f"metrics.optimizer_health: no optimizer of this run is titan_lowbit's (only torch's "
                f"{', '.join(torch_names)}), and the health numbers are read from titan_lowbit's states. "
                f"Name a titan_lowbit optimizer in the param groups ({', '.join(lowbit_names())}; or the "
                "lowbit_adamw override), give torch's Adam/AdamW a bf16 weight_update (stepped by "
                "titan_lowbit with fp32 states), or turn optimizer_health off.")
        self._optimizers = container


@override(target=MetricsProcessor.Config,
          description="titan_lowbit: the optimizer's health at every logged step")
def optimizer_health(cfg: MetricsProcessor.Config) -> HealthMetricsProcessor.Config:
    """``--override.imports titan_lowbit.torchtitan.v03.optimizer_health``: the config's
    metrics processor, torchtitan's own, becomes :class:`HealthMetricsProcessor` with
    ``optimizer_health`` on (its other settings kept); in configs titan_lowbit did not
    write, where ``--metrics.optimizer_health`` does not exist."""
    if not isinstance(cfg, HealthMetricsProcessor.Config) and type(cfg) is not MetricsProcessor.Config:
        raise ValueError(
            f"optimizer_health: this config's metrics processor is {type(cfg).__qualname__}, one of its "
            "own, which titan_lowbit cannot add its numbers to. Remove the override for this config, or "
            "call titan_lowbit.optim.optimizer_health from that processor's log.")
    return derive(cfg, HealthMetricsProcessor.Config, optimizer_health=True)


# ----------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------
def _bitnet_params(model_parts) -> list[nn.Parameter]:
    return [p for m in model_parts for p in m.parameters() if local_training_weight(p) is not None]


def keeps_masters(optimizer_config) -> bool:
    """Whether a param group of ``optimizer_config`` (a LowBitOptimizersContainer's)
    keeps fp32 master weights: weight_update master or master_remainder under an
    optimizer name titan_lowbit builds (its own, or torch's Adam/AdamW, which such an
    update makes LowBitAdamW)."""
    return isinstance(optimizer_config, LowBitOptimizersContainer.Config) and any(
        pg.optimizer_name in {*lowbit_names(), *TORCH_OPTIMIZERS}
        and pg.optimizer_kwargs.get("weight_update") in MASTER_UPDATES for pg in optimizer_config.param_groups)


def master_weight_params(model: nn.Module, optimizer_config) -> list[nn.Parameter]:
    """The bf16 parameters of ``model`` (one model part) that ``optimizer_config``'s
    container will put in a param group keeping fp32 master weights, by torchtitan's own
    assignment of parameters to groups (first matching pattern)."""
    groups, _ = OptimizersContainer._build_param_groups(model, optimizer_config.param_groups, {})
    names = {*lowbit_names(), *TORCH_OPTIMIZERS}
    return [p for name, name_groups in groups.items() if name in names for group in name_groups
            if group.get("weight_update") in MASTER_UPDATES for p in group["params"] if p.dtype == torch.bfloat16]


def _wrap_parallelize(parallelize_fn, on_cpu: bool, trainer_config):
    """torchtitan's ``parallelize_fn`` for one model part, then: with bf16 weights whose
    param groups keep fp32 master weights (``keeps_masters`` of ``trainer_config.optimizer``,
    read here, after torchtitan applied the overrides), the part initializes those weights
    in fp32 and the masters start from that init (:mod:`.fp32_init`; the container takes
    them when built); on the CPU path, gloo's reductions."""
    @functools.wraps(parallelize_fn)
    def parallelize(model, *args, parallel_dims, **kwargs):
        if parallel_dims.tp > 1 and _bitnet_params([model]):
            raise ValueError(
                "BitNet linears with tensor parallelism are not supported on torchtitan 0.3 yet "
                f"(--parallelism.tensor_parallel_degree = {parallel_dims.tp}): use FSDP "
                "(data_parallel_shard_degree), or torchtitan 0.2.x, where BitNet x TP is tested."
            )
        model = parallelize_fn(model, *args, parallel_dims=parallel_dims, **kwargs)
        optimizer_config = trainer_config.optimizer
        if keeps_masters(optimizer_config):
            wrap_init_weights(model, functools.partial(master_weight_params, optimizer_config=optimizer_config))
        if on_cpu:
            cpu_device.use_gloo_reductions(model)
        return model

    parallelize.titan_lowbit_wrapped = True
    return parallelize


class CpuFlexAttention(FlexAttention):
    """The CPU path's stand-in for FlexAttention, which has no backward on the CPU: the
    same attention (the BlockMask's mask, e.g. causal within each document) computed by
    ``F.scaled_dot_product_attention`` with the mask made dense."""

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, score_mod=None, scale=None,
                enable_gqa=False, out_transform=None, **kwargs):
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError(
                "titan_lowbit's CPU path computes FlexAttention as masked SDPA, which has no "
                "score_mod or log-sum-exp output: this model's attention needs a GPU")
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        mask = create_mask(attention_masks.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def _use_cpu_attention(model_config) -> int:
    """Put CpuFlexAttention in place of every FlexAttention config; returns how many."""
    nodes = [(parent, attr, cfg) for _, cfg, parent, attr in model_config.traverse(FlexAttention.Config)
             if type(cfg) is FlexAttention.Config]
    for parent, attr, cfg in nodes:
        new = derive(cfg, CpuFlexAttention.Config)
        _put(parent, attr, new)
    return len(nodes)


def wants_persistent_rows(config: "LowBitTrainer.Config") -> bool:
    """Whether the run compiles a model with BitNet linears and keeps
    ``bitnet_persistent_rows`` on."""
    spec = config.model_spec
    return bool(spec is not None and config.compile.enable and "model" in config.compile.components
                and config.bitnet_persistent_rows and any(True for _ in spec.model.traverse(BitNetLinear.Config)))


def _install_persistent_rows() -> bool:
    """Inductor's one-read row reductions for BitNet's fused row quantizations, where the
    installed torch is a tested one (kernels/private_apis.py); whether they are on."""
    if not private_api_ok("torch"):
        return False
    from titan_lowbit.bitnet import row_reductions

    return row_reductions.install()


def check_cpu_async_mode(checkpoint_config) -> None:
    """Refuse ``async_with_pinned_mem`` on the CPU path: torch stages that save with
    non-blocking copies, which need an accelerator, and would stop at the first save, after
    training up to it. ``async`` (a background thread) writes the same checkpoint."""
    mode = getattr(checkpoint_config, "async_mode", AsyncMode.DISABLED.value)
    if checkpoint_config.enable and mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
        raise ValueError(
            f"--checkpoint.async_mode {mode} stages each save in pinned memory with non-blocking "
            "copies, which need a GPU; on the CPU path torch would stop at the first save. Use "
            "--checkpoint.async_mode async (the same checkpoint, written by a background thread).")


class LowBitTrainer(Trainer):
    """torchtitan 0.3's Trainer with titan_lowbit's CPU path, start-up checks and BitNet
    scale precompute (see the module docstring). Its config is torchtitan's, with one
    more check: the corpus' files exist before anything is built."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        bitnet_persistent_rows: bool = True
        """Under ``--compile.enable`` with BitNet linears, let Inductor keep a row in
        registers (one read of the row) for the row quantizations it fuses, on rows up to
        8192 elements (titan_lowbit/bitnet/row_reductions.py, a private API of torch's:
        only with a tested torch); False keeps Inductor's default. Same math."""

    def __init__(self, config: Config):
        if not hasattr(torch.distributed, "set_timeout"):
            raise RuntimeError(
                f"torchtitan 0.3 needs torch >= 2.14 (it calls torch.distributed.set_timeout after "
                f"the first step); this torch is {torch.__version__}. Install torch 2.14, or "
                "torchtitan 0.2.2 for this torch.")
        on_cpu = cpu_device.switch()
        spec = config.model_spec
        if on_cpu:
            if spec is not None and _use_cpu_attention(spec.model):
                logger.info("titan_lowbit: the CPU path computes FlexAttention as masked SDPA "
                            "(FlexAttention has no backward on the CPU)")
            check_cpu_async_mode(config.checkpoint)
        if spec is not None:
            check_bitnet_kept(spec.model)
            if config.checkpoint.last_save_in_hf and any(True for _ in spec.model.traverse(NoBlockNorm.Config)):
                raise ValueError(
                    "BitNetSubLNConverter adds per-linear input norms that have no Hugging Face llama "
                    "name (and removes the block norms that have one): --checkpoint.last_save_in_hf "
                    "would fail at the last save. Leave it off (the DCP checkpoint keeps everything).")
        if spec is not None and not getattr(spec.parallelize_fn, "titan_lowbit_wrapped", False):
            config.model_spec = replace(spec, parallelize_fn=_wrap_parallelize(spec.parallelize_fn, on_cpu, config))
        if type(config.checkpoint) is CheckpointManager.Config:
            config.checkpoint = derive(config.checkpoint, CheckedCheckpointManager.Config)
        if isinstance(config.optimizer, LowBitOptimizersContainer.Config) and config.optimizer.seed is None:
            config.optimizer.seed = config.debug.seed or 0
        datasets.check_corpus(config.hf_assets_path, config.dataloader, config.validator)
        if wants_persistent_rows(config):
            _install_persistent_rows()
        super().__init__(config)
        # the schedule's settings travel with each checkpoint (titan_lowbit.torchtitan.lr_schedule)
        remember_schedule(self.lr_schedulers, config.lr_scheduler, config.training.steps)
        bitnet = _bitnet_params(self.model_parts)
        if bitnet and any(isinstance(p, DTensor) for p in bitnet):
            # After each optimizer step: every sharded weight's sum |W|, one collective per
            # sharded mesh dimension for all of them (instead of one per layer in the
            # all-gather that follows).
            self.optimizers.register_step_post_hook(lambda *args, **kwargs: precompute_scales(bitnet))
