"""Shared test helpers: the repository root and a runner for scripts/train.sh.

Whether Triton's interpreter runs the kernels is decided here, once per session, before
any test module imports triton (INTERPRET below).
"""

import atexit
import contextlib
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

# Everything the session writes to the system temp folder (pytest's tmp_path folders,
# Inductor's cache, torchrun's logs, the fork launcher's rank logs, in this process and in
# every process it starts) goes into one folder, removed when the session passes
# (pytest_sessionfinish below). Set before torch is imported: Inductor fixes its cache
# folder from the temp folder when it loads.
SESSION_TMP = Path(tempfile.mkdtemp(prefix="titan_lowbit_tests_"))
os.environ["TMPDIR"] = str(SESSION_TMP)
tempfile.tempdir = None  # gettempdir() reads TMPDIR again

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# Triton fixes whether the interpreter runs a kernel when it decorates the kernel (at
# import), so the choice is made in this one place, for the session and every process it
# starts; a test module that changed it later would leave kernels of both kinds in one
# process. Without a GPU the interpreter is the only way a kernel runs (on CPU tensors);
# with one the kernels are compiled, unless TRITON_INTERPRET=1 asks for the interpreter.
# Test modules read INTERPRET and never set TRITON_INTERPRET for this process.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

ROOT = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = ROOT / "train_configs" / "llama3_debug.toml"
# The tests' corpus lives in the clone (assets/ is git-ignored), not in the user's cache,
# for this process and every run it starts.
DATA = ROOT / "assets" / "lowbit_text"
os.environ["TITAN_LOWBIT_DATA"] = str(DATA)
PREPARE_DATA = [sys.executable, "-m", "titan_lowbit.prepare_data"]

from fork_launcher import Launcher, free_port  # noqa: E402
# scripts/ holds the readers of torchtitan's logs that the scripts and the tests share
# (run_logs), as scripts/ itself imports them: beside each other, not from the package;
# tools/ the checkpoint damage that tools/checkpoint_faults.py makes and the tests make too.
sys.path.append(str(ROOT / "scripts"))
sys.path.append(str(ROOT / "tools"))
from run_logs import step_losses  # noqa: E402,F401  (tests import step_losses from here)


# gloo's teardown (torch 2.13, CPU) now and then aborts one rank at exit with SIGABRT,
# "terminate called without an active exception", after every rank has finished its
# work: about one multi-process run in a hundred, a few per full test run. The abort is
# in torch's C++ teardown, not in the work a test checks, so a run that failed only that
# way, after rank 0 had finished training, is run once more from the same starting files.
# Anything else (an error, a hang, an abort before training finished, a second abort)
# fails the test.
TRAINING_FINISHED = "Sleeping 2 seconds for other ranks to complete"  # rank 0, after its last step
_ROOT_CAUSE_SIGABRT = re.compile(r"Root Cause \(first observed failure\):\s*\n.*?exitcode\s*:\s*-6\b",
                                 re.S)


# A two-rank script whose rank 1 aborts (SIGABRT) after the barrier, after rank 0 printed
# argv[2] (argv[1] = "after") or before it printed anything ("before").
RANK_ONE_ABORTS = """
import os, sys, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
if sys.argv[1] == "after" and rank == 0:
    print(sys.argv[2], flush=True)
dist.barrier()
if rank == 1:
    os.abort()
dist.destroy_process_group()
"""


def aborted_at_teardown(proc: subprocess.CompletedProcess, finished: str = TRAINING_FINISHED) -> bool:
    """True when a torchrun run failed only because a rank aborted (SIGABRT, torchrun's
    root cause) after the run printed ``finished``."""
    out = proc.stdout + proc.stderr
    return (proc.returncode != 0 and finished in out
            and _ROOT_CAUSE_SIGABRT.search(out) is not None)


def run_once_more_after_teardown_abort(cmd: list[str], env: dict, timeout: int, nproc: int,
                                       finished: str = TRAINING_FINISHED,
                                       before_retry=None) -> subprocess.CompletedProcess:
    """Run a torchrun command from the repository root; run it once more when it failed
    only by a rank's abort in gloo's teardown after it printed ``finished``, first calling
    ``before_retry()`` (to put back the files the first run found)."""
    def run() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    return _once_more_after_teardown_abort(run, " ".join(cmd), nproc, finished, before_retry)


