#!/usr/bin/env python3
"""Check titan_lowbit's checkpoint guarantees against real faults, and say which held.

Each fault is made for real and the run (or the checks a resume runs first) must notice
it as docs/distributed.md ("Checkpoint safety") says:

- ``kill-rank-during-save``: rank 1 is killed (SIGKILL) while a save is being written;
  the next run must resume from the last complete checkpoint, with the uninterrupted
  run's losses, and then write that step's checkpoint complete;
- damage to a written checkpoint, each refused at the resume naming what is wrong and the
  complete checkpoint to fall back to: ``truncated-distcp`` (a data file cut in half),
  ``flipped-bit`` (one bit of a tensor record), ``swapped-records`` (two records of equal
  length swapped in place: each keeps its own CRC-32), ``edited-step`` (the pickled
  ``train_state.step`` record changed by one), ``truncated-metadata`` (the index cut in
  half); and ``missing-metadata`` (the index removed, as a save cut short leaves it),
  which must be skipped, the run resuming from the checkpoint before it;
- ``full-disk``: the dump folder on a tmpfs that holds one checkpoint and a half; the
  second save must stop the run naming the free space, remove its partial folder and
  leave the first checkpoint whole (needs root, ``unshare`` and ``mount``; skipped
  elsewhere).

Without ``--checkpoint`` it trains CONFIG (default the llama3 debug model) for
2 x ``--interval`` steps with a checkpoint every ``--interval`` on ``--nproc`` processes
(GPUs where there are, else gloo CPU processes), then makes every fault against that run
and resumes from it (about 10 short runs). With ``--checkpoint STEP_DIR`` it makes the
damage faults in copies of that checkpoint folder and runs the checks a resume runs
before loading (no training). Extra arguments go to every run (torchtitan overrides).
Prints one line per fault; exits 1 if any guarantee did not hold.

    python tools/checkpoint_faults.py                                  # the debug model, 2 processes
    python tools/checkpoint_faults.py --optimizer.name AdamW8bit --lowbit.weight_dtype bfloat16 \\
        --lowbit.weight_update master_remainder
    python tools/checkpoint_faults.py --checkpoint outputs/llama3_debug/checkpoint/step-10
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "scripts") not in sys.path:
    sys.path.append(str(ROOT / "scripts"))  # runs and run_logs, shared with scripts/

from run_logs import step_losses  # noqa: E402  (scripts/run_logs.py)
from runs import child_env, gpu_count, launch  # noqa: E402  (scripts/runs.py)

from titan_lowbit.torchtitan import checkpoint_verify  # noqa: E402
from titan_lowbit.torchtitan.checkpoint_manifest import index_places  # noqa: E402

STEP_RECORD = "train_state.step"
REFUSED = "is damaged or incomplete and was not loaded"  # checkpoint.CheckpointDamaged's header


# ---- damage done to a written step folder ------------------------------------------------
# Each takes the step folder, changes it in place, and returns the texts a refusal must
# name (the file or the records).


def _places(step_dir: Path) -> dict[tuple, tuple[str, int, int]]:
    return index_places(FileSystemReader(str(step_dir)).read_metadata())


def _tensor_records(step_dir: Path) -> list[tuple[str, str, int, int]]:
    """(key, file, offset, length) of the tensor records (each chunk's origin) in the index."""
    meta = FileSystemReader(str(step_dir)).read_metadata()
    return [(fqn, *place) for (fqn, offset), place in index_places(meta).items()
            if isinstance(meta.state_dict_metadata.get(fqn), TensorStorageMetadata)]


def place_of(step_dir: Path, key: str) -> tuple[str, int, int]:
    """(file, offset, length) of record ``key`` (its chunk at the origin: rank 0's rows)."""
    [place] = [p for (name, offset), p in _places(step_dir).items()
               if name == key and not any(offset or ())]
    return place


def truncate_distcp(step_dir: Path) -> list[str]:
    """Cut the largest data file in half."""
    path = max(step_dir.glob("*.distcp"), key=lambda p: (p.stat().st_size, p.name))
    os.truncate(path, path.stat().st_size // 2)
    return [f"{path.name} is "]


def flip_bit(step_dir: Path) -> list[str]:
    """Flip one bit in the middle of the largest tensor record of the first data file."""
    first = min(p.name for p in step_dir.glob("*.distcp"))
    key, name, start, length = max((r for r in _tensor_records(step_dir) if r[1] == first),
                                   key=lambda r: r[3])
    with open(step_dir / name, "r+b") as f:
        f.seek(start + length // 2)
        byte = f.read(1)[0]
        f.seek(start + length // 2)
        f.write(bytes([byte ^ 0x10]))
    return [key]


def _read(path: Path, start: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(length)


def swap_records(step_dir: Path, a: str | None = None, b: str | None = None) -> list[str]:
    """Swap the bytes of two tensor records of one file and of equal length, ``a`` and
    ``b`` (by default the first such pair whose bytes differ), in place."""
    if a is None or b is None:
        groups: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for key, name, start, length in sorted(_tensor_records(step_dir), key=lambda r: (r[1], r[2])):
            groups.setdefault((name, length), []).append((key, start))
        pairs = ((x, y) for (name, length), records in groups.items()
                 for x, y in zip(records, records[1:])
                 if _read(step_dir / name, x[1], length) != _read(step_dir / name, y[1], length))
        (a, _), (b, _) = next(pairs, ((None, 0), (None, 0)))
        if a is None:
            raise ValueError(f"{step_dir} holds no two tensor records of one file and equal length to swap")
    (file_a, start_a, length), (file_b, start_b, length_b) = place_of(step_dir, a), place_of(step_dir, b)
    if file_a != file_b or length != length_b:
        raise ValueError(f"records {a} and {b} are not of one file and equal length")
    bytes_a, bytes_b = _read(step_dir / file_a, start_a, length), _read(step_dir / file_a, start_b, length)
    with open(step_dir / file_a, "r+b") as f:
        f.seek(start_a)
        f.write(bytes_b)
        f.seek(start_b)
        f.write(bytes_a)
    return [a, b]


def edit_step(step_dir: Path) -> list[str]:
    """Change the step in the pickled non-tensor record ``train_state.step`` by one, in
    place (torch.save of an int: its pickle appears as is in the record)."""
    name, start, length = place_of(step_dir, STEP_RECORD)
    record = _read(step_dir / name, start, length)
    step = int(torch.load(io.BytesIO(record), weights_only=True))
    old = pickle.dumps(step, protocol=2)[2:]  # without the protocol header: opcode, value, STOP
    new = next(body for body in (pickle.dumps(s, protocol=2)[2:] for s in (step + 1, step - 1))
               if len(body) == len(old))
    at = record.index(old)
    with open(step_dir / name, "r+b") as f:
        f.seek(start + at)
        f.write(new)
    return [STEP_RECORD]


def truncate_metadata(step_dir: Path) -> list[str]:
    path = step_dir / ".metadata"
    os.truncate(path, path.stat().st_size // 2)
    return [".metadata cannot be read"]


def remove_metadata(step_dir: Path) -> list[str]:
    (step_dir / ".metadata").unlink()
    return []


@dataclass
class Damage:
    name: str
    apply: Callable[[Path], list[str]]
    skipped: bool = False  # the guarantee: the folder is skipped (not refused)


DAMAGES = [
    Damage("truncated-distcp", truncate_distcp),
    Damage("flipped-bit", flip_bit),
    Damage("swapped-records", swap_records),
    Damage("edited-step", edit_step),
    Damage("truncated-metadata", truncate_metadata),
    Damage("missing-metadata", remove_metadata, skipped=True),
]
RUN_FAULTS = ["kill-rank-during-save", "full-disk"]


@dataclass
class Verdict:
    fault: str
    how: str  # "checks" (the checks a resume runs first) or "resume" (a real run)
    held: bool | None  # None: not run here
    detail: str

    def line(self) -> str:
        result = {True: "held", False: "FAILED", None: "skipped"}[self.held]
        return f"{self.fault:22} {self.how:7} {result:8} {' '.join(self.detail.split())}"


def _copy(step_dir: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    copy = into / step_dir.name
    shutil.copytree(step_dir, copy, symlinks=False)
    return copy


def check_damage(step_dir: Path, damage: Damage, work: Path) -> Verdict:
    """Make ``damage`` in a copy of ``step_dir`` (under ``work``) and run the checks a
    resume runs before loading: the damage must be named (or, missing .metadata, the
    folder must not count as a complete checkpoint)."""
    shutil.rmtree(work / damage.name, ignore_errors=True)
    copy = _copy(step_dir, work / damage.name / "checkpoint")
    try:
        expected = damage.apply(copy)
    except Exception as err:  # noqa: BLE001  (a checkpoint this damage cannot be made in)
        return Verdict(damage.name, "checks", None, f"cannot be made here: {err}")
    step = int(checkpoint_verify.STEP_DIR.search(copy.name).group(1))
    if damage.skipped:
        held = step not in checkpoint_verify.complete_steps(str(copy.parent))
        return Verdict(damage.name, "checks", held, "skipped as incomplete" if held else
                       "still counted as a complete checkpoint")
    try:
        problems, by_manifest = checkpoint_verify.checkpoint_problems(str(copy), checkpoint_verify.read_metadata(str(copy)))
    except checkpoint_verify.CheckpointDamaged as err:
        problems, by_manifest = [str(err)], True
    text = "\n".join(problems)
    missing = [e for e in expected if e not in text]
    if problems and not missing:
        return Verdict(damage.name, "checks", True, "refused: " + problems[0])
    how = "" if by_manifest else " (no manifest: per-record CRC-32 only)"
    return Verdict(damage.name, "checks", False, f"not detected{how}" if not problems else
                   f"refused without naming {missing}: {problems[0]}")


# ---- real runs ----------------------------------------------------------------------------


@dataclass
class Runs:
    """How to run CONFIG: its overrides, processes, the base run's dump folder and logs."""

    config: Path
    overrides: list[str]
    nproc: int
    interval: int
    logdir: Path
    timeout: float

    @property
    def last(self) -> int:
        return 2 * self.interval

    def args(self, dump: Path, steps: int) -> list[str]:
        return [*self.overrides, "--job.dump_folder", str(dump), "--checkpoint.enable",
                "--checkpoint.interval", str(self.interval), "--checkpoint.no_last_save_model_only",
                "--validation.no-enable", "--metrics.log_freq", "1", "--training.steps", str(steps)]

    def run(self, name: str, dump: Path, steps: int) -> tuple[int | None, str]:
        done = launch(self.config, self.args(dump, steps), self.nproc, gpu_count(),
                      self.logdir / f"{name}.log", self.timeout)
        return done.rc, done.text()


def resume_damaged(runs: Runs, base: Path, losses: dict, damage: Damage) -> Verdict:
    """A dump folder holding the base run's first checkpoint (a link) and a damaged copy
    of its last; a resume must refuse it naming the damage and the first checkpoint (or,
    for a missing .metadata, resume from the first with the base run's losses)."""
    dump = runs.logdir / damage.name
    shutil.rmtree(dump, ignore_errors=True)
    (dump / "checkpoint").mkdir(parents=True)
    os.symlink((base / "checkpoint" / f"step-{runs.interval}").resolve(),
               dump / "checkpoint" / f"step-{runs.interval}")
    copy = _copy(base / "checkpoint" / f"step-{runs.last}", dump / "checkpoint")
    expected = damage.apply(copy)
    if damage.skipped:
        rc, out = runs.run(damage.name, dump, runs.last)
        resumed = step_losses(out)
        want = {s: losses[s] for s in range(runs.interval + 1, runs.last + 1)}
        held = rc == 0 and "skipping incomplete checkpoint folder" in out and resumed == want
        return Verdict(damage.name, "resume", held, f"skipped, resumed from step {runs.interval} with the "
                       "uninterrupted losses" if held else f"exit {rc}, losses {resumed} (want {want})")
    rc, out = runs.run(damage.name, dump, runs.last + 1)
    missing = [e for e in (REFUSED, *expected, f"steps [{runs.interval}]") if e not in out]
    held = rc not in (0, None) and not step_losses(out) and not missing
    return Verdict(damage.name, "resume", held, "refused, naming it and step "
                   f"{runs.interval} to fall back to" if held else
                   f"exit {rc}, trained steps {sorted(step_losses(out))}, not named: {missing}")


def _rank_pid(root: int, rank: int) -> int | None:
    """The pid of training rank ``rank`` among the descendants of process ``root``
    (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:  # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(pid)
    todo, found = [root], []
    while todo:
        found += (kids := children.get(todo.pop(), []))
        todo += kids
    for pid in found:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"torchtitan.train" in cmdline:
            return pid
    return None


def kill_rank_during_save(runs: Runs, losses: dict) -> Verdict:
    """Kill rank 1 while the second checkpoint is being written; the next run must
    resume from the first, train the uninterrupted run's losses, and save the second
    checkpoint complete."""
    name = "kill-rank-during-save"
    if runs.nproc < 2:
        return Verdict(name, "resume", None, "needs --nproc 2 or more")
    dump = runs.logdir / name
    shutil.rmtree(dump, ignore_errors=True)
    staging = dump / "checkpoint" / f".saving-{runs.last}"
    cmd = ["bash", str(ROOT / "scripts" / "train.sh"), str(runs.config), "--metrics.disable_color_printing",
           *runs.args(dump, runs.last)]
    with open(runs.logdir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(runs.nproc, gpu_count()), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        killed, end = False, time.monotonic() + runs.timeout
        while proc.poll() is None and time.monotonic() < end:
            if staging.exists() and (pid := _rank_pid(proc.pid, 1)) is not None:
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.002)
        try:
            proc.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if not killed:
        return Verdict(name, "resume", None, f"the save of step {runs.last} finished before a rank could "
                       "be killed during it (raise the model size or lower the poll time)")
    rc, out = runs.run(f"{name}_resumed", dump, runs.last)
    resumed = step_losses(out)
    want = {s: losses[s] for s in range(runs.interval + 1, runs.last + 1)}
    step_dir = dump / "checkpoint" / f"step-{runs.last}"
    complete = (rc == 0 and step_dir.is_dir()
                and checkpoint_verify.checkpoint_problems(str(step_dir), checkpoint_verify.read_metadata(str(step_dir)))[0] == [])
    left = sorted(p.name for p in (dump / "checkpoint").iterdir() if p.name.startswith("."))
    held = proc.returncode != 0 and resumed == want and complete and not left
    return Verdict(name, "resume", held, f"killed during the save of step {runs.last}; resumed from step "
                   f"{runs.interval} with the uninterrupted losses, step {runs.last} saved complete"
                   if held else f"exit {rc}, losses {resumed} (want {want}), step {runs.last} complete: "
                   f"{complete}, partial folders left: {left}")


def full_disk(runs: Runs, base: Path) -> Verdict:
    """The dump folder on a tmpfs one and a half checkpoints large (a mount namespace of
    the run's own): the second save must fail naming the free space, remove its partial
    folder and leave the first checkpoint as it was."""
    name = "full-disk"
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("mount"):
        return Verdict(name, "resume", None, "mounting a tmpfs needs root, unshare and mount")
    first = base / "checkpoint" / f"step-{runs.interval}"
    size = sum(p.stat().st_size for p in first.iterdir())
    dump = runs.logdir / name
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    train = shlex.join(["bash", str(ROOT / "scripts" / "train.sh"), str(runs.config),
                        "--metrics.disable_color_printing", *runs.args(dump, runs.last)])
    script = (f"mount --make-rprivate / && mount -t tmpfs -o size={size * 3 // 2 // 1024}k tmpfs "
              f"{shlex.quote(str(dump))} || exit 97; {train}; rc=$?; "
              f"echo CHECKPOINT_FOLDER: $(ls -A {shlex.quote(str(dump / 'checkpoint'))}); exit $rc")
    with open(runs.logdir / f"{name}.log", "w") as log:
        proc = subprocess.run(["unshare", "-m", "bash", "-c", script], cwd=ROOT, timeout=runs.timeout,
                              env=child_env(runs.nproc, gpu_count()), stdout=log, stderr=subprocess.STDOUT)
    out = (runs.logdir / f"{name}.log").read_text(errors="replace")
    if proc.returncode == 97:
        return Verdict(name, "resume", None, "cannot mount a tmpfs here: " + out.strip()[-200:])
    listing = [line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("CHECKPOINT_FOLDER:")]
    named = [t for t in ("was not saved", "free when the save failed", "untouched") if t not in out]
    held = proc.returncode != 0 and listing == [[f"step-{runs.interval}"]] and not named
    return Verdict(name, "resume", held, f"save of step {runs.last} stopped naming the free space; partial "
                   f"folder removed, step-{runs.interval} kept" if held else
                   f"exit {proc.returncode}, folder holds {listing}, not named: {named}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other arguments are torchtitan overrides for every run.")
    p.add_argument("--config", type=Path, default=ROOT / "train_configs" / "llama3_debug.toml")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="a step-N folder: make the damage faults in copies of it, no training")
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs where there are, else gloo CPU)")
    p.add_argument("--interval", type=int, default=2, help="steps between checkpoints (the run trains two)")
    p.add_argument("--faults", default=None,
                   help=f"comma-separated, of {[d.name for d in DAMAGES] + RUN_FAULTS} (default all)")
    p.add_argument("--logdir", type=Path, default=ROOT / "outputs" / "checkpoint_faults")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    args, overrides = p.parse_known_args(argv)
    known = [d.name for d in DAMAGES] + RUN_FAULTS
    faults = args.faults.split(",") if args.faults else known
    if unknown := [f for f in faults if f not in known]:
        p.error(f"--faults: {unknown} are none of {known}")
    if args.checkpoint is not None and overrides:
        p.error(f"--checkpoint runs no training, so the overrides {overrides} would be ignored")
    damages = [d for d in DAMAGES if d.name in faults]
    verdicts: list[Verdict] = []
    if args.checkpoint is not None:
        if not (args.checkpoint / ".metadata").is_file():
            p.error(f"--checkpoint {args.checkpoint}: not a complete checkpoint folder (no .metadata)")
        with tempfile.TemporaryDirectory(prefix="checkpoint_faults_") as work:
            for damage in damages:
                verdicts.append(check_damage(args.checkpoint, damage, Path(work)))
                print(verdicts[-1].line(), flush=True)
    else:
        logdir = args.logdir.resolve()
        runs = Runs(args.config, overrides, args.nproc, args.interval, logdir, args.timeout)
        base = logdir / "base"
        shutil.rmtree(base, ignore_errors=True)
        rc, out = runs.run("base", base, runs.last)
        losses = step_losses(out)
        if rc != 0 or sorted(losses) != list(range(1, runs.last + 1)):
            print(f"checkpoint_faults: the base run failed (exit {rc}); see {logdir / 'base.log'}")
            return 1
        last = base / "checkpoint" / f"step-{runs.last}"
        for damage in damages:
            verdicts.append(check_damage(last, damage, logdir / "checks"))
            print(verdicts[-1].line(), flush=True)
            verdicts.append(resume_damaged(runs, base, losses, damage))
            print(verdicts[-1].line(), flush=True)
        for fault in (f for f in RUN_FAULTS if f in faults):
            verdicts.append(kill_rank_during_save(runs, losses) if fault == "kill-rank-during-save"
                            else full_disk(runs, base))
            print(verdicts[-1].line(), flush=True)
    failed = [v.fault for v in verdicts if v.held is False]
    print(f"checkpoint_faults: {sum(v.held is True for v in verdicts)} held, {len(failed)} failed"
          + (f" ({', '.join(dict.fromkeys(failed))})" if failed else "")
          + f", {sum(v.held is None for v in verdicts)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
