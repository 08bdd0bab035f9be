"""BitNet through torchtitan's real Trainer on two CPU processes (FSDP2, gloo).

SubLN + BitNet with full activation checkpointing trains and saves a DCP checkpoint of
plain tensors, and a second run resumes from it.
"""

import math

from conftest import ROOT, run_train, step_losses

CONFIG = ROOT / "train_configs" / "llama3_debug_bitnet.toml"


def test_bitnet_trains_checkpoints_and_resumes(tmp_path):
    common = ("--model.converters", "bitnet_subln,bitnet", "--activation_checkpoint.mode", "full",
              "--validation.no-enable", "--checkpoint.enable", "--checkpoint.interval", "2",
              "--training.local_batch_size", "2", "--training.seq_len", "128",
              "--job.dump_folder", str(tmp_path))
    first = run_train("--training.steps", "3", *common, config=CONFIG)
    losses = {s: float(v) for s, v in step_losses(first.stdout + first.stderr).items()}
    assert sorted(losses) == [1, 2, 3]
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[3] < losses[1]
    assert (tmp_path / "checkpoint" / "step-3").is_dir()

    second = run_train("--training.steps", "4", *common, config=CONFIG)
    out = second.stdout + second.stderr
    assert "Loading the checkpoint" in out and "step-3" in out
    resumed = {s: float(v) for s, v in step_losses(out).items()}
    assert sorted(resumed) == [4]  # started after the checkpoint, not from scratch
    assert math.isfinite(resumed[4]) and resumed[4] < losses[1]
