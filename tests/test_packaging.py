"""titan_lowbit installed and used the way README.md tells a newcomer: CI installs with
README's own line, and a non-editable install in a fresh virtual environment builds the
offline corpus with the packaged command and trains README's job file from an empty
directory on 2 CPU processes with plain torchrun."""

import os
import re
import shlex
import shutil
import site as python_site
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from conftest import ROOT, step_losses

README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
TEST_COMMAND = " && python -m pytest"  # the whole suite, torchtitan 0.2 line
TEST_COMMAND_03 = " && python -m pytest tests/test_torchtitan03.py"  # the torchtitan 0.3 line
# the kernels with the oldest Triton the package declares
TEST_COMMAND_OLDEST_TRITON = " && python -m pytest tests/test_optim_kernels.py tests/test_bitnet_kernels.py tests/test_health_kernels.py"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.S | re.M)


def readme_lines(predicate) -> list[str]:
    return [line for block in code_blocks("bash") for line in block.splitlines()
            if predicate(line)]


def test_ci_installs_exactly_as_readme_says():
    installs = []
    for command in (TEST_COMMAND, TEST_COMMAND_OLDEST_TRITON, TEST_COMMAND_03):
        tests = readme_lines(lambda line: line.endswith(command))
        assert len(tests) == 1, f"README.md should hold one test command ending {command!r}, found {tests}"
        installs.append(tests[0].removesuffix(command))
    ci = CI.read_text().splitlines()
    assert [line.strip() for line in ci if "pip install" in line] == installs
    assert ci.index(installs[0]) < ci.index("python -m pytest")
    stripped = [line.strip() for line in ci]
    # the oldest Triton, the version pyproject.toml declares as the lowest, after the suite
    oldest = re.search(r'"triton>=([0-9.]+),', (ROOT / "pyproject.toml").read_text()).group(1)
    assert installs[1] == f'pip install "triton=={oldest}.0"', installs[1]
    assert stripped.index(installs[1]) > stripped.index("python -m pytest")
    assert TEST_COMMAND_OLDEST_TRITON.removeprefix(" && ") in stripped
    assert "python -m pytest tests/test_torchtitan03.py" in stripped
    # Every README line that installs torch installs it as one of the tested lines does.
    for line in readme_lines(lambda line: line.startswith("pip install torch")):
        assert any(line.startswith(install) or install.startswith(line) for install in installs), line
    # The 0.2 line (the whole suite): the CPU build from PyTorch's CPU wheel index
    # (pytorch.org's form), not the CUDA one. (The 0.3 line takes the package index's torch
    # 2.14.1: its CUDA build's dependencies are on that index only.)
    assert "--index-url https://download.pytorch.org/whl/cpu" in installs[0]


def readme_job() -> str:
    """The job file under README.md's "Using it from your own torchtitan config"."""
    section = README.read_text().split("## Using it from your own torchtitan config", 1)[1]
    return re.search(r"^```toml\n(.*?)^```", section, re.S | re.M).group(1)


def readme_cpu_launch() -> tuple[dict[str, str], list[str]]:
    """(environment, torchrun arguments) of README.md's launch on CPU processes."""
    (line,) = readme_lines(lambda line: "torchrun" in line and "--nproc_per_node=2" in line
                           and "--job.config_file" in line)
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words[:words.index("torchrun")])
    return env, words[words.index("torchrun") + 1:]


def test_readme_job_file_is_complete_and_paths_free():
    job = tomllib.loads(readme_job())
    assert job["training"]["dataset"] == "lowbit_text"
    # A newcomer's first run logs every step and repeats itself.
    assert job["metrics"]["log_freq"] == 1 and job["debug"]["seed"] == 0
    # Nothing in it depends on the working directory but the outputs.
    assert "dataset_path" not in job["training"] and "hf_assets_path" not in job["model"]
    env, args = readme_cpu_launch()
    assert args[args.index("--job.config_file") + 1] == "my_job.toml"


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.mark.trainer
def test_non_editable_install_trains_readme_job_from_an_empty_directory(tmp_path):
    try:
        _install_prepare_and_train(tmp_path, readme_job())
    finally:  # everything the test and its processes wrote (the environment, corpus,
        # outputs, temporary files), not kept for later runs, even on failure
        shutil.rmtree(tmp_path, ignore_errors=True)


