#!/usr/bin/env python3
"""Convergence of every optimizer state format and BF16 weight-update mode.

Runs one short pretraining per variant through ``scripts/train.sh`` (the real torchtitan
Trainer; llama3 debug model by default, on the offline corpus), with the same seed and
data order for all, at a normal learning rate and at lr 1e-5 (where BF16 weights with
round-to-nearest stall), and writes, into ``--out``:

- ``convergence_debug.md``: final train loss (mean of the last 10% of steps) and
  validation loss per variant, with the gap to fp32 AdamW and the command line;
- ``convergence_debug.json``: every run's final figures;
- ``convergence_debug.png``: the training-loss curves (needs matplotlib).

Its own files only: ``docs/convergence.md`` (written by hand) explains these tables and
links to them.

Usage: ``python scripts/convergence.py [--steps 300] [--lrs 3e-3,1e-5] [--seeds 0,1,2]
[--jobs 4] [--out docs]``. ``--seeds`` repeats every run with each model seed
(``debug.seed``; the data order stays) and reports each seed's gap and their mean;
``--jobs`` runs that many variants at once (the debug model leaves a GPU mostly idle).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from run_logs import final_train_loss, step_losses, validation_losses  # scripts/run_logs.py, beside this file

ROOT = Path(__file__).resolve().parents[1]
# The report's file names in --out: REPORT.md, REPORT.json, REPORT.png.
REPORT = "convergence_debug"
# (label, optimizer name, [lowbit] weight_dtype, [lowbit] weight_update)
VARIANTS = [
    ("fp32 AdamW (torch)", "AdamW", "auto", "nearest"),
    ("AdamW8bit", "AdamW8bit", "auto", "nearest"),
    ("AdamW4bit", "AdamW4bit", "auto", "nearest"),
    ("AdamWFp8", "AdamWFp8", "auto", "nearest"),
    ("bf16 weights, nearest (torch AdamW)", "AdamW", "bfloat16", "nearest"),
    ("bf16 weights, stochastic", "AdamW", "bfloat16", "stochastic"),
    ("bf16 weights, kahan", "AdamW", "bfloat16", "kahan"),
    ("bf16 weights, master", "AdamW", "bfloat16", "master"),
    ("AdamW8bit + bf16 stochastic", "AdamW8bit", "bfloat16", "stochastic"),
]


def run_variant(config: Path, name: str, dtype: str, update: str, lr: float, steps: int,
                extra: list[str], dump: Path, seed: int | None = None) -> dict:
    seed_args = [] if seed is None else ["--debug.seed", str(seed)]
    cmd = ["bash", str(ROOT / "scripts" / "train.sh"), str(config),
           "--metrics.disable_color_printing", "--metrics.log_freq", "1",
           "--optimizer.name", name, "--optimizer.lr", repr(lr),
           "--lowbit.weight_dtype", dtype, "--lowbit.weight_update", update,
           "--training.steps", str(steps), "--lr_scheduler.warmup_steps", str(max(steps // 20, 1)),
           "--validation.freq", str(steps), "--validation.steps", "20",
           "--job.dump_folder", str(dump), *seed_args, *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "train.log").write_text(out)
    if proc.returncode != 0:
        raise SystemExit(f"variant {name}/{dtype}/{update} at lr {lr} failed:\n{out[-5000:]}")
    return {**parse_run(out, steps, f"{name}/{dtype}/{update}"), "seconds": elapsed}


def parse_run(out: str, steps: int, what: str) -> dict:
    """Training curve, final train loss (mean of the last 10% of steps) and final
    validation loss from one run's torchtitan output."""
    train = {s: float(l) for s, l in step_losses(out).items()}
    val = [loss for _, loss in sorted(validation_losses(out).items())]
    if len(train) != steps or not val:
        raise SystemExit(f"variant {what}: could not read losses:\n{out[-3000:]}")
    return {"train": train, "final_train": final_train_loss(train), "final_val": val[-1]}


# Results are keyed (lr, variant label, seed); seed None: the config's own debug.seed.

def _key_str(lr: float, label: str, seed: int | None) -> str:
    return f"{lr:g}|{label}" + ("" if seed is None else f"|{seed}")


def _parse_key(key: str) -> tuple[float, str, int | None]:
    lr, rest = key.split("|", 1)
    label, _, seed = rest.partition("|")
    return float(lr), label, (int(seed) if seed else None)


