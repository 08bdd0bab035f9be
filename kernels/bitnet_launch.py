"""Low-overhead launches of the BitNet Triton kernels.

Triton's launch path redoes per call what only changes with the arguments' types and
shapes: ``Autotuner.run`` rebuilds argument dicts and the tuning key and runs the
config's pre-hook; ``JITFunction.run`` reads its knobs, binds and specializes every
argument, builds the kernel-cache key from their string form, checks the kernel's global
values and builds the launch metadata. That is tens of microseconds of Python per launch,
and a BitNet layer launches five to seven kernels per step.

``FastKernel`` launches each specialization the first time through Triton (which
compiles, autotunes and launches it, exactly as ``kernel[grid](...)`` does) and keeps the
compiled kernel under a key of everything Triton specializes on: the device, every
integer argument's value (Triton specializes on == 1, divisibility by 16 and the integer
width), every tensor argument's dtype and 16-byte alignment, and the compile-time
meta-parameters. Later launches with the same key call the compiled kernel's launcher
directly with the same arguments Triton would pass it (all parameters in order, the
constexpr values included), on the current device's current stream, with Triton's launch
hooks when any are installed (profilers).

Inside a torch.compile graph (the ``torch.library.triton_op`` operators of
``titan_lowbit.bitnet.ops``) the int8 matmul records its launch with ``record_launch``
(``torch.library.wrap_triton``) instead: Inductor then compiles the kernel and launches it
from its generated code, with no Python of ours left per step.

The compiled kernel's launcher and its arguments, and the kernel's parameter list, are
Triton's private layout (``private_apis.py``), so the cache is used only with a tested
Triton, and none of them is read before a kernel's first launch has asked: otherwise, and
with ``TITAN_LOWBIT_PRIVATE_APIS=0``, every launch goes through Triton (same kernels, same
results). Under TRITON_INTERPRET=1 the kernels are interpreted functions with nothing
compiled to keep: every launch goes through Triton.
"""

from __future__ import annotations

from typing import Callable

import torch
from triton import JITFunction, knobs

from .private_apis import private_api_ok

