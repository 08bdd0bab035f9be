"""Checkpoints that cannot be trusted are never resumed from silently.

- A save cut short (a ``step-N`` folder without ``.metadata``, shards half written) is
  skipped with a warning: the run resumes from the last complete checkpoint with the
  same per-step losses as the uninterrupted run, and its own save replaces the
  incomplete folder.
- A checkpoint whose files were changed after they were written (overwritten bytes:
  DCP itself loads them silently; two records swapped, a pickled non-tensor record
  edited, an index that moves or drops records: the manifest each save writes; truncated
  or missing files; an unreadable ``.metadata``) stops the run naming the step folder,
  the records, and the complete checkpoints to resume from instead. One without a
  manifest (older versions) is checked per record and says so once.
- A new ``step-N`` is written beside the old one and moved into place only once it is
  complete; a save that fails (a full disk: a real tmpfs where the tests run as root)
  removes its partial folder and names the free space and what a checkpoint needs.
- A checkpoint that is fine but cannot resume this run as it is (model-only, another
  data-parallel degree, Adam* against AdamW*, BitNet layers added or dropped, or a load
  error after the file checks passed) stops the run naming the setting to change, and is
  never called damaged nor to be moved or deleted.
"""

import errno
import functools
import os
import pickle
import shutil
import subprocess
import traceback
from types import SimpleNamespace

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint_faults import edit_step, flip_bit, swap_records  # tools/checkpoint_faults.py
from conftest import SAVE_STEP, resume_folder, run_on_gloo, run_train, step_losses, stopped_run
from titan_lowbit.torchtitan import checkpoint_errors, checkpoint_layout, checkpoint_save, checkpoint_verify
from titan_lowbit.torchtitan.checkpoint_manifest import MANIFEST, write_manifest

LAST = SAVE_STEP + 2  # the fixture run saved at SAVE_STEP and at its last step, LAST
# What torch.distributed.checkpoint.load warns when called with no_dist=True.
FOREIGN_WARNING = "assuming the intent is to load in a single process"


def dump_with(tmp_path, fixture_dump, last_step_dir_edit):
    """A dump folder holding the fixture's complete step-SAVE_STEP (a link) and a copy of
    its step-LAST changed by ``last_step_dir_edit(path)``."""
    folder = tmp_path / "run" / "checkpoint"
    folder.mkdir(parents=True)
    os.symlink(fixture_dump / "checkpoint" / f"step-{SAVE_STEP}", folder / f"step-{SAVE_STEP}")
    shutil.copytree(fixture_dump / "checkpoint" / f"step-{LAST}", folder / f"step-{LAST}")
    last_step_dir_edit(folder / f"step-{LAST}")
    return tmp_path / "run"


def interrupt(step_dir):
    """What a save killed half-way leaves: no .metadata (DCP writes it last), a shard
    file cut in half."""
    (step_dir / ".metadata").unlink()
    shard = step_dir / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)


@pytest.mark.trainer
def test_interrupted_save_is_skipped_and_resume_continues_identically(two_process_checkpoint,
                                                                       tmp_path):
    fixture_dump, full, overrides = two_process_checkpoint
    dump = dump_with(tmp_path, fixture_dump, interrupt)

    proc = run_train(*overrides, "--job.dump_folder", str(dump), "--training.steps", str(LAST))
    assert "skipping incomplete checkpoint folder(s) ['step-6']" in proc.stdout, proc.stdout[-3000:]
    assert f"Loading the checkpoint from {dump / 'checkpoint' / f'step-{SAVE_STEP}'}" in proc.stdout
    resumed = step_losses(proc.stdout)
    assert resumed == {s: full[s] for s in range(SAVE_STEP + 1, LAST + 1)}, (resumed, full)
    # titan_lowbit's own reads of the checkpoint (the checks before the load) print no
    # warning of torch's: a user reads one at every resume as a fault.
    assert FOREIGN_WARNING not in proc.stdout + proc.stderr, proc.stderr[-3000:]

    # The run's own last-step save replaced the incomplete folder with a complete one,
    # its manifest written with it.
    step_dir = dump / "checkpoint" / f"step-{LAST}"
    assert checkpoint_verify.checkpoint_problems(str(step_dir), checkpoint_verify.read_metadata(str(step_dir))) == ([], True)
    assert sorted(os.listdir(dump / "checkpoint")) == [f"step-{SAVE_STEP}", f"step-{LAST}"]