def run_dir_name(lr: float, seed: int | None, name: str, dtype: str, update: str) -> str:
    return f"{lr:g}-" + ("" if seed is None else f"seed{seed}-") + f"{name}-{dtype}-{update}"


def load_saved(json_files: list[Path], dumps: list[Path], steps: int) -> dict:
    """Results of earlier invocations: their convergence_runs.json files and the
    train.log files under their --dump folders (named as ``run_dir_name`` names them)."""
    labels = {(name, dtype, update): label for label, name, dtype, update in VARIANTS}
    results = {}
    for path in json_files:
        for key, r in json.loads(path.read_text()).items():
            results[_parse_key(key)] = {**r, "train": {int(k): v for k, v in r["train"].items()}}
    for dump in dumps:
        for log in sorted(dump.glob("*/train.log")):
            lr, seed, name, dtype, update = _split_run_dir(log.parent.name)
            results[(float(lr), labels[(name, dtype, update)], seed)] = parse_run(
                log.read_text(), steps, log.parent.name)
    return results


def _split_run_dir(dirname: str) -> tuple[str, int | None, str, str, str]:
    """'1e-05-AdamW-bfloat16-kahan' -> ('1e-05', None, 'AdamW', 'bfloat16', 'kahan') and
    '0.003-seed1-AdamW8bit-auto-nearest' -> ('0.003', 1, ...): the lr itself may contain
    a '-'."""
    head, name, dtype, update = dirname.rsplit("-", 3)
    match = re.fullmatch(r"(.*)-seed(\d+)", head)
    if match:
        return match.group(1), int(match.group(2)), name, dtype, update
    return head, None, name, dtype, update


def write_report(results: dict, lrs: list[float], steps: int, argv: list[str], out: Path,
                 ran_here: bool) -> None:
    """``ran_here``: the runs ran in this invocation, so this machine's device and versions
    are theirs; a report of earlier runs (``--from-json``, ``--from-dump``) names none, as
    the saved runs do not record where they ran."""
    where = (f"Measured {datetime.date.today()} with `python scripts/convergence.py {' '.join(argv)}`"
             f"\n({env_versions()}). ") if ran_here else (
        f"Reported {datetime.date.today()} from earlier runs with "
        f"`python scripts/convergence.py {' '.join(argv)}` (the runs' device and versions are "
        "not in their saved results). ")
    lines = [
        "# Convergence of the llama3 debug model: state formats and BF16 weight updates", "",
        where + "Each row is one run of "
        f"`scripts/train.sh` ({steps} steps, same seed and data order); final train loss is the "
        "mean of the last 10% of steps, validation loss is on the held-out split at the end. "
        "What the runs were and what they show: [convergence.md](convergence.md).", "",
    ]
    for lr in lrs:
        seeds = sorted({seed for r_lr, _, seed in results if r_lr == lr},
                       key=lambda s: -1 if s is None else s)
        lines += [f"## lr {lr:g}", ""]
        if len(seeds) > 1:
            lines += [f"Seeds {', '.join('config' if s is None else str(s) for s in seeds)}: "
                      "train and validation loss are the means over the seeds; the gaps are "
                      "each seed's validation loss against fp32 AdamW's with the same seed.", ""]
        lines += ["| variant | final train loss | validation loss | validation vs fp32 AdamW |"
                  + (" per seed |" if len(seeds) > 1 else ""),
                  "| --- | --- | --- | --- |" + (" --- |" if len(seeds) > 1 else "")]
        for label, *_ in VARIANTS:
            runs = [(results.get((lr, label, s)), results.get((lr, VARIANTS[0][0], s)))
                    for s in seeds]
            runs = [(r, ref) for r, ref in runs if r is not None and ref is not None]
            if not runs:
                lines.append(f"| {label} | not measured | not measured | |"
                             + (" |" if len(seeds) > 1 else ""))
                continue
            gaps = [100 * (r["final_val"] - ref["final_val"]) / ref["final_val"] for r, ref in runs]
            train = sum(r["final_train"] for r, _ in runs) / len(runs)
            val = sum(r["final_val"] for r, _ in runs) / len(runs)
            row = f"| {label} | {train:.4f} | {val:.4f} | {sum(gaps) / len(gaps):+.2f}% |"
            if len(seeds) > 1:
                row += " " + ", ".join(f"{g:+.2f}%" for g in gaps) + " |"
            lines.append(row)
        lines.append("")
    lines.append(f"![training loss curves]({REPORT}.png)")
    (out / f"{REPORT}.md").write_text("\n".join(lines) + "\n")
    (out / f"{REPORT}.json").write_text(json.dumps(
        {_key_str(*key): {k: v for k, v in r.items() if k != "train"}
         for key, r in results.items()}, indent=2) + "\n")