def _once_more_after_teardown_abort(run, what: str, nproc: int, finished: str,
                                    before_retry) -> subprocess.CompletedProcess:
    proc = run()
    if nproc > 1 and aborted_at_teardown(proc, finished):
        warnings.warn(f"a gloo rank aborted at exit after the run finished; ran again: {what}")
        if before_retry is not None:
            before_retry()
        proc = run()
    return proc


# ---- how runs of several processes start -------------------------------------------------
# By default a test's torchrun-style run forks its ranks from one server process that has
# imported torch, torchtitan and titan_lowbit once (tests/fork_launcher.py: each rank gets
# torchrun's environment and its output is reported as torchrun's), which saves about 13 s
# of imports per run. TITAN_LOWBIT_TEST_LAUNCHER=torchrun runs every one through real
# torchrun (and scripts/train.sh) instead. Tests of train.sh itself, of torchrun's report
# and of the launcher's errors always use the real ones.
LAUNCHER_VARIABLE = "TITAN_LOWBIT_TEST_LAUNCHER"
_launcher: Launcher | None = None


# The CPU-path runs (train.sh's CPU path, the gloo scenarios) see no GPU, also on a GPU
# host: their ranks never touch CUDA, which cannot start in a process forked from one that
# has queried it (as the fork launcher's ranks are), and, as every process without a GPU,
# they run the Triton kernels under the interpreter.
CPU_PATH_ENV = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"} if torch.cuda.is_available() else {}


def cpu_run_env(**extra: str) -> dict[str, str]:
    """The environment scripts/train.sh gives its ranks on the CPU path."""
    return {**os.environ, "TITAN_LOWBIT_DEVICE": "cpu",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **CPU_PATH_ENV, **extra}


def fork_launcher(env: dict[str, str]) -> Launcher | None:
    """The session's fork server when runs may use it and ``env`` is one it can run
    (see fork_launcher.Launcher.can_run); None for real torchrun."""
    global _launcher
    choice = os.environ.get(LAUNCHER_VARIABLE, "fork")
    if choice not in ("fork", "torchrun"):
        raise ValueError(f"{LAUNCHER_VARIABLE}={choice!r}: use 'fork' (the default) or "
                         "'torchrun'")
    if choice == "torchrun":
        return None
    base = cpu_run_env()
    if _launcher is not None and not _launcher.can_run(base):
        # The session's own environment changed since the server started (a library of
        # this process set a variable: on a GPU host torch's and Triton's compilers do):
        # a server started now runs the ranks with it.
        _launcher.close()
        _launcher = None
    if _launcher is None:
        _launcher = Launcher(base, ROOT)
        atexit.register(_launcher.close)
    return _launcher if _launcher.can_run(env) else None


def pytest_sessionfinish(session, exitstatus):
    """Stop the fork server, then remove the session's temp folder (SESSION_TMP) unless a
    test failed: then it stays, for a look at the failed tests' files, and the summary
    says where."""
    if _launcher is not None:
        _launcher.close()
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        shutil.rmtree(SESSION_TMP, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus):
    if SESSION_TMP.exists():
        terminalreporter.write_line(f"this session's temporary files are kept in {SESSION_TMP} "
                                    "(a test failed); delete the folder when done")


def torchrun(target: list[str], nproc: int, env: dict[str, str], timeout: int,
             finished: str = TRAINING_FINISHED, before_retry=None,
             torchrun_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=nproc *torchrun_flags *target`` from the
    repository root (target: ``["-m", module, *argv]`` or ``[script, *argv]``), forked
    from the session's server where it can run it (whose output is rank 0's, as with
    ``--local-ranks-filter 0 --tee 3``); once more after a teardown abort, as above."""
    launcher = fork_launcher(env)
    if launcher is not None:
        return _once_more_after_teardown_abort(
            lambda: launcher.launch(target, nproc, env, ROOT, timeout),
            f"(forked) {' '.join(target)}", nproc, finished, before_retry)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *torchrun_flags, *target]
    return run_once_more_after_teardown_abort(cmd, env, timeout, nproc, finished, before_retry)


def _dump_folder(overrides) -> Path | None:
    folder = None
    for flag, value in zip(overrides, overrides[1:]):
        if flag == "--job.dump_folder":
            folder = Path(value)
    return folder


def _remove_new_paths(folder: Path, before: set[Path]) -> None:
    """Delete what a failed run added under ``folder`` (checkpoints, logs), so the
    second run starts from the files the first one found."""
    for path in sorted(set(folder.rglob("*")) - before, key=lambda p: len(p.parts)):
        if not path.exists() and not path.is_symlink():
            continue  # inside a folder removed above
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


_current_test: pytest.Item | None = None  # the test being set up or run


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Remember the test before its fixtures are set up (a fixture may train, for it)."""
    global _current_test
    _current_test = item


