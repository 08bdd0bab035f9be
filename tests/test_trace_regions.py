"""tools/trace_regions.py and tools/trace_kernels.py on small synthetic Chrome traces, run
as a user runs them (times in the traces are microseconds; the tools print milliseconds)."""

import json
import subprocess
import sys

from conftest import ROOT

MS = 1000  # one millisecond in the trace's microseconds


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts * MS, "dur": dur * MS, "tid": tid, "pid": 0, "cat": cat}


def _tool(name, *args) -> list[str]:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [" ".join(line.split()) for line in proc.stdout.splitlines()]


def test_sums_regions_and_their_direct_children_by_family(tmp_path):
    events = [
        _x("ProfilerStep#9", 0, 50, cat="user_annotation"),  # a step before the last: ignored
        _x("FSDP::pre_forward (layers.0)", 10, 30),
        _x("ProfilerStep#10", 100, 1000, cat="user_annotation"),
        _x("FSDP::pre_forward (layers.0)", 110, 100),
        _x("FSDP::all_gather (layers.0)", 120, 40),
        _x("aten::empty", 125, 5),  # inside all_gather: a grandchild, not listed
        _x("aten::copy_", 170, 10),
        _x("FSDP::pre_forward (layers.1)", 300, 60, tid=2),  # another thread counts too
        _x("FSDP::all_gather (layers.1)", 310, 20, tid=2),
        _x("gemm", 120, 500, cat="kernel"),  # device time: not host
        _x("FSDP::pre_backward (layers.1)", 500, 70),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = _tool("trace_regions.py", path, "FSDP::pre_forward (layers", "FSDP::pre_backward")
    assert out == [
        "'FSDP::pre_forward (layers': 2 regions, 160.00 ms of host time",
        "60.00 ms 2x FSDP::all_gather (layers.N)",
        "10.00 ms 1x aten::copy_",
        "'FSDP::pre_backward': 1 regions, 70.00 ms of host time",
    ], out


def test_kernel_time_by_family_and_busy_union(tmp_path):
    events = [
        _x("_int8_matmul_tma_device_kernel", 0, 100, cat="kernel"),
        _x("sm90_xmma_gemm_bf16bf16_bf16f32", 50, 100, cat="kernel"),  # overlaps: busy 0-150
        _x("triton_red_fused_abs_amax_0", 200, 30, cat="kernel"),
        _x("triton_per_fused_rms_norm_1", 240, 10, cat="kernel"),
        _x("Memset (Device)", 400, 5, cat="gpu_memset"),
        _x("aten::mm", 0, 1000),  # host event: not counted
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = _tool("trace_kernels.py", path)
    assert out[0] == f"{path}: GPU busy {150 + 30 + 10 + 5:.1f} ms of 405.0 ms, 5 device events", out
    assert sorted(out[1:]) == sorted([
        "100.00 ms 1x int8 matmul tma_device", "100.00 ms 1x cuBLAS GEMM",
        "40.00 ms 2x Inductor reduction", "5.00 ms 1x other: Memset (Device)"]), out
    out = _tool("trace_kernels.py", path, "--by-kernel")
    assert "30.00 ms 1x 30000.0 us each triton_red_fused_abs_amax_0" in out, out
    assert len(out) == 6, out
