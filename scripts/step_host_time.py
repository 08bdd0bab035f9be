#!/usr/bin/env python3
"""Where a fused LowBitAdamW step's time goes: host preparation or GPU kernels.

``bench_optimizer.py`` times each step between CUDA events after a host sync, so its
ms/step holds the host's preparation of the step (Python: gradient checks, launch plans,
pointer checks; Triton's launches), during which the GPU idles. This script prints, for
the TinyLlama-1.1B parameter set with bf16 weights and stochastic rounding:

- ``step() host``: wall time until ``opt.step()`` returns (the launches are asynchronous);
- ``events around step()``: what ``bench_optimizer.py`` measures (sync, event, step, event);
- ``kernels back to back``: the step's launches alone, queued behind each other (the GPU's
  own time per step, as when the host runs ahead of the GPU in training);
- ``launch host``: host time of one launch, direct (the plan's cached compiled kernel) and
  through Triton's ``JITFunction.run`` (the cache emptied before each launch).

    python3 scripts/step_host_time.py [8bit|4bit|fp8|...]
    python3 scripts/step_host_time.py --dtensor   # the parameters as DTensors (Shard(0) on a
                                                  # one-GPU mesh, gradients on each parameter's
                                                  # spec, as FSDP2 builds them)
    python3 scripts/step_host_time.py --nonfinite=raise   # the policy (default: ignore); raise
                                                          # times the kernels with their guard
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from bench_optimizer import make_params


def as_dtensor(p: torch.nn.Parameter, mesh) -> torch.nn.Parameter:
    """``p`` as a Shard(0) DTensor parameter on ``mesh``, its gradient built on the
    parameter's own spec object (as FSDP2's reduce-scatter output is)."""
    from torch.distributed.tensor import DTensor, Shard

    d = torch.nn.Parameter(DTensor.from_local(p.detach(), mesh, [Shard(0)], run_check=False))
    d.grad = DTensor(p.grad, d._spec, requires_grad=False)
    return d


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("step_host_time.py needs a CUDA GPU")
    from titan_lowbit.kernels.adamw_lowbit import AdamWHyper, NonfiniteGuard
    from titan_lowbit.optim import LowBitAdamW

    dtensor = "--dtensor" in sys.argv[1:]
    policy = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--nonfinite=")), "ignore")
    mesh = None
    if dtensor:
        import os

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
        mesh = init_device_mesh("cuda", (1,))

    formats = [a for a in sys.argv[1:] if not a.startswith("--")] or ["8bit", "4bit"]
    for fmt in formats:
        params = make_params(torch.bfloat16, torch.Generator(device="cuda").manual_seed(0))
        if dtensor:
            params = [as_dtensor(p, mesh) for p in params]
        opt = LowBitAdamW(params, lr=1e-4, weight_decay=0.1, state_format=fmt, weight_update="stochastic",
                          nonfinite_grad=policy, seed=0)
        for _ in range(5):
            opt.step()
        torch.cuda.synchronize()
        host, around = [], []
        for _ in range(30):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            b.record()
            torch.cuda.synchronize()
            host.append((t1 - t0) * 1e3)
            around.append(a.elapsed_time(b))
        plans = [pl for launches, _ in opt._plans.values() for pl, _ in launches]
        hyper = AdamWHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=10)
        guard = (NonfiniteGuard(torch.zeros(len(params), dtype=torch.int32, device="cuda"), 1)
                 if policy == "raise" else None)
        kernels = []
        for _ in range(30):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for pl in plans:
                pl.launch(hyper, guard)  # fill the queue: time back-to-back kernels only
            a.record()
            for pl in plans:
                pl.launch(hyper, guard)
            b.record()
            torch.cuda.synchronize()
            kernels.append(a.elapsed_time(b))
        launch_us = {}
        for how in ("direct", "triton"):
            times = []
            for _ in range(30):
                torch.cuda.synchronize()
                for pl in plans:
                    if how == "triton":
                        pl._compiled = None
                    t0 = time.perf_counter()
                    pl.launch(hyper, guard)
                    times.append((time.perf_counter() - t0) * 1e6)
            launch_us[how] = statistics.median(times)
        torch.cuda.synchronize()
        print(f"{'DTensor ' if dtensor else ''}{fmt} stochastic, nonfinite_grad={policy}: step() host {statistics.median(host):.3f} ms, events around step() "
              f"{statistics.median(around):.3f} ms, kernels back to back {statistics.median(kernels):.3f} ms, "
              f"plans {len(plans)}, launch host {launch_us['direct']:.0f} us direct / "
              f"{launch_us['triton']:.0f} us through triton", flush=True)
        del opt, params
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
