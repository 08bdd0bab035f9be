#!/usr/bin/env python3
"""A/B timing of versions of the fused AdamW kernel, alternating inside one process.

Host-to-host spread on the lent H100s is larger than most kernel changes (docs/optimizer.md),
so two versions are compared on the same GPU, the same optimizer and the same parameters,
in alternating rounds. A version is the current ``kernels/adamw_lowbit.py`` or an older
copy of that file (e.g. ``git show REV:kernels/adamw_lowbit.py > /tmp/old.py``), optionally
with a register cap for ptxas; its ``_adamw_lowbit_kernel`` is swapped into the optimizer's
launch plans (the launch arguments must be the same in both versions).

    python3 scripts/ab_kernel.py --version old=/tmp/old.py --version new \\
        --version new64=:64 --rounds 7 --only "8bit bfloat16 stochastic"

Prints the median ms per step of every version in every round, then each version's median
over rounds. Rows: LowBitAdamW on the TinyLlama-1.1B parameter set (bench_optimizer.py's),
``nonfinite_grad="ignore"``.
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
]


class _Capped:
    """A jitted kernel launched with a ptxas register cap."""

    def __init__(self, kernel, maxnreg: int):
        self.kernel, self.maxnreg = kernel, maxnreg

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *a, **kw: launch(*a, maxnreg=self.maxnreg, **kw)


def load_version(spec: str, current):
    """NAME, NAME=PATH, NAME=:MAXNREG or NAME=PATH:MAXNREG -> (name, kernel)."""
    name, _, rest = spec.partition("=")
    path, _, cap = rest.partition(":")
    kernel = current._adamw_lowbit_kernel
    if path:
        mod_name = f"titan_lowbit.kernels._ab_{name}"
        mod_spec = importlib.util.spec_from_file_location(mod_name, path)
        mod = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_name] = mod  # dataclasses look their module up there
        mod_spec.loader.exec_module(mod)  # relative imports resolve inside titan_lowbit.kernels
        kernel = mod._adamw_lowbit_kernel
    return name, (_Capped(kernel, int(cap)) if cap else kernel)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="append", default=[], help="NAME[=PATH][:MAXNREG]; repeat")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=[], help="configs whose 'format dtype update' contains one of these")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ab_kernel.py needs a CUDA GPU")
    from titan_lowbit.kernels import adamw_lowbit as K
    from titan_lowbit.optim import LowBitAdamW

    versions = [load_version(v, K) for v in (args.version or ["current"])]
    current = K._adamw_lowbit_kernel
    summary = []
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    for fmt, dtype, update in CONFIGS:
        label = f"{fmt} {dtype} {update}"
        if args.only and not any(o in label for o in args.only):
            continue
        params = make_params(getattr(torch, dtype), torch.Generator(device="cuda").manual_seed(0))
        opt = LowBitAdamW(params, lr=1e-4, weight_decay=0.1, state_format=fmt, weight_update=update,
                          nonfinite_grad="ignore", seed=0)
        times: dict[str, list[float]] = {n: [] for n, _ in versions}
        try:
            for r in range(args.rounds):
                for name, kernel in (versions if r % 2 == 0 else versions[::-1]):
                    K._adamw_lowbit_kernel = kernel
                    times[name].append(time_steps(opt, args.steps, args.warmup))
                print(f"{label} round {r}: " + ", ".join(f"{n} {times[n][-1]:.3f}" for n, _ in versions), flush=True)
        finally:
            K._adamw_lowbit_kernel = current
        summary.append((label, {n: statistics.median(t) for n, t in times.items()}))
        del opt, params
        torch.cuda.empty_cache()
    print()
    names = [n for n, _ in versions]
    print("| config | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, med in summary:
        print(f"| {label} | " + " | ".join(f"{med[n]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()
