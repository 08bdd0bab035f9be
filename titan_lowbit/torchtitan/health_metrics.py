"""The optimizer's health in torchtitan's metric loggers, for both torchtitan lines.

torchtitan's ``MetricsProcessor`` (0.2 and 0.3 alike) has ``log`` called on every rank at
the steps ``log_freq`` selects, right after the optimizer and LR scheduler stepped, with
its ``optimizers`` set to the optimizer container; ``log`` passes its metrics to
torchtitan's loggers (TensorBoard, Weights & Biases) and prints one console line.
:class:`OptimizerHealthLogging`, mixed in before a line's ``MetricsProcessor``, first
reads ``titan_lowbit.optim.optimizer_health`` of the container's titan_lowbit optimizers
(a collective over all ranks, which all log together), adds the numbers to those metrics
under ``optimizer_health/``, and prints them on a second line after torchtitan's. The read
runs before torchtitan takes the time since the last log, so the throughput and step time
torchtitan reports include its cost.

Each line switches it on through its own config: 0.2's ``[lowbit] health_metrics`` through
the train spec's ``build_metrics_processor_fn`` (:mod:`titan_lowbit.torchtitan.train_spec`),
0.3's ``--metrics.optimizer_health`` (:class:`titan_lowbit.torchtitan.v03.HealthMetricsProcessor`).
"""

from __future__ import annotations

from typing import Any, Optional

from torchtitan.tools.logging import logger

from titan_lowbit.torchtitan.lowbit_optimizers import is_lowbit


def lowbit_optimizers(container) -> list:
    """The titan_lowbit optimizers of torchtitan's optimizer container (None: none)."""
    return [opt for opt in (container or ()) if is_lowbit(opt)]


class OptimizerHealthLogging:
    """Mixed in before torchtitan's ``MetricsProcessor``: ``log`` also logs the titan_lowbit
    optimizers' health while :meth:`reports_health` says so."""

    def reports_health(self) -> bool:
        return True

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: Optional[dict[str, Any]] = None):
        if not self.reports_health():
            return super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
        from titan_lowbit.optim import optimizer_health  # with Triton: only for titan_lowbit's optimizers

        health = optimizer_health(lowbit_optimizers(self.optimizers))
        super().log(step, global_avg_loss, global_max_loss, grad_norm,
                    extra_metrics={**(extra_metrics or {}), **health.metrics()})
        logger.info(f"{self.color.yellow}titan_lowbit health: step {step:2}  {health.summary()}{self.color.reset}")
