"""tools/checkpoint_faults.py on a tiny one-process DCP checkpoint (no Trainer): every
damage it makes is named by the checks a resume runs, and a damage those checks cannot
see (a checkpoint without a manifest: records swapped, the step edited) is reported as a
guarantee that failed, with exit status 1. Its runs against a Trainer are the tool's own
use (docs/distributed.md); the same damage against a Trainer's checkpoint is in
tests/test_checkpoint_safety.py."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint_faults as faults  # tools/checkpoint_faults.py
from titan_lowbit.torchtitan.checkpoint_manifest import MANIFEST, write_manifest

STEP = 8


@pytest.fixture
def step_dir(tmp_path):
    """step-8 of a one-process DCP checkpoint with a manifest: two optimizer-like
    tensors of one shape (records of equal length), a weight, and the pickled step."""
    g = torch.Generator().manual_seed(0)
    folder = tmp_path / "checkpoint" / f"step-{STEP}"
    state = {"tok_embeddings.weight": torch.randn(128, 64, generator=g),
             "optimizer": {"state": {"a": {"exp_avg": torch.randn(32, 32, generator=g)},
                                     "b": {"exp_avg": torch.randn(32, 32, generator=g)}}},
             "train_state": {"step": STEP}}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    write_manifest(str(folder))
    return folder


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_every_damage_is_named_by_the_checks_before_a_resume(step_dir, tmp_path):
    verdicts = {d.name: faults.check_damage(step_dir, d, tmp_path / "work") for d in faults.DAMAGES}
    assert {name: v.held for name, v in verdicts.items()} == {d.name: True for d in faults.DAMAGES}, verdicts
    assert "optimizer.state.a.exp_avg" in verdicts["swapped-records"].detail, verdicts["swapped-records"]
    assert "records moved or swapped" in verdicts["swapped-records"].detail
    assert verdicts["edited-step"].detail.startswith("refused: train_state.step ("), verdicts["edited-step"]
    assert verdicts["missing-metadata"].detail == "skipped as incomplete"
    assert faults.main(["--checkpoint", str(step_dir)]) == 0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_damage_the_checks_cannot_see_is_reported_as_failed(step_dir, tmp_path, capsys):
    (step_dir / MANIFEST).unlink()  # as checkpoints were written before manifests
    verdicts = {d.name: faults.check_damage(step_dir, d, tmp_path / "work") for d in faults.DAMAGES}
    for name in ("swapped-records", "edited-step"):
        assert verdicts[name].held is False, verdicts[name]
        assert verdicts[name].detail == "not detected (no manifest: per-record CRC-32 only)"
    assert verdicts["flipped-bit"].held and verdicts["truncated-distcp"].held
    assert faults.main(["--checkpoint", str(step_dir), "--faults", "swapped-records,flipped-bit"]) == 1
    out = capsys.readouterr().out
    assert "swapped-records        checks  FAILED   not detected" in out, out
    assert "checkpoint_faults: 1 held, 1 failed (swapped-records), 0 skipped" in out, out
