#!/usr/bin/env python3
"""Optimizer-step benchmark on the TinyLlama-1.1B parameter set (one GPU).

The step is memory-bound, so the yardstick is bandwidth: for each optimizer we count the
fewest bytes a step must move per parameter (gradient read once, weight read and written,
every state byte read and written; with fp32 master weights the bf16 weight is only
written, with master weights as remainders it is read and written) and divide by the
measured time, then compare with a device-to-device copy measured in the same run.

    python3 scripts/bench_optimizer.py                 # all rows, markdown table last
    python3 scripts/bench_optimizer.py --only 8bit     # rows whose label contains '8bit'
    python3 scripts/bench_optimizer.py --only master --no-peers   # master and master_remainder rows
    python3 scripts/bench_optimizer.py --sweep         # also launch-shape variants of LowBitAdamW

Weights and gradients are random (never zeros). Times: median of --steps steps after
--warmup steps, each timed with CUDA events after a host sync, so the step's host
preparation (Python, kernel launches) counts while the GPU waits for it. A second figure,
"queued", is the median of --steps steps after --warmup steps, each between its own CUDA
events, issued back to back without a host sync: the host prepares step i+1 while the GPU
runs step i, as in training, where the host runs ahead of the GPU; each step's events
then hold its GPU time. Optimizers that sync inside their step (the non-finite check)
show their host time in both. State bytes: torch.cuda.memory_allocated()
after minus before building the optimizer and running its first step (lazy optimizers
create state there; for LowBitAdamW this includes its launch tables).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch


def tinyllama_shapes() -> list[tuple[int, ...]]:
    """TinyLlama-1.1B: vocab 32000, dim 2048, 22 layers, 4 KV heads of 64, FFN 5632."""
    shapes = [(32000, 2048)]  # embedding
    for _ in range(22):
        shapes += [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048),  # q k v o
                   (5632, 2048), (5632, 2048), (2048, 5632),  # gate up down
                   (2048,), (2048,)]  # attention and FFN norms
    shapes += [(2048,), (32000, 2048)]  # final norm, output
    return shapes


def copy_bandwidth(nbytes: int = 4 << 30, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median of reps)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def make_params(dtype: torch.dtype, gen: torch.Generator) -> list[torch.nn.Parameter]:
    params = []
    for shape in tinyllama_shapes():
        p = torch.nn.Parameter(torch.empty(shape, device="cuda", dtype=dtype))
        p.data.normal_(0, 0.02, generator=gen)
        p.grad = torch.empty_like(p).normal_(0, 1e-3, generator=gen)
        params.append(p)
    return params


def time_steps(opt, steps: int, warmup: int, queued: bool = False) -> float:
    """Median ms of ``steps`` steps after ``warmup``, each between its own CUDA events.

    Synced (default): a host sync before each step, so the step's host preparation counts
    while the GPU waits for it. ``queued``: the steps issued back to back without a host
    sync between them: step i's events and kernels queue behind step i-1's, so each
    measures the GPU's time for its step while the host prepares the next (unless the host
    falls behind the GPU, when its preparation shows here too)."""
    for _ in range(warmup):
        opt.step()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for a, b in events:
        a.record()
        opt.step()
        b.record()
        if not queued:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def row_specs(args) -> list[dict]:
    """label, builder, weight dtype, extra bytes per param the weight update adds."""
    from titan_lowbit.optim import LowBitAdamW

    specs = []

    def ours(fmt, wdtype, update="nearest", **kw):
        name = f"LowBitAdamW {fmt}"
        if kw:
            name += " " + ",".join(f"{k}={v}" for k, v in kw.items())
        launch = {k: kw.pop(k) for k in ("elems", "warps") if k in kw}
        nf = kw.pop("nonfinite_grad", "raise")  # the default: what a user gets

        def build(params):
            opt = LowBitAdamW(params, lr=1e-4, weight_decay=0.1, state_format=fmt, weight_update=update,
                              nonfinite_grad=nf, seed=0)
            if launch:
                opt.launch_options = {name: launch[k] for k, name in (
                    ("elems", "elems_per_program"), ("warps", "num_warps")) if k in launch}
            return opt

        upd = update if wdtype == torch.bfloat16 else "exact"
        specs.append(dict(label=f"{name}", update=upd, dtype=wdtype, build=build))

    for fmt in ("8bit", "4bit", "fp8", "bf16", "fp32"):
        ours(fmt, torch.float32)
        ours(fmt, torch.bfloat16, "stochastic")
    ours("8bit", torch.bfloat16, "nearest")
    ours("8bit", torch.bfloat16, "kahan")
    # fp32 master weights, as fp32 state and as the bf16 weight + a 16-bit remainder
    for fmt in ("8bit", "4bit", "fp8", "bf16", "fp32"):
        ours(fmt, torch.bfloat16, "master")
        ours(fmt, torch.bfloat16, "master_remainder")
    # the other non-finite policies: no check at all, and the check before the step
    ours("8bit", torch.float32, nonfinite_grad="ignore")
    ours("8bit", torch.bfloat16, "stochastic", nonfinite_grad="ignore")
    ours("8bit", torch.float32, nonfinite_grad="skip")
    if args.sweep:
        for elems, warps in ((512, 4), (2048, 4), (2048, 8)):
            ours("8bit", torch.float32, elems=elems, warps=warps)
            ours("8bit", torch.bfloat16, "stochastic", elems=elems, warps=warps)
            ours("4bit", torch.bfloat16, "stochastic", elems=elems, warps=warps)
            ours("fp8", torch.bfloat16, "stochastic", elems=elems, warps=warps)

    for wdtype in (torch.float32, torch.bfloat16):
        specs.append(dict(label="torch AdamW fused", update="nearest" if wdtype == torch.bfloat16 else "exact",
                          dtype=wdtype,
                          build=lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)))
    if args.peers:
        try:
            import torchao.optim as tao

            for cls in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
                specs.append(dict(label=f"torchao {cls} (compiled)", update="exact", dtype=torch.float32,
                                  build=lambda params, c=cls: getattr(tao, c)(params, lr=1e-4, weight_decay=0.1)))
            # torchao with 8-bit states, bf16 weights and stochastic rounding.
            specs.append(dict(label="torchao AdamW8bit (compiled)", update="stochastic", dtype=torch.bfloat16,
                              build=lambda params: tao.AdamW8bit(params, lr=1e-4, weight_decay=0.1,
                                                                 bf16_stochastic_round=True)))
        except Exception as e:  # noqa: BLE001 -- a peer that cannot load is reported, not fatal
            print(f"torchao unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        try:
            import bitsandbytes as bnb

            specs.append(dict(label="bitsandbytes AdamW8bit", update="exact", dtype=torch.float32,
                              build=lambda params: bnb.optim.AdamW8bit(params, lr=1e-4, weight_decay=0.1)))
        except Exception as e:  # noqa: BLE001
            print(f"bitsandbytes unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    return [s for s in specs if not args.only or any(o in s["label"] or o in s["update"] for o in args.only)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=[], help="rows whose label or bf16 update contains one of these")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-peers", dest="peers", action="store_false")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_optimizer.py needs a CUDA GPU")

    import triton

    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    n = sum(torch.Size(s).numel() for s in tinyllama_shapes())
    print(f"device {dev}; torch {torch.__version__}; triton {triton.__version__}; "
          f"{n / 1e9:.3f}B params in {len(tinyllama_shapes())} tensors; copy bandwidth {bw / 1e12:.2f} TB/s",
          flush=True)
    rows = []
    for spec in row_specs(args):
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = make_params(spec["dtype"], gen)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        t0 = time.time()
        try:
            opt = spec["build"](params)
            opt.step()
            torch.cuda.synchronize()
            state_bytes = (torch.cuda.memory_allocated() - before) / n
            ms = time_steps(opt, args.steps, args.warmup)
            ms_queued = time_steps(opt, args.steps, args.warmup, queued=True)
        except Exception as e:  # noqa: BLE001 -- one failing row must not hide the others
            print(f"{spec['label']}: FAILED {type(e).__name__}: {e}", flush=True)
            del params
            gc.collect()
            torch.cuda.empty_cache()
            continue
        wbytes = torch.finfo(spec["dtype"]).bits // 8
        gbytes = wbytes
        # With fp32 master weights (counted in the state, read and written) the bf16
        # weight is only written: the update never needs its old value. As a remainder
        # (master_remainder: in the state too) the master is rebuilt from the weight, which
        # is then read and written.
        wtraffic = wbytes if spec["update"] == "master" else 2 * wbytes
        min_bytes = gbytes + wtraffic + 2 * state_bytes
        tbps = min_bytes * n / (ms / 1e3) / 1e12
        row = dict(label=spec["label"], dtype=str(spec["dtype"]).removeprefix("torch."), update=spec["update"],
                   min_bytes=min_bytes, ms=ms, tbps=tbps, pct=100 * tbps * 1e12 / bw, state=state_bytes,
                   ms_queued=ms_queued, pct_queued=100 * min_bytes * n / (ms_queued / 1e3) / bw,
                   setup=time.time() - t0)
        rows.append(row)
        print(f"{row['label']:<55} {row['dtype']:<9} {row['update']:<16} {min_bytes:6.2f} B/param "
              f"{ms:8.2f} ms {tbps:5.2f} TB/s {row['pct']:5.1f}% state {state_bytes:6.3f} B/param; "
              f"queued {ms_queued:.2f} ms {row['pct_queued']:5.1f}% "
              f"(setup+first step {row['setup']:.1f} s)", flush=True)
        del opt, params
        gc.collect()
        torch.cuda.empty_cache()

    print()
    print(f"Device: {dev}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write); {n / 1e9:.3f}B params")
    print()
    print("| optimizer | weights | bf16 update | min bytes/param | ms/step | TB/s | % of copy bw | state B/param "
          "| queued ms/step | queued % of copy bw |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['dtype']} | {r['update']} | {r['min_bytes']:.2f} | {r['ms']:.2f} | "
              f"{r['tbps']:.2f} | {r['pct']:.0f}% | {r['state']:.3f} | {r['ms_queued']:.2f} | {r['pct_queued']:.0f}% |")


if __name__ == "__main__":
    main()
