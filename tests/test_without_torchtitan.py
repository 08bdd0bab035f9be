"""titan_lowbit's core serves any PyTorch loop: ``titan_lowbit.optim`` and
``titan_lowbit.bitnet`` import with torch and triton alone, without touching torchtitan or
changing anything, and examples/fsdp2_lowbit.py trains under plain FSDP2 with a DCP
checkpoint on 2 gloo processes. In each case torchtitan is made unimportable: a
``torchtitan`` package first on PYTHONPATH records every attempt to import it and
raises ImportError."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_once_more_after_teardown_abort

STUB = """
import os, traceback
with open(os.environ["TORCHTITAN_IMPORT_LOG"], "a") as log:
    log.write("".join(traceback.format_stack()) + "\\n")
raise ImportError("torchtitan is made unimportable for this test")
"""

IMPORT = """
import json, logging, os, sys
import torch, torch.distributed as dist
# What torch itself does when these modules load (Inductor's config sets its cache folder
# variable and a backend entry) is not titan_lowbit's doing: they load before the snapshot.
import triton, torch._inductor.config, torch._inductor.choices
import torch.distributed._functional_collectives
def snapshot():
    return dict(backends=dict(dist.Backend.default_device_backend_map),
                inductor=repr(sorted(torch._inductor.config.get_config_copy().items())),
                device=str(torch.get_default_device()), dtype=str(torch.get_default_dtype()),
                env=dict(os.environ), log_handlers=len(logging.root.handlers),
                log_level=logging.root.level, threads=torch.get_num_threads())
before = snapshot()
import titan_lowbit.optim, titan_lowbit.bitnet
from titan_lowbit.optim import LowBitAdamW
from titan_lowbit.bitnet import convert_to_bitnet
after = snapshot()
from titan_lowbit.bitnet import insert_subln
try:  # surgery on torchtitan's llama3 blocks: a plain model has none
    insert_subln(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    subln = "no error"
except ValueError as error:
    subln = str(error)
try:
    import torchtitan
    blocked = False
except ImportError:
    blocked = True
print("RESULT " + json.dumps(dict(
    changed=sorted(k for k in before if before[k] != after[k]),
    torchtitan=sorted(m for m in sys.modules if m.split(".")[0] == "torchtitan"),
    titan_lowbit=sorted(m for m in sys.modules if m.split(".")[0] == "titan_lowbit"),
    subln=subln, blocked=blocked)))
"""


def blocked_env(tmp_path) -> dict[str, str]:
    stub = tmp_path / "blocked" / "torchtitan"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(STUB)
    path = os.pathsep.join(p for p in (str(stub.parent), str(ROOT), os.environ.get("PYTHONPATH"))
                           if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
            "TORCHTITAN_IMPORT_LOG": str(tmp_path / "torchtitan_imports.log")}


def test_optim_and_bitnet_import_without_torchtitan_and_change_nothing(tmp_path):
    env = blocked_env(tmp_path)
    proc = subprocess.run([sys.executable, "-c", IMPORT], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    result = json.loads(line.split(" ", 1)[1])
    log = tmp_path / "torchtitan_imports.log"
    attempts = log.read_text() if log.exists() else ""
    # the blocker works (the last import above is its one recorded attempt) ...
    assert result["blocked"] and attempts.count("\n\n") == 1, attempts
    # ... and nothing before it tried torchtitan, loaded it, or changed the process
    assert result["torchtitan"] == [] and result["changed"] == []
    assert "has none" in result["subln"], result["subln"]
    # the components, the kernels and the name matcher the BitNet converter shares with
    # the job config; nothing of the torchtitan integration
    parts = {m.split(".")[1] for m in result["titan_lowbit"] if "." in m}
    assert parts == {"optim", "bitnet", "kernels", "fqn_fragments"}, result["titan_lowbit"]


def test_fsdp2_example_trains_and_resumes_from_dcp_without_torchtitan(tmp_path):
    env = blocked_env(tmp_path)
    checkpoint = tmp_path / "checkpoint"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "fsdp2_lowbit.py"), "--steps", "8",
           "--checkpoint-dir", str(checkpoint)]
    finished = "same losses, bit for bit"
    proc = run_once_more_after_teardown_abort(cmd, env, 300, 2, finished)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert finished in proc.stdout, proc.stdout[-3000:]
    assert not (tmp_path / "torchtitan_imports.log").exists()
    assert (checkpoint / ".metadata").exists()


def _example_module():
    spec = importlib.util.spec_from_file_location("fsdp2_lowbit_example",
                                                  ROOT / "examples" / "fsdp2_lowbit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gpus,local_ranks,expected", [
    (0, 2, ["cpu", "cpu"]),
    (1, 2, ["cpu", "cpu"]),      # a GPU for one rank only: no rank takes it
    (2, 2, ["cuda:0", "cuda:1"]),
    (4, 2, ["cuda:0", "cuda:1"]),
])
def test_fsdp2_example_takes_the_gpus_only_when_every_local_rank_has_one(
        monkeypatch, capsys, gpus, local_ranks, expected):
    """examples/fsdp2_lowbit.py on a host with fewer GPUs than processes (2 processes on
    a 1-GPU host asked CUDA for a device that does not exist) trains on the CPU and says
    why on its first local rank, naming the process count that would use the GPUs."""
    example = _example_module()
    monkeypatch.setattr(example.torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(example.torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    for local_rank, device in enumerate(expected):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        assert str(example.pick_device()) == device
        said = capsys.readouterr().out
        if 0 < gpus < local_ranks and local_rank == 0:
            assert f"but {gpus} GPU(s)" in said and f"--nproc_per_node={gpus}" in said, said
        else:
            assert said == ""