def running_site_packages() -> list[str]:
    """The site-packages folders of the running environment (a virtual environment's own,
    and those it shares), where its torch, triton and torchtitan are."""
    folders = python_site.getsitepackages()
    if python_site.ENABLE_USER_SITE:
        folders.append(python_site.getusersitepackages())
    return [folder for folder in folders if os.path.isdir(folder)]


def _new_venv_seeing_this_one(venv: Path) -> str:
    """A virtual environment at ``venv`` that imports the running environment's packages
    (after its own); its python. ``--system-site-packages`` would show the packages of the
    base Python instead, which has no torch when the tests run in a virtual environment.
    The folders are listed in a .pth file, so Python adds them to the path without reading
    their own .pth files: a titan_lowbit installed there in editable mode stays out."""
    _run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    site_dir = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                         ).stdout.strip())
    (site_dir / "running_environment.pth").write_text("\n".join(running_site_packages()) + "\n")
    return python


def _install_prepare_and_train(tmp_path: Path, job_text: str) -> None:
    top_before = {p.name for p in ROOT.iterdir()}
    python = _new_venv_seeing_this_one(tmp_path / "venv")
    # A user's environment: no PYTHONPATH into a clone, no test settings, an empty cache;
    # temporary files (pip's builds, torchrun's and Inductor's) in tmp_path.
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TITAN_LOWBIT_DATA", "TITAN_LOWBIT_DEVICE",
                        "TRITON_INTERPRET", "OMP_NUM_THREADS")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    # torch and torchtitan come from the running environment; titan_lowbit is built and
    # copied in.
    _run([python, "-c", "import torch, torchtitan, triton"], env=env)
    _run([python, "-m", "pip", "install", "--no-deps", "--quiet", str(ROOT)], env=env)
    assert {p.name for p in ROOT.iterdir()} == top_before, "the install left files in the tree"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     env=env).stdout.strip())
    assert (site / "titan_lowbit" / "kernels" / "__init__.py").is_file()
    assert (site / "titan_lowbit" / "prepare_data.py").is_file()
    assert not (site / "kernels").exists(), "kernels/ installed as a top-level module"
    # scripts/train.sh runs from the clone's root, where the clone's titan_lowbit comes
    # first: it must be whole there too.
    _run([python, "-c", "import titan_lowbit.kernels.quant_maps"], cwd=ROOT, env=env)

    work = tmp_path / "job"
    work.mkdir()
    where = _run([python, "-c", "import titan_lowbit.kernels as k; print(k.__file__)"],
                 cwd=work, env=env).stdout.strip()
    assert where.startswith(str(site)), f"imported {where}, not the installed copy"
    # The packaged data step (a smaller corpus than the default's 24 MB, for time).
    _run([python, "-m", "titan_lowbit.prepare_data", "--max-bytes", "1500000"], cwd=work, env=env)
    data = tmp_path / "cache" / "titan_lowbit" / "lowbit_text"
    assert (data / "tokenizer" / "tokenizer.json").is_file()

    (work / "my_job.toml").write_text(job_text)
    launch_env, args = readme_cpu_launch()
    # torchrun from the virtual environment (the system's `torchrun` would run the system's
    # Python); a few short steps, each logged.
    steps = 2
    proc = _run([python, "-m", "torch.distributed.run", *args, "--training.steps", str(steps),
                 "--training.seq_len", "64", "--training.local_batch_size", "2",
                 "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
                 "--metrics.disable_color_printing"],
                cwd=work, env={**env, **launch_env}, timeout=600)
    out = proc.stdout + proc.stderr
    assert sorted(step_losses(out)) == list(range(1, steps + 1)), out[-4000:]
    assert f"using the tokenizer of lowbit_text, {data / 'tokenizer'}" in out
    assert sorted(p.name for p in work.iterdir()) == ["my_job.toml", "outputs"]
