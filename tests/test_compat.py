"""The private-API fence (titan_lowbit/compat.py): an untested library version, or
TITAN_LOWBIT_PRIVATE_APIS=0, takes the public paths with one log line per library, and
training still works there. (The BitNet launches' public path: test_bitnet_launch.py.)"""

import logging
import os
import subprocess
import sys

from conftest import ROOT
from titan_lowbit import compat


def test_an_untested_version_is_refused_once_per_library(monkeypatch, caplog):
    monkeypatch.setattr(compat, "_told", set())
    monkeypatch.delenv(compat.ENV, raising=False)
    assert compat.private_api_ok("torch") and compat.private_api_ok("triton")
    torch_version = compat.installed("torch")
    monkeypatch.setitem(compat.TESTED, "torch", ((1, 0), (1, 99)))
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        assert not compat.private_api_ok("torch")
        assert not compat.private_api_ok("torch")
        assert compat.private_api_ok("triton")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    found = ".".join(map(str, torch_version))
    assert f"torch {found} is outside the tested range 1.0 to 1.99" in lines[0], lines
    assert "row_reductions.py" in lines[0], lines  # names where the public path is taken


def test_the_switch_takes_every_public_path(monkeypatch):
    monkeypatch.setattr(compat, "_told", set())
    monkeypatch.setenv(compat.ENV, "0")
    assert not any(compat.private_api_ok(lib) for lib in compat.TESTED)
    assert compat.FENCED and {u.library for u in compat.FENCED} <= set(compat.TESTED)


PUBLIC_RUN = r"""
import torch
import torch.nn as nn
import titan_lowbit.torchtitan  # registers with torchtitan, as custom_import does
import titan_lowbit.config
import torchtitan.protocols.model_converter as mc
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.config.manager import ConfigManager
import torch._inductor.config as inductor_config
from titan_lowbit.bitnet import BitNetConverter, convert_to_bitnet
from titan_lowbit.optim import LowBitAdamW

assert not getattr(CheckpointManager.dcp_load, "titan_lowbit_checked", False)
assert not getattr(ConfigManager._dict_to_dataclass, "titan_lowbit_checked", False)
assert type(mc._registry_model_converter_cls) is dict
assert mc._registry_model_converter_cls["bitnet"] is BitNetConverter


class Job:  # what BitNetConverter reads of a JobConfig
    class compile:
        enable = True


BitNetConverter(Job(), parallel_dims=None)
assert inductor_config.inductor_choices_class is None

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
convert_to_bitnet(model, filter_fqns=())
opt = LowBitAdamW(model.parameters(), lr=1e-3, min_quantized_numel=1)
for _ in range(2):
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
assert all(torch.isfinite(p).all() for p in model.parameters())
print("public-paths-ok")
"""


def test_training_on_the_public_paths():
    """In a fresh process with TITAN_LOWBIT_PRIVATE_APIS=0: torchtitan's checkpointing,
    config loader and converter registry are left as they are (the converters still
    registered), Inductor's
    choices are not replaced, and a BitNet model trains with LowBitAdamW."""
    env = {**os.environ, compat.ENV: "0", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", PUBLIC_RUN], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "public-paths-ok" in proc.stdout, proc.stderr[-4000:]
    said = [l for l in proc.stderr.splitlines() if "taking the public paths" in l]
    assert sorted(l.split("instead of ")[1].split("'s")[0] for l in said) == ["torch", "torchtitan"], said
