"""scripts/plot_losses.py as a user runs it on saved torchtitan logs: the table's figures
(state bytes from titan_lowbit's summary line, peak memory, median tokens/s, the last
validation loss and its gap), and the refusals that keep a comparison honest."""

import re
import subprocess
import sys

import pytest

from conftest import ROOT

SUMMARY = ("[rank0]:[titan] 2026-11-27 14:04:29,472 - root - INFO - titan_lowbit: converters none; "
           "optimizer {name} (titan_lowbit, state format 8bit); weights float32; optimizer state "
           "{state} B/param vs 8 for fp32 AdamW (3.94x less)")


def _log(name, state, losses, tps, gib, val, val_step=None, summary=True):
    """What scripts/train.sh prints for a run: the summary line, one metrics line per step
    (rank 0 and rank 1), one validation line."""
    lines = [SUMMARY.format(name=name, state=state)] if summary else []
    for step, (loss, t) in enumerate(zip(losses, tps), 1):
        for rank, mem in ((0, gib), (1, gib + 1.0 if step == 2 else gib)):
            lines.append(f"[rank{rank}]:[titan] 2026-11-27 14:05:0{step},000 - root - INFO - step: {step:2d}  "
                         f"loss: {loss:8.5f}  grad_norm:  1.5000  memory: {mem:5.2f}GiB(25.00%)  "
                         f"tps: {t:,}  tflops: 185.31  mfu: 18.74%")
    lines.append(f"[rank0]:[titan] 2026-11-27 14:06:23,805 - root - INFO - validate step: "
                 f"{val_step or len(losses)}  loss:  {val:.4f}  memory: {gib:5.2f}GiB(25.00%)  tps: 182,460")
    return "\n".join(lines) + "\n"


def _run(tmp_path, logs, *args):
    paths = []
    for label, text in logs.items():
        path = tmp_path / f"{len(paths)}.log"
        path.write_text(text)
        paths.append(f"{label}={path}")
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_losses.py"), *args, *paths],
                          capture_output=True, text=True, timeout=60)


def test_table_gives_each_runs_figures_and_its_gap_to_the_baseline(tmp_path):
    proc = _run(tmp_path, {
        "AdamW": _log("AdamW", "8.000", [10.0, 6.0, 5.0, 4.0], [1000, 2000, 3000, 5000], 27.05, 3.6582),
        "Muon8bit": _log("Muon8bit", "1.137", [10.0, 5.0, 4.0, 3.0], [900, 900, 1100, 1000], 20.13, 3.2430),
    }, "--baseline", "Muon8bit", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()[2:]]
    # The median of the steps after the first, rank 0's; the peak over every rank and step.
    assert [c.strip() for c in rows[0]] == ["AdamW", "8.000", "28.05", "3,000", "4.0000", "3.6582", "+12.80%"]
    assert [c.strip() for c in rows[1]] == ["Muon8bit", "1.137", "21.13", "1,000", "3.0000", "3.2430", ""]
    assert "validation loss (step 4)" in proc.stdout and "vs Muon8bit" in proc.stdout


def test_runs_that_cannot_be_compared_are_refused_by_name(tmp_path):
    good = _log("AdamW", "8.000", [10.0, 6.0], [1000, 2000], 27.05, 3.6582)
    proc = _run(tmp_path, {"AdamW": good, "Muon": _log("Muon", "4.477", [10.0, 5.0], [900, 900], 23.49,
                                                       3.2371, summary=False)})
    assert proc.returncode != 0 and "'Muon' has no titan_lowbit's summary line" in proc.stderr, proc.stderr
    proc = _run(tmp_path, {"AdamW": good, "Muon": _log("Muon", "4.477", [10.0, 5.0], [900, 900], 23.49,
                                                       3.2371, val_step=1)})
    assert proc.returncode != 0 and "'Muon' was validated last at step 1, 'AdamW' at 2" in proc.stderr
    proc = _run(tmp_path, {"AdamW": good}, "--baseline", "Muon")
    assert proc.returncode != 0 and "--baseline 'Muon' is none of the runs' labels" in proc.stderr


def test_png_holds_the_curves_or_the_error_names_matplotlib(tmp_path):
    """With matplotlib (the ``bench`` extra) the curves land in the PNG; without it the
    table is printed and the PNG is refused naming the extra, never silently skipped."""
    png = tmp_path / "curves.png"
    proc = _run(tmp_path, {"AdamW": _log("AdamW", "8.000", [10.0, 6.0], [1000, 2000], 27.05, 3.6582)},
                "--png", str(png), "--title", "test")
    assert "| AdamW | 8.000 |" in proc.stdout, proc.stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert proc.returncode != 0 and "pip install -e '.[bench]'" in proc.stderr and not png.exists()
    else:
        assert proc.returncode == 0, proc.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validation_curves_start_at_val_from_and_training_curves_stay_whole():
    from plot_losses import curves  # scripts/plot_losses.py (conftest puts scripts/ on the path)

    rows = [{"label": "AdamW", "losses": {1: 10.0, 2: 6.0, 3: 5.0}, "validation": {1: 10.8, 2: 4.0, 3: 3.5}},
            {"label": "8bit", "losses": {1: 10.0, 2: 6.1, 3: 5.1}, "validation": {1: 10.8, 2: 4.1, 3: 3.6}}]
    (train_label, train), (val_label, val) = curves(rows, val_from=2)
    assert train == {"AdamW": {1: 10.0, 2: 6.0, 3: 5.0}, "8bit": {1: 10.0, 2: 6.1, 3: 5.1}}
    assert val == {"AdamW": {2: 4.0, 3: 3.5}, "8bit": {2: 4.1, 3: 3.6}}
    assert (train_label, val_label) == ("training loss", "validation loss (from step 2)")
    assert curves(rows)[1] == ("validation loss", {r["label"]: r["validation"] for r in rows})


def test_val_from_is_refused_past_the_last_validation_or_without_png(tmp_path):
    runs = {"AdamW": _log("AdamW", "8.000", [10.0, 6.0], [1000, 2000], 27.05, 3.6582)}
    proc = _run(tmp_path, runs, "--val-from", "1")
    assert proc.returncode != 0 and "--val-from draws the validation curves of --png" in proc.stderr
    from plot_losses import curves

    rows = [{"label": "AdamW", "losses": {1: 10.0, 2: 6.0}, "validation": {1: 10.8, 2: 4.0}}]
    with pytest.raises(SystemExit, match=re.escape("--val-from 3: ['AdamW'] validated last before that step")):
        curves(rows, val_from=3)