def run_train(*overrides: str, config: Path = DEBUG_CONFIG, nproc: int = 2, timeout: int = 600,
              check: bool = True, launcher: str = "any") -> subprocess.CompletedProcess:
    """Train with torchtitan's Trainer on the CPU path with ``nproc`` gloo processes: the
    ranks scripts/train.sh would start, forked from the session's server (see above), or,
    with ``launcher="train.sh"``, through scripts/train.sh itself."""
    env = cpu_run_env(NPROC=str(nproc), PYTHON=sys.executable)
    dump = _dump_folder(overrides)
    before = set(dump.rglob("*")) if dump is not None and dump.exists() else set()

    def put_back() -> None:
        if dump.exists():
            _remove_new_paths(dump, before)

    if launcher not in ("any", "train.sh"):
        raise ValueError(f"launcher={launcher!r}: use 'any' or 'train.sh'")
    if _current_test is not None and _current_test.get_closest_marker("trainer") is None:
        raise AssertionError(f"{_current_test.nodeid} runs torchtitan's Trainer: mark it "
                             "@pytest.mark.trainer, so that `-m 'not trainer'` leaves it out")
    forked = fork_launcher(env) if launcher == "any" else None
    if forked is not None:
        # what train.sh does before it starts torchrun
        subprocess.run([*PREPARE_DATA, "--if-missing"], cwd=ROOT, check=True,
                       capture_output=True)
        target = ["-m", "torchtitan.train", "--job.config_file", str(config),
                  "--metrics.disable_color_printing", *overrides]
        what = f"(forked) {' '.join(target)}"

        def run() -> subprocess.CompletedProcess:
            return forked.launch(target, nproc, env, ROOT, timeout)
    else:
        cmd = ["bash", str(ROOT / "scripts" / "train.sh"), str(config), *overrides]
        what = " ".join(cmd)

        def run() -> subprocess.CompletedProcess:
            return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout)
    if dump is None:  # no folder to put back: a second run could resume the first's checkpoint
        proc = run()
    else:
        proc = _once_more_after_teardown_abort(run, what, nproc, TRAINING_FINISHED, put_back)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"train.sh failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


# Smaller steps than the debug config's 4 sequences of 256 tokens per rank, for runs whose
# assertions are about the parallelism and the checkpoints rather than how fast the loss
# falls (each rank's share of a 4-process run costs as much CPU as a 2-process rank's):
# 2 sequences of 128 tokens per rank. The flags are the same on torchtitan 0.2 and 0.3.
SMALL_STEPS = ("--training.local_batch_size", "2", "--training.seq_len", "128")