@pytest.mark.trainer
def test_damaged_checkpoint_stops_the_run_naming_folder_tensor_and_fallback(
        two_process_checkpoint, tmp_path):
    fixture_dump, _, overrides = two_process_checkpoint
    damaged = {}
    dump = dump_with(tmp_path, fixture_dump,
                     lambda d: damaged.update(fqn=flip_bit(d)[0]))

    out = stopped_run(*overrides, "--job.dump_folder", str(dump), "--training.steps", str(LAST + 1))
    step_dir = dump / "checkpoint" / f"step-{LAST}"
    for text in (f"checkpoint {step_dir} is damaged or incomplete and was not loaded",
                 damaged["fqn"], "does not match the CRC-32 written with the checkpoint",
                 f"steps [{SAVE_STEP}]", "--checkpoint.load_step"):
        assert text in out, (text, out[-3000:])


@pytest.mark.trainer
def test_truncated_missing_and_unreadable_files_are_named(two_process_checkpoint, tmp_path):
    """The checks of a checkpoint without a manifest (written before titan_lowbit wrote
    one): files and sizes against the index, each tensor record against its own CRC-32."""
    fixture_dump, _, _ = two_process_checkpoint
    step_dir = tmp_path / f"step-{SAVE_STEP}"
    shutil.copytree(fixture_dump / "checkpoint" / f"step-{SAVE_STEP}", step_dir)
    meta = checkpoint_verify.read_metadata(str(step_dir))
    assert checkpoint_verify.file_problems(str(step_dir), meta) == []

    [fqn] = flip_bit(step_dir)
    [problem] = checkpoint_verify.file_problems(str(step_dir), meta)
    assert problem.startswith(f"__0_0.distcp: {fqn} (bytes ") and "Bad CRC-32" in problem
    # Split between 2 ranks: file 0 is rank 0's to read; sizes are checked by every rank.
    assert checkpoint_verify.file_problems(str(step_dir), meta, rank=1, world=2) == []
    assert checkpoint_verify.file_problems(str(step_dir), meta, crc=False) == []

    size = (step_dir / "__1_0.distcp").stat().st_size
    os.truncate(step_dir / "__1_0.distcp", size - 100)
    (step_dir / "__0_0.distcp").unlink()
    assert checkpoint_verify.file_problems(str(step_dir), meta, crc=False) == [
        "__0_0.distcp is missing",
        f"__1_0.distcp is truncated: {size - 100} bytes, the index needs {size}",
    ]

    (step_dir / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(checkpoint_verify.CheckpointDamaged, match=r"\.metadata cannot be read") as err:
        checkpoint_verify.read_metadata(str(step_dir))
    assert "no other complete checkpoint" in str(err.value)


# Two records of equal length in __0_0.distcp (rank 0's rows of two same-shaped weights).
SWAPPED = tuple(f"optimizer.state.layers.{i}.attention.wq.weight.exp_avg_codes" for i in (0, 1))


@pytest.mark.trainer
def test_manifest_names_swapped_edited_moved_and_dropped_records(two_process_checkpoint, tmp_path):
    """Every save writes a manifest (each record's place, length and CRC-32); against it
    a swap of two records, a changed non-tensor record and an index that moves or drops
    records are named, where the per-record CRC-32 sees none of them."""
    fixture_dump, _, _ = two_process_checkpoint
    step_dir = tmp_path / f"step-{LAST}"
    shutil.copytree(fixture_dump / "checkpoint" / f"step-{LAST}", step_dir)
    meta = checkpoint_verify.read_metadata(str(step_dir))
    assert checkpoint_verify.checkpoint_problems(str(step_dir), meta) == ([], True)

    swap_records(step_dir, *SWAPPED)
    edit_step(step_dir)
    assert checkpoint_verify.file_problems(str(step_dir), meta) == []  # what the per-record check sees
    problems, by_manifest = checkpoint_verify.checkpoint_problems(str(step_dir), meta)
    assert by_manifest and len(problems) == 3, problems
    named = {problem.split(" (", 1)[0]: problem for problem in problems}
    for name, other in (SWAPPED, SWAPPED[::-1]):
        assert named[name].startswith(f"{name} (__0_0.distcp bytes "), named
        assert named[name].endswith(f"these bytes are the ones written for {other}: records "
                                    "moved or swapped"), named
    assert named["train_state.step"].startswith("train_state.step (__0_0.distcp bytes 0-"), named
    assert "does not match the CRC-32 written with the checkpoint" in named["train_state.step"]
    # TITAN_LOWBIT_VERIFY_CHECKPOINT=size reads no data; rank 1 of 2 reads __1_0.distcp only.
    assert checkpoint_verify.checkpoint_problems(str(step_dir), meta, crc=False) == ([], True)
    assert checkpoint_verify.checkpoint_problems(str(step_dir), meta, rank=1, world=2) == ([], True)

    # An index that places a record elsewhere, or drops records, differs from .metadata's
    # CRC-32 in the manifest; the records are named.
    shutil.rmtree(step_dir)
    shutil.copytree(fixture_dump / "checkpoint" / f"step-{LAST}", step_dir)
    edited = FileSystemReader(str(step_dir)).read_metadata()
    index = {i.fqn: i for i in edited.storage_data if not any(i.offset or ())}
    a, b = (index[fqn] for fqn in SWAPPED)
    edited.storage_data[a], edited.storage_data[b] = edited.storage_data[b], edited.storage_data[a]
    edited.storage_data = {k: v for k, v in edited.storage_data.items()
                           if not k.fqn.startswith("lr_scheduler.")}
    with open(step_dir / ".metadata", "wb") as f:
        pickle.dump(edited, f)
    problems, _ = checkpoint_verify.checkpoint_problems(str(step_dir), edited)
    assert problems[0].startswith(f"{SWAPPED[0]}: the .metadata index places it at __0_0.distcp "
                                  "bytes "), problems
    assert problems[1].startswith(f"{SWAPPED[1]}: the .metadata index places it at"), problems
    assert "missing from the checkpoint's .metadata index (its manifest lists them), e.g. " \
        "lr_scheduler." in problems[2], problems

    (step_dir / MANIFEST).write_text('{"titan_lowbit_manifest": 1, "records": [')
    problems, _ = checkpoint_verify.checkpoint_problems(str(step_dir), edited)
    assert problems[0].startswith(f"{MANIFEST} cannot be read: JSONDecodeError("), problems


@pytest.mark.trainer
def test_swapped_and_edited_records_stop_the_resume_naming_them(two_process_checkpoint, tmp_path):
    fixture_dump, _, overrides = two_process_checkpoint

    def damage(step_dir):
        swap_records(step_dir, *SWAPPED)
        edit_step(step_dir)

    dump = dump_with(tmp_path, fixture_dump, damage)
    out = stopped_run(*overrides, "--job.dump_folder", str(dump), "--training.steps", str(LAST + 2))
    step_dir = dump / "checkpoint" / f"step-{LAST}"
    for text in (f"checkpoint {step_dir} is damaged or incomplete and was not loaded",
                 f"{SWAPPED[0]} (__0_0.distcp bytes ", f"{SWAPPED[1]} (__0_0.distcp bytes ",
                 "records moved or swapped", "train_state.step (__0_0.distcp bytes 0-",
                 f"steps [{SAVE_STEP}]", "--checkpoint.load_step"):
        assert text in out, (text, out[-3000:])


def test_new_step_folder_replaces_the_old_only_once_complete(tmp_path):
    folder = tmp_path / "checkpoint"
    old = folder / "step-8"
    old.mkdir(parents=True)
    (old / ".metadata").write_text("old checkpoint index")  # 20 bytes

    def failing_save(target):
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, "__0_0.distcp"), "w") as f:
            f.write("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    def save(target):
        os.makedirs(target, exist_ok=True)
        for name in ("__0_0.distcp", ".metadata"):
            with open(os.path.join(target, name), "w") as f:
                f.write("new")
        return "saved"

    with pytest.raises(checkpoint_save.CheckpointNotSaved, match="No space left on device") as err:
        checkpoint_save.save_atomically(failing_save, str(old))
    assert sorted(os.listdir(old)) == [".metadata"]
    assert (old / ".metadata").read_text() == "old checkpoint index"
    assert sorted(os.listdir(folder)) == ["step-8"]  # .saving-8 removed
    free = shutil.disk_usage(folder).free
    for text in (f"checkpoint {old} was not saved", "The disk is full",
                 f"The partial folder {folder / '.saving-8'} (4 bytes written) was removed",
                 "takes about 20 bytes (the size of step-8)",
                 f"the earlier checkpoints in {folder} (steps [8]) are untouched", "keep_latest_k"):
        assert text in str(err.value), (text, str(err.value))
    assert " free when the save failed" in str(err.value) and free > 0
    # DCP's form on several ranks: torch.save's short write inside a CheckpointException.
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    def dcp_failing_save(target):
        os.makedirs(target, exist_ok=True)
        raise CheckpointException("save failed", {1: (short, traceback.StackSummary())})

    with pytest.raises(checkpoint_save.CheckpointNotSaved, match="unexpected pos 704 vs 598") as err:
        checkpoint_save.save_atomically(dcp_failing_save, str(old))
    assert "If the file system is full or its quota reached: free space" in str(err.value)
    assert sorted(os.listdir(folder)) == ["step-8"]
    other_rank = checkpoint_save.save_failure(old, folder / ".saving-8", short, remove=False)
    assert str(other_rank).endswith(f"Rank 0 removes the partial folder {folder / '.saving-8'} "
                                    "and reports the free space on that file system.")
    # torchtitan resumes from the complete checkpoint.
    manager = SimpleNamespace(folder=str(folder))
    from torchtitan.components.checkpoint import CheckpointManager

    assert CheckpointManager._find_load_step(manager) == 8
    assert checkpoint_verify.complete_steps(str(folder)) == [8]

    assert checkpoint_save.save_atomically(save, str(old)) == "saved"
    assert sorted(os.listdir(folder)) == ["step-8"]
    assert (old / ".metadata").read_text() == "new" and (old / "__0_0.distcp").read_text() == "new"


def _save_on_a_full_tmpfs(folder: str, rank: int) -> dict:
    """(a rank of run_on_gloo, a process of its own) Mount a 4 MiB tmpfs on ``folder`` in
    a mount namespace of this process alone, save a 1 MiB checkpoint step-1 there, then a
    5 MiB step-2 through save_atomically; return what that raised and what the folder
    holds, or {"skip": why} where no tmpfs can be mounted."""
    import ctypes

    import torch
    import torch.distributed.checkpoint as dcp

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        return {"skip": f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"}
    for cmd in (["mount", "--make-rprivate", "/"],
                ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", folder]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            return {"skip": f"{' '.join(cmd)}: {proc.stderr.strip()}"}

    def saver(state):
        return lambda target: dcp.save(state, checkpoint_id=target)

    checkpoint_save.save_atomically(saver({"w": torch.ones(256, 1024)}), os.path.join(folder, "step-1"))
    try:
        checkpoint_save.save_atomically(saver({"w": torch.ones(256, 1024), "m": torch.ones(1024, 1024)}),
                             os.path.join(folder, "step-2"))
        out = {"raised": None}
    except BaseException as err:  # noqa: BLE001  (what it is, is the result)
        out = {"raised": type(err).__name__, "message": str(err)}
    out["files"] = {name: sorted(os.listdir(os.path.join(folder, name)))
                    for name in os.listdir(folder)}
    return out


def test_a_full_disk_stops_the_save_naming_the_space_and_removing_the_partial_folder(tmp_path):
    """A real full file system (a 4 MiB tmpfs, mounted by a process of its own where it
    runs as root; elsewhere skipped, the simulated ENOSPC above covers the rest). There
    torch.save's error says nothing of the disk ("unexpected pos"), so the error must."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount")
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    out = run_on_gloo(functools.partial(_save_on_a_full_tmpfs, str(folder)), 1,
                      tmp_path / "full_disk.pt")
    if "skip" in out:
        pytest.skip(f"cannot mount a tmpfs here: {out['skip']}")
    assert out["raised"] == "CheckpointNotSaved", out
    assert out["files"] == {"step-1": [".metadata", "__0_0.distcp"]}, out  # no .saving-2
    for text in (f"checkpoint {folder / 'step-2'} was not saved", "unexpected pos",
                 "had 0 bytes free when the save failed", "The disk is full",
                 f"The partial folder {folder / '.saving-2'} (",
                 "written) was removed", "this checkpoint needs more than the ",
                 f"the earlier checkpoints in {folder} (steps [1]) are untouched"):
        assert text in out["message"], (text, out["message"])


NOT_DAMAGE = ("damaged", "delete", "Move ", "restore the files")


def assert_mismatch_only(out: str) -> None:
    """The run stopped on a configuration mismatch, without calling the checkpoint
    damaged or advising to move or delete it."""
    assert "does not match this run" in out, out[-3000:]
    for text in NOT_DAMAGE:
        assert text not in out, (text, out[-3000:])


def keep_entries(step_dir, keep, manifest: bool = True) -> None:
    """Rewrite ``step_dir``'s ``.metadata`` so that it indexes only the entries whose key
    ``keep(key)`` accepts (the data files stay as they are), and its manifest to match
    (``manifest``, as a save of those entries writes it) or remove it (as titan_lowbit
    wrote checkpoints before manifests)."""
    meta = FileSystemReader(str(step_dir)).read_metadata()
    meta.state_dict_metadata = {k: v for k, v in meta.state_dict_metadata.items() if keep(k)}
    meta.storage_data = {k: v for k, v in meta.storage_data.items() if keep(k.fqn)}
    with open(step_dir / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    if manifest:
        write_manifest(str(step_dir))
    else:
        (step_dir / MANIFEST).unlink()


def keep_model_only(step_dir) -> None:
    """Make ``step_dir`` what torchtitan's last save writes with last_save_model_only:
    the model's entries (and titan_lowbit's record) and nothing else."""
    keep_entries(step_dir, lambda k: k.split(".", 1)[0] not in (
        "optimizer", "lr_scheduler", "dataloader", "train_state"))


@pytest.mark.trainer
def test_model_only_checkpoint_stops_naming_the_full_checkpoints(two_process_checkpoint,
                                                                 tmp_path):
    fixture_dump, _, overrides = two_process_checkpoint
    dump = dump_with(tmp_path, fixture_dump, keep_model_only)

    out = stopped_run(*overrides, "--job.dump_folder", str(dump), "--training.steps", str(LAST + 2))
    assert_mismatch_only(out)
    step_dir = dump / "checkpoint" / f"step-{LAST}"
    for text in ("holds the model weights only", "last_save_model_only = true",
                 f"--checkpoint.load_step N (those in {dump / 'checkpoint'}: steps [{SAVE_STEP}])",
                 f"--checkpoint.initial_load_path {step_dir}"):
        assert text in out, (text, out[-3000:])
    assert "optimizer layout" not in out and "torch Adam/AdamW" not in out, out[-3000:]


@pytest.mark.trainer
def test_resume_on_another_process_count_names_the_dataloader_fix(two_process_checkpoint,
                                                                  tmp_path):
    dump, _, overrides = two_process_checkpoint
    resumed = resume_folder(tmp_path, dump / "checkpoint")
    out = stopped_run(*overrides, "--job.dump_folder", str(resumed),
                      "--training.steps", str(SAVE_STEP + 1), nproc=1)
    assert_mismatch_only(out)
    for text in ("data loader positions of 2 data-parallel ranks, this run has 1",
                 "--checkpoint.exclude_from_loading dataloader"):
        assert text in out, (text, out[-3000:])


@pytest.mark.trainer
def test_adam_resuming_an_adamw_checkpoint_names_the_optimizer_name(two_process_checkpoint,
                                                                    tmp_path):
    dump, _, overrides = two_process_checkpoint  # written by AdamW4bit
    resumed = resume_folder(tmp_path, dump / "checkpoint")
    out = stopped_run(*overrides, "--job.dump_folder", str(resumed), "--optimizer.name", "Adam4bit",
                      "--training.steps", str(SAVE_STEP + 1))
    assert_mismatch_only(out)
    for text in ("decoupled_weight_decay=True", "decoupled_weight_decay=False",
                 '[optimizer] name = "AdamW4bit" (--optimizer.name AdamW4bit)'):
        assert text in out, (text, out[-3000:])


@pytest.mark.trainer
def test_resume_with_bitnet_added_names_the_converters_and_a_new_run_may_start_from_it(
        two_process_checkpoint, tmp_path):
    """A BitNet weight's checkpoint entry is its plain latent weight, so only the record
    the plugin writes beside the states tells a BitNet run's checkpoint from a plain one's:
    resuming the plain fixture with ``bitnet`` stops; starting a new run from its weights
    with ``bitnet`` (a model-only initial load) trains."""
    dump, _, overrides = two_process_checkpoint  # written without converters
    step_dir = dump / "checkpoint" / f"step-{SAVE_STEP}"
    assert checkpoint_layout.BITNET_WEIGHTS in FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    resumed = resume_folder(tmp_path, dump / "checkpoint")
    out = stopped_run(*overrides, "--job.dump_folder", str(resumed), "--model.converters", "bitnet",
                      "--training.steps", str(SAVE_STEP + 1))
    assert_mismatch_only(out)
    for text in ("written with 0 BitNet linear weights (no bitnet converter), this run has 42",
                 f"--checkpoint.initial_load_path {resumed / 'checkpoint' / f'step-{SAVE_STEP}'}"):
        assert text in out, (text, out[-3000:])

    fresh = run_train(*overrides, "--job.dump_folder", str(tmp_path / "fresh"),
                      "--model.converters", "bitnet", "--checkpoint.initial_load_path", str(step_dir),
                      "--training.steps", "2")
    assert f"Loading the checkpoint from {step_dir}" in fresh.stdout + fresh.stderr, fresh.stdout[-3000:]
    assert sorted(step_losses(fresh.stdout)) == [1, 2], fresh.stdout[-3000:]


def drop_conversion_record(step_dir) -> None:
    """Make ``step_dir`` what titan_lowbit wrote before it recorded the conversion (and
    before it wrote manifests)."""
    keep_entries(step_dir, lambda k: not k.startswith(checkpoint_layout.RECORD + "."), manifest=False)


@pytest.mark.trainer
def test_checkpoint_without_conversion_record_resumes_identically(two_process_checkpoint, tmp_path):
    fixture_dump, full, overrides = two_process_checkpoint
    dump = dump_with(tmp_path, fixture_dump, drop_conversion_record)  # step-LAST edited
    proc = run_train(*overrides, "--job.dump_folder", str(dump), "--training.steps", str(LAST + 1))
    step_dir = dump / "checkpoint" / f"step-{LAST}"
    assert f"Loading the checkpoint from {step_dir}" in proc.stdout
    assert sorted(step_losses(proc.stdout)) == [LAST + 1], proc.stdout[-3000:]
    # Without a manifest the checks are the per-record ones, and the log says so once.
    assert proc.stdout.count(f"checkpoint {step_dir} has no manifest") == 1, proc.stdout[-3000:]
    assert "checked by the per-record CRC-32 only" in proc.stdout


def raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001
        return err
    raise AssertionError(f"{fn} raised nothing")


def test_load_errors_after_the_checks_are_not_called_damage(tmp_path):
    import torch

    from titan_lowbit.optim import LowBitAdamW

    folder = tmp_path / "checkpoint"
    for step in (2, 3):
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / ".metadata").write_bytes(b"")
    checkpoint_id = str(folder / "step-3")

    # LowBitAdamW's own load check (an Adam* optimizer given an AdamW* state dict).
    saved = LowBitAdamW([torch.nn.Parameter(torch.zeros(8))]).state_dict()
    adam = LowBitAdamW([torch.nn.Parameter(torch.zeros(8))], decoupled_weight_decay=False)
    err = checkpoint_errors.load_failure(checkpoint_id, raised(lambda: adam.load_state_dict(saved)))
    assert isinstance(err, checkpoint_layout.CheckpointMismatch), err
    assert "[optimizer] name" in str(err) and "AdamW*" in str(err), err

    # torchtitan's data loader assertion, also as DCP wraps a rank's error.
    dp = AssertionError("dp_degree is inconsistent before and after checkpoint, dataloader "
                        "resharding is not supported yet.")
    wrapped = CheckpointException("load failed", {1: (dp, traceback.StackSummary())})
    for failure in (dp, wrapped):
        err = checkpoint_errors.load_failure(checkpoint_id, failure)
        assert isinstance(err, checkpoint_layout.CheckpointMismatch), err
        assert "--checkpoint.exclude_from_loading dataloader" in str(err), err

    # Anything else: the files passed the checks, so no damage is claimed and the other
    # checkpoint is offered by --checkpoint.load_step.
    err = checkpoint_errors.load_failure(checkpoint_id, RuntimeError("something else"))
    assert isinstance(err, checkpoint_errors.CheckpointNotLoaded), err
    assert "something else" in str(err) and "--checkpoint.load_step N (steps [2]" in str(err)
    err_size = checkpoint_errors.load_failure(checkpoint_id, RuntimeError("something else"), crc=False)
    assert f"{checkpoint_verify.VERIFY_ENV}=size" in str(err_size), err_size
    for message in (str(err), str(err_size)):
        for text in NOT_DAMAGE:
            assert text not in message, (text, message)
