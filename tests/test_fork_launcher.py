"""tests/fork_launcher.py, the tests' torchrun without the imports: its ranks see what
torchrun's workers see (compared with a real torchrun run of the same script), a failing
rank stops the others and is named in a torchrun-style report that conftest's abort
handling reads as it reads torchrun's, a run past its time is killed and the server goes
on, and an environment the server was not started with is refused, and a variable the session
itself sets after the server started reaches the ranks of a new server. The server refuses
to start where torchtitan's Trainer no longer sleeps 2 s on rank 0 where its ranks wait for
the others instead (that they do: test_train_e2e, the 0.3 straight run)."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import (
    LAUNCHER_VARIABLE,
    RANK_ONE_ABORTS,
    ROOT,
    TRAINING_FINISHED,
    aborted_at_teardown,
    cpu_run_env,
    fork_launcher,
    run_on_gloo,
)
import fork_launcher as server
from fork_launcher import Launcher

SHOW = """
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "TITAN_LOWBIT_DEVICE", "OMP_NUM_THREADS")
seen = {k: os.environ.get(k) for k in keys}
seen.update(argv=sys.argv[1:], cwd=os.getcwd(), path0=sys.path[0], name=__name__,
            total=total.item(), threads=torch.get_num_threads())
print("SEEN " + json.dumps(seen), flush=True)
dist.destroy_process_group()
"""

FAIL = """
import sys, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("rank one refuses: " + sys.argv[1])
dist.barrier()  # rank 0 waits here until the launcher stops it
"""


@pytest.fixture(scope="module")
def launcher():
    """The session's fork server, or one of its own when the session runs real torchrun."""
    env = cpu_run_env()
    own = None
    found = fork_launcher(env)
    if found is None:
        found = own = Launcher(env, ROOT)
    yield found
    if own is not None:
        own.close()


def script(tmp_path, text: str):
    path = tmp_path / "script.py"
    path.write_text(text)
    return str(path)


def seen(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if "SEEN " in line]
    assert len(lines) == 1, stdout[-3000:]  # rank 0's only, as --local-ranks-filter 0 shows
    return json.loads(lines[0].split("SEEN ", 1)[1])


def test_ranks_see_what_torchrun_gives_its_workers(launcher, tmp_path):
    path = script(tmp_path, SHOW)
    env = cpu_run_env()
    forked = launcher.launch([path, "a", "--b=1"], 2, env, ROOT, 120)
    assert forked.returncode == 0, forked.stderr[-3000:]
    assert all(line.startswith("[rank0]:") for line in forked.stdout.splitlines())
    real = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", "--local-ranks-filter", "0", "--role", "rank",
                           "--tee", "3", path, "a", "--b=1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert real.returncode == 0, real.stderr[-3000:]
    assert seen(forked.stdout) == seen(real.stdout)
    assert seen(forked.stdout)["total"] == 3.0 and seen(forked.stdout)["threads"] == 1


