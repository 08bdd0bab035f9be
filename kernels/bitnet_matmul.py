"""int8 x int8 -> int32 matmul with the BitNet scales fused in the epilogue (Triton).

Math:
    out[m, n] = ( sum_k a[m, k] * b[n, k] ) * a_scale[m] * b_scale          (exact int32 sum,
                                                                             one fp32 epilogue)
    a: int8 [M, K] (row-quantized activations or grad_output), a_scale: fp32 [M]
    b: int8 [N, K] (ternary weight, or its transpose for grad_input), b_scale: fp32 0-d
    out: [M, N] in the activation dtype (fp32 / bf16 / fp16)

Both operands are K-contiguous ("K-major"): Hopper's 8-bit wgmma reads both operands
K-major from shared memory, so the backward pass hands this kernel a transposed copy of
the (small) ternary weight rather than a strided view. |a| <= 127 and |b| <= 127, so an
int32 accumulator holds K up to 133 000 without overflow (checked).

The forward pass uses it as y = x^ W^T (a = x codes, b = W codes); grad_input as
dx = dy^ W (a = dy codes, b = W codes transposed).

The first call of each shape autotunes through Triton's autotuner; later calls launch the
chosen tile's compiled kernel directly (``bitnet_launch.FastKernel``), building the TMA
descriptors with that tile's box instead of running the autotuner's pre-hook.

Inside a torch.compile graph (``traced=True``) the launch is recorded for Inductor, with
the tile that autotuning picks for the shape, timed once per shape while the graph is
traced (on scratch operands of that shape). Where the operands' bases and rows are
16-byte aligned on a Hopper GPU, the variant recorded is the faster in GPU time of the
pointer variant and one that builds its tensor descriptors in the kernel
(``tl.make_tensor_descriptor``: the device-TMA variant); elsewhere it is the pointer
variant. Not the host-descriptor TMA variant: torch 2.11 records no host-side
tensor descriptor built inside a ``triton_op`` (its kernel analysis sees a descriptor
over a fake tensor and fails), and Inductor cannot run the autotuner's pre-hook that
sizes a descriptor's box per config. Descriptors built in a kernel live in a global
scratch buffer that Triton asks an allocator for at each launch: Inductor sets one before
its launches; launches through Triton itself (other compile backends, the autotuner,
tests) get ``_scratch_allocator`` from the kernel's pre-run hook.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .bitnet_launch import FastKernel, arg_key, record_launch
from .bitnet_launch import cdiv as _cdiv
from .loops import kernel_range
from .private_apis import private_api_ok

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Triton fixes interpretation when a kernel is defined (module import), so read it once.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# 127 * 127 * K < 2**31  <=>  K < 133 144
MAX_K = (2**31 - 1) // (127 * 127)
# The iterator of loops with run-time bounds (K, the tile count): compiled, tl.range (the
# loop Python's range gives, without options); it also runs under the interpreter of
# every supported Triton (kernels/loops.py).
_range = kernel_range()


def _set_tma_blocks(nargs):
    """Autotune pre-hook: the tensor descriptors' box is the config's tile (the output's
    is half a tile wide when the epilogue stores it in two halves)."""
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]
    if nargs["OUT_ALIGNED"]:
        nargs["o_desc"].block_shape = _out_box(nargs["BLOCK_M"], nargs["BLOCK_N"],
                                               nargs["TMA_STORE"], nargs["SPLIT_N"])


def _out_box(bm: int, bn: int, tma_store: bool, split: bool) -> list[int]:
    """The output descriptor's box: the tile, or half of it (SPLIT_N); a fixed small box
    when the config stores through pointers (the descriptor is then passed but unused,
    and its box is part of the compiled kernel's signature)."""
    return [bm, bn // (1 + split)] if tma_store else [16, 16]


def _configs(tma: bool, host_descriptors: bool = True) -> list[triton.Config]:
    """Tiles the autotuner times per shape.

    The TMA variant's configs also choose PER_SM (resident programs per SM, each looping
    over tiles; 0: one program per tile), TMA_STORE and SPLIT_N (the epilogue). Measured on
    an H100 (docs/bitnet.md): two 128 x 128 programs per SM with 3 stages and a split TMA
    store win most short-K shapes (K = 2048 and less) by 7 to 32%, as one program's
    epilogue runs while the other's main loop does; the long-K shapes move within 3%.
    The first five one-program-per-tile configs with pointer stores (the pointer
    variant's list) stay, so the autotuner can still pick them where they win.
    ``host_descriptors=False``: the TMA tiles for the variant that builds its descriptors
    in the kernel (no pre-hook sizing host descriptors)."""
    hook = _set_tma_blocks if tma and host_descriptors else None
    if INTERPRET:
        # The interpreter runs every program in numpy; one small tile keeps tests quick
        # and exercises the ragged edges. Under it the TMA variant loops over tiles (two
        # programs: _programs) and stores through split descriptors; the test
        # test_int8_matmul_every_tile_schedule_matches_reference launches the others.
        extra = dict(PER_SM=1, TMA_STORE=True, SPLIT_N=True) if tma else {}
        return [triton.Config(dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, **extra),
                              num_warps=4, num_stages=1,
                              pre_hook=hook)]
    # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages
    one_per_tile = ((128, 256, 128, 8, 3), (128, 256, 128, 8, 4), (256, 128, 128, 8, 3),
                    (256, 128, 128, 8, 4), (128, 128, 128, 4, 4), (128, 128, 128, 8, 4),
                    (128, 256, 64, 8, 4), (64, 128, 128, 4, 4))
    if not tma:
        configs = [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8),
                                 num_warps=w, num_stages=st)
                   for bm, bn, bk, w, st in one_per_tile]
    else:
        # ... PER_SM, TMA_STORE, SPLIT_N
        tiles = ((128, 128, 128, 8, 3, 2, True, True), (128, 256, 128, 8, 3, 1, True, False),
                 (128, 256, 128, 8, 3, 1, True, True), (128, 256, 128, 8, 4, 1, True, True),
                 (256, 128, 128, 8, 3, 1, True, True), (256, 128, 128, 8, 4, 1, True, True))
        tiles += tuple(t + (0, False, False) for t in one_per_tile[:5])
        configs = [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PER_SM=per_sm,
                                      TMA_STORE=store, SPLIT_N=split),
                                 num_warps=w, num_stages=st, pre_hook=hook)
                   for bm, bn, bk, w, st, per_sm, store, split in tiles]
    return configs


