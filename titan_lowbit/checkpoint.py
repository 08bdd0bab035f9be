"""Checkpoint safety around torchtitan's CheckpointManager (DCP, one folder per step).

Loading. Before torchtitan's ``CheckpointManager.dcp_load`` reads anything:

- the checkpoint's files are checked against its ``.metadata`` index: every file there,
  none shorter than the index says, and every tensor's CRC-32 (torch.save writes one per
  record; DCP itself never checks it, so overwritten bytes would load silently). The
  ranks split the files between them and agree on the verdict. A damaged checkpoint
  stops the run naming the step folder, what is wrong, and the complete checkpoints
  beside it to resume from instead. ``TITAN_LOWBIT_VERIFY_CHECKPOINT=size`` keeps the
  file and size checks but skips reading the data for the CRCs;
- :func:`check_compatible` compares the checkpoint's optimizer layout (state format,
  block size, BF16 update rule, fp32-state threshold) and parameter dtypes with the
  current run's, and stops with both named: torch.distributed.checkpoint loads into the
  tensors the run allocated, so a 4-bit checkpoint loaded by an 8-bit run fails with a
  bare "Size mismatch", an 8-bit one loaded by an FP8 run (codes of the same shape) would
  be *cast* silently into garbage state, and bf16 weights into fp32 ones (or back) are
  cast silently too. An optimizer entry the run needs and the checkpoint lacks stops it,
  by name;
- an error from DCP's own load is re-raised with the step folder and the same advice.

Saving. DCP writes the data files first and ``.metadata`` last (to a temporary name,
then renamed), and torchtitan resumes only from ``step-N`` folders that hold a
``.metadata``, so a save cut short is skipped (titan_lowbit logs a warning naming it).
But a save into an existing ``step-N`` folder (a run resumed from an earlier step
re-saves a step it had saved before) overwrites that checkpoint's files in place while
its old ``.metadata`` still stands. So synchronous saves are written to ``.saving-N``
beside the step folders and moved into place as ``step-N`` only once complete; the old
``step-N`` is removed after that. (Async saves, ``[checkpoint] async_mode``, keep
torchtitan's behaviour.)
"""

from __future__ import annotations

import io
import os
import re
import shutil
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_lowbit.optimizer_builder import is_lowbit

STEP_DIR = re.compile(r"step-(\d+)")  # torchtitan's own pattern (re.search)
VERIFY_ENV = "TITAN_LOWBIT_VERIFY_CHECKPOINT"
LAYOUT_KEYS = ("state_format", "block_size", "weight_update", "min_quantized_numel")
TORCH_LAYOUT = {"optimizer": "torch Adam/AdamW (fp32 or parameter-dtype moments)"}


def current_layout(optimizers) -> dict[str, Any]:
    first = next(iter(optimizers))
    if not is_lowbit(first):  # torch's Adam/AdamW
        return dict(TORCH_LAYOUT)
    group = first.param_groups[0]
    return {"optimizer": "titan_lowbit", **{k: group[k] for k in LAYOUT_KEYS}}


def saved_layout(checkpoint_id: str, metadata) -> dict[str, Any]:
    keys = metadata.state_dict_metadata
    formats = sorted(k for k in keys
                     if k.startswith("optimizer.param_groups.") and k.endswith(".state_format"))
    if not formats:
        return dict(TORCH_LAYOUT)
    prefix = formats[0][: -len("state_format")]
    values: dict[str, Any] = {prefix + k: None for k in LAYOUT_KEYS if prefix + k in keys}
    dcp.load(values, checkpoint_id=checkpoint_id)
    return {"optimizer": "titan_lowbit", **{k: values.get(prefix + k) for k in LAYOUT_KEYS}}


def _describe(layout: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in layout.items())


