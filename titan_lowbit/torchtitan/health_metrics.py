"""``[lowbit] health_metrics``: the optimizer's health in torchtitan's metric loggers.

torchtitan 0.2's Trainer builds its ``MetricsProcessor`` through the train spec's
``build_metrics_processor_fn`` (its own ``build_metrics_processor`` when the spec names
none) and calls ``log`` on every rank at the steps ``[metrics] log_freq`` selects, right
after the optimizer and LR scheduler stepped, with ``self.optimizers`` set to the
optimizer container. ``HealthMetricsProcessor`` is that processor, whose ``log`` first
reads ``titan_lowbit.optim.optimizer_health`` of the container's titan_lowbit optimizers
(a collective over all ranks, which all log together), passes the numbers to torchtitan's
loggers (TensorBoard, Weights & Biases) under ``optimizer_health/``, and prints them on a
second line after torchtitan's. The read runs before torchtitan takes the time since the
last log, so the throughput and step time torchtitan reports include its cost.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from torchtitan.components.metrics import MetricsProcessor, build_metrics_processor
from torchtitan.tools.logging import logger

from titan_lowbit.config import lowbit_of
from titan_lowbit.torchtitan.lowbit_optimizers import is_lowbit


class HealthMetricsProcessor(MetricsProcessor):
    """torchtitan's MetricsProcessor that also logs the titan_lowbit optimizers' health."""

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: Optional[dict[str, Any]] = None):
        from titan_lowbit.optim import optimizer_health  # with Triton: only for titan_lowbit's optimizers

        health = optimizer_health([opt for opt in (self.optimizers or ()) if is_lowbit(opt)])
        super().log(step, global_avg_loss, global_max_loss, grad_norm,
                    extra_metrics={**(extra_metrics or {}), **health.metrics()})
        logger.info(f"{self.color.yellow}titan_lowbit health: step {step:2}  {health.summary()}{self.color.reset}")


def wrap_build_metrics_processor(base_builder):
    """A train spec's ``build_metrics_processor_fn`` (``None``: torchtitan's own) that
    builds a HealthMetricsProcessor when ``[lowbit] health_metrics`` is on, and the spec's
    own processor otherwise."""

    @functools.wraps(base_builder or build_metrics_processor)
    def build(job_config, parallel_dims, model_args=None, tag: Optional[str] = None):
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
