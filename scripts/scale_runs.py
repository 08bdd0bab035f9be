#!/usr/bin/env python3
"""Peak memory and tokens/s of optimizer variants at scale, one short torchtitan run each.

Each variant runs ``scripts/train.sh CONFIG`` for ``--steps`` steps on ``--ngpu`` GPUs
(the first ones visible; with no GPU, that many gloo CPU processes) with FSDP2 over
``ngpu / tp`` and TP over ``--tp``, one after another. From each run's log it takes the
median tokens/s per GPU of the steps after ``--warmup``, the peak reserved memory over
every step and rank, and the last loss, and writes a markdown table (``--out``, rewritten
after every run, with a ``.json`` beside it) with the ratio to the fp32 AdamW run of the
same mesh. A variant that fails or runs past ``--timeout`` is recorded with the last
lines of its log, and the next one starts.

Multi-GPU tokens/s varies from run to run by more than the optimizers differ (on a 4-GPU
2-D mesh the same fp32 run measured 5,750 and 4,096 tokens/s per GPU within minutes,
the spread in NCCL's all-gather and reduce-scatter time), so ``--rounds R`` runs the whole
variant list R times, in alternating order (forward, then backward, ...), and reports
each variant's median over its rounds beside every round's figure.

    python scripts/scale_runs.py --ngpu 2 --out docs/scale_8b_2gpu.md          # llama3 8B
    python scripts/scale_runs.py --ngpu 4 --tp 2 --variants fp32,8bit --rounds 3
    python scripts/scale_runs.py --config train_configs/llama3_debug.toml --steps 4  # CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

from runs import ROOT, Budget, gpu_count, launch, versions  # scripts/runs.py, beside this file
from run_logs import merge_rounds, parse_log, scale_table, summarize  # scripts/run_logs.py

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# name: (optimizer, [lowbit] weight_dtype, weight_update, converters or None = config's)
VARIANTS = {
    "fp32": ("AdamW", "auto", "nearest", None),
    "8bit": ("AdamW8bit", "auto", "nearest", None),
    "4bit_bf16_sr": ("AdamW4bit", "bfloat16", "stochastic", None),
    "bitnet_8bit": ("AdamW8bit", "auto", "nearest", "bitnet"),
}


def variant_overrides(name: str) -> list[str]:
    optimizer, dtype, update, converters = VARIANTS[name]
    args = ["--optimizer.name", optimizer, "--lowbit.weight_dtype", dtype,
            "--lowbit.weight_update", update]
    return args + (["--model.converters", converters] if converters else [])


def describe(name: str, config: dict) -> dict[str, str]:
    optimizer, dtype, update, converters = VARIANTS[name]
    precision = config.get("training", {}).get("mixed_precision_param", "bfloat16")
    weights = ("fp32" if dtype == "auto" else dtype.replace("bfloat16", "bf16"))
    weights += f", {update} update" if dtype == "bfloat16" else f" (compute {precision})"
    if converters is None:
        converters = ",".join(config.get("model", {}).get("converters", [])) or "none"
    return {"optimizer": optimizer, "weights": weights, "converters": converters}


def run_variant(name: str, tag: str, args, extra: list[str], gpus: int, budget: Budget) -> dict:
    """One run of one variant: its figures, or why it has none."""
    timeout = budget.timeout(args.timeout)
    if timeout is None:
        return {"failure": "not run: --budget spent"}
    overrides = [
        "--training.steps", str(args.steps), "--metrics.log_freq", "1",
        "--validation.no-enable", "--checkpoint.no-enable",
        "--parallelism.data_parallel_shard_degree", str(args.ngpu // args.tp),
        "--parallelism.tensor_parallel_degree", str(args.tp),
        "--job.dump_folder", str(args.logdir / tag), *variant_overrides(name), *extra,
    ]
    run = launch(args.config, overrides, args.ngpu, gpus, args.logdir / f"{tag}.log", timeout)
    figures = summarize(parse_log(run.text()), args.warmup)
    row = {"seconds": round(run.seconds, 1)}
    if run.rc == 0 and figures and figures["last_step"] == args.steps:
        row.update(figures)
    else:
        why = "timed out" if run.rc is None else f"exit {run.rc}"
        row["failure"] = f"{why} after {run.seconds:.0f} s: {run.tail(6)}"
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "train_configs" / "llama3_8b.toml")
    p.add_argument("--ngpu", type=int, default=2, help="processes: GPUs, or CPU processes")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_degree (FSDP2 over ngpu/tp)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of tokens/s")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--extra", action="append", default=[],
                   help="torchtitan overrides for every run, one shell-quoted string")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs per variant, the variant order alternating between rounds")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all runs; later runs get what is left")
    p.add_argument("--logdir", type=Path, default=ROOT / "outputs" / "scale_runs")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown table (default LOGDIR/scale.md)")
    args = p.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in names if v not in VARIANTS]:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds} must be at least 1")
    if args.ngpu % args.tp:
        p.error(f"--ngpu {args.ngpu} is not a multiple of --tp {args.tp}")
    out = args.out or args.logdir / "scale.md"
    config = tomllib.loads(args.config.read_text())
    extra = [a for s in args.extra for a in shlex.split(s)]
    gpus, budget = gpu_count(), Budget(args.budget)
    mesh = f"dp_shard {args.ngpu // args.tp} x tp {args.tp}"
    header = [
        f"# Scale runs: {args.config.name}, {mesh}", "",
        f"Measured {datetime.date.today()} with `python scripts/scale_runs.py "
        f"{shlex.join(argv)}` ({versions()}). Each row is "
        + (f"{args.rounds} runs" if args.rounds > 1 else "one run")
        + f" of `scripts/train.sh` for {args.steps} steps; tokens/s per GPU is the median "
        f"of steps {args.warmup + 1}-{args.steps} (torchtitan's tps)"
        + (", then the median over the rounds, which ran the variants in alternating "
           "order (each round's figure in brackets, in round order)" if args.rounds > 1 else "")
        + "; peak memory is torchtitan's max reserved memory over every step, rank and run.",
    ]
    bases = {name: {"ngpu": args.ngpu, "mesh": mesh, **describe(name, config)} for name in names}
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for k in range(args.rounds):
        for name in (names if k % 2 == 0 else names[::-1]):
            tag = name if args.rounds == 1 else f"{name}.r{k + 1}"
            runs[name].append(run_variant(name, tag, args, extra, gpus, budget))
            row = runs[name][-1]
            status = (f"{row['tps']:,.0f} tok/s/GPU, {row['peak_gib']:.2f} GiB" if row.get("tps")
                      else row["failure"].splitlines()[0])
            print(f"scale_runs: {tag}: {status} ({row.get('seconds', 0):.0f} s)", flush=True)
            rows = [merge_rounds(n, runs[n], bases[n]) for n in names if runs[n]]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(scale_table(rows, header))
            out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(out.read_text())
    return 0 if all(r.get("tps") for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
