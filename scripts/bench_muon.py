#!/usr/bin/env python3
"""LowBitMuon's step on the TinyLlama-1.1B parameter set (one GPU): the fused kernels
against the PyTorch reference path, and the Newton-Schulz part's throughput.

    python3 scripts/bench_muon.py                      # fp32, 8bit, 4bit (NF4 and dynamic map); both paths
    python3 scripts/bench_muon.py --formats 8bit --paths fused --steps 5

Parameters: TinyLlama-1.1B's (bench_optimizer.tinyllama_shapes), bf16, random, with random
bf16 gradients, named so that the embedding and the output head go to LowBitMuon's AdamW
part; the 154 matrices of the 22 layers (0.97B elements) are Muon's. For each momentum
format and path ("fused": kernels/muon_lowbit.py, as on every CUDA tensor; "reference":
kernels/muon_ref.py's PyTorch ops, forced) one row. "4bit" is Muon4bit as it comes (NF4
levels); "4bit-dynamic" the same with ``momentum_4bit_levels="dynamic"``:

* step ms: the whole optimizer step (Muon and AdamW parts), median of --steps steps after
  --warmup, each between host syncs (bench_optimizer.time_steps);
* NS ms: Newton-Schulz alone on the same matrices (bf16 inputs, one call per matrix as
  the step makes them), timed the same way; NS TFLOP/s: its FLOPs
  (muon_ref.newton_schulz_flops, the matmuls' 2 m n k) over that time, to set against the
  GPU's dense bf16 peak; the rest of the step (step ms - NS ms) is the elementwise phases,
  the AdamW part and the launches;
* state bytes/param: LowBitMuon.state_bytes_per_param();
* peak GiB: torch.cuda.max_memory_allocated() over the timed steps.

The figures depend on the GPU, the driver, torch and Triton: the script prints them with
the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench_optimizer import time_steps, tinyllama_shapes  # scripts/bench_optimizer.py, beside this file


def named_params(gen: torch.Generator) -> list[tuple[str, torch.nn.Parameter]]:
    """TinyLlama-1.1B's parameters, bf16 with bf16 gradients; the first and last 2-D
    tensors are the embedding and the output head (AdamW's by name)."""
    shapes = tinyllama_shapes()
    out = []
    for i, shape in enumerate(shapes):
        name = "embed.weight" if i == 0 else "output.weight" if i == len(shapes) - 1 else f"p{i}"
        p = torch.nn.Parameter(torch.empty(shape, device="cuda", dtype=torch.bfloat16))
        p.data.normal_(0, 0.02, generator=gen)
        p.grad = torch.empty_like(p).normal_(0, 1e-3, generator=gen)
        out.append((name, p))
    return out


def newton_schulz_ms(opt, steps: int, warmup: int) -> tuple[float, int]:
    """(median ms, FLOPs) of Newton-Schulz on the optimizer's Muon matrices, bf16 inputs."""
    from titan_lowbit.kernels.muon_ref import newton_schulz, newton_schulz_flops

    group = next(g for g in opt.param_groups if g.get("use_muon"))
    inputs = [torch.randn(p.shape, device="cuda", dtype=torch.bfloat16) for p in opt.muon_params()]
    flops = sum(newton_schulz_flops(*u.shape, group["ns_steps"]) for u in inputs)

    def run():
        for u in inputs:
            newton_schulz(u, group["ns_steps"], tuple(group["ns_coefficients"]))

    for _ in range(warmup):
        run()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), flops


def bench_formats() -> dict[str, tuple[str, dict]]:
    """--formats name -> (row label, LowBitMuon keyword arguments): every state format,
    "4bit-dynamic" (the 4-bit momentum in the dynamic map instead of its default levels) and
    "4bit-factor" (with a rank-8 factor beside its codes)."""
    from titan_lowbit.optim.formats import STATE_FORMATS
    from titan_lowbit.optim.muon_groups import DEFAULT_MOMENTUM_4BIT_LEVELS

    rows = {name: (f"{name} momentum", {"state_format": name}) for name in STATE_FORMATS}
    rows["4bit"] = (f"4bit momentum ({DEFAULT_MOMENTUM_4BIT_LEVELS})", {"state_format": "4bit"})
    rows["4bit-dynamic"] = ("4bit momentum (dynamic)", {"state_format": "4bit", "momentum_4bit_levels": "dynamic"})
    rows["4bit-factor"] = (f"4bit momentum ({DEFAULT_MOMENTUM_4BIT_LEVELS}) + rank-8 factor",
                           {"state_format": "4bit", "momentum_4bit_factor_rank": 8})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    formats = bench_formats()
    ap.add_argument("--formats", nargs="+", default=["fp32", "8bit", "4bit", "4bit-dynamic", "4bit-factor"],
                    choices=sorted(formats))
    ap.add_argument("--paths", nargs="+", default=["reference", "fused"], choices=["reference", "fused"])
    ap.add_argument("--weight-update", default="stochastic")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_muon.py times the step on a GPU; none is visible")
    import triton

    from titan_lowbit.optim import LowBitMuon

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    ns = None
    for fmt in args.formats:
        for path in args.paths:
            gen = torch.Generator(device="cuda").manual_seed(0)
            params = named_params(gen)
            label, kwargs = formats[fmt]
            opt = LowBitMuon(params, lr=1e-3, weight_decay=0.1, weight_update=args.weight_update, **kwargs)
            if path == "reference":
                opt._use_fused = lambda t: False
            torch.cuda.reset_peak_memory_stats()
            step_ms = time_steps(opt, args.steps, args.warmup)
            peak = torch.cuda.max_memory_allocated() / 2**30
            if ns is None:
                ns = newton_schulz_ms(opt, args.steps, args.warmup)
            ns_ms, flops = ns
            rows.append((label, path, step_ms, ns_ms, flops / (ns_ms * 1e-3) / 1e12,
                         opt.state_bytes_per_param(), peak))
            print(*rows[-1], sep="\t", flush=True)
            del opt, params
            torch.cuda.empty_cache()
    print(f"\nweights bf16, weight_update={args.weight_update}; NS: {ns[1] / 1e12:.1f} TFLOP per step")
    print("| momentum | path | step ms | NS ms | NS TFLOP/s | rest ms | state B/param | peak GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, path, step_ms, ns_ms, tflops, bpp, peak in rows:
        print(f"| {label} | {path} | {step_ms:.1f} | {ns_ms:.1f} | {tflops:.0f} | {step_ms - ns_ms:.1f} | "
              f"{bpp:.2f} | {peak:.1f} |")


if __name__ == "__main__":
    main()
