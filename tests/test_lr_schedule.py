"""A checkpoint keeps the learning-rate schedule's settings; a resume that changes them
(most often a larger ``--training.steps``, which stretches the schedule) is warned that
the loss will not continue the checkpoint's curve (titan_lowbit.torchtitan.lr_schedule).
The Trainer-side wiring (the file in each step folder, no warning on a plain resume) is
checked by tests/test_train_e2e.py."""

import json

import pytest
import torch
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config import LRScheduler as LRSchedulerConfig
from torchtitan.config import Optimizer as OptimizerConfig

from titan_lowbit.torchtitan.lr_schedule import (
    SCHEDULE_FILE,
    schedule_change,
    wrap_build_lr_schedulers,
    write_schedule,
)


def _schedulers(training_steps: int, **config):
    model = torch.nn.Linear(4, 4)
    optimizers = build_optimizers([model], OptimizerConfig(name="AdamW", lr=1e-3), None)
    build = wrap_build_lr_schedulers(build_lr_schedulers)
    return build(optimizers, LRSchedulerConfig(**config), training_steps)


def test_same_settings_resume_quietly(tmp_path):
    write_schedule(_schedulers(20, warmup_steps=2), tmp_path)
    assert json.loads((tmp_path / SCHEDULE_FILE).read_text())["training.steps"] == 20
    assert schedule_change(_schedulers(20, warmup_steps=2), tmp_path) is None


def test_a_longer_run_is_told_its_curve_changes(tmp_path):
    write_schedule(_schedulers(20, warmup_steps=2), tmp_path)
    warning = schedule_change(_schedulers(40, warmup_steps=2), tmp_path)
    assert "schedule length (steps) 20 -> 40" in warning, warning
    assert "does not continue the checkpoint's curve" in warning
    warning = schedule_change(_schedulers(20, warmup_steps=5, decay_type="cosine"), tmp_path)
    assert "lr_scheduler.decay_type 'linear' -> 'cosine'" in warning, warning
    assert "lr_scheduler.warmup_steps 2 -> 5" in warning, warning


@pytest.mark.parametrize("saved,now,changes", [
    # the schedule's length is total_steps where set, whatever training.steps says
    ((20, {"total_steps": 20}), (40, {"total_steps": 20}), False),
    ((20, {}), (40, {"total_steps": 20}), False),
    ((20, {"total_steps": 20}), (20, {"total_steps": 30}), True),
])
def test_the_schedule_length_is_total_steps_or_training_steps(tmp_path, saved, now, changes):
    write_schedule(_schedulers(saved[0], warmup_steps=2, **saved[1]), tmp_path)
    warning = schedule_change(_schedulers(now[0], warmup_steps=2, **now[1]), tmp_path)
    assert (warning is not None) == changes, warning


def test_checkpoints_without_the_settings_resume_without_a_word(tmp_path):
    """Written before titan_lowbit kept the schedule, by the 0.3 line, or damaged: no
    warning, and never a failed resume over a side file."""
    assert schedule_change(_schedulers(20), tmp_path) is None
    (tmp_path / SCHEDULE_FILE).write_text("{not json")
    assert schedule_change(_schedulers(40), tmp_path) is None
    assert schedule_change(None, tmp_path) is None  # --checkpoint.exclude_from_loading lr_scheduler