def check_compatible(state_dict: dict[str, Any], checkpoint_id: str, metadata=None) -> None:
    """Raise ValueError when the checkpoint at ``checkpoint_id`` was written with another
    optimizer layout or other parameter dtypes than ``state_dict`` (the run's states)."""
    if metadata is None:
        metadata = FileSystemReader(checkpoint_id).read_metadata()
    problems = []
    optimizers = state_dict.get("optimizer")
    if optimizers is not None:
        have, saved = current_layout(optimizers), saved_layout(checkpoint_id, metadata)
        if have != saved:
            problems.append(
                f"optimizer layout: checkpoint {_describe(saved)}; this run {_describe(have)}. "
                "Resume with the [optimizer] name and [lowbit] block_size, weight_update and "
                "min_quantized_numel the checkpoint was written with, or train into a new "
                "job.dump_folder."
            )
    for key, value in state_dict.items():
        saved_meta = metadata.state_dict_metadata.get(key)
        if isinstance(value, torch.Tensor) and isinstance(saved_meta, TensorStorageMetadata):
            if saved_meta.properties.dtype != value.dtype:
                problems.append(
                    f"parameter {key}: checkpoint holds {saved_meta.properties.dtype}, this run "
                    f"{value.dtype}. Set [lowbit] weight_dtype (and [training] dtype) as when "
                    "the checkpoint was written."
                )
                break  # one parameter says it; the rest would repeat it
    if optimizers is not None and not problems:
        wanted = {f"optimizer.{key}" for key in optimizers.state_dict()}
        missing = sorted(wanted - set(metadata.state_dict_metadata))
        if missing:
            problems.append(
                f"{len(missing)} optimizer entries are missing from the checkpoint, e.g. "
                f"{missing[:3]}; the checkpoint is incomplete or from another model. Restore "
                "it, or drop the optimizer with [checkpoint] exclude_from_loading = "
                '["optimizer"] to start the optimizer afresh.'
            )
    if problems:
        raise ValueError(
            f"checkpoint {checkpoint_id} does not match this run:\n  " + "\n  ".join(problems)
        )


class CheckpointDamaged(RuntimeError):
    """A checkpoint whose files cannot be trusted; the message says what to do."""

    def __init__(self, checkpoint_id: str, problems: list[str],
                 header: str = "is damaged or incomplete and was not loaded"):
        folder, name = os.path.split(os.path.normpath(checkpoint_id))
        step = STEP_DIR.search(name)
        others = [s for s in complete_steps(folder) if not step or s != int(step.group(1))]
        if others:
            advice = (f"Move {checkpoint_id} out of {folder} (or delete it) to resume from the "
                      f"latest other complete checkpoint there (steps {others}), or choose "
                      "one with --checkpoint.load_step N.")
        else:
            advice = (f"There is no other complete checkpoint in {folder}: restore the files "
                      "from a copy, or start afresh in a new --job.dump_folder.")
        shown = problems[:5] + ([f"... and {len(problems) - 5} more"] if len(problems) > 5 else [])
        super().__init__(f"checkpoint {checkpoint_id} {header}:\n  " + "\n  ".join(shown)
                         + "\n" + advice)


def step_folders(folder: str) -> dict[int, str]:
    """{N: path} of the ``step-N`` folders in ``folder`` (torchtitan's naming)."""
    if not os.path.isdir(folder):
        return {}
    return {int(m.group(1)): os.path.join(folder, name) for name in os.listdir(folder)
            if (m := STEP_DIR.search(name))}


def complete_steps(folder: str) -> list[int]:
    """Steps of the ``step-N`` folders in ``folder`` that hold a DCP ``.metadata``."""
    return sorted(step for step, path in step_folders(folder).items()
                  if os.path.isfile(os.path.join(path, ".metadata")))


def read_metadata(checkpoint_id: str):
    try:
        return FileSystemReader(checkpoint_id).read_metadata()
    except Exception as err:  # noqa: BLE001  (any failure here means an unreadable index)
        raise CheckpointDamaged(checkpoint_id, [f".metadata cannot be read: {err!r}"]) from err


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable file of its own
    (zipfile reads one torch.save record of a .distcp file through it)."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, min(self.length, base + offset))
        return self.pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.length - self.pos)
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


def _record_problem(path: Path, start: int, length: int) -> str | None:
    """What is wrong with the torch.save record at bytes [start, start + length) of
    ``path`` (None: its zip structure reads and every CRC-32 matches)."""
    try:
        with open(path, "rb") as f, zipfile.ZipFile(_Window(f, start, length)) as z:
            for info in z.infolist():
                if info.CRC == 0:  # written with torch's CRC-32 turned off: nothing to check
                    continue
                with z.open(info) as member:
                    while member.read(1 << 22):
                        pass
    except zipfile.BadZipFile as err:
        return f"damaged ({err})"
    except Exception as err:  # noqa: BLE001
        return f"unreadable ({err!r})"
    return None


