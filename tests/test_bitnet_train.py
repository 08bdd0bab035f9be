"""BitNet through torchtitan's real Trainer on two CPU processes (FSDP2, gloo).

SubLN + BitNet with full activation checkpointing trains and saves a DCP checkpoint of
plain tensors, and a second run resumes from it.
"""

import math

import pytest

from conftest import ROOT, SMALL_STEPS, run_train, step_losses

pytestmark = pytest.mark.trainer  # every test here runs torchtitan's Trainer

CONFIG = ROOT / "train_configs" / "llama3_debug_bitnet.toml"


def test_bitnet_trains_checkpoints_and_resumes(tmp_path):
    common = ("--model.converters", "bitnet_subln,bitnet", "--activation_checkpoint.mode", "full",
              "--validation.no-enable", "--checkpoint.enable", "--checkpoint.interval", "2",
              *SMALL_STEPS,
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


def test_kept_codes_train_and_resume_bit_identically(tmp_path):
    """One process (no FSDP: the weights are unsharded) with [lowbit] bitnet_keep_codes and
    full activation checkpointing (whose recomputed forwards read the kept codes): the
    losses equal those of quantizing in every forward, and a run resumed from the step-2
    checkpoint (the codes are recomputed, not saved) continues bit-identically."""
    import shutil

    def common(dump, *extra):
        return ("--model.converters", "bitnet_subln,bitnet", "--activation_checkpoint.mode", "full",
                "--validation.no-enable", "--checkpoint.enable", "--checkpoint.interval", "2",
                *SMALL_STEPS,
                "--training.steps", "4", "--job.dump_folder", str(dump), *extra)

    kept = tmp_path / "kept"
    out = run_train(*common(kept, "--lowbit.bitnet-keep-codes"), config=CONFIG, nproc=1)
    straight = step_losses(out.stdout + out.stderr)
    assert sorted(straight) == [1, 2, 3, 4]
    plain = run_train(*common(tmp_path / "plain"), config=CONFIG, nproc=1)
    assert step_losses(plain.stdout + plain.stderr) == straight

    shutil.rmtree(kept / "checkpoint" / "step-4")
    again = run_train(*common(kept, "--lowbit.bitnet-keep-codes"), config=CONFIG, nproc=1)
    out = again.stdout + again.stderr
    assert "Loading the checkpoint" in out and "step-2" in out
    resumed = step_losses(out)
    assert sorted(resumed) == [3, 4]
    assert all(resumed[s] == straight[s] for s in (3, 4)), (resumed, straight)
