"""The test helpers' handling of gloo's rare abort at exit (conftest.TRAINING_FINISHED):
a rank killed by SIGABRT after the run finished is recognised from torchrun's real
report, one killed before is not, and run_on_gloo runs a set again only when a rank
aborted before the results were written, with its ranks forked or spawned."""

import functools
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from conftest import LAUNCHER_VARIABLE, RANK_ONE_ABORTS, TRAINING_FINISHED, aborted_at_teardown, run_on_gloo

def torchrun_abort(tmp_path, when: str) -> subprocess.CompletedProcess:
    script = tmp_path / "abort.py"
    script.write_text(RANK_ONE_ABORTS)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), when, TRAINING_FINISHED],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("when, expected", [("after", True), ("before", False)])
def test_torchrun_report_of_an_abort_is_recognised(tmp_path, when, expected):
    proc = torchrun_abort(tmp_path, when)
    assert proc.returncode != 0
    assert aborted_at_teardown(proc) is expected, proc.stderr[-3000:]


def _abort_once(flag: str, rank: int):
    dist.all_reduce(__import__("torch").ones(1))
    if rank == 1 and not os.path.exists(flag):
        open(flag, "w").close()
        os.abort()
    return {"rank": rank, "sum": dist.get_world_size()}


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_run_on_gloo_runs_again_after_an_abort_before_the_results(tmp_path, start):
    if start == "fork" and os.environ.get(LAUNCHER_VARIABLE) == "torchrun":
        pytest.skip(f"{LAUNCHER_VARIABLE}=torchrun: this session has no fork launcher")
    flag = tmp_path / "aborted_once"
    with pytest.warns(UserWarning, match="before the results were written"):
        out = run_on_gloo(functools.partial(_abort_once, str(flag)), 2, tmp_path / "res.pt",
                          start=start)
    assert flag.exists() and out == {"rank": 0, "sum": 2}


def test_a_second_run_starts_from_the_files_the_first_found(tmp_path):
    from conftest import _remove_new_paths

    (tmp_path / "checkpoint" / "step-4").mkdir(parents=True)
    (tmp_path / "checkpoint" / "step-4" / "a.distcp").write_text("kept")
    before = set(tmp_path.rglob("*"))
    (tmp_path / "checkpoint" / "step-6").mkdir()
    (tmp_path / "checkpoint" / "step-6" / "b.distcp").write_text("new")
    (tmp_path / "tb").mkdir()
    (tmp_path / "checkpoint" / "step-4" / "extra").write_text("new")
    _remove_new_paths(tmp_path, before)
    assert set(tmp_path.rglob("*")) == before
    assert (tmp_path / "checkpoint" / "step-4" / "a.distcp").read_text() == "kept"
