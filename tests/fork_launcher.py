"""torchrun for the tests without the imports: one server process imports torch,
torchtitan and titan_lowbit once, then starts each run's ranks by fork.

Why: a Trainer run on the CPU path spends about 13 of its 20 seconds importing (torchrun's
launcher imports torch, each rank imports torchtitan, which pulls in Inductor); CI has
about forty such runs. Forked ranks start with those modules loaded.

What a forked rank gets is what torchrun gives a worker: the environment of the run with
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT
set, the working directory, and ``python -m MODULE ARGV`` (or a script path) run as
``__main__``. Its output is reported as torchrun's ``--local-ranks-filter 0 --tee 3``
shows it: rank 0's stdout and stderr, each line prefixed ``[rank0]:``. As under torchrun,
the first failure ends the others (SIGTERM, then SIGKILL), the launch returns 1, and a
report names the rank that failed first, its exit code or signal, with the tail of its
stderr. "First" is by time, as torchrun's error files decide it: a rank that ends with an
exception records when it caught it, a rank ended by a signal counts from when the server
saw it exit (at once: the server waits on each rank's pidfd). A rank that fails because a
peer died (gloo's "connection closed" or "reset": in its exception, recorded before its
traceback is printed, or in its stderr) comes after every other failed rank, so the rank
whose error started the failure is named, whichever the clocks say. One thing
differs from torchrun, in time only: rank 0 of a torchtitan Trainer run waits for the other
ranks' exit where torchtitan sleeps 2 s after training
(_wait_for_other_ranks_instead_of_trainer_sleep says why that is safe).

The server never runs torch work itself, so nothing is forked mid-computation: no thread
pool of OpenMP, gloo or Triton exists in it yet. Variables read at import
(``TRITON_INTERPRET``, ``OMP_NUM_THREADS``, ``TITAN_LOWBIT_*``) are fixed when the server
starts; ``Launcher.can_run`` refuses a run whose environment differs from the server's
in anything else than the per-run variables, and the caller then uses real torchrun.

Used by tests/conftest.py. ``python tests/fork_launcher.py`` is the server: requests
and replies are JSON lines on its stdin and stdout.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Variables a run may set differently from the server's start (none is read at import):
# scripts/train.sh's process count and interpreter, and pytest's name of the running test.
# (LOG_RANK is not among them: the launcher shows rank 0's output only.)
PER_RUN = frozenset({"NPROC", "PYTHON", "PYTEST_CURRENT_TEST"})
# torchrun's worker variables: set here for every rank, never taken from the request.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                  "MASTER_ADDR", "MASTER_PORT")
PRELOAD = ("torch", "torch.distributed.checkpoint", "torchtitan.train",
           "titan_lowbit.torchtitan")
# torchtitan's Trainer.train ends, on rank 0, with a fixed sleep "for other ranks to complete"
# (see _wait_for_other_ranks_instead_of_trainer_sleep).
TRAINER_SLEEP = "time.sleep(2)"
WAITED_FOR_OTHER_RANKS = "fork_launcher: rank 0 waited for the other ranks' exit instead of torchtitan's 2 s sleep:"
_TRAINER_SLEEP_SITE: tuple[str, int] | None = None  # set by serve()
GRACE_S = 10.0  # after SIGTERM, before SIGKILL
# gloo's errors on a rank whose peer exited or was killed
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
_REPLIES_FD = -1  # the server's reply pipe; a forked rank closes its copy


# ---- client (the pytest process) ---------------------------------------------------------

class Launcher:
    """A running fork server. ``launch`` returns a ``subprocess.CompletedProcess`` shaped
    like a torchrun run's."""

    def __init__(self, env: dict[str, str], cwd: Path):
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())],
                                     cwd=cwd, env=self.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if json.loads(ready or "{}").get("ready") is not True:
            raise RuntimeError(f"fork launcher did not start (said {ready!r}); its stderr "
                               "went to the test output")

    def differences(self, env: dict[str, str]) -> list[str]:
        """The variables in which ``env`` differs from the server's start environment,
        PER_RUN and torchrun's worker variables aside."""
        keys = (set(env) | set(self.env)) - PER_RUN - set(RANK_VARIABLES)
        return sorted(k for k in keys if env.get(k) != self.env.get(k))

    def can_run(self, env: dict[str, str]) -> bool:
        """True when ``env`` equals the server's start environment but for PER_RUN."""
        return not self.differences(env)

    def launch(self, target: list[str], nproc: int, env: dict[str, str], cwd: Path,
               timeout: float) -> subprocess.CompletedProcess:
        """``target`` is ``["-m", module, *argv]`` or ``[script, *argv]``."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"fork launcher exited ({self.proc.returncode})")
        if differing := self.differences(env):
            raise ValueError(f"fork launcher: the run's environment differs in {differing} "
                             "from the server's, which read them at import; run it through "
                             "real torchrun (conftest.torchrun does when can_run says no)")
        request = {"target": target, "nproc": nproc, "env": env, "cwd": str(cwd),
                   "timeout": timeout}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fork launcher exited ({self.proc.wait()}) during a run")
        reply = json.loads(line)
        args = ["fork-launcher", f"--nproc_per_node={nproc}", *target]
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(args, timeout, reply["stdout"], reply["stderr"])
        return subprocess.CompletedProcess(args, reply["returncode"], reply["stdout"],
                                           reply["stderr"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


# ---- server -------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (the rendezvous port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record_failure(path: str, error: BaseException | None = None) -> None:
    """When this rank failed (the system-wide monotonic clock the server reads too) and
    whether its error is gloo's report of a peer that went away (PEER_GONE, anywhere in the
    exception's chain). Recorded, and moved into place whole, before the traceback is
    printed: a rank the server stops while it prints (its peer's exit seen meanwhile) is
    still known for a consequence, not the cause."""
    chain = []
    while error is not None and len(chain) < 16:
        chain.append(error)
        error = error.__cause__ or error.__context__
    peer_gone = any(m in str(e) for e in chain for m in PEER_GONE)
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps({"at": time.monotonic(), "peer_gone": peer_gone}))
    os.replace(path + ".tmp", path)


def _trainer_sleep_site() -> tuple[str, int]:
    """(file, first line) of the code of torchtitan's ``Trainer.train``, after checking that it
    still holds TRAINER_SLEEP on rank 0; a torchtitan whose Trainer moved it stops the server
    here, loudly, rather than leaving every run 2 s slower without a word."""
    import inspect

    from torchtitan.train import Trainer  # 0.2 defines it there, 0.3 imports it from trainer

    source = inspect.getsource(Trainer.train)  # the method's own, under any decorator
    if not re.search(r"if torch\.distributed\.get_rank\(\) == 0:\s*\n.*\n\s*"
                     + re.escape(TRAINER_SLEEP), source):
        raise RuntimeError(f"fork_launcher: torchtitan's Trainer.train ({inspect.getsourcefile(Trainer)}) no "
                           f"longer has rank 0's {TRAINER_SLEEP} after training; update "
                           "_wait_for_other_ranks_instead_of_trainer_sleep to what it does now")
    code = inspect.unwrap(Trainer.train).__code__  # 0.2 wraps it in torchrun's @record
    return code.co_filename, code.co_firstlineno


def _wait_for_other_ranks_instead_of_trainer_sleep(site: tuple[str, int], others_gone: int) -> None:
    """In rank 0: torchtitan's 2 s sleep after training (TRAINER_SLEEP, called from the code
    at ``site``) becomes a wait until every other rank of the run has exited, at most those
    2 s (``others_gone``: the read end of a pipe whose write ends only the other ranks hold,
    so it reads end-of-file once they have all exited). Every other call of time.sleep
    sleeps as asked.

    Why the sleep exists: torchtitan added it (pytorch/torchtitan#224) so that rank 0,
    which hosts the run's TCPStore where the workers start without torchrun's agent store
    (as these forked ranks do), exits only after the other ranks have stopped using the
    store (pytorch/pytorch#123969: NCCL's heartbeat monitor read it after rank 0 had
    gone). Waiting until they have exited keeps that order, exactly instead of by a
    guess, and costs only the time they take; where a rank outlives rank 0's 2 s (a forked
    child of its own holding the pipe open), rank 0 goes on as torchtitan's sleep would.
    Rank 0 prints how long it waited (WAITED_FOR_OTHER_RANKS)."""
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        caller = sys._getframe(1).f_code
        if (caller.co_filename, caller.co_firstlineno) != site or seconds != 2:
            real_sleep(seconds)
            return
        start = time.monotonic()
        select.select([others_gone], [], [], seconds)
        print(f"{WAITED_FOR_OTHER_RANKS} {time.monotonic() - start:.2f} s", file=sys.stderr, flush=True)

    time.sleep = sleep


def _rank_main(target: list[str], env: dict[str, str], cwd: str, out: str, err: str,
               failed: str) -> int:
    """Body of a forked rank: returns its exit status (never returns to the server loop)."""
    os.close(_REPLIES_FD)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import runpy
    import traceback

    from torchtitan.config.manager import ConfigManager
    status = 0
    try:
        # sys.path[0] as python sets it: the working directory for -m, else the script's
        if target[0] == "-m":
            sys.path[0] = cwd
            sys.argv = [target[1], *target[2:]]
        else:
            sys.path[0] = str(Path(target[0]).resolve().parent)
            sys.argv = list(target)
        # torchtitan's ConfigManager.parse_args takes ``args=sys.argv[1:]`` as a default
        # argument, bound when the server imported it: bind this rank's.
        ConfigManager.parse_args.__defaults__ = (sys.argv[1:],)
        if target[0] == "-m":
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if status != 0:
            _record_failure(failed)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException as e:
        _record_failure(failed, e)
        traceback.print_exc()
        status = 1
    return status


def _succeeded(status: int) -> bool:
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"exitcode  : -{sig} (pid got signal {signal.Signals(sig).name})"
    return f"exitcode  : {os.WEXITSTATUS(status)}"


def _prefixed(text: str, rank: int) -> str:
    return "".join(f"[rank{rank}]:{line}" for line in text.splitlines(keepends=True))


class _Exits:
    """Reaps the ranks as they exit and says when each did: woken by each rank's pidfd
    where the system has them (Linux), else by polling every 20 ms."""

    def __init__(self, pids: dict[int, int]):
        self.fds: dict[int, int] = {}
        self.poll = None
        if hasattr(os, "pidfd_open"):
            self.poll = select.poll()
            for pid in pids:
                fd = os.pidfd_open(pid)
                self.fds[fd] = pid
                self.poll.register(fd, select.POLLIN)

    def wait(self, seconds: float) -> list[tuple[int, int, float]]:
        """(pid, status, time) of the ranks that exited, waiting up to ``seconds``."""
        if self.poll is None:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(min(seconds, 0.02))
                return []
            return [(pid, status, time.monotonic())]
        done = []
        for fd, _ in self.poll.poll(max(1, int(seconds * 1000))):
            at = time.monotonic()
            pid = self.fds.pop(fd)
            self.poll.unregister(fd)
            os.close(fd)
            done.append((pid, os.waitpid(pid, 0)[1], at))
        return done

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def _run(request: dict) -> dict:
    nproc, timeout = int(request["nproc"]), float(request["timeout"])
    port = free_port()
    logs = tempfile.mkdtemp(prefix="fork_launcher_")
    pids: dict[int, int] = {}
    sys.stdout.flush()
    sys.stderr.flush()
    others_gone, other_rank_alive = os.pipe()  # see _wait_for_other_ranks_instead_of_trainer_sleep
    for rank in range(nproc):
        env = {k: v for k, v in request["env"].items() if k not in RANK_VARIABLES}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                   ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), ROLE_NAME="rank",
                   MASTER_ADDR="localhost", MASTER_PORT=str(port))
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                if rank == 0:
                    os.close(other_rank_alive)
                    _wait_for_other_ranks_instead_of_trainer_sleep(_TRAINER_SLEEP_SITE, others_gone)
                else:
                    os.close(others_gone)
                status = _rank_main(request["target"], env, request["cwd"],
                                    f"{logs}/{rank}.out", f"{logs}/{rank}.err",
                                    f"{logs}/{rank}.failed")
            finally:
                # Flush what the rank printed, then leave without the server's exit path
                # (its atexit handlers and the pipes to pytest belong to the server).
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:
                        pass
                os._exit(status if 0 <= status < 256 else 1)
        pids[pid] = rank
    os.close(others_gone)
    os.close(other_rank_alive)

    statuses: dict[int, int] = {}
    ended: dict[int, float] = {}  # when the server saw each rank exit

    def signal_running(sig: int) -> None:
        for p, r in pids.items():
            if r not in statuses:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass

    failed, timed_out, kill_at = False, False, None
    deadline = time.monotonic() + timeout
    exits = _Exits(pids)
    while len(statuses) < nproc:
        wake = min(deadline, kill_at or deadline)
        for pid, status, at in exits.wait(max(0.0, wake - time.monotonic())):
            rank = pids[pid]
            statuses[rank], ended[rank] = status, at
            if not _succeeded(status) and not failed and not timed_out:
                failed = True  # torchrun's agent stops the other workers likewise
                signal_running(signal.SIGTERM)
                kill_at = at + GRACE_S
        now = time.monotonic()
        if not timed_out and now > deadline:
            timed_out = True
            signal_running(signal.SIGKILL)
        elif kill_at is not None and now > kill_at:
            signal_running(signal.SIGKILL)
            kill_at = None
    exits.close()

    def failure(rank: int) -> dict:
        """What the rank recorded when it caught its error (_record_failure); {} if nothing."""
        try:
            return json.loads(Path(f"{logs}/{rank}.failed").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def failed_at(rank: int) -> float:
        return failure(rank).get("at", ended[rank])

    def read(rank: int, stream: str) -> str:
        try:
            return Path(f"{logs}/{rank}.{stream}").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def after_a_peer(rank: int) -> bool:
        """Whether the rank's error is gloo's report of a peer that went away: the
        consequence of another rank's failure, never its cause, however the clocks fall
        (a loaded machine may see the peer's exit after this rank caught the error)."""
        return failure(rank).get("peer_gone", False) or any(m in read(rank, "err")[-2000:] for m in PEER_GONE)

    failures = [rank for rank, status in statuses.items() if not _succeeded(status)]
    first_failure = None
    if failures and not timed_out:
        first_failure = min(failures, key=lambda r: (after_a_peer(r), failed_at(r), r))

    stdout, stderr = _prefixed(read(0, "out"), 0), _prefixed(read(0, "err"), 0)
    returncode = 0
    if first_failure is not None:
        returncode = 1
        tail = "".join(read(first_failure, "err").splitlines(keepends=True)[-60:])
        stderr += ("fork_launcher: a rank failed; the others were stopped\n"
                   "Root Cause (first observed failure):\n"
                   f"[0]:\n  rank      : {first_failure} (local_rank: {first_failure})\n"
                   f"  {_describe(statuses[first_failure])}\n"
                   f"  stderr tail of rank {first_failure}:\n{tail}")
    for rank in range(nproc):
        for stream in ("out", "err", "failed", "failed.tmp"):
            Path(f"{logs}/{rank}.{stream}").unlink(missing_ok=True)
    os.rmdir(logs)
    return {"returncode": returncode, "stdout": stdout, "stderr": stderr,
            "timed_out": timed_out}


def serve() -> None:
    # Replies go to the original stdout; anything the server or an import prints goes to
    # stderr, so it cannot corrupt a reply.
    global _REPLIES_FD
    _REPLIES_FD = os.dup(1)
    replies = os.fdopen(_REPLIES_FD, "w")
    os.dup2(2, 1)
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    global _TRAINER_SLEEP_SITE
    _TRAINER_SLEEP_SITE = _trainer_sleep_site()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        replies.write(json.dumps(_run(json.loads(line))) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
