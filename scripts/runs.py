"""Launch torchtitan runs through scripts/train.sh, for scripts/scale_runs.py and
scripts/reshard_runs.py (their logs are read by ``run_logs``).

:func:`launch` runs ``scripts/train.sh CONFIG overrides`` on ``nproc`` GPUs (the first
``nproc`` visible ones) or, with no GPU, on ``nproc`` gloo CPU processes; every rank's
output is kept (``LOG_RANK``), written to a log file as it comes, and the run is stopped
after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from run_logs import ANSI  # scripts/run_logs.py, beside this file

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = re.compile(r"^(?:\[(?:rank|default)\d+\]:)+")
ERROR = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*:")
# Children on GPUs: NVLink SHARP (NVLS) and symmetric-memory multicast stay off, as the
# lent machines require.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def gpu_count() -> int:
    if os.environ.get("TITAN_LOWBIT_DEVICE", "").lower() == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def child_env(nproc: int, gpus: int) -> dict[str, str]:
    """Environment of a train.sh child using ``nproc`` processes: the first ``nproc``
    visible GPUs (CUDA_VISIBLE_DEVICES and NGPU, so train.sh starts ``nproc``), or
    ``nproc`` gloo CPU processes when ``gpus`` is 0."""
    env = dict(os.environ, PYTHON=sys.executable, LOG_RANK=",".join(map(str, range(nproc))),
               **GPU_ENV)
    if gpus:
        if nproc > gpus:
            raise SystemExit(f"{nproc} GPUs asked for, {gpus} visible")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        env.update(CUDA_VISIBLE_DEVICES=",".join(ids[:nproc]), NGPU=str(nproc))
    else:
        env.update(TITAN_LOWBIT_DEVICE="cpu", NPROC=str(nproc))
    return env


@dataclass
class Run:
    rc: int | None  # None: stopped at the timeout
    seconds: float
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 6) -> str:
        """Why the run failed: the last exception line of the log (without the rank
        prefix) when there is one, then its last ``lines`` lines that say something; for
        a run stopped at its timeout, its last torchtitan lines."""
        keep = [PREFIXES.sub("", ANSI.sub("", l)).rstrip() for l in self.text().splitlines()]
        keep = [l for l in keep if l.strip(" =-")]
        if self.rc is None:  # stopped: what it was doing, not the stop's own traceback
            return "\n".join(([l for l in keep if "[titan]" in l] or keep)[-lines:])
        errors = [l.strip() for l in keep
                  if ERROR.match(l.strip()) and "ChildFailedError" not in l]
        return "\n".join(errors[-1:] + keep[-lines:])


def launch(config: Path, overrides: list[str], nproc: int, gpus: int, log: Path,
           timeout: float) -> Run:
    """Run scripts/train.sh with ``overrides`` on ``nproc`` processes; the output of
    every rank goes to ``log`` as it comes. After ``timeout`` seconds the run's process
    group is stopped (SIGTERM, then SIGKILL)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["bash", str(ROOT / "scripts" / "train.sh"), str(config),
           "--metrics.disable_color_printing", *overrides]
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(nproc, gpus), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                try:
                    os.killpg(proc.pid, sig)  # the session train.sh leads: torchrun and ranks
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            out.write(f"\n[stopped after the {timeout:.0f} s timeout]\n")
    return Run(rc, time.perf_counter() - start, log)


def versions() -> str:
    """Device and versions, for the header of a report."""
    import torch

    parts = []
    if gpu_count():
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.split()[0]
        except Exception:  # noqa: BLE001  (no nvidia-smi: leave the driver out)
            driver = "?"
        parts.append(f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()} visible, "
                     f"driver {driver}, CUDA {torch.version.cuda}")
    else:
        parts.append(f"CPU ({platform.machine()}, {os.cpu_count()} cores), gloo")
    parts.append(f"torch {torch.__version__}")
    for name in ("torchtitan", "triton"):
        try:
            from importlib.metadata import version

            parts.append(f"{name} {version(name)}")
        except Exception:  # noqa: BLE001  (not installed: say nothing)
            pass
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


def resume_dump(dump: Path, source: Path, step: int) -> Path:
    """A fresh dump folder whose only checkpoint is ``source/checkpoint/step-<step>``
    (a link), so torchtitan resumes from it and writes its own checkpoints beside it."""
    shutil.rmtree(dump, ignore_errors=True)
    (dump / "checkpoint").mkdir(parents=True)
    os.symlink((source / "checkpoint" / f"step-{step}").resolve(),
               dump / "checkpoint" / f"step-{step}")
    return dump


class Budget:
    """Seconds left of an overall time limit (None: no limit), so the last runs of a
    series get a shorter timeout instead of being cut off by the caller."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def timeout(self, per_run: float) -> float | None:
        """The timeout of the next run; None when less than 30 s are left to run it."""
        left = self.left()
        return None if left < 30 else min(per_run, left)
