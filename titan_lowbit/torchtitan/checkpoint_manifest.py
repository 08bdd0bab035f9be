"""A checkpoint's manifest: the place, length and CRC-32 of every record, written with it.

Why: torch.save stores a CRC-32 inside each tensor record of a ``.distcp`` file, and
:func:`titan_lowbit.torchtitan.checkpoint.file_problems` checks it. That cannot see two
records swapped (each carries its own CRC with it, so a record in another tensor's place
checks out) nor a changed non-tensor record (the step, the data loader's position, the
param-group values: DCP pickles them, and nothing checks them). The manifest is written by
titan_lowbit after DCP has written the checkpoint (``.metadata`` included) and before the
``.saving-N`` folder becomes ``step-N``, so it is part of the checkpoint as atomically as
the rest. It holds, per record of the ``.metadata`` index (tensor chunks and non-tensor
records alike): its key (FQN and chunk offset), file, byte offset, length and the CRC-32
of those bytes as read back from the file; per file its size; and the size and CRC-32 of
``.metadata`` itself. Before a load, every record is read at its place and compared, so a
record moved, swapped, edited, added to or dropped from the index fails, by name.

The ranks split the files between them (file i of the sorted list when i % world == rank)
when writing the manifest and when checking it: one read pass over the checkpoint, spread
over the ranks, as the per-record check costs. The manifest is JSON (no pickle: reading it
runs no code).
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

MANIFEST = ".titan_lowbit_manifest.json"
METADATA = ".metadata"  # DCP's index file (FileSystemWriter's name for it)
FORMAT = 1
CHUNK = 4 << 20  # bytes read at a time for a CRC


class ManifestUnreadable(ValueError):
    """A manifest file that is there but cannot be used; the message says why."""


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _key(fqn: str, offset) -> tuple[str, tuple[int, ...] | None]:
    """A record's identity: its FQN and, for a tensor chunk, the chunk's offset."""
    return fqn, None if offset is None else tuple(int(i) for i in offset)


def record_name(key: tuple[str, tuple[int, ...] | None]) -> str:
    """``fqn``, with the chunk's offset when the chunk does not start at the origin."""
    fqn, offset = key
    return f"{fqn} (chunk at {list(offset)})" if offset and any(offset) else fqn


def _where(place: tuple[str, int, int]) -> str:
    name, start, length = place
    return f"{name} bytes {start}-{start + length}"


def index_places(metadata) -> dict[tuple, tuple[str, int, int]]:
    """{record key: (file, offset, length)} of every record the ``.metadata`` index names."""
    return {_key(index.fqn, index.offset): (info.relative_path, info.offset, info.length)
            for index, info in metadata.storage_data.items()}


def crc32_of(path: str | Path, start: int = 0, length: int | None = None) -> int:
    """CRC-32 of bytes [start, start + length) of ``path`` (to its end when length is None);
    EOFError when the file ends first. zlib releases the GIL, so threads run in parallel."""
    if length is None:
        length = os.stat(path).st_size - start
    buffer = memoryview(bytearray(min(CHUNK, max(length, 1))))
    crc, left = 0, length
    with open(path, "rb") as f:
        f.seek(start)
        while left:
            got = f.readinto(buffer[:min(CHUNK, left)])
            if not got:
                raise EOFError(f"{path} ends {left} bytes before byte {start + length}")
            crc = zlib.crc32(buffer[:got], crc)
            left -= got
    return crc


def _crcs(folder: Path, places: list[tuple[str, int, int]]) -> list[int]:
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda p: crc32_of(folder / p[0], p[1], p[2]), places))


def _share(names, rank: int, world: int) -> set[str]:
    """The files of ``names`` this rank reads: file i of the sorted list when i % world == rank."""
    return {name for i, name in enumerate(sorted(names)) if i % world == rank}


def write_manifest(checkpoint_id: str) -> None:
    """Write ``checkpoint_id``'s manifest from the files DCP wrote there (every rank calls
    it after the save; each reads its share of the files, rank 0 writes the manifest, to a
    temporary name first, synced, then renamed)."""
    rank, world = _rank_world()
    folder = Path(checkpoint_id)
    places = index_places(FileSystemReader(checkpoint_id).read_metadata())
    mine = _share({place[0] for place in places.values()}, rank, world)
    keys = [key for key, place in places.items() if place[0] in mine]
    crcs = _crcs(folder, [places[key] for key in keys])
    part = {"files": {name: os.stat(folder / name).st_size for name in mine},
            "records": [[key[0], None if key[1] is None else list(key[1]), *places[key], crc]
                        for key, crc in zip(keys, crcs)]}
    parts = [part]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, part)
    if rank != 0:
        return
    manifest = {
        "titan_lowbit_manifest": FORMAT,
        "metadata": {"bytes": os.stat(folder / METADATA).st_size,
                     "crc32": crc32_of(folder / METADATA)},
        "files": {name: size for p in parts for name, size in sorted(p["files"].items())},
        "records": sorted((r for p in parts for r in p["records"]),
                          key=lambda r: (r[2], r[3])),
    }
    temporary = folder / (MANIFEST + ".tmp")
    with open(temporary, "w") as f:
        json.dump(manifest, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, folder / MANIFEST)


