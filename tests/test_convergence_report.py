"""scripts/convergence.py's bookkeeping: run folders and result keys with and without a
seed, results read back from saved logs and JSON, and the report's per-seed gaps."""

import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import convergence as conv  # noqa: E402

STEPS = 3


def _log(losses, val):
    """torchtitan's log lines (plain) for a run of len(losses) steps and one validation."""
    lines = [f"[rank0]:[titan] 2026-11-25 03:00:0{i},000 - root - INFO - step:  {i}  loss:  {l:.5f}  "
             f"grad_norm:  0.5000  memory:  0.80GiB(3.39%)  tps: 100  tflops: 0.00  mfu: 0.00%"
             for i, l in enumerate(losses, 1)]
    lines.append(f"[rank0]:[titan] 2026-11-25 03:00:09,000 - root - INFO - validate step: {len(losses)}  "
                 f"loss: {val:.4f}  memory:  0.80GiB(3.39%)")
    return "\n".join(lines) + "\n"


def test_run_folders_round_trip_with_and_without_seed():
    for lr, seed in ((1e-5, None), (3e-3, 2), (1e-5, 11)):
        name = conv.run_dir_name(lr, seed, "AdamW", "bfloat16", "kahan")
        assert conv._split_run_dir(name) == (f"{lr:g}", seed, "AdamW", "bfloat16", "kahan")
        key = (lr, "bf16 weights, kahan", seed)
        assert conv._parse_key(conv._key_str(*key)) == key
    # Folders and keys of runs made before seeds existed still read.
    assert conv._split_run_dir("1e-05-AdamW8bit-auto-nearest") == ("1e-05", None, "AdamW8bit", "auto", "nearest")
    assert conv._parse_key("0.003|AdamW8bit") == (0.003, "AdamW8bit", None)


def test_report_gives_each_seed_gap_and_their_mean(tmp_path):
    dump = tmp_path / "dump"
    vals = {("AdamW", "auto", "nearest"): {0: 6.0, 1: 5.0},
            ("AdamW8bit", "auto", "nearest"): {0: 6.06, 1: 4.90}}
    for (name, dtype, update), per_seed in vals.items():
        for seed, val in per_seed.items():
            run = dump / conv.run_dir_name(0.003, seed, name, dtype, update)
            run.mkdir(parents=True)
            (run / "train.log").write_text(_log([8.0, 7.0, 6.5 + seed], val))
    results = conv.load_saved([], [dump], STEPS)
    assert set(results) == {(0.003, label, s) for label in ("fp32 AdamW (torch)", "AdamW8bit")
                            for s in (0, 1)}
    assert results[(0.003, "AdamW8bit", 1)]["final_val"] == 4.90
    conv.write_report(results, [0.003], STEPS, ["--seeds", "0,1"], tmp_path)
    text = (tmp_path / "convergence.md").read_text()
    row = next(l for l in text.splitlines() if l.startswith("| AdamW8bit |"))
    # seed 0: +1.00%, seed 1: -2.00%, mean -0.50%; validation loss the mean 5.48
    assert row == "| AdamW8bit | 7.0000 | 5.4800 | -0.50% | +1.00%, -2.00% |", row
    assert "| AdamW4bit | not measured | not measured | | |" in text
    # The JSON keeps every seed's figures and reads back as the same results.
    saved = json.loads((tmp_path / "convergence.json").read_text())
    assert saved["0.003|AdamW8bit|1"]["final_val"] == 4.90