def stopped_run(*overrides: str, nproc: int = 2) -> str:
    """Output of a train.sh run that must stop before its first training step."""
    proc = run_train(*overrides, nproc=nproc, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not step_losses(out), out[-3000:]
    return out


# The optimizer's health line (docs/health_metrics.md) of a run whose every optimizer has
# quantized second moments and a residual bf16 update (kahan, master, master_remainder).
HEALTH_LINE = re.compile(r"titan_lowbit health: step\s+(\d+)\s+max update/lr ([0-9.e+-]+)\s+v at smallest code "
                         r"([0-9.]+)%\s+skipped steps (\d+)\s+residual ([0-9.]+) ulp")


def check_health_reported(stdout: str, tb_folder: Path, steps: int) -> None:
    """A Trainer run with the health metrics on and log_freq 1, on either torchtitan line:
    the health line of every step 1..``steps`` (quantized states, a residual bf16 update: no
    rounding loss), and the same numbers in the TensorBoard event file under
    optimizer_health/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = {int(m.group(1)): m.groups()[1:] for m in HEALTH_LINE.finditer(stdout)}
    assert sorted(lines) == list(range(1, steps + 1)), stdout[-3000:]
    for step, (max_update, v_small, skipped, residual) in lines.items():
        assert 0.5 < float(max_update) < 10 and 0 <= float(v_small) < 100 and skipped == "0", lines[step]
        assert 0 < float(residual) <= 0.5, lines[step]
    events = sorted(tb_folder.rglob("events.out.tfevents.*"))
    assert len(events) == 1, events  # rank 0 writes
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]
               if tag.startswith("optimizer_health/")}
    assert sorted(scalars) == [f"optimizer_health/{k}" for k in
                               ("max_update_over_lr", "residual_over_ulp", "skipped_steps", "v_at_smallest_code")]
    for step, (max_update, v_small, _, residual) in lines.items():
        assert scalars["optimizer_health/max_update_over_lr"][step] == pytest.approx(float(max_update), rel=5e-3)
        assert scalars["optimizer_health/v_at_smallest_code"][step] * 100 == pytest.approx(float(v_small), abs=1e-3)
        assert scalars["optimizer_health/residual_over_ulp"][step] == pytest.approx(float(residual), abs=1e-3)


def parse_job_config(*args, toml: str | None = None, tmp_path=None):
    """The JobConfig torchtitan 0.2's ConfigManager parses from command-line ``args``, after
    the job file ``toml`` (written under ``tmp_path``) when given."""
    from torchtitan.config import ConfigManager

    argv = list(args)
    if toml is not None:
        path = tmp_path / "job.toml"
        path.write_text(toml)
        argv = ["--job.config_file", str(path), *argv]
    return ConfigManager().parse_args(argv)


def small_bf16_model(seed=0):
    """The FSDP2 tests' bf16 model: two linears and a norm."""
    import torch.nn as nn

    torch.manual_seed(seed)
    # 70 rows: odd per-rank split is fine (35 each); 4-bit blocks of 128 along 300 columns.
    return nn.Sequential(nn.Linear(300, 70), nn.LayerNorm(70), nn.Linear(70, 130, bias=False)).to(torch.bfloat16)


def sharded_small_model(mesh):
    """small_bf16_model() under FSDP2: each linear its own group, the rest (the norm) the root's."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    m = small_bf16_model()
    for mod in [x for x in m if isinstance(x, nn.Linear)] + [m]:
        fully_shard(mod, mesh=mesh)
    return m


def train_mean_square(model, opt, xs):
    """One step per input on the mean square of the model's output."""
    for x in xs:
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


SAVE_STEP = 4


@pytest.fixture(scope="session")
def two_process_checkpoint(tmp_path_factory, prepared_data):
    """(dump folder, losses, overrides) of a 2-process AdamW4bit + bf16 master-weight run
    that saved a checkpoint at step SAVE_STEP and trained on to SAVE_STEP + 2 (saving
    there too). Tests link or copy its step folders; they never change them."""
    dump = tmp_path_factory.mktemp("reshard")
    overrides = ("--optimizer.name", "AdamW4bit", "--lowbit.weight_dtype", "bfloat16",
                 "--lowbit.weight_update", "master", "--lr_scheduler.total_steps", "8",
                 "--validation.no-enable", "--checkpoint.enable",
                 "--checkpoint.interval", str(SAVE_STEP), "--job.dump_folder", str(dump))
    proc = run_train(*overrides, "--training.steps", str(SAVE_STEP + 2))
    return dump, step_losses(proc.stdout), overrides


def resume_folder(tmp_path, checkpoint_dir, step: int = SAVE_STEP):
    """A new dump folder whose only checkpoint is ``checkpoint_dir/step-{step}`` (a link),
    so torchtitan resumes from it and writes its own checkpoints beside it."""
    dump = tmp_path / "resumed"
    (dump / "checkpoint").mkdir(parents=True)
    os.symlink((checkpoint_dir / f"step-{step}").resolve(), dump / "checkpoint" / f"step-{step}")
    return dump


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory, prepared_data):
    """``shared_run(*overrides)``: (dump folder, completed process) of ``run_train(*overrides,
    "--job.dump_folder", folder)``, run once per session for the same overrides, so tests
    that train the same run share it (test_train_e2e's torch AdamW run, which
    test_checkpoint_convert resumes as AdamW8bit). Tests read the folder (resume_folder
    links its checkpoints); they never change it."""
    runs: dict[tuple[str, ...], tuple[Path, subprocess.CompletedProcess]] = {}

    def run(*overrides: str) -> tuple[Path, subprocess.CompletedProcess]:
        if overrides not in runs:
            dump = tmp_path_factory.mktemp("shared_run")
            runs[overrides] = dump, run_train(*overrides, "--job.dump_folder", str(dump))
        return runs[overrides]
    return run


