"""DCP checkpoints across process counts (FSDP2 on gloo): one written by 2 processes
loads into 1 and into 4, one written by 4 loads into 2, and checkpoints move between
FSDP2 and a 2x2 FSDP2 x TP mesh both ways; every model and optimizer
tensor, gathered, equals the checkpoint's element for element, and training continues
without a jump in the loss. A checkpoint from another configuration, or one missing
optimizer entries, stops the run with both sides named."""

import subprocess

import pytest

from conftest import (DEBUG_CONFIG, ROOT, SAVE_STEP, SMALL_STEPS, cpu_run_env, reshard_check,
                      resume_folder, run_train, step_losses, torchrun)

pytestmark = pytest.mark.trainer  # every test here runs torchtitan's Trainer


@pytest.mark.parametrize("nproc", [1, 4])
def test_checkpoint_reshards_exactly_and_training_continues(two_process_checkpoint, nproc,
                                                            tmp_path):
    dump, losses_2proc, overrides = two_process_checkpoint
    ckpt = dump / "checkpoint"
    argv = ["--job.config_file", str(DEBUG_CONFIG), *overrides,
            "--checkpoint.exclude_from_loading", "dataloader"]

    check = reshard_check(nproc, str(ckpt),
                     str(SAVE_STEP), *argv)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-4000:]
    assert f"RESHARD OK" in check.stdout and f"on {nproc} processes" in check.stdout

    # Train on from the step-SAVE_STEP checkpoint in a copy of the dump folder (the
    # dataloader's per-rank position cannot follow a new data-parallel degree).
    resumed_dump = resume_folder(tmp_path, ckpt)
    proc = run_train(*overrides, "--job.dump_folder", str(resumed_dump), "--checkpoint.interval",
                     "1000", "--checkpoint.exclude_from_loading", "dataloader",
                     "--training.steps", str(SAVE_STEP + 2), nproc=nproc)
    resumed = step_losses(proc.stdout)
    assert sorted(resumed) == [SAVE_STEP + 1, SAVE_STEP + 2], resumed
    # Different data-parallel degree: other batches, same model and optimizer state. The
    # loss continues below where the 2-process run stood after its first step (a model
    # that lost its state would start over near the fresh loss of ~8.1).
    for step in resumed:
        assert float(resumed[step]) < float(losses_2proc[2]), (resumed, losses_2proc)