def plot(results: dict, lrs: list[float], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("convergence.py: the PNG needs matplotlib: pip install -e '.[bench]' "
                         f"(the table is written to {out / f'{REPORT}.md'})") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lrs), figsize=(7 * len(lrs), 5), squeeze=False)
    first_seed = min((seed for _, _, seed in results), key=lambda s: -1 if s is None else s)
    for ax, lr in zip(axes[0], lrs):
        for label, *_ in VARIANTS:
            if (lr, label, first_seed) not in results:
                continue
            train = results[(lr, label, first_seed)]["train"]
            steps = sorted(train)
            k = max(len(steps) // 50, 1)  # light smoothing: running mean over k steps
            ys = [sum(train[t] for t in steps[max(0, i - k + 1): i + 1]) / min(i + 1, k)
                  for i in range(len(steps))]
            ax.plot(steps, ys, label=label, linewidth=1)
        seed = "" if first_seed is None else f", seed {first_seed}"
        ax.set_title(f"llama3 debug model, lr {lr:g}{seed}")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{REPORT}.png", dpi=110)


def env_versions() -> str:
    import torch

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return f"{dev}, torch {torch.__version__}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "train_configs" / "llama3_debug.toml")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lrs", default="3e-3,1e-5")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--dump", type=Path, default=ROOT / "outputs" / "convergence")
    parser.add_argument("--from-json", type=Path, nargs="*", default=[],
                        help="report earlier runs from their convergence_runs.json instead of running")
    parser.add_argument("--from-dump", type=Path, nargs="*", default=[],
                        help="report earlier runs from the train.log files under their --dump folder")
    parser.add_argument("--only", nargs="*", default=[],
                        help="run only the variants whose label contains one of these strings "
                             "(the fp32 AdamW baseline always runs)")
    parser.add_argument("--seeds", default="",
                        help="comma-separated model seeds (debug.seed) to repeat every run with "
                             "(default: the config's seed)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once (each is its own torchrun; default 1)")
    parser.add_argument("extra", nargs="*", help="torchtitan overrides for every run (after --)")
    args = parser.parse_args(argv)
    lrs = [float(x) for x in args.lrs.split(",")]
    variants = [v for i, v in enumerate(VARIANTS)
                if i == 0 or not args.only or any(o in v[0] for o in args.only)]
    if args.only and len(variants) == 1:
        parser.error(f"--only {args.only} matches no variant; labels: {[v[0] for v in VARIANTS]}")
    if args.from_json or args.from_dump:
        results = load_saved(args.from_json, args.from_dump, args.steps)
        lrs = sorted({lr for lr, _, _ in results}, reverse=True)
        args.out.mkdir(parents=True, exist_ok=True)
        write_report(results, lrs, args.steps, argv, args.out, ran_here=False)
        plot(results, lrs, args.out)
        print((args.out / f"{REPORT}.md").read_text())
        return 0
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give at least 1")
    try:
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 0,1,2")
    runs = [(lr, seed, v) for lr in lrs for seed in seeds for v in variants]
    # The offline dataset once, before the runs: train.sh prepares it when missing, and
    # several runs starting at once would each write it.
    subprocess.run([sys.executable, "-m", "titan_lowbit.prepare_data", "--if-missing"],
                   cwd=ROOT, check=True)
    results = {}
    args.out.mkdir(parents=True, exist_ok=True)

    def one(run):
        lr, seed, (label, name, dtype, update) = run
        r = run_variant(args.config, name, dtype, update, lr, args.steps, args.extra,
                        args.dump / run_dir_name(lr, seed, name, dtype, update), seed)
        return (lr, label, seed), r

    # Results are printed and saved in run order, each as soon as it and those before it are done.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for (lr, label, seed), r in pool.map(one, runs):
            results[(lr, label, seed)] = r
            print(f"lr {lr:g} seed {seed} {label:40s} train {r['final_train']:.4f} "
                  f"val {r['final_val']:.4f} ({r['seconds']:.0f} s)", flush=True)
            (args.out / "convergence_runs.json").write_text(json.dumps(
                {_key_str(*k): v for k, v in results.items()}) + "\n")
    write_report(results, lrs, args.steps, argv, args.out, ran_here=True)
    plot(results, lrs, args.out)
    print((args.out / f"{REPORT}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
