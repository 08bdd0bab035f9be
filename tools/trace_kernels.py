#!/usr/bin/env python3
"""GPU time by kernel family in a torchtitan profiler trace.

torchtitan's ``--profiling.enable_profiling`` writes a Chrome trace per rank
(``outputs/<run>/profile_traces/iteration_N/rank0_trace.json``) whose device events are
the kernels, copies and memsets of the profiled step. This sums their durations by
family (int8 matmul variant, cuBLAS GEMM, attention, Inductor reduction / pointwise /
template kernels, optimizer, other kernels by name) and reports the time the GPU was
busy (the union of the events' intervals) against the span from the first to the last.

    python3 tools/trace_kernels.py rank0_trace.json [--top 25] [--by-kernel]

``--by-kernel`` lists single kernels (by name) instead of families, with their mean time
per launch: which Inductor kernel a change made faster or slower.

docs/bitnet.md's per-step kernel tables of the 1B model come from this.
"""

from __future__ import annotations

import argparse
import collections
import re

from trace_regions import load_events

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def family(name: str) -> str:
    """The family a device event's name belongs to."""
    if "_int8_matmul" in name:
        return "int8 matmul " + name.split("_int8_matmul", 1)[1].split("_kernel")[0].strip("_")
    if re.search(r"gemm|cutlass|xmma|nvjet|cublas", name, re.I):
        return "cuBLAS GEMM"
    if re.search(r"flash|fmha|cudnn", name, re.I):
        return "attention"
    if "multi_tensor" in name or "foreach" in name.lower():
        return "optimizer (multi-tensor)"
    for prefix, what in (("triton_red", "Inductor reduction"), ("triton_per", "Inductor reduction"),
                         ("triton_poi", "Inductor pointwise"), ("triton_tem", "Inductor template")):
        if name.startswith(prefix):
            return what
    return "other: " + name[:60]


def kernel_summary(events: list[dict], key=family
                   ) -> tuple[float, float, collections.Counter, collections.Counter]:
    """(span us, busy us, us by key, count by key) of the trace's device events; the key
    of an event is ``key(name)`` (its family by default)."""
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS),
                 key=lambda e: e["ts"])
    if not dev:
        raise SystemExit("no kernels in the trace: was the profiler's CUDA activity on?")
    busy, start, end = 0.0, None, None
    us: collections.Counter = collections.Counter()
    n: collections.Counter = collections.Counter()
    for e in dev:
        s, t = e["ts"], e["ts"] + e["dur"]
        if end is None or s > end:
            if end is not None:
                busy += end - start
            start, end = s, t
        else:
            end = max(end, t)
        us[key(e["name"])] += e["dur"]
        n[key(e["name"])] += 1
    busy += end - start
    span = max(e["ts"] + e["dur"] for e in dev) - dev[0]["ts"]
    return span, busy, us, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="Chrome trace (.json or .json.gz) of one rank")
    parser.add_argument("--top", type=int, default=25, help="families (or kernels) listed")
    parser.add_argument("--by-kernel", action="store_true",
                        help="single kernels by name, with the mean time per launch")
    args = parser.parse_args()
    span, busy, us, n = kernel_summary(load_events(args.trace),
                                       key=str if args.by_kernel else family)
    print(f"{args.trace}: GPU busy {busy / 1e3:.1f} ms of {span / 1e3:.1f} ms, "
          f"{sum(n.values())} device events")
    for name, t in us.most_common(args.top):
        mean = f" {t / n[name]:8.1f} us each" if args.by_kernel else ""
        print(f"  {t / 1e3:8.2f} ms {n[name]:5d}x{mean}  {name[:140]}")


if __name__ == "__main__":
    main()
