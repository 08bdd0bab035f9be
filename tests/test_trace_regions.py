"""scripts/trace_regions.py and scripts/trace_kernels.py on small synthetic Chrome traces."""

import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from trace_regions import host_events_of_last_step, load_events, region_summary  # noqa: E402


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "cat": cat}


def test_sums_regions_and_their_direct_children_by_family(tmp_path):
    events = [
        _x("ProfilerStep#9", 0, 50, cat="user_annotation"),  # an earlier step: ignored
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
    by_thread = host_events_of_last_step(load_events(str(path)))
    count, total, child_us, child_n = region_summary(by_thread, "FSDP::pre_forward (layers")
    assert (count, total) == (2, 160)
    assert child_us == {"FSDP::all_gather (layers.N)": 60, "aten::copy_": 10}
    assert child_n["FSDP::all_gather (layers.N)"] == 2
    assert region_summary(by_thread, "FSDP::pre_backward")[:2] == (1, 70)


def test_kernel_time_by_family_and_busy_union(tmp_path):
    from trace_kernels import kernel_summary

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
    span, busy, us, n = kernel_summary(load_events(str(path)))
    assert (span, busy) == (405, 150 + 30 + 10 + 5)
    assert us["int8 matmul tma_device"] == 100 and us["cuBLAS GEMM"] == 100
    assert us["Inductor reduction"] == 40 and n["Inductor reduction"] == 2
    assert us["other: Memset (Device)"] == 5
    _, _, us, n = kernel_summary(load_events(str(path)), key=str)
    assert us["triton_red_fused_abs_amax_0"] == 30 and n["triton_per_fused_rms_norm_1"] == 1
    assert len(us) == 5
