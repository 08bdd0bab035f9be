"""tools/gpu_checks.sh, the one command for every GPU check (README): what it refuses
before it starts anything. Its checks themselves run on GPU hosts."""

import os
import subprocess

from conftest import ROOT

SCRIPT = str(ROOT / "tools" / "gpu_checks.sh")


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # as a host without a GPU, also on a GPU host
    return subprocess.run(["bash", SCRIPT, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_without_a_gpu_it_says_so_and_starts_nothing():
    proc = run()
    assert proc.returncode == 2 and "no GPU torch can use" in proc.stderr, proc.stderr


def test_an_unknown_check_is_named_with_the_checks_there_are():
    proc = run("tests", "bitnett")
    assert proc.returncode == 2 and "unknown check 'bitnett' (tests, compat, bitnet)" in proc.stderr, proc.stderr
