#!/usr/bin/env python3
"""A/B timing of versions of the fused AdamW kernel, alternating inside one process.

Host-to-host spread on the lent H100s is larger than most kernel changes (docs/optimizer.md),
so versions are compared on the same GPU, the same optimizer and the same parameters, in
alternating rounds. A version is ``NAME`` or ``NAME:OPTION=VALUE,...`` with options

- ``file=PATH``: an older copy of ``kernels/adamw_lowbit.py`` (e.g. ``git show
  REV:kernels/adamw_lowbit.py > /tmp/old.py``), whose launch (``FusedAdamW.launch`` and the
  kernel it calls) is swapped into the optimizer's launch plans;
- ``maxnreg=N``: a register cap for ptxas;
- ``tiles=N``: tiles each program steps (the plans' ``tiles_per_program``; files whose
  kernel steps one tile per program ignore it).

    python3 scripts/ab_kernel.py --version old:file=/tmp/old.py --version new \\
        --version t1:tiles=1 --version new64:maxnreg=64 --rounds 7 --only "8bit bfloat16 stochastic"

Prints the median ms per step of every version in every round, then each version's median
over rounds. Rows: LowBitAdamW on the TinyLlama-1.1B parameter set (bench_optimizer.py's),
``nonfinite_grad="ignore"`` (``--nonfinite raise``: the default policy, guarded kernels).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_optimizer import make_params, time_steps  # noqa: E402  (one parameter set, one timer)

CONFIGS = [  # (state format, weight dtype, weight update)
    ("8bit", "bfloat16", "stochastic"), ("4bit", "bfloat16", "stochastic"),
    ("8bit", "bfloat16", "nearest"), ("4bit", "bfloat16", "nearest"),
    ("8bit", "float32", "nearest"), ("4bit", "float32", "nearest"),
    ("fp8", "bfloat16", "stochastic"), ("8bit", "bfloat16", "kahan"),
    ("fp8", "float32", "nearest"), ("bf16", "bfloat16", "stochastic"), ("fp32", "float32", "nearest"),
]


class _Capped:
    """A jitted kernel launched with a ptxas register cap."""

    def __init__(self, kernel, maxnreg: int):
        self.kernel, self.maxnreg = kernel, maxnreg

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *a, **kw: launch(*a, maxnreg=self.maxnreg, **kw)


class Version:
    """One version of the step: which launch function and kernel, and the plans' settings."""

    def __init__(self, spec: str, current):
        self.name, _, rest = spec.partition(":")
        opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        unknown = set(opts) - {"file", "maxnreg", "tiles"}
        if unknown:
            sys.exit(f"ab_kernel.py: unknown option(s) {sorted(unknown)} in --version {spec!r}")
        self.module = current
        if "file" in opts:
            mod_name = f"titan_lowbit.kernels._ab_{self.name}"
            mod_spec = importlib.util.spec_from_file_location(mod_name, opts["file"])
            mod = importlib.util.module_from_spec(mod_spec)
            sys.modules[mod_name] = mod  # dataclasses look their module up there
            mod_spec.loader.exec_module(mod)  # relative imports resolve inside titan_lowbit.kernels
            self.module = mod
        self.launch = self.module.FusedAdamW.launch
        self.kernel = self.module._adamw_lowbit_kernel
        if "maxnreg" in opts:
            self.kernel = _Capped(self.kernel, int(opts["maxnreg"]))
        self.tiles = int(opts["tiles"]) if "tiles" in opts else None  # None: the plan's default

    def apply(self, current, opt) -> None:
        current.FusedAdamW.launch = self.launch
        self.module._adamw_lowbit_kernel = self.kernel
        for launches, _ in opt._plans.values():
            for plan, _ in launches:
                if not hasattr(plan, "default_tiles"):
                    plan.default_tiles = plan.tiles_per_program
                plan.tiles_per_program = self.tiles or plan.default_tiles
                plan.n_programs = plan.n_tiles  # what launches of older files read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="append", default=[], help="NAME or NAME:OPTION=VALUE,... (see above); repeat")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=[], help="configs whose 'format dtype update' contains one of these")
    ap.add_argument("--nonfinite", default="ignore", choices=("ignore", "raise"),
                    help="the optimizers' nonfinite_grad: 'raise' times the guarded kernels")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ab_kernel.py needs a CUDA GPU")
    from titan_lowbit.kernels import adamw_lowbit as K
    from titan_lowbit.optim import LowBitAdamW

    versions = [Version(v, K) for v in (args.version or ["current"])]
    current_launch, current_kernel = K.FusedAdamW.launch, K._adamw_lowbit_kernel
    summary = []
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    for fmt, dtype, update in CONFIGS:
        label = f"{fmt} {dtype} {update}"
        if args.only and not any(o in label for o in args.only):
            continue
        params = make_params(getattr(torch, dtype), torch.Generator(device="cuda").manual_seed(0))
        opt = LowBitAdamW(params, lr=1e-4, weight_decay=0.1, state_format=fmt, weight_update=update,
                          nonfinite_grad=args.nonfinite, seed=0)
        opt.step()  # builds the launch plans that the versions adjust
        times: dict[str, list[float]] = {v.name: [] for v in versions}
        try:
            for r in range(args.rounds):
                for v in (versions if r % 2 == 0 else versions[::-1]):
                    v.apply(K, opt)
                    times[v.name].append(time_steps(opt, args.steps, args.warmup))
                print(f"{label} round {r}: " + ", ".join(f"{v.name} {times[v.name][-1]:.3f}" for v in versions),
                      flush=True)
        finally:
            K.FusedAdamW.launch, K._adamw_lowbit_kernel = current_launch, current_kernel
        summary.append((label, {n: statistics.median(t) for n, t in times.items()}))
        del opt, params
        torch.cuda.empty_cache()
    print()
    names = [v.name for v in versions]
    print("| config | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, med in summary:
        print(f"| {label} | " + " | ".join(f"{med[n]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()
