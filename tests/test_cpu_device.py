"""The CPU switch is loud: one log line when titan_lowbit moves torchtitan to the CPU
path, an error instead of a CPU run on a machine whose GPUs CUDA cannot initialise, and
TITAN_LOWBIT_DEVICE=cpu still choosing the CPU path. What the machine shows (device
files, nvidia-smi, torch.cuda) is mocked; torchtitan's globals are never touched in the
test process. On the CPU path, sharded parameters initialise as one process draws them
(gloo processes of their own)."""

import logging

import pytest
import torch

from titan_lowbit.log_notes import DroppedNotes
from titan_lowbit.torchtitan import cpu_device


@pytest.fixture
def machine(monkeypatch):
    """A machine without GPUs and without CUDA, whose switch only records the call."""
    enabled = []
    monkeypatch.delenv("TITAN_LOWBIT_DEVICE", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(cpu_device.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(cpu_device.shutil, "which", lambda name: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_device, "enable", lambda: enabled.append(True))
    return enabled


def switch_records(caplog) -> tuple[bool, list[logging.LogRecord]]:
    caplog.clear()
    with caplog.at_level(logging.INFO):
        switched = cpu_device.switch()
    return switched, [r for r in caplog.records if "titan_lowbit" in r.getMessage()]


def test_no_gpu_switches_to_the_cpu_with_one_log_line(machine, caplog):
    switched, records = switch_records(caplog)
    assert switched and machine == [True]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "CPU path" in message and "no GPU found" in message and "gloo" in message


@pytest.mark.parametrize("sign", ["device file", "nvidia-smi", "CUDA_VISIBLE_DEVICES"])
def test_gpus_that_cuda_cannot_use_stop_the_run(machine, caplog, monkeypatch, sign):
    if sign == "device file":
        monkeypatch.setattr(cpu_device.glob, "glob", lambda pattern: ["/dev/nvidia0"])
        shown = "/dev/nvidia0"
    elif sign == "nvidia-smi":
        monkeypatch.setattr(cpu_device.shutil, "which", lambda name: "/usr/bin/" + name)
        shown = "nvidia-smi on PATH"
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
        shown = "CUDA_VISIBLE_DEVICES=0,1"
    monkeypatch.setattr(torch.version, "cuda", "13.0")

    def init():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "init", init)
    with pytest.raises(RuntimeError) as error:
        switch_records(caplog)
    message = str(error.value)
    assert shown in message and "CUDA driver initialization failed" in message
    assert "TITAN_LOWBIT_DEVICE=cpu" in message
    assert machine == []


def test_a_cpu_only_torch_on_a_gpu_machine_is_named(machine, caplog, monkeypatch):
    monkeypatch.setattr(cpu_device.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(RuntimeError, match="CPU-only build"):
        switch_records(caplog)


@pytest.mark.parametrize("hidden", ["", "-1"])
def test_gpus_hidden_on_purpose_take_the_cpu_path(machine, caplog, monkeypatch, hidden):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    assert switch_records(caplog)[0] and machine == [True]


def test_titan_lowbit_device_cpu_forces_the_cpu_path(machine, caplog, monkeypatch):
    monkeypatch.setattr(cpu_device.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TITAN_LOWBIT_DEVICE", "cpu")
    switched, records = switch_records(caplog)
    assert switched and machine == [True]
    assert len(records) == 1 and "TITAN_LOWBIT_DEVICE=cpu" in records[0].getMessage()


def test_working_cuda_keeps_torchtitan_on_the_gpu(machine, caplog, monkeypatch):
    monkeypatch.setattr(cpu_device.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    switched, records = switch_records(caplog)
    assert not switched and machine == [] and records == []


def test_a_misspelt_device_choice_is_refused(machine, monkeypatch):
    monkeypatch.setenv("TITAN_LOWBIT_DEVICE", "gpu")
    with pytest.raises(ValueError, match="TITAN_LOWBIT_DEVICE='gpu'"):
        cpu_device.switch()


def test_cpu_path_drops_only_the_warnings_that_are_wrong_there():
    keep = ["titan_lowbit: torchtitan runs on the CPU path (...)", "step:  1  loss:  7.6",
            "HF assets path ./x does not exist!"]
    drop = ["Error running lspci: [Errno 2] No such file or directory: 'lspci', fallback to use device_name",
            "Peak flops undefined for: CPU (x86_64, 2 cores), fallback to A100",
            "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config"]
    noise = DroppedNotes(cpu_device.CPU_PATH_NOISE)

    def passes(message: str) -> bool:
        return noise.filter(logging.LogRecord("root", logging.WARNING, __file__, 0, message, None, None))

    assert all(map(passes, keep)) and not any(map(passes, drop))



class _Layers(torch.nn.Module):
    """An embedding and a column- and a row-wise parallel linear, as torchtitan's TP plan
    shards them; 10 rows do not split evenly over 4 ranks."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.up = torch.nn.Linear(8, 12, bias=False)
        self.down = torch.nn.Linear(12, 8, bias=False)


def _initialise(model: _Layers) -> None:
    """Each of DTensor's random fills (cpu_device.RANDOM_FILLS), as torch.nn.init reaches them."""
    torch.manual_seed(0)
    with torch.no_grad():
        torch.nn.init.normal_(model.emb.weight)
        torch.nn.init.trunc_normal_(model.up.weight, std=0.02)  # uniform_
        model.down.weight.bernoulli_(0.3)


def _sharded_initialisations(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cpu_device.enable()  # this rank's process: torchtitan's globals, DTensor's fills
    plan = {"emb": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    tp = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = {}
    for name in ("tp", "fsdp_x_tp"):
        with torch.device("meta"):
            model = _Layers()
        parallelize_module(model, tp if name == "tp" else mesh["tp"], plan)
        if name == "fsdp_x_tp":
            fully_shard(model, mesh=mesh["dp"])
        model.to_empty(device="cpu")
        _initialise(model)
        results[name] = {n: (str(p.placements), p.full_tensor()) for n, p in model.named_parameters()}
    return results


def test_sharded_parameters_initialise_as_one_process_draws(tmp_path):
    """On the CPU path, a model sharded by TP (4 ranks) or FSDP2 x TP (2 x 2, FSDP2's strided
    shards) and then initialised holds the values one process draws with the same seed:
    torch fills every shard of a CPU mesh alike, copies of one shard."""
    from conftest import run_on_gloo

    whole = _Layers()
    _initialise(whole)
    results = run_on_gloo(_sharded_initialisations, 4, tmp_path / "results.pt")
    for layout, params in results.items():
        for name, (placements, value) in params.items():
            assert "Shard" in placements, (layout, name, placements)
            assert torch.equal(value, whole.get_parameter(name)), (layout, name, placements)
