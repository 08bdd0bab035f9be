"""Host time of named regions in one step of a torchtitan profiler trace.

torchtitan's ``--profiling.enable_profiling`` writes a Chrome trace per rank
(``outputs/<run>/profile_trace/iteration_N/rank0_trace.json``). For each name prefix given,
this sums the host (CPU-side) duration of the regions whose name starts with it inside the
trace's last ``ProfilerStep``, on every thread, and lists what those regions spent their
time in, one level down (nested regions of a family, e.g. the 22 layers'
``FSDP::all_gather (layers.N)``, are summed under one name with the layer index dropped).

    python3 tools/trace_regions.py rank0_trace.json "FSDP::pre_forward (layers" \\
        "FSDP::pre_backward (layers" "Optimizer.step#OptimizersContainer"

docs/bitnet.md's table of the FSDP2 all-gather hooks' host time comes from this.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re

# Device-side and flow events: not host work.
_NOT_HOST = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "ac2g", "Trace"}


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def host_events_of_last_step(events: list[dict]) -> dict[int, list[dict]]:
    """Complete host events inside the last ProfilerStep, per thread, sorted by start."""
    steps = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("ProfilerStep#")]
    if not steps:
        raise SystemExit("no ProfilerStep in the trace: was it written by torch.profiler with a schedule?")
    t0 = steps[-1]["ts"]
    t1 = t0 + steps[-1]["dur"]
    by_thread: dict[int, list[dict]] = collections.defaultdict(list)
    for e in events:
        if (e.get("ph") == "X" and e.get("cat") not in _NOT_HOST and t0 <= e.get("ts", -1) < t1
                and not e.get("name", "").startswith("ProfilerStep#")):
            by_thread[e["tid"]].append(e)
    for es in by_thread.values():
        es.sort(key=lambda e: (e["ts"], -e["dur"]))
    return by_thread


def _family(name: str) -> str:
    return re.sub(r"layers\.\d+", "layers.N", name)


def region_summary(by_thread: dict[int, list[dict]], prefix: str) -> tuple[int, float, collections.Counter, collections.Counter]:
    """(regions found, their total host us, children's total us by family, children's counts)."""
    count, total = 0, 0.0
    child_us: collections.Counter = collections.Counter()
    child_n: collections.Counter = collections.Counter()
    for es in by_thread.values():
        starts = [e["ts"] for e in es]
        for e in es:
            if not e["name"].startswith(prefix):
                continue
            count += 1
            total += e["dur"]
            end = e["ts"] + e["dur"]
            child_end = -1.0
            for k in es[bisect.bisect_right(starts, e["ts"]):bisect.bisect_left(starts, end)]:
                if k is e or k["ts"] < child_end or k["ts"] + k["dur"] > end:
                    continue  # nested deeper, or not inside
                child_end = k["ts"] + k["dur"]
                child_us[_family(k["name"])] += k["dur"]
                child_n[_family(k["name"])] += 1
    return count, total, child_us, child_n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="Chrome trace (.json or .json.gz) of one rank")
    parser.add_argument("prefixes", nargs="+", help="region name prefixes")
    parser.add_argument("--children", type=int, default=6, help="children listed per prefix")
    args = parser.parse_args()
    by_thread = host_events_of_last_step(load_events(args.trace))
    for prefix in args.prefixes:
        count, total, child_us, child_n = region_summary(by_thread, prefix)
        print(f"{prefix!r}: {count} regions, {total / 1e3:.2f} ms of host time")
        for name, us in child_us.most_common(args.children):
            print(f"    {us / 1e3:8.2f} ms {child_n[name]:5d}x  {name}")


if __name__ == "__main__":
    main()
