"""Are a checkpoint's files whole? Checked before anything is loaded.

Against the manifest every save writes (:mod:`titan_lowbit.torchtitan.checkpoint_manifest`)
where the checkpoint has one: ``.metadata`` itself, every file's size, every record's place,
length and CRC-32. Without one (written before titan_lowbit wrote manifests): every file the
``.metadata`` index names, none shorter than it says, and each tensor record's own CRC-32
(torch.save writes one per record; DCP itself never checks it). The ranks split the files
between them and agree on the verdict; a damaged checkpoint raises :class:`CheckpointDamaged`
naming the step folder, what is wrong and the complete checkpoints beside it.
``TITAN_LOWBIT_VERIFY_CHECKPOINT=size`` keeps the file, size and index checks but skips
reading the data.
"""

from __future__ import annotations

import io
import os
import re
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_lowbit.torchtitan.checkpoint_manifest import (
    MANIFEST,
    ManifestUnreadable,
    manifest_problems,
    read_manifest,
)


STEP_DIR = re.compile(r"step-(\d+)")  # torchtitan's own pattern (re.search)
VERIFY_ENV = "TITAN_LOWBIT_VERIFY_CHECKPOINT"


class CheckpointDamaged(RuntimeError):
    """A checkpoint whose files cannot be trusted; the message says what to do."""

    def __init__(self, checkpoint_id: str, problems: list[str],
                 header: str = "is damaged or incomplete and was not loaded"):
        folder, others = other_steps(checkpoint_id)
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


def other_steps(checkpoint_id: str) -> tuple[str, list[int]]:
    """(the folder of ``checkpoint_id``, the steps of the complete checkpoints in it other
    than ``checkpoint_id`` itself): where to fall back to or resume from instead."""
    folder, name = os.path.split(os.path.normpath(checkpoint_id))
    step = STEP_DIR.search(name)
    return folder, [s for s in complete_steps(folder) if not step or s != int(step.group(1))]


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


def checkpoint_problems(checkpoint_id: str, metadata, rank: int = 0, world: int = 1,
                        crc: bool = True) -> tuple[list[str], bool]:
    """(what is wrong with the checkpoint's files in this rank's share, whether its
    manifest checked them): against the manifest where the checkpoint has one
    (:func:`manifest_problems`: every record's place and bytes), else each tensor record
    against its own CRC-32 (:func:`file_problems`)."""
    try:
        manifest = read_manifest(checkpoint_id)
    except ManifestUnreadable as err:
        return [str(err)], True
    if manifest is None:
        return file_problems(checkpoint_id, metadata, rank, world, crc), False
    return manifest_problems(checkpoint_id, metadata, manifest, rank, world, crc), True


def verify(checkpoint_id: str, metadata) -> None:
    """Raise CheckpointDamaged on every rank when any rank finds a problem with the
    checkpoint's files (see :func:`checkpoint_problems`)."""
    from torchtitan.tools.logging import logger

    begin = time.monotonic()
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    crc = os.environ.get(VERIFY_ENV, "crc").lower() != "size"
    problems, by_manifest = checkpoint_problems(checkpoint_id, metadata, rank, world, crc)
    if distributed:
        gathered: list[list[str] | None] = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = list(dict.fromkeys(p for ps in gathered for p in ps or []))
    if problems:
        raise CheckpointDamaged(checkpoint_id, problems)
    took = f"in {time.monotonic() - begin:.1f} s"
    if by_manifest:
        logger.info(f"titan_lowbit: checkpoint {checkpoint_id}: "
                    + (f"every record verified against its manifest (place, length, CRC-32) {took}"
                       if crc else f"files and index verified against its manifest {took} "
                       f"({VERIFY_ENV}=size: the data was not read)"))
    else:
        logger.info(f"titan_lowbit: checkpoint {checkpoint_id} has no manifest ({MANIFEST}: "
                    "written by titan_lowbit before manifests, or by an async save), so it is "
                    "checked by the per-record CRC-32 only, which cannot see records swapped "
                    "between tensors nor a changed non-tensor record: files "
                    f"{'and CRC-32 ' if crc else ''}verified {took}")