# Distinct specializations kept per kernel; a run with ever-changing shapes (e.g. varying
# sequence lengths) starts over instead of growing without bound.
MAX_ENTRIES = 512


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code (triton.cdiv is a constexpr_function: microseconds a call)."""
    return -(-a // b)


def _jit_function(kernel):
    """The JITFunction under an Autotuner/Heuristics chain (None when interpreted)."""
    fn = kernel
    while not isinstance(fn, JITFunction):
        fn = getattr(fn, "fn", None)
        if fn is None:
            return None
    return fn


def arg_key(args) -> tuple:
    """What Triton specializes a launch on, for positional runtime arguments.

    Integers by value (a superset of Triton's == 1 / % 16 / width specialization), tensors
    by dtype and 16-byte alignment, floats and None by type (never specialized).
    """
    key = []
    for a in args:
        if type(a) is int:
            key.append(a)
        elif isinstance(a, torch.Tensor):
            key.append(a.dtype)
            key.append(a.data_ptr() % 16 == 0)
        elif type(a) is float or a is None:
            key.append(type(a))
        else:
            raise TypeError(f"FastKernel: unsupported runtime argument of type {type(a).__name__}")
    return tuple(key)


class _Entry:
    __slots__ = ("launcher", "handle", "packed", "kernel", "tail", "config")

    def __init__(self, compiled, tail, config):
        self.launcher = compiled.run  # initialized by the first launch
        self.handle = compiled.function  # the loaded device function
        self.packed = compiled.packed_metadata
        self.kernel = compiled
        self.tail = tail
        self.config = config


class FastKernel:
    """Launch ``kernel`` (``@triton.jit``, optionally under ``@triton.autotune``) with a
    per-specialization cache of its compiled kernel (module docstring).

    Runtime arguments are passed positionally and must precede every constexpr parameter
    in the kernel's signature; constexpr values and launch options go in ``meta``.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.jit = _jit_function(kernel)
        self._entries: dict = {}
        self._driver = None
        self._enabled = None  # decided at the first launch (private_api_ok)

    @property
    def enabled(self) -> bool:
        """Whether launches go through the cache: a compiled kernel and a tested Triton."""
        if self._enabled is None:
            self._enabled = self.jit is not None and private_api_ok("triton")
            if self._enabled:
                self._read_parameters()
        return self._enabled

    def _read_parameters(self) -> None:
        """How many runtime parameters the kernel takes and the names of its constexpr
        ones, which must come after all runtime parameters (the launcher takes them in
        order)."""
        params = self.jit.params
        n_rt = sum(not p.is_constexpr for p in params)
        if any(p.is_constexpr for p in params[:n_rt]):
            raise TypeError(f"FastKernel: {self.jit.__name__} must list its constexpr "
                            "parameters after all runtime parameters")
        self._n_runtime = n_rt
        self._constexpr_names = tuple(p.name for p in params[n_rt:])

    # -- the cache ----------------------------------------------------------------------

    def _device(self) -> int:
        if self._driver is None:
            from triton.runtime import driver

            active = driver.active
            self._driver = (active.get_current_device, active.get_current_stream)
        return self._driver[0]()

    def lookup(self, key):
        """The entry for ``key`` on the current device, or None (launch through Triton)."""
        if not self.enabled:
            return None
        return self._entries.get((self._device(), key))

    def remember(self, key, compiled, meta: dict, config=None):
        """Keep the kernel Triton just compiled and launched for ``key``; ``meta`` holds
        the constexpr values it was launched with (``config``: caller data, e.g. the tile
        the autotuner chose)."""
        if not self.enabled or compiled is None or not hasattr(compiled, "packed_metadata"):
            return
        missing = [n for n in self._constexpr_names if n not in meta]
        if missing:
            raise TypeError(f"FastKernel: {self.jit.__name__} launched without {missing}")
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.clear()
        tail = tuple(meta[n] for n in self._constexpr_names)
        self._entries[(self._device(), key)] = _Entry(compiled, tail, config)

    def fire(self, entry: _Entry, grid: tuple, args: tuple) -> None:
        """Launch a remembered kernel: what JITFunction.run does after its cache hit."""
        device = self._driver[0]()
        stream = self._driver[1](device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        enter = knobs.runtime.launch_enter_hook
        if getattr(enter, "calls", enter):  # hooks installed (a profiler): as Triton does
            md = entry.kernel.launch_metadata(grid, stream, *args, *entry.tail)
            entry.launcher(grid[0], g1, g2, stream, entry.handle, entry.packed, md,
                           enter, knobs.runtime.launch_exit_hook, *args, *entry.tail)
        else:
            entry.launcher(grid[0], g1, g2, stream, entry.handle, entry.packed, None,
                           None, None, *args, *entry.tail)

    # -- the common case ----------------------------------------------------------------

    def __call__(self, grid: tuple, args: tuple, **meta) -> None:
        """``kernel[grid](*args, **meta)``, from the cache after the first launch of a
        specialization."""
        if not self.enabled:
            self.kernel[grid](*args, **meta)
            return
        key = (arg_key(args), tuple(meta.items()))
        entry = self._entries.get((self._device(), key))
        if entry is not None:
            self.fire(entry, grid, args)
            return
        if len(args) != self._n_runtime:
            raise TypeError(f"FastKernel: {self.jit.__name__} takes {self._n_runtime} "
                            f"runtime arguments, got {len(args)}")
        self.remember(key, self.kernel[grid](*args, **meta), meta)

    def prepare(self, grid: tuple, args: tuple, **meta) -> Callable[[], None]:
        """``kernel[grid](*args, **meta)`` as a zero-argument launch for arguments that are
        the same tensors at every call (buffers rewritten in place, never reallocated):
        the specialization key is built once, and each call after the first launch goes
        straight to ``fire``."""
        key = (arg_key(args), tuple(meta.items()))

        def launch() -> None:
            entry = self.lookup(key)
            if entry is None:
                self(grid, args, **meta)
            else:
                self.fire(entry, grid, args)

        return launch


def record_launch(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """Record ``kernel[grid](*args, **meta)`` in the graph that torch.compile is building
    (inside a ``torch.library.triton_op``); Inductor compiles and launches it itself.
    ``meta`` may hold launch options (num_warps, num_stages) next to constexpr values."""
    from torch.library import wrap_triton

    wrap_triton(kernel)[grid](*args, **meta)
