#!/usr/bin/env python3
"""What converting a run's optimizer states at a resume costs: the converted run's losses
against the same checkpoint resumed unconverted, over ``--after`` steps.

Runs of ``scripts/train.sh CONFIG`` (default: the llama3 debug model), all with the LR
schedule of ``--save-step + --after`` steps, so that every run follows one schedule:

1. ``AdamW``: torch's AdamW (fp32 states and weights) to step ``--save-step`` N, saving
   a full checkpoint there; then that checkpoint resumed up to N + ``--after``
   unconverted (``AdamW, resumed``) and, with ``[lowbit] convert_optimizer_states``, as
   ``AdamW8bit`` and as ``AdamW8bit`` with bf16 weights and ``master_remainder`` (the
   fp32 weights become the masters);
2. ``AdamW8bit`` likewise to step N, resumed unconverted and converted into
   ``AdamW4bit``;
3. ``AdamW4bit`` from step 0, without a checkpoint.

A conversion quantizes each moment once in the new format, so a converted run's loss at
N + 1 (computed with the checkpoint's weights, before the first step with converted
states) is the unconverted run's, and the two part from N + 2 on: first by the
conversion's rounding, then as the new format's steps round otherwise than the old
format's. The report puts each converted run beside its unconverted run, and the
formats' own distance beside it, measured without any conversion: AdamW8bit from step 0
(its steps to N, then resumed) against torch's AdamW, and AdamW4bit from step 0 against
AdamW8bit, over the same steps N + 1 .. N + ``--after``. A conversion that lost state
would jump well above those.

    python scripts/conversion_runs.py       # the debug model: GPUs where there are, else CPU
    python scripts/conversion_runs.py --nproc 1 --save-step 4 --after 20 --out conversion.md

The report (``--out``, markdown, a ``.json`` with every run's losses beside it) is
rewritten after each run. A run that fails is run once more (on CPU, gloo's teardown
now and then aborts a rank at exit after the run finished).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from runs import ROOT, Budget, gpu_count, launch, resume_dump, versions  # scripts/runs.py, beside this file
from run_logs import parse_log, summarize  # scripts/run_logs.py, beside this file

BF16_MASTER_REMAINDER = ["--lowbit.weight_dtype", "bfloat16", "--lowbit.weight_update", "master_remainder"]


@dataclass
class Plan:
    """One run: its name, the [optimizer] / [lowbit] overrides, and the run whose step-N
    checkpoint it resumes (None: from step 0), converted or not."""

    name: str
    settings: list[str]
    source: str | None = None
    convert: bool = False
    to_step_n: bool = False  # stops at step N, saving a checkpoint there
    label: str = field(default="")


PLANS = [
    Plan("adamw", ["--optimizer.name", "AdamW"], to_step_n=True),
    Plan("adamw_resumed", ["--optimizer.name", "AdamW"], "adamw", label="torch AdamW, resumed"),
    Plan("adamw_to_8bit", ["--optimizer.name", "AdamW8bit"], "adamw", True,
         label="torch AdamW -> AdamW8bit, converted"),
    Plan("adamw_to_8bit_bf16", ["--optimizer.name", "AdamW8bit", *BF16_MASTER_REMAINDER], "adamw", True,
         label="torch AdamW -> AdamW8bit, bf16 weights + master_remainder, converted"),
    Plan("8bit", ["--optimizer.name", "AdamW8bit"], to_step_n=True),
    Plan("8bit_resumed", ["--optimizer.name", "AdamW8bit"], "8bit", label="AdamW8bit, resumed"),
    Plan("8bit_to_4bit", ["--optimizer.name", "AdamW4bit"], "8bit", True,
         label="AdamW8bit -> AdamW4bit, converted"),
    Plan("4bit", ["--optimizer.name", "AdamW4bit"], label="AdamW4bit from step 0"),
]
# (run, the run it is compared with, what the comparison shows)
COMPARISONS = [
    ("adamw_resumed", "adamw_resumed", "reference"),
    ("adamw_to_8bit", "adamw_resumed", "conversion"),
    ("adamw_to_8bit_bf16", "adamw_resumed", "conversion"),
    ("8bit_resumed", "adamw_resumed", "format"),
    ("8bit_resumed", "8bit_resumed", "reference"),
    ("8bit_to_4bit", "8bit_resumed", "conversion"),
    ("4bit", "8bit_resumed", "format"),
]


def losses_of(results: dict, name: str) -> dict[int, float]:
    return {int(s): l for s, l in results.get(name, {}).get("losses", {}).items()}


def compare(run: dict[int, float], ref: dict[int, float], steps: range) -> dict | None:
    """Mean and max |loss difference| of ``run`` against ``ref`` over ``steps`` (None
    unless both logged every one of them)."""
    if not all(s in run and s in ref for s in steps):
        return None
    diffs = [abs(run[s] - ref[s]) for s in steps]
    return {"mean": statistics.fmean(diffs), "max": max(diffs)}


def report(results: dict, args, argv: list[str], place: str) -> str:
    n, end = args.save_step, args.save_step + args.after
    after = range(n + 1, end + 1)
    shown = list(dict.fromkeys(s for s in (n + 1, n + 2, n + 10, end) if n < s <= end))
    label = {p.name: p.label for p in PLANS}
    label["8bit_resumed_format"] = "AdamW8bit from step 0 (to N, resumed)"
    lines = [
        "# Converting optimizer states at a resume", "",
        f"Measured {datetime.date.today()} with `python scripts/conversion_runs.py {shlex.join(argv)}` "
        f"({versions()}; {place}): {args.config.name}, checkpoint at step N = {n}, "
        f"{args.after} steps after it, one LR schedule of {end} steps.", "",
        "| run | compared with | " + " | ".join(f"loss at {s}" for s in shown)
        + f" | \\|loss difference\\| at {n + 2} | mean \\|loss difference\\|, steps "
        f"{after.start}-{after.stop - 1} | max |",
        "| --- | --- |" + " --- |" * (len(shown) + 3),
    ]

    def fmt(x, digits=5):
        return "n/a" if x is None else f"{x:.{digits}f}"

    for run, ref, kind in COMPARISONS:
        got, base = losses_of(results, run), losses_of(results, ref)
        name = label["8bit_resumed_format"] if (run, kind) == ("8bit_resumed", "format") else label[run]
        cells = [fmt(got.get(s)) for s in shown]
        if kind == "reference":
            lines.append(f"| {name} | | " + " | ".join(cells) + " | | | |")
            continue
        gap, jump = compare(got, base, after), compare(got, base, range(n + 2, n + 3))
        lines.append(f"| {name} | {label[ref]} | " + " | ".join(cells)
                     + f" | {fmt(jump and jump['max'])} | {fmt(gap and gap['mean'])} | {fmt(gap and gap['max'])} |")
    for name, r in results.items():
        if "failure" in r:
            tail = r["failure"].replace("\n", "\n    ")
            lines += ["", f"Run `{name}` failed:", "", f"    {tail}"]
    return "\n".join(lines) + "\n"


def run_plan(plan: Plan, args, common: list[str], gpus: int, logdir: Path,
             timeout: float) -> tuple[bool, dict]:
    """Run ``plan`` in a fresh dump folder (a resumed one holds only the link to its
    source's step-N checkpoint); (whether it trained every step it should and converted
    exactly when asked, its figures)."""
    end = args.save_step + args.after
    dump = logdir / plan.name
    if plan.source is None:
        shutil.rmtree(dump, ignore_errors=True)
        steps = args.save_step if plan.to_step_n else end
        ckpt = ["--checkpoint.interval", str(args.save_step)] if plan.to_step_n else ["--checkpoint.no-enable"]
    else:
        resume_dump(dump, logdir / plan.source, args.save_step)
        steps = end
        ckpt = ["--checkpoint.load_only"] + (["--lowbit.convert_optimizer_states"] if plan.convert else [])
    run = launch(args.config, [*common, *plan.settings, *ckpt, "--training.steps", str(steps),
                               "--job.dump_folder", str(dump)],
                 args.nproc, gpus, logdir / f"{plan.name}.log", timeout)
    figures = summarize(parse_log(run.text()), warmup=0) or {}
    first = args.save_step + 1 if plan.source else 1
    converted = sum("optimizer states converted" in line for line in run.text().splitlines())
    ok = (run.rc == 0 and figures.get("last_step") == steps and min(figures["losses"]) == first
          and (converted > 0) == plan.convert)
    figures = figures if ok else {
        **figures, "failure": ("timed out" if run.rc is None else f"exit {run.rc}")
        + f" after {run.seconds:.0f} s (steps {sorted(figures.get('losses', {}))}, "
        + f"{converted} conversion log lines): " + run.tail(8)}
    return ok, {**figures, "seconds": round(run.seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "train_configs" / "llama3_debug.toml")
    p.add_argument("--save-step", type=int, default=10, help="N: the step of the checkpoint")
    p.add_argument("--after", type=int, default=100, help="steps trained after the checkpoint")
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs where there are, else gloo CPU)")
    p.add_argument("--extra", action="append", default=[],
                   help="torchtitan overrides for every run, one shell-quoted string")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all runs; later runs get what is left")
    p.add_argument("--logdir", type=Path, default=ROOT / "outputs" / "conversion_runs",
                   help="logs and the runs' dump folders")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="markdown (default LOGDIR/conversion.md)")
    args = p.parse_args(argv)
    if args.save_step < 1 or args.after < 2:
        p.error("--save-step must be at least 1 and --after at least 2")
    out = args.out or args.logdir / "conversion.md"
    end = args.save_step + args.after
    extra = [a for s in args.extra for a in shlex.split(s)]
    common = ["--lr_scheduler.total_steps", str(end), "--metrics.log_freq", "1",
              "--validation.no-enable", "--checkpoint.enable", "--checkpoint.no_last_save_model_only",
              *extra]
    gpus, budget = gpu_count(), Budget(args.budget)
    place = f"{args.nproc} {'GPUs' if gpus else 'gloo CPU processes'}, FSDP2"
    logdir = args.logdir.resolve()
    results: dict[str, dict] = {}
    for plan in PLANS:
        if plan.source is not None and "failure" in results[plan.source]:
            results[plan.name] = {"failure": f"not run: run {plan.source} failed"}
            continue
        for attempt in (1, 2):  # gloo's teardown (CPU) now and then aborts a rank at exit
            timeout = budget.timeout(args.timeout)
            if timeout is None:
                results[plan.name] = {"failure": "not run: --budget spent"}
                break
            ok, results[plan.name] = run_plan(plan, args, common, gpus, logdir, timeout)
            print(f"conversion_runs: {plan.name}: {'ok' if ok else 'FAILED'} "
                  f"({results[plan.name]['seconds']:.0f} s)", flush=True)
            if ok:
                break
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report(results, args, argv, place))
        out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    if not args.keep_checkpoints:
        for plan in PLANS:
            shutil.rmtree(logdir / plan.name / "checkpoint", ignore_errors=True)
    print(out.read_text())
    return 0 if all("failure" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