def read_manifest(checkpoint_id: str) -> dict[str, Any] | None:
    """The checkpoint's manifest, as {"metadata", "files", "records": {key: (file, offset,
    length, crc)}}; None when it has none (written before titan_lowbit wrote manifests, or
    by an async save). ManifestUnreadable when the file is there but unusable."""
    path = Path(checkpoint_id) / MANIFEST
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        found = raw.get("titan_lowbit_manifest") if isinstance(raw, dict) else None
        if found != FORMAT:
            raise ValueError(f"format {found!r}, this titan_lowbit reads format {FORMAT}"
                             + (" (written by a newer titan_lowbit: upgrade it)"
                                if isinstance(found, int) and found > FORMAT else ""))
        records = {_key(fqn, offset): (name, int(start), int(length), int(crc))
                   for fqn, offset, name, start, length, crc in raw["records"]}
        return {"metadata": (int(raw["metadata"]["bytes"]), int(raw["metadata"]["crc32"])),
                "files": {str(k): int(v) for k, v in raw["files"].items()},
                "records": records}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ManifestUnreadable(f"{MANIFEST} cannot be read: {err!r}") from err


def _index_problems(metadata, manifest: dict[str, Any]) -> list[str]:
    """How the ``.metadata`` index differs from the one the manifest was written with."""
    index, written = index_places(metadata), manifest["records"]
    problems = []
    for key, place in index.items():
        if key not in written:
            problems.append(f"{record_name(key)} ({_where(place)}) is in the .metadata index but "
                            "was not written with the checkpoint (its manifest lacks it)")
        elif written[key][:3] != place:
            problems.append(f"{record_name(key)}: the .metadata index places it at "
                            f"{_where(place)}, it was written at {_where(written[key][:3])}")
    dropped = [key for key in written if key not in index]
    if dropped:
        problems.append(f"{len(dropped)} records written with the checkpoint are missing from "
                        "the checkpoint's .metadata index (its manifest lists them), e.g. "
                        + ", ".join(record_name(key) for key in dropped[:3]))
    return problems


def manifest_problems(checkpoint_id: str, metadata, manifest: dict[str, Any], rank: int = 0,
                      world: int = 1, crc: bool = True) -> list[str]:
    """What differs between the checkpoint's files and its ``manifest``: ``.metadata``'s
    size and CRC-32 (with the records it moved, added or dropped named), each file's size,
    and (``crc``) each record's CRC-32 at its place, in the files this rank checks."""
    folder = Path(checkpoint_id)
    problems = []
    size, crc32 = manifest["metadata"]
    now = (os.stat(folder / METADATA).st_size, crc32_of(folder / METADATA))
    if now != (size, crc32):
        problems += _index_problems(metadata, manifest) or [
            f"{METADATA} was changed after the checkpoint was written ({now[0]} bytes, CRC-32 "
            f"{now[1]:08x}; written: {size} bytes, CRC-32 {crc32:08x}), though it places every "
            "record where it was written: shapes, types or other entries of the index differ"]
    readable = set()
    for name, written in sorted(manifest["files"].items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif (have := path.stat().st_size) != written:
            problems.append(f"{name} is {have} bytes, it was written with {written}")
        else:
            readable.add(name)
    if not crc:
        return problems
    records = manifest["records"]
    mine = _share(manifest["files"], rank, world) & readable
    keys = [key for key, record in records.items() if record[0] in mine]
    written_as: dict[int, list] = {}
    for key, record in records.items():
        written_as.setdefault(record[3], []).append(key)
    for key, now_crc in zip(keys, _crcs(folder, [records[key][:3] for key in keys])):
        if now_crc == records[key][3]:
            continue
        problem = (f"{record_name(key)} ({_where(records[key][:3])}) does not match the CRC-32 "
                   f"written with the checkpoint ({now_crc:08x}, written {records[key][3]:08x})")
        if len(others := written_as.get(now_crc, [])) == 1:
            problem += (f"; these bytes are the ones written for {record_name(others[0])}: "
                        "records moved or swapped")
        problems.append(problem)
    return problems