def file_problems(checkpoint_id: str, metadata, rank: int = 0, world: int = 1,
                  crc: bool = True) -> list[str]:
    """Files of the checkpoint that are missing or shorter than ``metadata`` says, and
    (``crc``) tensors whose bytes fail torch.save's CRC-32, in the files this rank checks
    (file i of the sorted list when i % world == rank)."""
    items: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        items.setdefault(info.relative_path, []).append((index, info))
    problems, records = [], []
    for i, name in enumerate(sorted(items)):
        path = Path(checkpoint_id) / name
        need = max(info.offset + info.length for _, info in items[name])
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        if (size := path.stat().st_size) < need:
            problems.append(f"{name} is truncated: {size} bytes, the index needs {need}")
            continue
        if crc and i % world == rank:
            records += [(path, index.fqn, info) for index, info in items[name]
                        if not info.transform_descriptors and isinstance(
                            metadata.state_dict_metadata.get(index.fqn), TensorStorageMetadata)]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        verdicts = pool.map(lambda r: _record_problem(r[0], r[2].offset, r[2].length), records)
        for (path, fqn, info), verdict in zip(records, verdicts):
            if verdict:
                problems.append(f"{path.name}: {fqn} (bytes {info.offset}-"
                                f"{info.offset + info.length}) is {verdict}")
    return problems


def verify(checkpoint_id: str, metadata) -> None:
    """Raise CheckpointDamaged on every rank when any rank finds a problem with the
    checkpoint's files (see :func:`file_problems`)."""
    from torchtitan.tools.logging import logger

    begin = time.monotonic()
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    crc = os.environ.get(VERIFY_ENV, "crc").lower() != "size"
    problems = file_problems(checkpoint_id, metadata, rank, world, crc)
    if distributed:
        gathered: list[list[str] | None] = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = list(dict.fromkeys(p for ps in gathered for p in ps or []))
    if problems:
        raise CheckpointDamaged(checkpoint_id, problems)
    logger.info(f"titan_lowbit: checkpoint {checkpoint_id}: files "
                f"{'and CRC-32 ' if crc else ''}verified in {time.monotonic() - begin:.1f} s")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_atomically(save, checkpoint_id: str):
    """Run ``save(staging_id)`` into ``.saving-N`` beside the ``step-N`` folder
    ``checkpoint_id``, then (rank 0) move it into place, replacing an older ``step-N``
    only after the new one is complete."""
    target = Path(checkpoint_id)
    staging = target.parent / ("." + STEP_DIR.sub(r"saving-\1", target.name))
    first = not dist.is_initialized() or dist.get_rank() == 0
    if first:
        _remove(staging)  # what a save cut short left behind
    _barrier()
    result = save(str(staging))
    if first:
        replaced = target.parent / ("." + STEP_DIR.sub(r"replaced-\1", target.name))
        if target.exists() or target.is_symlink():
            _remove(replaced)
            os.replace(target, replaced)
        os.replace(staging, target)
        _remove(replaced)
    _barrier()
    return result


def register() -> None:
    from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
    from torchtitan.tools.logging import logger

    original_load = CheckpointManager.dcp_load
    if getattr(original_load, "titan_lowbit_checked", False):
        return
    original_save = CheckpointManager.dcp_save
    original_find = CheckpointManager._find_load_step

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf:
            return original_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
        metadata = read_metadata(checkpoint_id)
        verify(checkpoint_id, metadata)
        check_compatible(state_dict, checkpoint_id, metadata)
        try:
            return original_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
        except Exception as err:
            cause = (str(err).strip().splitlines() or [repr(err)])[0]
            raise CheckpointDamaged(
                checkpoint_id, [cause], "could not be loaded (written by another model or "
                "configuration? then resume with that one; otherwise it is damaged)") from err

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False,
                 to_hf=False):
        def save(target):
            return original_save(self, state_dict, target, async_mode,
                                 enable_garbage_collection, to_hf)

        if to_hf or async_mode != AsyncMode.DISABLED or not STEP_DIR.fullmatch(
                os.path.basename(os.path.normpath(checkpoint_id))):
            return save(checkpoint_id)
        return save_atomically(save, checkpoint_id)

    def _find_load_step(self, folder: str = "") -> int:
        step = original_find(self, folder)
        folder = folder or self.folder
        newer = sorted(s for s, path in step_folders(folder).items() if s > step
                       and not os.path.isfile(os.path.join(path, ".metadata"))
                       and not os.path.isfile(os.path.join(path, "model.safetensors.index.json")))
        if newer:
            logger.warning(
                f"titan_lowbit: skipping incomplete checkpoint folder(s) "
                f"{[f'step-{s}' for s in newer]} in {folder} (no .metadata: a save that did "
                f"not finish); " + (f"resuming from step-{step}" if step >= 0 else
                                    "no complete checkpoint to resume from"))
        return step

    dcp_load.titan_lowbit_checked = True
    CheckpointManager.dcp_load = dcp_load
    CheckpointManager.dcp_save = dcp_save
    CheckpointManager._find_load_step = _find_load_step