def test_module_target_runs_as_main_from_the_working_directory(launcher, tmp_path):
    (tmp_path / "shown_module.py").write_text(SHOW)
    proc = launcher.launch(["-m", "shown_module", "x"], 1, cpu_run_env(), tmp_path, 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = seen(proc.stdout)
    assert shown["argv"] == ["x"] and shown["name"] == "__main__"
    assert shown["cwd"] == shown["path0"] == str(tmp_path) and shown["WORLD_SIZE"] == "1"


def test_a_failing_rank_stops_the_others_and_is_named(launcher, tmp_path):
    proc = launcher.launch([script(tmp_path, FAIL), "because"], 2, cpu_run_env(), ROOT, 120)
    assert proc.returncode == 1
    assert "Root Cause (first observed failure)" in proc.stderr
    assert "rank      : 1" in proc.stderr and "exitcode  : 1" in proc.stderr
    assert "ValueError: rank one refuses: because" in proc.stderr
    assert not aborted_at_teardown(proc)


@pytest.mark.parametrize("when, expected", [("after", True), ("before", False)])
def test_report_of_an_abort_reads_as_torchruns(launcher, tmp_path, when, expected):
    proc = launcher.launch([script(tmp_path, RANK_ONE_ABORTS), when, TRAINING_FINISHED], 2,
                           cpu_run_env(), ROOT, 120)
    assert proc.returncode == 1 and "SIGABRT" in proc.stderr, proc.stderr[-3000:]
    assert aborted_at_teardown(proc) is expected, proc.stderr[-3000:]


def test_a_run_past_its_time_is_killed_and_the_server_goes_on(launcher, tmp_path):
    slow = script(tmp_path, "import time\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        launcher.launch([slow], 2, cpu_run_env(), ROOT, 2)
    proc = launcher.launch([script(tmp_path, SHOW)], 2, cpu_run_env(), ROOT, 120)
    assert proc.returncode == 0 and seen(proc.stdout)["total"] == 3.0, proc.stderr[-3000:]


def test_an_environment_read_at_import_is_refused(launcher):
    assert launcher.can_run(cpu_run_env(NPROC="4", MASTER_PORT="1234"))
    assert not launcher.can_run(cpu_run_env(TRITON_INTERPRET="0" if cpu_run_env().get(
        "TRITON_INTERPRET") == "1" else "1"))
    assert not launcher.can_run(cpu_run_env(TITAN_LOWBIT_DEVICE="cuda"))
    with pytest.raises(ValueError, match="TITAN_LOWBIT_DEVICE"):
        launcher.launch(["unused.py"], 1, cpu_run_env(TITAN_LOWBIT_DEVICE="cuda"), ROOT, 10)


def _set_later(rank: int):
    return os.environ.get("TITAN_LOWBIT_TEST_SET_LATER")


def test_the_server_follows_a_variable_the_session_sets_after_it_started(monkeypatch, tmp_path):
    """A library of the test process can set a variable after the fork server started
    (on a GPU host torch's and Triton's compilers do); gloo runs still fork, from a
    server started with the session's environment as it is now."""
    if os.environ.get(LAUNCHER_VARIABLE) == "torchrun":
        pytest.skip(f"{LAUNCHER_VARIABLE}=torchrun: this session has no fork launcher")
    assert fork_launcher(cpu_run_env()) is not None
    monkeypatch.setenv("TITAN_LOWBIT_TEST_SET_LATER", "yes")
    assert run_on_gloo(_set_later, 2, tmp_path / "res.pt", start="fork") == "yes"


def _train_without_the_sleep(self):
    time.sleep(1)  # a torchtitan whose rank 0 no longer sleeps 2 s here


def test_server_refuses_a_torchtitan_whose_trainer_moved_rank_0s_sleep(monkeypatch):
    """The forked rank 0 replaces the 2 s sleep of torchtitan's Trainer.train by a wait for
    the other ranks (fork_launcher._wait_for_other_ranks_instead_of_trainer_sleep); the
    server checks at start that the sleep is where it replaces it, and stops otherwise."""
    from torchtitan.train import Trainer

    filename, _ = server._trainer_sleep_site()
    assert filename.endswith(("torchtitan/train.py", "torchtitan/trainer.py")), filename
    monkeypatch.setattr(Trainer, "train", _train_without_the_sleep)
    with pytest.raises(RuntimeError, match=r"no longer has rank 0's time\.sleep\(2\)"):
        server._trainer_sleep_site()


def test_a_failure_is_recorded_with_whether_a_peer_was_gone_before_its_traceback(tmp_path):
    """A rank's failure record says when and whether its error (anywhere in the exception's
    chain) is gloo's report of a peer that went away: the server reads that even when it
    stopped the rank before its traceback reached stderr (a loaded machine's race)."""
    def raised(outer: str, inner: str) -> BaseException:
        try:
            try:
                raise RuntimeError(inner)
            except RuntimeError:
                raise RuntimeError(outer)
        except RuntimeError as e:
            return e

    path = str(tmp_path / "0.failed")
    before = time.monotonic()
    server._record_failure(path, raised("destroy_process_group failed", "[pair.cc:598] Connection closed by peer"))
    record = json.loads(open(path).read())
    assert record["peer_gone"] is True and before <= record["at"] <= time.monotonic()
    server._record_failure(path, raised("a real error", "another one"))
    assert json.loads(open(path).read())["peer_gone"] is False
    server._record_failure(path)  # a SystemExit with a code: no exception to read
    assert json.loads(open(path).read())["peer_gone"] is False
    assert sorted(os.listdir(tmp_path)) == ["0.failed"]