def _untimed_with_switch(configs, named_args, **kwargs):
    """The autotuner's pruning step, run once per new shape: with
    ``TITAN_LOWBIT_INT8_AUTOTUNE=0`` the first tile, without timing the others (quick GPU
    test runs; each new shape otherwise costs one timing of every config)."""
    return configs[:1] if os.environ.get("TITAN_LOWBIT_INT8_AUTOTUNE") == "0" else configs


_AUTOTUNE_SWITCH = {"early_config_prune": _untimed_with_switch}


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_index(device: torch.device) -> int:
    """A CUDA device's index ("cuda" alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _programs(tiles: int, per_sm: int, device: torch.device) -> int:
    """Programs to launch: one per tile, or PER_SM per SM looping over the tiles. Off a
    GPU (the interpreter) the "SMs" are 2: few programs, each looping over several tiles."""
    if per_sm == 0:
        return tiles
    if device.type != "cuda":
        return min(tiles, per_sm * 2)
    return min(tiles, per_sm * _cuda_sm_count(_device_index(device)))


@triton.jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped tile order: GROUP_M row tiles share each column tile of b while it sits in L2.
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % group) % group_rows, (pid % group) // group_rows


@triton.jit
def _scaled(acc, a_scale_ptr, b_scale, M, pid_m, BLOCK_M: tl.constexpr):
    """The epilogue's math: acc (int32) * a_scale[row] * b_scale, in fp32."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    return acc.to(tl.float32) * (a_scale * b_scale)[:, None]


