"""scripts/convergence.py's report from earlier runs (``--from-dump``, ``--from-json``), run
as a user runs it: run folders with and without a seed, results read back from saved logs
and JSON, and the report's per-seed gaps."""

import json
import subprocess
import sys

from conftest import ROOT

STEPS = 3


def _log(losses, val):
    """torchtitan's log lines (plain) for a run of len(losses) steps and one validation."""
    lines = [f"[rank0]:[titan] 2026-11-25 03:00:0{i},000 - root - INFO - step:  {i}  loss:  {l:.5f}  "
             f"grad_norm:  0.5000  memory:  0.80GiB(3.39%)  tps: 100  tflops: 0.00  mfu: 0.00%"
             for i, l in enumerate(losses, 1)]
    lines.append(f"[rank0]:[titan] 2026-11-25 03:00:09,000 - root - INFO - validate step: {len(losses)}  "
                 f"loss: {val:.4f}  memory:  0.80GiB(3.39%)")
    return "\n".join(lines) + "\n"


# A hand-written page beside the report, as docs/convergence.md is beside docs/convergence_debug.md.
PAGE = "# Convergence\n\nWritten by hand: the report must leave it as it is.\n"


def _report(out, *args) -> tuple[str, dict]:
    """convergence_debug.md and convergence_debug.json of a report from earlier runs,
    written into a folder that holds a hand-written convergence.md, which stays as it
    was; the report does not name this machine as the one that ran them. Without
    matplotlib the script writes both and then stops, naming it, instead of the PNG."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence.md").write_text(PAGE)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "convergence.py"),
                           "--steps", str(STEPS), "--out", str(out), *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 or "needs matplotlib" in proc.stderr, proc.stderr[-3000:]
    assert (out / "convergence.md").read_text() == PAGE
    text = (out / "convergence_debug.md").read_text()
    # Earlier runs: the report names no device or versions, which would be this machine's.
    header = text.split("## ")[0]
    assert "from earlier runs" in header and "torch " not in header and "Measured" not in header, header
    return text, json.loads((out / "convergence_debug.json").read_text())


def test_report_gives_each_seed_gap_and_their_mean(tmp_path):
    dump = tmp_path / "dump"
    # Run folders as convergence.py names them: lr, the seed when one was given, then the
    # variant; the lr itself may hold a '-'.
    runs = {"0.003-seed0-AdamW-auto-nearest": 6.0, "0.003-seed1-AdamW-auto-nearest": 5.0,
            "0.003-seed0-AdamW8bit-auto-nearest": 6.06, "0.003-seed1-AdamW8bit-auto-nearest": 4.90,
            "1e-05-AdamW-auto-nearest": 7.0, "1e-05-AdamW-bfloat16-kahan": 7.7}
    for name, val in runs.items():
        (dump / name).mkdir(parents=True)
        seed = 1 if "seed1" in name else 0
        (dump / name / "train.log").write_text(_log([8.0, 7.0, 6.5 + seed], val))
    text, saved = _report(tmp_path / "out", "--seeds", "0,1", "--from-dump", dump)
    assert set(saved) == {"0.003|fp32 AdamW (torch)|0", "0.003|fp32 AdamW (torch)|1",
                          "0.003|AdamW8bit|0", "0.003|AdamW8bit|1",
                          "1e-05|fp32 AdamW (torch)", "1e-05|bf16 weights, kahan"}, saved
    assert saved["0.003|AdamW8bit|1"]["final_val"] == 4.90
    lr3 = text.split("## lr 1e-05")[0]
    row = next(l for l in lr3.splitlines() if l.startswith("| AdamW8bit |"))
    # seed 0: +1.00%, seed 1: -2.00%, mean -0.50%; validation loss the mean 5.48
    assert row == "| AdamW8bit | 7.0000 | 5.4800 | -0.50% | +1.00%, -2.00% |", row
    assert "| AdamW4bit | not measured | not measured | | |" in lr3
    assert "| bf16 weights, kahan | 6.5000 | 7.7000 | +10.00% |" in text.split("## lr 1e-05")[1]


def test_report_reads_the_runs_json_with_and_without_seeds(tmp_path):
    train = {"1": 8.0, "2": 7.0, "3": 6.0}
    runs = {"0.003|fp32 AdamW (torch)": {"train": train, "final_train": 6.0, "final_val": 5.0},
            "0.003|AdamW8bit": {"train": train, "final_train": 6.0, "final_val": 5.5},
            "0.003|AdamW4bit|2": {"train": train, "final_train": 6.0, "final_val": 5.5}}
    path = tmp_path / "convergence_runs.json"
    path.write_text(json.dumps(runs))
    text, saved = _report(tmp_path / "out", "--from-json", path)
    assert set(saved) == set(runs), saved
    assert "| AdamW8bit | 6.0000 | 5.5000 | +10.00% |" in text, text
