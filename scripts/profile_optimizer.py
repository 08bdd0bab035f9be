#!/usr/bin/env python3
"""Run a few LowBitAdamW steps on the TinyLlama-1.1B parameter set, for a profiler.

``bench_optimizer.py`` times many optimizers; this script runs exactly one configuration so
that Nsight Compute sees only its launches:

    ncu -k regex:_adamw_lowbit_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        python3 scripts/profile_optimizer.py --format 8bit --dtype bfloat16 --update stochastic
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_optimizer import make_params  # scripts/bench_optimizer.py, beside this file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="8bit")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--update", default="nearest")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_optimizer.py needs a CUDA GPU")
    from titan_lowbit.optim import LowBitAdamW

    params = make_params(getattr(torch, args.dtype), torch.Generator(device="cuda").manual_seed(0))
    opt = LowBitAdamW(params, lr=1e-4, weight_decay=0.1, state_format=args.format,
                      weight_update=args.update, nonfinite_grad="ignore", seed=0)
    for _ in range(args.steps):
        opt.step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