@triton.jit
def _store_pointer(out, out_ptr, stride_om, M, N, pid_m, pid_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.autotune(configs=_configs(tma=False), key=["M", "N", "K"], prune_configs_by=_AUTOTUNE_SWITCH)
@triton.jit
def _int8_matmul_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, out_ptr,
    M, N, K,
    stride_am, stride_bn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Pointer loads (cp.async): any 16-byte-unaligned operand. One program per tile
    (looping over tiles measured 3 to 7% slower for this variant)."""
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Clamp out-of-range rows to row 0: loads stay in bounds without a row mask, and the
    # store is masked.
    rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_b = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in _range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out = _scaled(acc, a_scale_ptr, tl.load(b_scale_ptr), M, pid_m, BLOCK_M)
    _store_pointer(out, out_ptr, stride_om, M, N, pid_m, pid_n, BLOCK_M, BLOCK_N)


@triton.jit
def _tma_tile(tile, a_desc, b_desc, o_desc, a_scale_ptr, b_scale, out_ptr, M, N, K, stride_om,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP_M: tl.constexpr, SPLIT_N: tl.constexpr, STORE_TMA: tl.constexpr):
    """One output tile of the TMA kernel: the K loop, then the scaled epilogue."""
    pid_m, pid_n = _tile_of(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in _range(0, K, BLOCK_K):
        a = a_desc.load([pid_m * BLOCK_M, k0])
        b = b_desc.load([pid_n * BLOCK_N, k0])
        acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
    out = _scaled(acc, a_scale_ptr, b_scale, M, pid_m, BLOCK_M)
    if not STORE_TMA:
        _store_pointer(out, out_ptr, stride_om, M, N, pid_m, pid_n, BLOCK_M, BLOCK_N)
    elif SPLIT_N:
        # columns [0, BLOCK_N/2) and [BLOCK_N/2, BLOCK_N) as two stores
        left, right = tl.split(tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        o_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], left.to(out_ptr.dtype.element_ty))
        o_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2],
                     right.to(out_ptr.dtype.element_ty))
    else:
        o_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out.to(out_ptr.dtype.element_ty))


@triton.jit
def _tma_program(a_desc, b_desc, o_desc, a_scale_ptr, b_scale_ptr, out_ptr, M, N, K, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, PER_SM: tl.constexpr, SPLIT_N: tl.constexpr,
                 STORE_TMA: tl.constexpr):
    """One program of the TMA kernels, whichever built the descriptors.
    PER_SM 0: one program per tile. Otherwise each program steps through the tiles pid,
    pid + programs, ..., in one loop flattened with the K loop, so the compiler issues the
    next tile's loads while this tile's epilogue runs."""
    b_scale = tl.load(b_scale_ptr)
    if PER_SM == 0:
        _tma_tile(tl.program_id(0), a_desc, b_desc, o_desc, a_scale_ptr, b_scale, out_ptr,
                  M, N, K, stride_om, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_N, STORE_TMA)
    else:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in _range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
            _tma_tile(tile, a_desc, b_desc, o_desc, a_scale_ptr, b_scale, out_ptr,
                      M, N, K, stride_om, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_N, STORE_TMA)


@triton.autotune(configs=_configs(tma=True), key=["M", "N", "K"], prune_configs_by=_AUTOTUNE_SWITCH)
@triton.jit
def _int8_matmul_tma_kernel(
    a_desc, b_desc, o_desc, a_scale_ptr, b_scale_ptr, out_ptr,
    M, N, K, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PER_SM: tl.constexpr, TMA_STORE: tl.constexpr, SPLIT_N: tl.constexpr,
    OUT_ALIGNED: tl.constexpr,
):
    """Tensor-memory-accelerator loads (Hopper) through descriptors built on the host: the
    copy engine fills shared memory and zero-fills the ragged edges, so the loop carries no
    masks. The output leaves through its descriptor (o_desc, clipped at the edges by the
    copy engine; SPLIT_N: in two half-width stores, half the shared-memory staging) when
    the config asks for it (TMA_STORE) and its rows are 16-byte aligned (OUT_ALIGNED, from
    the caller); otherwise through masked pointer stores (out_ptr, the same tensor)."""
    _tma_program(a_desc, b_desc, o_desc, a_scale_ptr, b_scale_ptr, out_ptr, M, N, K, stride_om,
                 BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PER_SM, SPLIT_N, TMA_STORE and OUT_ALIGNED)


@triton.autotune(configs=_configs(tma=True, host_descriptors=False), key=["M", "N", "K"],
                 prune_configs_by=_AUTOTUNE_SWITCH)
@triton.jit
def _int8_matmul_tma_device_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, out_ptr,
    M, N, K, stride_am, stride_bn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PER_SM: tl.constexpr, TMA_STORE: tl.constexpr, SPLIT_N: tl.constexpr,
    OUT_ALIGNED: tl.constexpr,
):
    """The TMA kernel with its descriptors built here, once per program: plain pointer
    arguments, which a compiled graph can record. The caller guarantees 16-byte-aligned
    bases and row strides of a and b, and of out when OUT_ALIGNED."""
    STORE_TMA: tl.constexpr = TMA_STORE and OUT_ALIGNED
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    if STORE_TMA:
        o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[stride_om, 1],
                                           block_shape=[BLOCK_M, BLOCK_N // (1 + SPLIT_N)])
    else:
        o_desc = out_ptr  # not used: the epilogue stores through pointers
    _tma_program(a_desc, b_desc, o_desc, a_scale_ptr, b_scale_ptr, out_ptr, M, N, K, stride_om,
                 BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PER_SM, SPLIT_N, STORE_TMA)


def _scratch_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for descriptors built in a kernel: device memory from torch's caching
    allocator on the current device, ordered on the current stream (its blocks are
    512-byte aligned, more than the 128 bytes a descriptor needs)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _set_scratch_allocator(*args, **kwargs) -> None:
    """Pre-run hook of the device-TMA kernel: Triton's allocator is a per-thread context
    variable, unset in a thread that never set it (autograd's backward thread, say), so a
    launch through Triton sets ours first."""
    triton.set_allocator(_scratch_allocator)


_int8_matmul_tma_device_kernel.fn.add_pre_run_hook(_set_scratch_allocator)


def _check(a, b, a_scale, b_scale, out_dtype):
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"BitNet int8 matmul takes int8 operands, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"BitNet int8 matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} "
                         "must be [M, K] and [N, K]")
    if a.shape[1] > MAX_K:
        raise ValueError(f"BitNet int8 matmul: K = {a.shape[1]} > {MAX_K} could overflow the "
                         "int32 accumulator")
    if a_scale.dtype != torch.float32 or a_scale.dim() != 1 or a_scale.shape[0] != a.shape[0]:
        raise ValueError("BitNet int8 matmul: a_scale must be fp32 with one value per row of a")
    if b_scale.numel() != 1 or b_scale.dtype != torch.float32:
        raise ValueError("BitNet int8 matmul: b_scale must be a one-element fp32 tensor")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"BitNet int8 matmul: output dtype {out_dtype} is not one of "
                        f"{[str(d) for d in OUT_DTYPES]}")


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _rows_aligned(t: torch.Tensor) -> bool:
    """What a TMA descriptor needs of a 2-D tensor: a 16-byte-aligned base and row stride."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def _tma_ok(*ts: torch.Tensor) -> bool:
    # TMA wants aligned rows (_rows_aligned) and a Hopper-or-newer GPU.
    if not INTERPRET:
        if not ts[0].is_cuda or not _has_tma(ts[0].get_device()):
            return False
    return all(_rows_aligned(t) for t in ts)


class _CheckedDescriptor(TensorDescriptor):
    """A TensorDescriptor whose constraints were checked already: 16-byte-aligned base
    and row stride (``_tma_ok``), positive shape, and the box of a tile that the first,
    validated launch of the same key used. Skips the per-construction validation."""

    def __post_init__(self):
        pass


_POINTER = FastKernel(_int8_matmul_kernel)
_TMA = FastKernel(_int8_matmul_tma_kernel)
# The autotuned kernel behind each variant a compiled graph can record.
_TRACED_KERNELS = {"pointer": _int8_matmul_kernel, "device_tma": _int8_matmul_tma_device_kernel}
IMPLS = ("auto", "tma", "device_tma", "pointer")
# (variant, M, N, K, a row stride, b row stride, out dtype) -> the autotuner's chosen
# Config, recorded by every autotuning launch (the traced path reads it).
_TUNED: dict[tuple, triton.Config] = {}


def _traced_tile(variant: str, M: int, N: int, K: int, stride_a: int, stride_b: int,
                 out_dtype: torch.dtype, device: torch.device) -> triton.Config:
    """The tile the autotuner picks for this variant and shape, timing it now on scratch
    operands if no eager launch of the shape has (while torch.compile traces). Timing
    while tracing needs a private API of torch (``_real_tensors``): without it, the
    variant's first tile."""
    key = (variant, M, N, K, stride_a, stride_b, out_dtype)
    if key not in _TUNED and not private_api_ok("torch"):
        return _TRACED_KERNELS[variant].configs[0]
    if key not in _TUNED:
        with _real_tensors():
            a, b, scale = _scratch_operands(M, N, K, stride_a, stride_b, device)
            int8_matmul_scaled(a, b, scale, scale[0], out_dtype, impl=variant)
    return _TUNED[key]


def _real_tensors():
    """A context outside torch.compile's tracing modes (fake tensors, proxies): timing
    while a graph is traced runs on real device memory. A private API of torch
    (private_apis.py): its callers ask ``private_api_ok("torch")`` first."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _scratch_operands(M: int, N: int, K: int, stride_a: int, stride_b: int, device):
    """Random operands of a traced launch's shape and row strides, to time it on."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randint(-127, 128, (M, stride_a), dtype=torch.int8, device=device,
                      generator=gen)[:, :K]
    b = torch.randint(-1, 2, (N, stride_b), dtype=torch.int8, device=device,
                      generator=gen)[:, :K]
    return a, b, torch.rand(M, dtype=torch.float32, device=device, generator=gen)


def _traced_rows_aligned(t: torch.Tensor) -> bool:
    """``_rows_aligned`` from what a traced (fake) tensor knows: its storage offset and row
    stride (the storage's base comes from an allocator that aligns far beyond 16 bytes)."""
    size = t.element_size()
    return int(t.storage_offset()) * size % 16 == 0 and int(t.stride(0)) * size % 16 == 0


def _gpu_ms(fn, reps: int = 20) -> float:
    """GPU time of one ``fn()`` from a CUDA graph of ``reps`` calls (best of three replays):
    no host time, which the timings of small launches would otherwise measure."""
    fn()  # compiled and autotuned before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: other threads' CUDA calls (a compile running beside training) do not
    # invalidate this capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(reps):
            fn()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


# (M, N, K, a row stride, b row stride, out dtype) -> the variant a compiled graph records
_TRACED_VARIANT: dict[tuple, str] = {}


def _traced_variant(a, b, M: int, N: int, K: int, out_dtype: torch.dtype) -> str:
    """The variant a compiled graph records for this shape: the faster, in GPU time on
    scratch operands, of the pointer and the device-TMA variant (each autotuned) where a
    Hopper GPU and the operands' alignment allow the latter; else the pointer variant.
    Descriptors built in the kernel cost each program some time, which loses on the
    smallest shapes (measured in docs/bitnet.md). Timing while tracing needs a private API
    of torch: without it, the pointer variant."""
    if not (_has_tma(_device_index(a.device)) and _traced_rows_aligned(a) and _traced_rows_aligned(b)
            and private_api_ok("torch")):
        return "pointer"
    key = (M, N, K, int(a.stride(0)), int(b.stride(0)), out_dtype)
    if key not in _TRACED_VARIANT:
        with _real_tensors():
            sa, sb, scale = _scratch_operands(*key[:5], a.device)
            times = {v: _gpu_ms(lambda v=v: int8_matmul_scaled(sa, sb, scale, scale[0], out_dtype,
                                                                 impl=v))
                     for v in ("pointer", "device_tma")}
        _TRACED_VARIANT[key] = min(times, key=times.get)
    return _TRACED_VARIANT[key]


def _launch_traced(a, b, a_scale, b_scale, out, M, N, K):
    """Record the launch in the graph torch.compile builds (module docstring): the
    variant ``_traced_variant`` picks, with its autotuned tile."""
    # int(): a traced call with dynamic sizes specializes on them (the tile is per shape).
    variant = _traced_variant(a, b, int(M), int(N), int(K), out.dtype)
    cfg = _traced_tile(variant, int(M), int(N), int(K), int(a.stride(0)), int(b.stride(0)),
                       out.dtype, a.device)
    meta = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    tiles = _cdiv(M, cfg.kwargs["BLOCK_M"]) * _cdiv(N, cfg.kwargs["BLOCK_N"])
    args = (a, b, a_scale, b_scale, out, M, N, K, a.stride(0), b.stride(0), N)
    if variant == "pointer":
        record_launch(_int8_matmul_kernel.fn, (tiles,), args, meta)
    else:
        meta["OUT_ALIGNED"] = int(N) * out.element_size() % 16 == 0  # out: new, dense rows
        grid = (_programs(tiles, cfg.kwargs["PER_SM"], a.device),)
        record_launch(_int8_matmul_tma_device_kernel.fn, grid, args, meta)


def _launch_device_tma(a, b, a_scale, b_scale, out, M, N, K, out_dtype):
    """An eager launch of the device-TMA variant through Triton's autotuner (tests, and
    the timing behind a traced launch's tile)."""

    def grid(meta):
        tiles = _cdiv(M, meta["BLOCK_M"]) * _cdiv(N, meta["BLOCK_N"])
        return (_programs(tiles, meta["PER_SM"], a.device),)

    _int8_matmul_tma_device_kernel[grid](a, b, a_scale, b_scale, out, M, N, K, a.stride(0),
                                         b.stride(0), N, OUT_ALIGNED=_rows_aligned(out))
    _TUNED[("device_tma", M, N, K, a.stride(0), b.stride(0), out_dtype)] = \
        _int8_matmul_tma_device_kernel.best_config


def int8_matmul_scaled(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                       b_scale: torch.Tensor, out_dtype: torch.dtype,
                       impl: str = "auto", traced: bool = False) -> torch.Tensor:
    """(a @ b.T) * a_scale[:, None] * b_scale on int8 tensor cores, written in out_dtype.

    impl: "tma" (Hopper tensor-descriptor loads through descriptors built on the host, and
    stores where the output's rows are 16-byte aligned), "device_tma" (the same with the
    descriptors built in the kernel), "pointer" (cp.async loads, any alignment) or "auto"
    (TMA where the operands allow it). All compute the same sums. After the first call of
    each shape (which autotunes), "tma" and "pointer" launches skip Triton's autotuner and
    launch preparation (``bitnet_launch.FastKernel``).
    ``traced``: record the launch in the graph torch.compile builds (the device-TMA or the
    pointer variant with the tile the autotuner picks for the shape).
    """
    _check(a, b, a_scale, b_scale, out_dtype)
    if impl not in IMPLS:
        raise ValueError(f"BitNet int8 matmul: impl={impl!r}; choose one of {IMPLS}")
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    if a_scale.stride(0) != 1:
        a_scale = a_scale.contiguous()
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    if traced:
        if impl != "auto":
            raise ValueError("BitNet int8 matmul: a traced launch picks its variant (impl='auto')")
        _launch_traced(a, b, a_scale, b_scale, out, M, N, K)
        return out
    tma_ok = _tma_ok(a, b)
    if impl in ("tma", "device_tma") and not tma_ok:
        raise ValueError(f"BitNet int8 matmul: impl={impl!r} needs 16-byte-aligned operands "
                         "and row strides on a Hopper GPU; use impl='pointer'")
    if impl == "device_tma":
        _launch_device_tma(a, b, a_scale, b_scale, out, M, N, K, out_dtype)
        return out
    use_tma = tma_ok if impl == "auto" else impl == "tma"
    if use_tma:
        out_aligned = _rows_aligned(out)  # the output can leave through a descriptor
        tail = (a_scale, b_scale, out, M, N, K, N)
        kernel = _TMA
    else:
        tail = (a, b, a_scale, b_scale, out, M, N, K, a.stride(0), b.stride(0), N)
        kernel = _POINTER
    # The operands' strides are in the key too (TMA descriptors carry them).
    key = (arg_key(tail), a.stride(0), b.stride(0))
    entry = kernel.lookup(key)
    if entry is not None:
        bm, bn, bk, per_sm, tma_store, split = entry.config
        grid = (_programs(_cdiv(M, bm) * _cdiv(N, bn), per_sm, a.device),)
        if use_tma:
            o_desc = (_CheckedDescriptor(out, [M, N], [N, 1], _out_box(bm, bn, tma_store, split))
                      if out_aligned else out)
            args = (_CheckedDescriptor(a, [M, K], [a.stride(0), 1], [bm, bk]),
                    _CheckedDescriptor(b, [N, K], [b.stride(0), 1], [bn, bk]), o_desc, *tail)
        else:
            args = tail
        kernel.fire(entry, grid, args)
        return out

    def grid(meta):
        tiles = _cdiv(M, meta["BLOCK_M"]) * _cdiv(N, meta["BLOCK_N"])
        return (_programs(tiles, meta.get("PER_SM", 0), a.device),)

    extra = {}
    if use_tma:
        # Box shapes are placeholders; the autotune pre-hook sets each config's tile.
        o_desc = TensorDescriptor(out, [M, N], [N, 1], [16, 16]) if out_aligned else out
        args = (TensorDescriptor(a, [M, K], [a.stride(0), 1], [16, 16]),
                TensorDescriptor(b, [N, K], [b.stride(0), 1], [16, 16]), o_desc, *tail)
        extra["OUT_ALIGNED"] = out_aligned
    else:
        args = tail
    compiled = kernel.kernel[grid](*args, **extra)
    best_config = kernel.kernel.best_config
    _TUNED[("tma" if use_tma else "pointer", M, N, K, a.stride(0), b.stride(0), out_dtype)] = \
        best_config
    best = best_config.kwargs
    kernel.remember(key, compiled, dict(best, **extra),
                    config=(best["BLOCK_M"], best["BLOCK_N"], best["BLOCK_K"], best.get("PER_SM", 0),
                            best.get("TMA_STORE", False), best.get("SPLIT_N", False)))
    return out


def int8_matmul_scaled_reference(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                                 b_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Pure-PyTorch reference: exact integer product, same fp32 epilogue.

    The product is taken in fp64 on every device: each term is at most 128 * 128 = 2**14 in
    magnitude, so a sum of K of them stays an integer below 2**53 for any K up to 2**39
    (5 * 10**11), and every partial sum is exact in whatever order BLAS adds them: the
    value of the kernel's int32 accumulator. (An int64 matmul is just as exact, but on the
    CPU it has no BLAS and ran 40x slower: about 105 ms against 2.5 ms for a 256 x 256 x 768
    product on two cores.)"""
    _check(a, b, a_scale, b_scale, out_dtype)
    acc = (a.to(torch.float64) @ b.to(torch.float64).T).to(torch.float32)
    return (acc * (a_scale[:, None] * b_scale.reshape(()))).to(out_dtype)