@pytest.fixture(scope="session")
def prepared_data() -> Path:
    """The offline corpus, prepared once (train.sh would do the same on first use)."""
    subprocess.run([*PREPARE_DATA, "--if-missing"], cwd=ROOT, check=True)
    return DATA


def _gloo_worker(rank: int, world: int, port: int, scenarios, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = scenarios(rank)
        # Every rank's collectives are done before any rank tears its process group down
        # (a rank destroying gloo's group while a peer's last work is still in flight can
        # abort that peer at exit), and rank 0 writes the results only once every rank
        # has finished its scenarios.
        dist.barrier()
        if rank == 0:  # whole or not at all: an abort elsewhere may end this process mid-write
            torch.save(results, out_path + ".tmp")
            os.replace(out_path + ".tmp", out_path)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """os.environ with ``values`` set, as it was afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_on_gloo(scenarios, world: int, out_path: Path, start: str = "auto"):
    """Run the module-level function ``scenarios(rank)`` on ``world`` CPU processes joined
    in a gloo process group; return what rank 0 returned. The ranks are forked from the
    session's launcher (tests/gloo_rank.py, the ranks of train.sh's CPU path: one thread
    each, no GPU) unless TITAN_LOWBIT_TEST_LAUNCHER=torchrun, else spawned with the same
    CPU-path environment; ``start`` = "fork" or "spawn" insists on one.

    A rank that aborts in gloo's teardown (see TRAINING_FINISHED above) after rank 0 has
    written the results, which it does only after every rank finished, leaves the results
    valid; one that aborts earlier gets the whole set run once more."""
    if start not in ("auto", "fork", "spawn"):
        raise ValueError(f"start={start!r}: use 'auto', 'fork' or 'spawn'")
    launcher = None
    if start != "spawn":
        launcher = fork_launcher(cpu_run_env())
        if launcher is None and start == "fork":
            raise RuntimeError(f"run_on_gloo(start='fork'): no fork launcher "
                               f"({LAUNCHER_VARIABLE}={os.environ.get(LAUNCHER_VARIABLE)!r})")
    for attempt in (1, 2):
        out_path.unlink(missing_ok=True)
        if launcher is not None:
            pickled = out_path.with_name(out_path.name + ".scenarios.pkl")
            pickled.write_bytes(pickle.dumps(scenarios))
            proc = launcher.launch([str(ROOT / "tests" / "gloo_rank.py"), str(pickled),
                                    str(out_path)], world, cpu_run_env(), ROOT, 1800)
            if proc.returncode == 0:
                return torch.load(out_path, weights_only=False)
            aborted = _ROOT_CAUSE_SIGABRT.search(proc.stderr)
            if aborted is None:
                raise AssertionError(f"run_on_gloo: a rank failed:\n{proc.stdout[-4000:]}\n"
                                     f"{proc.stderr[-6000:]}")
            where = "a rank"
        else:
            try:
                with _environment(CPU_PATH_ENV):  # what the spawned ranks inherit
                    mp.spawn(_gloo_worker, args=(world, free_port(), scenarios, str(out_path)),
                             nprocs=world, join=True)
                return torch.load(out_path, weights_only=False)
            except mp.ProcessExitedException as error:
                if error.signal_name != "SIGABRT":
                    raise
                where = f"rank {error.error_index}"
        if not out_path.exists():
            if attempt == 2:
                raise AssertionError(f"run_on_gloo: {where} aborted (SIGABRT) twice before "
                                     "the results were written")
            warnings.warn(f"run_on_gloo: {where} aborted (SIGABRT) before the results were "
                          "written; running again")
            continue
        warnings.warn(f"run_on_gloo: {where} aborted (SIGABRT) in gloo's teardown after every "
                      "rank finished; results kept")
        return torch.load(out_path, weights_only=False)


def reshard_check(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """tests/reshard_check.py on ``nproc`` gloo processes. It only reads the checkpoint,
    so a run that a rank's abort in gloo's teardown failed after the check passed on every
    rank (see TRAINING_FINISHED) is run once more."""
    return torchrun([str(ROOT / "tests" / "reshard_check.py"), *args], nproc, cpu_run_env(), 900,
                    finished="RESHARD OK")
