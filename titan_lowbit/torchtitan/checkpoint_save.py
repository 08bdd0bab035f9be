"""Saves that never leave a half-written ``step-N``, and a failed save said plainly.

DCP writes the data files first and ``.metadata`` last, and torchtitan resumes only from
``step-N`` folders that hold a ``.metadata``; but a save into an existing ``step-N`` (a run
resumed from an earlier step saves a step it had saved before) overwrites that
checkpoint's files in place while its old ``.metadata`` still stands. So a synchronous save
is written to ``.saving-N`` and moved into place once complete (:func:`save_atomically`).
A save that fails (a full disk, most often: torch.save then says only "unexpected pos")
removes its ``.saving-N`` and raises :class:`CheckpointNotSaved` naming the free space, the
space a checkpoint takes and the untouched earlier checkpoints.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from titan_lowbit.torchtitan.checkpoint_errors import first_line, root_causes
from titan_lowbit.torchtitan.checkpoint_verify import STEP_DIR, complete_steps


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CheckpointNotSaved(RuntimeError):
    """A save that failed (a full disk, most often); its partial folder is removed and the
    message gives the free space, the space a checkpoint needs and what to do."""


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _folder_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (a step folder, or a link to one)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed while counting: not part of the total
    return total


# What torch.save raises when a write comes up short (a full disk, among others: the
# OSError behind it is not kept), and the errnos of a full disk or quota.
SHORT_WRITE = "unexpected pos"
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def save_failure(target: Path, staging: Path, err: BaseException, remove: bool) -> CheckpointNotSaved:
    """The error to raise when writing the checkpoint ``target`` into ``staging`` failed
    with ``err``. With ``remove`` (rank 0) it removes ``staging``, whose partial files would
    keep a full disk full, and names the free space on that file system, the space a
    checkpoint of this run takes (the newest complete one's size) and the checkpoints that
    are untouched: measured here because the OSError behind torch.save's short write is
    lost, so its message never says the disk is full. Other ranks name the cause only."""
    folder = target.parent
    causes = [exc for exc, _ in root_causes(err)]
    shown = "; ".join(dict.fromkeys(f"{type(exc).__name__}: {first_line(exc)}" for exc in causes))
    if not remove:  # another rank: rank 0 may be removing the folder while this one measures
        return CheckpointNotSaved(
            f"checkpoint {target} was not saved: {shown}\n  Rank 0 removes the partial folder "
            f"{staging} and reports the free space on that file system.")
    free_then = shutil.disk_usage(folder).free
    written = _folder_bytes(staging) if staging.exists() else 0
    try:
        _remove(staging)
        removal = f"The partial folder {staging} ({_size(written)} written) was removed"
    except OSError as rm_err:
        removal = (f"The partial folder {staging} could not be removed ({rm_err}): delete it "
                   "by hand to free its space")
    free_now = shutil.disk_usage(folder).free
    steps = complete_steps(str(folder))
    need = written
    needs = f"this checkpoint needs more than the {_size(written)} written before the failure"
    kept = f"there is no earlier checkpoint in {folder}"
    if steps:
        last = _folder_bytes(folder / f"step-{steps[-1]}")
        if last >= written:
            need = last
            needs = (f"a checkpoint of this run takes about {_size(last)} (the size of "
                     f"step-{steps[-1]})")
        else:
            needs += f" (step-{steps[-1]} takes {_size(last)})"
        kept = f"the earlier checkpoints in {folder} (steps {steps}) are untouched"
    full = (any(isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS for exc in causes)
            or free_then < max(need, 1 << 20))
    why = ("The disk is full: " if full else
           "If the file system is full or its quota reached: " if any(
               SHORT_WRITE in first_line(exc) for exc in causes) else "")
    return CheckpointNotSaved(
        f"checkpoint {target} was not saved: {shown}\n"
        f"  The file system of {folder} had {_size(free_then)} free when the save failed "
        f"({_size(free_now)} now); {needs}.\n  {removal}; {kept}.\n"
        f"  {why}free space there (e.g. fewer checkpoints with [checkpoint] keep_latest_k) or "
        "write to a file system with room (--job.dump_folder, [checkpoint] folder), then "
        "start the run again to resume from the last complete checkpoint.")


def save_atomically(save, checkpoint_id: str):
    """Run ``save(staging_id)`` into ``.saving-N`` beside the ``step-N`` folder
    ``checkpoint_id``, then (rank 0) move it into place, replacing an older ``step-N``
    only after the new one is complete. A save that fails (any error of the writer, DCP's
    CheckpointException included) raises :class:`CheckpointNotSaved` on each rank, rank 0
    having removed ``.saving-N``."""
    target = Path(checkpoint_id)
    staging = target.parent / ("." + STEP_DIR.sub(r"saving-\1", target.name))
    first = not dist.is_initialized() or dist.get_rank() == 0
    if first:
        _remove(staging)  # what a save cut short left behind
    _barrier()
    try:
        result = save(str(staging))
    except (Exception, CheckpointException) as err:  # CheckpointException: BaseException
        raise save_failure(target, staging, err, remove=first) from err
    if first:
        replaced = target.parent / ("." + STEP_DIR.sub(r"replaced-\1", target.name))
        if target.exists() or target.is_symlink():
            _remove(replaced)
            os.replace(target, replaced)
        os.replace(staging, target)
        _remove(replaced)
    _barrier()
    return result


