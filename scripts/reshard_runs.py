#!/usr/bin/env python3
"""Resume a checkpoint on another mesh and compare the losses with uninterrupted runs.

Four runs of ``scripts/train.sh CONFIG`` (default: llama3 1B, AdamW8bit, compile off):

1. ``2d``: ``--big`` processes on a 2-D mesh (FSDP2 over big/tp x TP over ``--tp``),
   ``--steps`` steps, checkpoint at ``--save-step``;
2. ``fsdp``: ``--small`` processes, FSDP2 only, the same steps and checkpoint;
3. ``2d->fsdp``: run 1's checkpoint resumed on the FSDP2 mesh up to ``--steps``;
4. ``fsdp->2d``: run 2's checkpoint resumed on the 2-D mesh up to ``--steps``.

Both meshes have the same data-parallel degree by default (4 GPUs as 2 x 2, and 2 GPUs),
so every run sees the same batches and a resumed run also restores the data loader.
Losses of the two uninterrupted runs still differ (the initial weights may be drawn
differently on another mesh, and reductions run in another order); a resumed run
starts from the weights of the run it came from, so it should track that run closely
and differ from it only by the new mesh's reduction order. The report (``--out``,
markdown, with a ``.json`` beside it) lists the per-step losses side by side and, for
each resumed run, the largest |difference| after the resume against the run it came
from and against the uninterrupted run on its own mesh, next to the difference between
the two uninterrupted runs (the noise floor between meshes): a resumed run that lost
state would jump well above it.

    python scripts/reshard_runs.py --out docs/reshard_1b.md                  # 4 GPUs
    python scripts/reshard_runs.py --config train_configs/llama3_debug.toml \\
        --steps 4 --save-step 2                                              # CPU, gloo
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import sys
from pathlib import Path

from runs import ROOT, Budget, gpu_count, launch, resume_dump, versions  # scripts/runs.py, beside this file
from run_logs import parse_log, summarize  # scripts/run_logs.py, beside this file


def mesh_args(nproc: int, tp: int) -> list[str]:
    return ["--parallelism.data_parallel_shard_degree", str(nproc // tp),
            "--parallelism.tensor_parallel_degree", str(tp)]


def report(results: dict, args, argv: list[str], big: str, small: str) -> str:
    losses = {name: {int(s): l for s, l in r.get("losses", {}).items()}
              for name, r in results.items()}
    names = ["2d", "fsdp", "2d->fsdp", "fsdp->2d"]
    label = {"2d": f"2-D ({big})", "fsdp": f"FSDP ({small})",
             "2d->fsdp": "2-D -> FSDP, resumed", "fsdp->2d": "FSDP -> 2-D, resumed"}
    lines = [
        f"# Resharding a checkpoint between {big} and {small}", "",
        f"Measured {datetime.date.today()} with `python scripts/reshard_runs.py "
        f"{shlex.join(argv)}` ({versions()}): {args.config.name}, optimizer "
        f"{args.optimizer}, {args.steps} steps, checkpoint at step {args.save_step}.", "",
        "| step | " + " | ".join(label[n] for n in names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for step in range(1, args.steps + 1):
        cells = [f"{losses[n][step]:.4f}" if step in losses.get(n, {}) else "" for n in names]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")

    def gap(a: str, b: str, steps) -> float | None:
        both = [s for s in steps if s in losses.get(a, {}) and s in losses.get(b, {})]
        return max((abs(losses[a][s] - losses[b][s]) for s in both), default=None)

    def fmt(x):
        return "n/a" if x is None else f"{x:.4f}"

    before = range(1, args.save_step + 1)
    after = range(args.save_step + 1, args.steps + 1)
    lines += [
        "",
        f"Noise floor between the meshes (same data; initial draw and reduction order "
        f"differ): max |2-D - FSDP| over steps 1-{args.save_step}: "
        f"{fmt(gap('2d', 'fsdp', before))}; over steps {after.start}-{after.stop - 1}: "
        f"{fmt(gap('2d', 'fsdp', after))}.", "",
        f"| resumed run | max abs diff, steps {after.start}-{after.stop - 1}: vs the run it "
        "came from | vs the uninterrupted run on its own mesh | first step after the resume |",
        "| --- | --- | --- | --- |",
    ]
    for resumed, source, own in (("2d->fsdp", "2d", "fsdp"), ("fsdp->2d", "fsdp", "2d")):
        first = min(losses.get(resumed, {}), default="none")
        lines.append(f"| {label[resumed]} | {fmt(gap(resumed, source, after))} | "
                     f"{fmt(gap(resumed, own, after))} | {first} |")
    for name, r in results.items():
        if "failure" in r:
            tail = r["failure"].replace("\n", "\n    ")
            lines += ["", f"Run `{name}` failed:", "", f"    {tail}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "train_configs" / "llama3_1b.toml")
    p.add_argument("--optimizer", default="AdamW8bit")
    p.add_argument("--big", type=int, default=4, help="processes of the 2-D mesh")
    p.add_argument("--tp", type=int, default=2, help="tensor_parallel_degree of the 2-D mesh")
    p.add_argument("--small", type=int, default=2, help="processes of the FSDP2-only mesh")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-step", type=int, default=10)
    p.add_argument("--extra", action="append", default=[],
                   help="torchtitan overrides for every run, one shell-quoted string "
                        "(default adds --compile.no-enable --lr_scheduler.warmup_steps 5)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all runs; later runs get what is left")
    p.add_argument("--logdir", type=Path, default=ROOT / "outputs" / "reshard_runs",
                   help="logs (and, without --dumpdir, the runs' dump folders)")
    p.add_argument("--dumpdir", type=Path, default=None,
                   help="the runs' dump folders, with their checkpoints (default LOGDIR)")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="markdown (default LOGDIR/reshard.md)")
    args = p.parse_args(argv)
    if args.big % args.tp or not 0 < args.save_step < args.steps:
        p.error("--big must be a multiple of --tp, and 0 < --save-step < --steps")
    out = args.out or args.logdir / "reshard.md"
    extra = [a for s in (args.extra or ["--compile.no-enable --lr_scheduler.warmup_steps 5"])
             for a in shlex.split(s)]
    big, small = f"{args.big} processes, dp_shard {args.big // args.tp} x tp {args.tp}", \
        f"{args.small} processes, dp_shard {args.small}"
    common = ["--optimizer.name", args.optimizer, "--training.steps", str(args.steps),
              "--metrics.log_freq", "1", "--validation.no-enable", "--checkpoint.enable",
              "--checkpoint.last_save_model_only", *extra]
    if args.big // args.tp != args.small:
        # The data loader's per-rank position cannot follow another data-parallel degree.
        common += ["--checkpoint.exclude_from_loading", "dataloader"]
    gpus, budget = gpu_count(), Budget(args.budget)
    logdir = args.logdir.resolve()
    dumpdir = (args.dumpdir or args.logdir).resolve()
    plan = [  # name, processes, tp, source run of the checkpoint (None: train from scratch)
        ("2d", args.big, args.tp, None), ("fsdp", args.small, 1, None),
        ("2d->fsdp", args.small, 1, "2d"), ("fsdp->2d", args.big, args.tp, "fsdp"),
    ]
    results: dict[str, dict] = {}
    for name, nproc, tp, source in plan:
        dump = dumpdir / name.replace("->", "_to_")
        if source is None:
            shutil.rmtree(dump, ignore_errors=True)
            ckpt = ["--checkpoint.interval", str(args.save_step)]
        elif "failure" in results[source]:
            results[name] = {"failure": f"not run: run {source} failed"}
            continue
        else:
            resume_dump(dump, dumpdir / source.replace("->", "_to_"), args.save_step)
            ckpt = ["--checkpoint.load_only"]  # resume, save nothing
        timeout = budget.timeout(args.timeout)
        if timeout is None:
            results[name] = {"failure": "not run: --budget spent"}
            continue
        run = launch(args.config, [*common, *ckpt, *mesh_args(nproc, tp),
                                   "--job.dump_folder", str(dump)],
                     nproc, gpus, logdir / f"{dump.name}.log", timeout)
        figures = summarize(parse_log(run.text()), warmup=0) or {}
        first = args.save_step + 1 if source else 1
        ok = (run.rc == 0 and figures.get("last_step") == args.steps
              and min(figures["losses"]) == first)
        results[name] = figures if ok else {
            **figures, "failure": ("timed out" if run.rc is None else f"exit {run.rc}")
            + f" after {run.seconds:.0f} s (steps {sorted(figures.get('losses', {}))}): "
            + run.tail(8)}
        results[name]["seconds"] = round(run.seconds, 1)
        print(f"reshard_runs: {name}: {'ok' if ok else 'FAILED'} ({run.seconds:.0f} s)", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report(results, args, argv, big, small))
        out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    if not args.keep_checkpoints:
        for name, *_ in plan:
            shutil.rmtree(dumpdir / name.replace("->", "_to_") / "checkpoint", ignore_errors=True)
    print(out.read_text())
    return 0 if all("failure" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
