"""End to end: the real torchtitan Trainer on 2 CPU processes (gloo), through
scripts/train.sh, on train_configs/llama3_debug.toml and the offline corpus."""

import pytest

from conftest import run_train, step_losses

STEPS = 8
HALF = STEPS // 2

OPTIMIZERS = ["AdamW"]  # later issues extend this to every titan_lowbit optimizer


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_loss_falls_and_checkpoint_resumes_identically(optimizer, tmp_path, prepared_data):
    base = ("--optimizer.name", optimizer, "--lr_scheduler.total_steps", str(STEPS),
            "--validation.freq", "1000")

    full = step_losses(run_train(*base, "--training.steps", str(STEPS),
                                 "--job.dump_folder", str(tmp_path / "full")).stdout)
    assert sorted(full) == list(range(1, STEPS + 1)), full
    first, last = float(full[1]), [float(full[s]) for s in range(STEPS - 1, STEPS + 1)]
    assert sum(last) / len(last) < first - 0.5, f"loss did not fall: {full}"

    ckpt = ("--job.dump_folder", str(tmp_path / "resumed"), "--checkpoint.enable",
            "--checkpoint.interval", str(HALF))
    part1 = run_train(*base, *ckpt, "--training.steps", str(HALF))
    assert (tmp_path / "resumed" / "checkpoint" / f"step-{HALF}").is_dir(), part1.stdout[-3000:]
    part2 = run_train(*base, *ckpt, "--training.steps", str(STEPS))
    assert f"Loading the checkpoint from {tmp_path / 'resumed' / 'checkpoint' / f'step-{HALF}'}" in (
        part2.stdout + part2.stderr), "second half did not resume from the checkpoint"

    resumed = step_losses(part1.stdout) | step_losses(part2.stdout)
    assert resumed == full, f"resumed run differs:\nfull    {full}\nresumed {resumed}"
