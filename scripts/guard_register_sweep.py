#!/usr/bin/env python3
"""Registers, spills and queued ms/step of the fused AdamW step on the TinyLlama-1.1B
parameter set, without the non-finite check and with it under several register caps
(``maxnreg``): how ``GUARD_MAXNREG`` was chosen (docs/optimizer.md). On a GPU:

    python3 scripts/guard_register_sweep.py
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_optimizer import make_params  # noqa: E402

CASES = [("8bit", torch.bfloat16, "stochastic"), ("4bit", torch.bfloat16, "stochastic"),
         ("fp8", torch.bfloat16, "stochastic"), ("4bit", torch.float32, "nearest"),
         ("8bit", torch.bfloat16, "nearest"), ("8bit", torch.bfloat16, "kahan"),
         ("8bit", torch.bfloat16, "master"), ("fp8", torch.float32, "nearest")]
# (nonfinite_grad, register cap): the unguarded step, then the guard uncapped and capped
RUNS = [("ignore", None), ("raise", None), ("raise", 40), ("raise", 48), ("raise", 56), ("raise", 64)]


def queued_ms(opt, rounds: int = 5, steps: int = 10) -> float:
    """Median over rounds of the mean step time of ``steps`` steps issued back to back."""
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            opt.step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / steps)
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("guard_register_sweep.py needs a CUDA GPU")
    from titan_lowbit.optim import LowBitAdamW

    for fmt, wdtype, update in CASES:
        for policy, cap in RUNS:
            params = make_params(wdtype, torch.Generator(device="cuda").manual_seed(0))
            opt = LowBitAdamW(params, lr=1e-4, weight_decay=0.1, state_format=fmt, weight_update=update,
                              nonfinite_grad=policy, seed=0)
            if cap:
                opt.launch_options = {"maxnreg": cap}
            for _ in range(4):
                opt.step()
            torch.cuda.synchronize()
            ms = queued_ms(opt)
            regs = []
            for launches, _ in opt._plans.values():
                for pl, _ in launches:
                    kernel = pl._compiled[1]
                    kernel._init_handles()
                    regs.append((kernel.n_regs, kernel.n_spills))
            print(f"{fmt} {wdtype} {update} {policy:6s} maxnreg={cap}: queued {ms:.3f} ms/step, "
                  f"(registers, spills) per launch {regs}", flush=True)
            del opt, params
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
