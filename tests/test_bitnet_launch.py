"""The BitNet kernels' fast launches (kernels/bitnet_launch.py) pass the compiled kernel
exactly what Triton's own launch path passes it.

Runs in a fresh process with Triton compiled (not interpreted) and its compiler and
launcher stubbed out (``tests/triton_stub.py``), so it needs no GPU: the first launch of each specialization goes through Triton
(``JITFunction.run``, and the autotuner for the int8 matmul), later ones through the
cache. For each kernel wrapper the test records both launches' arguments and compares
them: grid, stream, function, metadata and every kernel argument (tensors by dtype,
shape, strides and address, TMA descriptors by their fields), and checks that changing
what Triton specializes on (alignment, a shape) goes through Triton again.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _norm(a, inputs):
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(a, torch.Tensor):
        # Inputs by address (the same tensor must be passed); fresh outputs by layout.
        ptr = a.data_ptr() if a.data_ptr() in inputs else None
        return ("tensor", a.dtype, tuple(a.shape), a.stride(), ptr)
    if isinstance(a, TensorDescriptor):
        return ("desc", _norm(a.base, inputs), [int(v) for v in a.shape],
                [int(v) for v in a.strides], list(a.block_shape), a.padding)
    return a


def _worker(fast: bool) -> None:
    from triton_stub import bitnet_gpu_path_on_cpu, stub_triton_launches

    stub = stub_triton_launches()
    bitnet_gpu_path_on_cpu()  # TMA allowed on (aligned) CPU tensors
    import torch
    from triton import knobs

    from titan_lowbit.kernels import bitnet_launch as bl
    from titan_lowbit.kernels import bitnet_matmul as mm
    from titan_lowbit.kernels import bitnet_quant as bq

    from titan_lowbit.kernels import private_apis

    assert private_apis.private_api_ok("triton") == fast
    torch.manual_seed(0)
    x = torch.randn(33, 256, dtype=torch.bfloat16)
    w = torch.randn(80, 256)
    g = bq.absmean_scale_reference(w)
    s = torch.linalg.vector_norm(w, 1, dtype=torch.float32)
    q8 = torch.randint(-127, 128, (33, 256), dtype=torch.int8)
    sx = torch.rand(33)
    t8 = torch.randint(-1, 2, (80, 256), dtype=torch.int8)
    t8_t = t8.t().contiguous()
    qd = torch.randint(-127, 128, (33, 80), dtype=torch.int8)
    packed = torch.randint(0, 255, (80, 64), dtype=torch.uint8)
    w72 = torch.randn(72, 256)  # a specialization of its own: the prepared launch's first
    prepared = bq.prepare_ternarize_from_sum(w72, s, w72.numel(), pack=True)  # goes through Triton
    cases = {
        "quantize_rows": (lambda: bq.quantize_rows(x), [x]),
        "quantize_rows_two_pass": (lambda: bq.quantize_rows(x, block_k=64), [x]),
        "dequantize_rows": (lambda: bq.dequantize_rows(q8, sx, torch.bfloat16), [q8, sx]),
        "ternarize": (lambda: bq.ternarize(w, g), [w, g]),
        "ternarize_packed": (lambda: bq.ternarize(w, g, pack=True), [w, g]),
        "ternarize_from_sum": (lambda: bq.ternarize_from_sum(w, s, w.numel()), [w, s]),
        "ternarize_from_sum_packed": (lambda: bq.ternarize_from_sum(w, s, w.numel(), pack=True), [w, s]),
        "ternarize_from_sum_prepared": (prepared[0], [w72, s, prepared[1], prepared[2]]),
        "unpack_ternary": (lambda: bq.unpack_ternary(packed, 256), [packed]),
        "transpose_codes": (lambda: bq.transpose_codes(t8), [t8]),
        "int8_mm_pointer": (lambda: mm.int8_matmul_scaled(q8, t8, sx, g, torch.bfloat16, impl="pointer"),
                            [q8, t8, sx, g]),
        "int8_mm_tma": (lambda: mm.int8_matmul_scaled(q8, t8, sx, g, torch.bfloat16, impl="tma"),
                        [q8, t8, sx, g]),
        "int8_mm_tma_dgrad": (lambda: mm.int8_matmul_scaled(qd, t8_t, sx, g, torch.float32, impl="tma"),
                              [qd, t8_t, sx, g]),
    }
    for name, (fn, inputs) in cases.items():
        ptrs = {t.data_ptr() for t in inputs}
        for hooked in (False, True):
            if hooked:  # a profiler's launch hook: the fast path hands over metadata and hooks
                seen = []
                knobs.runtime.launch_enter_hook.add(seen.append)
            stub["record"] = []
            runs = stub["triton_runs"]
            fn()
            fn()
            fn()
            (name1, a1), (name2, a2), (name3, a3) = stub["record"]
            # The first launch of a specialization goes through Triton (once per hook
            # state only when fast launches are off: Triton caches its kernel either way).
            expected = 3 if not fast else (0 if hooked else 1)
            assert stub["triton_runs"] - runs == expected, (name, hooked, stub["triton_runs"] - runs)
            assert name1 == name2 == name3
            n1 = [_norm(a, ptrs) for a in a1]
            for a in (a2, a3):
                n = [_norm(v, ptrs) for v in a]
                # grid, stream, function, packed metadata
                assert n[:6] == n1[:6], (name, n[:6], n1[:6])
                if hooked or not fast:
                    assert n[6:9] == n1[6:9], (name, n[6:9], n1[6:9])
                else:  # no hooks installed: none passed, no metadata built
                    assert tuple(a[6:9]) == (None, None, None), name
                assert n[9:] == n1[9:], (name, n[9:], n1[9:])
            if hooked:
                knobs.runtime.launch_enter_hook.remove(seen.append)
    # What Triton specializes on changes -> through Triton again, once.
    for fn in (lambda: bq.quantize_rows(x[:, 1:]),                  # misaligned base
               lambda: bq.quantize_rows(x[:17]),                     # another M
               lambda: bq.quantize_rows(x.float()),                  # another dtype
               lambda: mm.int8_matmul_scaled(q8[:7], t8, sx[:7], g, torch.bfloat16, impl="pointer")):
        runs = stub["triton_runs"]
        fn()
        fn()
        assert stub["triton_runs"] - runs == (1 if fast else 2)
    print("launch-worker-ok")


def _run(fast: bool):
    env = dict(os.environ, TRITON_INTERPRET="0", TITAN_LOWBIT_PRIVATE_APIS="1" if fast else "0")
    proc = subprocess.run([sys.executable, __file__, "fast" if fast else "slow"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and "launch-worker-ok" in proc.stdout, \
        proc.stdout[-4000:] + proc.stderr[-6000:]
    # The public path is announced once, however many kernels take it.
    said = proc.stderr.count("taking the public paths instead of triton's")
    assert said == (0 if fast else 1), proc.stderr[-4000:]


def test_a_kernel_is_wrapped_and_launched_without_tritons_internals(monkeypatch):
    """FastKernel reads a kernel's parameter list (JITFunction.params, Triton's internals:
    kernels/private_apis.py) only once a launch has found the private APIs usable; wrapping
    a kernel (at import) and launching it with them off reads none of it."""
    from triton import JITFunction

    from titan_lowbit.kernels import bitnet_launch as bl
    from titan_lowbit.kernels import private_apis

    launched = []

    class Probe(JITFunction):
        def __init__(self):  # none of Triton's state: any read of it fails
            pass

        @property
        def params(self):
            raise AssertionError("JITFunction.params read")

        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append((grid, args, meta))

    monkeypatch.setattr(private_apis, "_told", set())
    monkeypatch.setenv(private_apis.ENV, "0")
    kernel = bl.FastKernel(Probe())
    kernel((2,), (3, 5), BLOCK=4)
    kernel.prepare((1,), (7,), BLOCK=8)()
    assert launched == [((2,), (3, 5), {"BLOCK": 4}), ((1,), (7,), {"BLOCK": 8})]


def test_fast_launch_passes_what_triton_passes():
    _run(fast=True)


def test_private_apis_off_launches_through_triton():
    _run(fast=False)


if __name__ == "__main__":
    _worker(sys.argv[1] == "fast")
