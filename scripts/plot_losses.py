#!/usr/bin/env python3
"""Training runs side by side, from their torchtitan logs: a markdown table and a plot.

Each run is ``LABEL=LOG``, the output of ``scripts/train.sh`` (``--metrics.disable_color_printing``
or not). The table gives, per run: the optimizer state in bytes per parameter that
titan_lowbit's start-up summary line states, the peak memory and the median tokens/s per
GPU after ``--warmup`` logged steps (rank 0; ``run_logs.summarize``), the training loss
as the mean of the last 10% of the logged steps (one step's loss is one batch's, too noisy
to compare), the validation loss of the last validated step, and its gap to the
``--baseline`` run's. ``--png`` draws the training-loss curves, and beside them the
validation curves when the runs validated more than once (needs matplotlib:
``pip install -e '.[bench]'``); ``--val-from`` starts those at a later step, so that a first
validation of the untrained model does not squeeze the runs' ends into one line.

    python3 scripts/plot_losses.py --baseline Muon --png docs/muon_1b.png \\
        Muon=logs/muon.log Muon8bit=logs/muon8.log "AdamW (torch)=logs/adamw.log"

Runs are read as they are: give it runs of the same config, seed and data order, or the
comparison means nothing.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from run_logs import final_train_loss, parse_log, summarize, validation_losses  # scripts/run_logs.py, beside this file

# titan_lowbit's start-up summary line: "... optimizer state 1.137 B/param vs 8 for fp32 AdamW ..."
STATE_BYTES = re.compile(r"optimizer state ([0-9.]+) B/param")


def read_run(label: str, text: str, warmup: int) -> dict:
    """One run's row: state bytes, peak GiB, tokens/s, last train loss, last validation
    loss and the training curve. Exits naming the run when its log lacks any of them."""
    figures = summarize(parse_log(text), warmup)
    validation = validation_losses(text)
    state = STATE_BYTES.search(text)
    missing = [what for what, found in (("training steps", figures), ("a validation loss", validation),
                                        ("titan_lowbit's summary line", state)) if not found]
    if missing:
        raise SystemExit(f"plot_losses: the log of {label!r} has no {', no '.join(missing)}")
    last = max(validation)
    return {"label": label, "state_bytes": float(state.group(1)), **figures,
            "train_loss": final_train_loss(figures["losses"]), "validation": validation,
            "val_step": last, "val_loss": validation[last]}


def table(rows: list[dict], baseline: str) -> str:
    """The markdown table, gaps against the row labelled ``baseline``."""
    base = next(r for r in rows if r["label"] == baseline)
    lines = ["| run | optimizer state B/param | peak GiB | tokens/s | train loss (last 10% of logged steps) "
             f"| validation loss (step {base['val_step']}) | vs {baseline} |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["val_step"] != base["val_step"]:
            raise SystemExit(f"plot_losses: {r['label']!r} was validated last at step {r['val_step']}, "
                             f"{baseline!r} at {base['val_step']}: compare runs of the same length")
        gap = "" if r is base else f"{100 * (r['val_loss'] - base['val_loss']) / base['val_loss']:+.2f}%"
        lines.append(f"| {r['label']} | {r['state_bytes']:.3f} | {r['peak_gib']:.2f} | {r['tps']:,.0f} "
                     f"| {r['train_loss']:.4f} | {r['val_loss']:.4f} | {gap} |")
    return "\n".join(lines) + "\n"


def curves(rows: list[dict], val_from: int = 0) -> list[tuple[str, dict[str, dict[int, float]]]]:
    """The panels to draw: (y label, {run label: {step: loss}}), the training losses and,
    when the runs validated more than once, their validation losses from step
    ``val_from`` on. Exits when that leaves no validation point of some run to draw."""
    panels = [("training loss", {r["label"]: r["losses"] for r in rows})]
    if any(len(r["validation"]) > 1 for r in rows):
        validation = {r["label"]: {s: v for s, v in r["validation"].items() if s >= val_from}
                      for r in rows}
        if empty := [label for label, points in validation.items() if not points]:
            raise SystemExit(f"plot_losses: --val-from {val_from}: {empty} validated last before "
                             "that step; give a step at or before a run's last validation")
        panels.append((f"validation loss (from step {val_from})" if val_from else "validation loss",
                       validation))
    return panels


def plot(rows: list[dict], png: Path, title: str, val_from: int = 0) -> None:
    panels = curves(rows, val_from)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot_losses: --png needs matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5), squeeze=False)
    for ax, (what, runs) in zip(axes[0], panels):
        for label, points in runs.items():
            steps = sorted(points)
            ax.plot(steps, [points[s] for s in steps], label=label, linewidth=1.2,
                    marker="o" if what.startswith("validation") else None, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=LOG")
    parser.add_argument("--baseline", help="the run the gaps are measured against (default: the first)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="logged steps left out of the tokens/s median (default 2)")
    parser.add_argument("--png", type=Path, help="write the training-loss curves here")
    parser.add_argument("--title", default="", help="the figure's title")
    parser.add_argument("--val-from", type=int, default=0,
                        help="draw the validation curves from this step on (default: all)")
    args = parser.parse_args(argv)
    rows = []
    for run in args.runs:
        label, sep, log = run.partition("=")
        if not sep or not label or not log:
            parser.error(f"{run!r}: give each run as LABEL=LOG")
        if not Path(log).is_file():
            parser.error(f"{run!r}: no file {log}")
        rows.append(read_run(label, Path(log).read_text(errors="replace"), args.warmup))
    if args.val_from and not args.png:
        parser.error("--val-from draws the validation curves of --png; give --png too")
    baseline = args.baseline or rows[0]["label"]
    if baseline not in [r["label"] for r in rows]:
        parser.error(f"--baseline {baseline!r} is none of the runs' labels: {[r['label'] for r in rows]}")
    print(table(rows, baseline), end="")
    if args.png:
        plot(rows, args.png, args.title, args.val_from)
    return 0


if __name__ == "__main__":
    sys.exit(main())