@pytest.mark.parametrize("override,expect", [
    (("--optimizer.name", "AdamW8bit"), ["state_format='4bit'", "state_format='8bit'"]),
    (("--lowbit.block_size", "64"), ["block_size=0", "block_size=64"]),
    (("--lowbit.weight_dtype", "auto", "--lowbit.weight_update", "nearest"), ["torch.bfloat16", "torch.float32"]),
])
def test_resume_with_another_configuration_stops_naming_both(two_process_checkpoint, override,
                                                               expect, tmp_path):
    dump, _, overrides = two_process_checkpoint
    resumed_dump = resume_folder(tmp_path, dump / "checkpoint")
    proc = run_train(*overrides, "--job.dump_folder", str(resumed_dump), *override,
                     "--training.steps", str(SAVE_STEP + 2), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not step_losses(out)
    assert "does not match this run" in out, out[-3000:]
    for text in expect:
        assert text in out, out[-3000:]


def test_block_size_zero_and_the_formats_default_resume_into_each_other(two_process_checkpoint,
                                                                       tmp_path):
    # Written with block_size 0, i.e. 4-bit's default block of 128: the same state, so a
    # resume that names 128 continues exactly where the run itself went on.
    dump, losses, overrides = two_process_checkpoint
    resumed_dump = resume_folder(tmp_path, dump / "checkpoint")
    proc = run_train(*overrides, "--job.dump_folder", str(resumed_dump), "--lowbit.block_size",
                     "128", "--checkpoint.interval", "1000", "--training.steps", str(SAVE_STEP + 2))
    resumed = step_losses(proc.stdout)
    assert resumed == {s: losses[s] for s in (SAVE_STEP + 1, SAVE_STEP + 2)}, (resumed, losses)


def test_checkpoint_missing_optimizer_entries_stops_naming_them(two_process_checkpoint, tmp_path):
    import pickle
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    from titan_lowbit.torchtitan.checkpoint_manifest import write_manifest

    dump, _, overrides = two_process_checkpoint
    step_dir = tmp_path / "resumed" / "checkpoint" / f"step-{SAVE_STEP}"
    shutil.copytree(dump / "checkpoint" / f"step-{SAVE_STEP}", step_dir)
    meta = FileSystemReader(str(step_dir)).read_metadata()
    lost = "optimizer.state.layers.0.attention.wq.weight."
    meta.state_dict_metadata = {k: v for k, v in meta.state_dict_metadata.items()
                                if not k.startswith(lost)}
    meta.storage_data = {k: v for k, v in meta.storage_data.items() if not k.fqn.startswith(lost)}
    with open(step_dir / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    # A checkpoint written without those entries, as a run of another layout writes it: its
    # manifest agrees with its index, so the layout check (not the integrity check) stops it.
    write_manifest(str(step_dir))

    proc = run_train(*overrides, "--job.dump_folder", str(tmp_path / "resumed"),
                     "--training.steps", str(SAVE_STEP + 2), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not step_losses(out)
    assert "missing from the checkpoint" in out and lost in out, out[-3000:]


def test_checkpoint_from_four_processes_reshards_into_two(tmp_path, prepared_data):
    dump = tmp_path / "four"
    overrides = ("--optimizer.name", "AdamW8bit", "--lowbit.weight_dtype", "bfloat16",
                 "--lowbit.weight_update", "stochastic", "--validation.no-enable",
                 "--checkpoint.enable", "--checkpoint.interval", "2",
                 "--job.dump_folder", str(dump))
    run_train(*overrides, *SMALL_STEPS, "--training.steps", "2", nproc=4)
    argv = ["--job.config_file", str(DEBUG_CONFIG), *overrides,
            "--checkpoint.exclude_from_loading", "dataloader"]
    check = reshard_check(2, str(dump / "checkpoint"), "2",
                     *argv)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-4000:]
    assert "RESHARD OK" in check.stdout and "on 2 processes" in check.stdout


TWO_D = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2")


def test_fsdp_checkpoint_loads_into_fsdp_x_tp_mesh(two_process_checkpoint):
    """2 processes (FSDP2) -> 4 processes on a 2x2 (FSDP2 x TP) mesh. 4-bit blocks of 128
    keep whole blocks in each TP shard of the 256-wide debug model."""
    dump, _, overrides = two_process_checkpoint
    argv = ["--job.config_file", str(DEBUG_CONFIG), *overrides, *TWO_D,
            "--checkpoint.exclude_from_loading", "dataloader"]
    check = reshard_check(4, str(dump / "checkpoint"),
                     str(SAVE_STEP), *argv)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-4000:]
    assert "RESHARD OK" in check.stdout and "on 4 processes" in check.stdout


def test_fsdp_x_tp_checkpoint_loads_into_fsdp_only(two_process_checkpoint, tmp_path):
    """4 processes on a 2x2 (FSDP2 x TP) mesh -> 2 processes, FSDP2 only."""
    _, _, overrides = two_process_checkpoint
    dump = tmp_path / "two_d"
    overrides = (*overrides, "--job.dump_folder", str(dump), "--checkpoint.interval", "2")
    run_train(*overrides, *TWO_D, *SMALL_STEPS, "--training.steps", "2", nproc=4)
    argv = ["--job.config_file", str(DEBUG_CONFIG), *overrides,
            "--checkpoint.exclude_from_loading", "dataloader"]
    check = reshard_check(2, str(dump / "checkpoint"), "2",
                     *argv)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-4000:]
    assert "RESHARD OK" in check.stdout and "on 2 processes" in check.stdout
