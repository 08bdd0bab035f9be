"""Wrap every torchtitan train spec so ``[optimizer]`` and ``[lowbit]`` reach it.

The user keeps ``[model] name = "llama3"`` (or any built-in model). torchtitan's Trainer
asks ``torchtitan.protocols.train_spec.get_train_spec(name)`` for the spec; titan_lowbit
replaces that one function (a write into torchtitan listed in kernels/private_apis.py) with
one that returns the same spec with five builders wrapped:

- ``parallelize_fn`` first refuses ``[lowbit] bitnet_*`` settings the job would ignore
  (``config.check_bitnet_keys``), applies ``[lowbit] weight_dtype`` to the (meta) model, so
  FSDP2 shards and initializes parameters in that dtype, then runs torchtitan's own;
  with bf16 weights and fp32 master weights it makes the model initialize in fp32 for the
  masters to start from (:mod:`titan_lowbit.torchtitan.fp32_init`); it gives
  tensor-parallel BitNet layers their TP group (``enable_tensor_parallel``), and
  remembers which JobConfig the model was built with;
- ``build_optimizers_fn`` (see :mod:`titan_lowbit.torchtitan.optimizer_builder`) reads that
  JobConfig, because torchtitan passes it only the ``[optimizer]`` section;
- ``build_tokenizer_fn`` gives a config that trains on ``lowbit_text`` without
  ``[model] hf_assets_path`` that corpus' tokenizer (:mod:`titan_lowbit.torchtitan.datasets`);
- ``build_lr_schedulers_fn`` remembers the schedule's settings, which each checkpoint
  keeps, so a resume that changes them says so (:mod:`titan_lowbit.torchtitan.lr_schedule`);
- ``build_metrics_processor_fn`` builds a :class:`HealthMetricsProcessor`, which adds the
  optimizer's health to the logged metrics, when ``[lowbit] health_metrics`` asks for it
  (:func:`wrap_build_metrics_processor`, :mod:`titan_lowbit.torchtitan.health_metrics`).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import torch
import torch.nn as nn
import torchtitan.protocols.train_spec as train_spec_module
from torchtitan.components.metrics import MetricsProcessor, build_metrics_processor
from torchtitan.tools.logging import logger

from titan_lowbit.torchtitan import cpu_device, datasets
from titan_lowbit.bitnet import enable_tensor_parallel
from titan_lowbit.config import check_bitnet_keys, lowbit_of
from titan_lowbit.kernels.private_apis import patch
from titan_lowbit.optim.master_start import MASTER_UPDATES
from titan_lowbit.torchtitan.fp32_init import wrap_init_weights
from titan_lowbit.torchtitan.health_metrics import OptimizerHealthLogging
from titan_lowbit.torchtitan.lr_schedule import wrap_build_lr_schedulers
from titan_lowbit.torchtitan.optimizer_builder import wrap_build_optimizers

_JOB_CONFIGS: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()
_original_get_train_spec = train_spec_module.get_train_spec
_logged_notes: set[str] = set()  # once per process, not once per pipeline stage


def job_config_of(model_parts: list[nn.Module]):
    for model in model_parts:
        if model in _JOB_CONFIGS:
            return _JOB_CONFIGS[model]
    raise RuntimeError(
        "titan_lowbit's optimizer builder got model parts that were not parallelized "
        "through titan_lowbit's wrapped train spec; build the model with "
        "torchtitan.protocols.train_spec.get_train_spec() after `import titan_lowbit.torchtitan`."
    )


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> int:
    """Re-create every floating-point parameter in ``dtype`` (buffers are left alone:
    RoPE tables stay in their precision). Returns how many were cast."""
    cast = 0
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_floating_point() and param.dtype != dtype:
                module.register_parameter(
                    name, nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
                )
                cast += 1
    return cast


def apply_weight_dtype(model: nn.Module, job_config) -> None:
    lowbit = lowbit_of(job_config)
    training_dtype = job_config.training.dtype
    if lowbit.weight_dtype == "bfloat16":
        cast_parameters(model, torch.bfloat16)
    elif lowbit.weight_dtype == "float32" and training_dtype != "float32":
        raise ValueError(
            f'[lowbit] weight_dtype = "float32" contradicts [training] dtype = '
            f'"{training_dtype}"; set one of them to match, or weight_dtype = "auto".'
        )


def check_float8_with_bf16_weights(job_config, parallel_dims) -> None:
    """Refuse bf16 weights with torchao's float8 linears where torchtitan trains under
    ``torch.autocast`` (no FSDP, TP or PP: one GPU, or DDP). There Float8Linear's matmul
    fails at the first forward on bf16 weights (an AssertionError in torchao's autocast
    cast; torchao 0.17, H100), while the same job under FSDP2 (float8 all-gathers,
    compiled) trains and resumes bit for bit (docs/compatibility.md)."""
    if ("quantize.linear.float8" not in (job_config.model.converters or [])
            or lowbit_of(job_config).weight_dtype != "bfloat16"):
        return
    if parallel_dims.fsdp_enabled or parallel_dims.tp_enabled or parallel_dims.pp_enabled:
        return
    raise ValueError(
        '[lowbit] weight_dtype = "bfloat16" with the float8 converter (quantize.linear.float8) '
        "needs FSDP2 here: without FSDP, TP or PP torchtitan trains under "
        "torch.autocast, where torchao's Float8Linear fails on bf16 weights at the first forward. "
        "Shard the model (data_parallel_shard_degree > 1, on two or more GPUs), or keep fp32 "
        "weights ([lowbit] weight_dtype = \"auto\" or \"float32\").")


def wrap_parallelize(parallelize_fn):
    @functools.wraps(parallelize_fn)
    def parallelize(model, parallel_dims, job_config, *args, **kwargs):
        for note in check_bitnet_keys(job_config, parallel_dims):
            if note not in _logged_notes:
                _logged_notes.add(note)
                logger.info(note)
        check_float8_with_bf16_weights(job_config, parallel_dims)
        apply_weight_dtype(model, job_config)
        model = parallelize_fn(model, parallel_dims, job_config, *args, **kwargs)
        if lowbit_of(job_config).weight_update in MASTER_UPDATES:
            wrap_init_weights(model)
        if parallel_dims.tp_enabled:
            enable_tensor_parallel(model, parallel_dims.get_mesh("tp"))
        if cpu_device.is_enabled():
            cpu_device.use_gloo_reductions(model)
        _JOB_CONFIGS[model] = job_config
        return model

    return parallelize


class HealthMetricsProcessor(OptimizerHealthLogging, MetricsProcessor):
    """torchtitan 0.2's MetricsProcessor that also logs the titan_lowbit optimizers' health
    (built only with ``[lowbit] health_metrics = true``)."""


def wrap_build_metrics_processor(base_builder):
    """A train spec's ``build_metrics_processor_fn`` (``None``: torchtitan's own) that
    builds a HealthMetricsProcessor when ``[lowbit] health_metrics`` is on, and the spec's
    own processor otherwise."""

    @functools.wraps(base_builder or build_metrics_processor)
    def build(job_config, parallel_dims, model_args=None, tag: str | None = None):
        if not lowbit_of(job_config).health_metrics:
            return (base_builder or build_metrics_processor)(job_config, parallel_dims, model_args, tag)
        if base_builder is not None and base_builder is not build_metrics_processor:
            raise NotImplementedError(
                f"[lowbit] health_metrics = true: this model's train spec builds its own metrics processor "
                f"({getattr(base_builder, '__qualname__', base_builder)}), which titan_lowbit cannot add its "
                "numbers to. Turn health_metrics off for this model.")
        return HealthMetricsProcessor(job_config, parallel_dims, tag)

    build.titan_lowbit_wrapped = True
    return build


def wrap(spec: train_spec_module.TrainSpec) -> train_spec_module.TrainSpec:
    if getattr(spec.build_optimizers_fn, "titan_lowbit_wrapped", False):
        return spec
    return dataclasses.replace(
        spec,
        parallelize_fn=wrap_parallelize(spec.parallelize_fn),
        build_optimizers_fn=wrap_build_optimizers(spec.build_optimizers_fn, job_config_of),
        build_tokenizer_fn=datasets.wrap_build_tokenizer(spec.build_tokenizer_fn),
        build_lr_schedulers_fn=wrap_build_lr_schedulers(spec.build_lr_schedulers_fn),
        build_metrics_processor_fn=wrap_build_metrics_processor(spec.build_metrics_processor_fn),
    )


def get_train_spec(name: str) -> train_spec_module.TrainSpec:
    return wrap(_original_get_train_spec(name))


def register() -> None:
    patch(train_spec_module, "get_train_spec", get_train_spec)
