"""The learning-rate schedule a checkpoint was written with, and one warning when a
resumed run plans another.

torchtitan's LR scheduler is a function of the step and of the job's ``[lr_scheduler]``
settings and ``training.steps`` (the schedule's length, unless ``lr_scheduler.total_steps``
fixes it). A checkpoint stores the step it reached, not those settings, so a run resumed
with a larger ``--training.steps`` (the usual way to "train longer") silently follows
another curve from the resumed step on: the warm-up, the decay start and the final
learning rate all move. That is sometimes what the user wants, and it is not an error;
but nothing said so. Here the settings travel with each checkpoint, in a small JSON file
beside the manifest, and a resume that changes them logs which ones and how to keep the
old curve.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

SCHEDULE_FILE = ".titan_lowbit_lr_schedule.json"
ATTRIBUTE = "titan_lowbit_lr_schedule"  # on torchtitan's LRSchedulersContainer


def schedule_settings(lr_scheduler_config, training_steps: int) -> dict[str, Any]:
    """The settings that decide the schedule, as the job gives them (command-line names)."""
    settings = {f"lr_scheduler.{k}": v for k, v in dataclasses.asdict(lr_scheduler_config).items()}
    settings["training.steps"] = training_steps
    return settings


def remember_schedule(container, lr_scheduler_config, training_steps: int) -> None:
    """Let torchtitan's LR scheduler ``container`` carry the settings it was built from."""
    setattr(container, ATTRIBUTE, schedule_settings(lr_scheduler_config, training_steps))


def wrap_build_lr_schedulers(build):
    """torchtitan 0.2's ``build_lr_schedulers_fn``, whose container remembers its settings."""

    @functools.wraps(build)
    def build_lr_schedulers(optimizers, lr_scheduler_config, training_steps):
        container = build(optimizers, lr_scheduler_config, training_steps)
        remember_schedule(container, lr_scheduler_config, training_steps)
        return container

    return build_lr_schedulers


def write_schedule(container, folder: str | os.PathLike) -> None:
    """Write the container's settings into the checkpoint ``folder`` (made when missing:
    the file may come before the checkpoint's own files): every rank calls it, rank 0
    writes (no file when the container does not carry its settings)."""
    settings = getattr(container, ATTRIBUTE, None)
    if settings is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        path = Path(folder) / SCHEDULE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, sort_keys=True))


def schedule_change(container, folder: str | os.PathLike) -> str | None:
    """The warning for a resume of ``folder`` into ``container`` whose schedule settings
    differ from the checkpoint's; None when they agree or either side has none."""
    now = getattr(container, ATTRIBUTE, None)
    path = Path(folder) / SCHEDULE_FILE
    if now is None or not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except ValueError:
        return None  # a damaged side file costs the warning, never the resume
    saved, now = _with_length(saved), _with_length(now)
    changed = [key for key in sorted(set(saved) | set(now)) if saved.get(key) != now.get(key)]
    if not changed:
        return None
    differences = ", ".join(f"{key} {saved.get(key)!r} -> {now.get(key)!r}" for key in changed)
    return (f"titan_lowbit: this run's learning-rate schedule differs from the one checkpoint "
            f"{folder} was written with ({differences}): from the resumed step on, the learning "
            f"rate follows this run's schedule, so the loss does not continue the checkpoint's "
            f"curve. To continue that curve, resume with the checkpoint's settings.")


def _with_length(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings with the schedule's length in place of the two settings that give it
    (torchtitan: ``lr_scheduler.total_steps`` when set, else ``training.steps``)."""
    rest = {k: v for k, v in settings.items() if k not in ("training.steps", "lr_scheduler.total_steps")}
    total = settings.get("lr_scheduler.total_steps")
    rest["schedule length (steps)"] = total if total is not None else settings.get("training.steps")
    return rest
