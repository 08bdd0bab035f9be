"""Triton's compiler and launcher stubbed out, so that Triton's own launch path (argument
binding, specialization, its kernel cache) and titan_lowbit's fast launches run on a
machine without a GPU. Used by tests/test_bitnet_launch.py."""

import os

import torch


def stub_triton_launches() -> dict:
    """Stub out Triton's compiler and launcher. Must run before triton is imported with TRITON_INTERPRET
    set (it sets TRITON_INTERPRET=0).

    Triton runs normally up to the launch: Autotuner.run and JITFunction.run bind and
    specialize the arguments, look the kernel up in its cache and call the compiled
    kernel's ``run``, which here does nothing but count (and record, when
    ``stub["record"]`` is a list, the arguments it got); the first launch of each
    specialization "compiles" a stub instead of a cubin. Returns the counters:
    ``launches`` (compiled-kernel runs) and ``triton_runs`` (launches that went through
    JITFunction.run).
    """
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["TITAN_LOWBIT_INT8_AUTOTUNE"] = "0"  # one tile: nothing to time
    import triton  # noqa: F401
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    stub = {"launches": 0, "triton_runs": 0, "record": None}

    class _StubKernel:
        function = 0x5EED
        packed_metadata = ("packed",)

        def __init__(self, name):
            self.name = name

        def launch_metadata(self, grid, stream, *args):
            return {"name": self.name, "grid": grid}

        def run(self, *args):
            stub["launches"] += 1
            if stub["record"] is not None:
                stub["record"].append((self.name, args))

    class _StubDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 7

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            # Triton 3.6's autotuner times a single remaining config too (3.9 skips it):
            # nothing runs here, every config takes the same time.
            return lambda fn, quantiles=None, **kwargs: [1.0] * len(quantiles or (1,))

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = _StubKernel(self.__name__)
        self.device_caches[device][0][key] = kernel
        return kernel

    jit_run = JITFunction.run

    def _counting_run(self, *args, **kwargs):
        stub["triton_runs"] += 1
        return jit_run(self, *args, **kwargs)

    driver.set_active(_StubDriver())
    JITFunction._do_compile = _do_compile
    JITFunction.run = _counting_run
    return stub


def bitnet_gpu_path_on_cpu():
    """With stubbed launches: CPU tensors take the layer's Triton path (TMA where aligned)."""
    from titan_lowbit.bitnet import ops
    from titan_lowbit.kernels import bitnet_matmul as mm

    ops._on_gpu = lambda t: True
    mm._tma_ok = lambda *ts: all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in ts)
