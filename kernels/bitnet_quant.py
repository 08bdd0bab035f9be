"""BitNet b1.58 quantization kernels (Triton) and their pure-PyTorch references.

Math (arXiv 2402.17764, "BitNet b1.58"), with EPS = 1e-5:

    activations, one scale per row m (row-wise abs-max, 8 bits):
        s[m]    = max(max_k |x[m, k]|, EPS) / 127               (correctly rounded fp32 divisions)
        r[m]    = 1 / s[m]
        q[m, k] = clamp(floor(x[m, k] * r[m] + 0.5), -127, 127)  (int8; x ~= q * s)

    weights, one scale per tensor (abs-mean, ternary):
        g       = max(sum |W| / numel(W), EPS)                   (IEEE fp32 division by fp32(numel);
                                                                  sum |W| from the caller, under
                                                                  FSDP all-reduced over the shards;
                                                                  ternarize_from_sum derives g in
                                                                  the ternarizing kernel)
        t[n, k] = clamp(floor(W[n, k] * (1 / g) + 0.5), -1, 1)   (int8 in {-1, 0, +1}; W ~= t * g)

    2-bit packing of ternary values, four per byte along the last dimension:
        code = t + 1 in {0, 1, 2};  byte[n, j] = sum_{i<4} code[n, 4j + i] << (2 i)
        columns past the end of a row pack as t = 0 (code 1) and are dropped on unpacking.

Rounding is half up, floor(v + 0.5) (BitNet's reference code rounds half to even; the two
differ only on exact ties). The scales are correctly rounded on both sides, so the
interpreter reproduces the references bit for bit. On the GPU the compiler may fuse
x * r + 0.5 into one fused multiply-add (one rounding instead of two), so a code can
differ by one where x * r lies within an ulp of a rounding boundary; the GPU tests allow
that for a tiny fraction of elements. Multiplying by the per-row reciprocal instead of
dividing every element keeps the kernels memory-bound.

Launches go through ``bitnet_launch.FastKernel``: Triton's launch path the first time per
argument specialization, the cached compiled kernel afterwards (host time per launch).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .bitnet_launch import FastKernel, record_launch
from .bitnet_launch import cdiv as _cdiv
from .loops import kernel_range

EPS = 1e-5
QMAX = 127
SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest row held in registers at once by the activation quantizer; longer rows take
# two passes over the row (the second one mostly hits L2).
MAX_SINGLE_PASS_COLS = 16384
# The iterator of loops with run-time bounds (K): compiled, the loop Python's range
# gives; it also runs under the interpreter of every supported Triton (kernels/loops.py).
_range = kernel_range()


def check_float_input(name: str, t: torch.Tensor) -> None:
    """Refuse dtypes the kernels were not written for, naming the tensor and the fix."""
    if t.dtype not in SUPPORTED_FLOAT_DTYPES:
        raise TypeError(
            f"BitNet: {name} has dtype {t.dtype}; the BitNet kernels take "
            f"{[str(d) for d in SUPPORTED_FLOAT_DTYPES]}. Cast it first "
            "(training.mixed_precision_param / the model dtype)."
        )


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"BitNet: {name} must be 2-D, got shape {tuple(t.shape)}")


# --------------------------------------------------------------------------------------
# Activation (and grad_output) quantization: row-wise abs-max to int8
# --------------------------------------------------------------------------------------


def row_absmax(x: torch.Tensor) -> torch.Tensor:
    """max_k |x[m, k]| per row, fp32 [M] (exact: no rounding in abs or max); 0 for empty rows."""
    if x.shape[1] == 0:
        return torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x, float("inf"), dim=1, dtype=torch.float32)


def weight_abs_sums(ws) -> list[torch.Tensor]:
    """sum |W| over all elements of each tensor of ``ws``, each an fp32 0-d tensor: the
    abs-mean scale's numerator (a shard's local sum before the sum over its shards).

    The one definition of this sum in eager code, for one weight or for many at once:
    every path that computes a weight's scale (the post-optimizer precompute of all
    weights, a layer's own sum inside its all-gather or tensor-parallel forward, kept
    codes, the unsharded forward) sums a weight in the same order, so its scale has the
    same bits whichever path computed it (a resumed run, whose first step has no
    precomputed sums, continues the uninterrupted one bit for bit).

    The order is that of torch's multi-tensor L1 norm, whose result for a tensor depends
    on that tensor alone: on CUDA it sums fixed-size chunks of each tensor (counted from
    the tensor's start), then the chunks' sums of that tensor, whatever else the list
    holds; elsewhere it is ``torch.linalg.vector_norm`` per tensor. Its CUDA kernel serves
    a list of tensors of one device and dtype that are all dense, so the tensors go to it
    grouped by device and dtype, and one with gaps between its elements as a contiguous
    copy (the same values in the same order). ``torch.linalg.vector_norm`` is another
    CUDA kernel with another order: rounded differently, its sums differ in the last bits.
    """
    ws = [w.detach() for w in ws]
    groups: dict[tuple, list[int]] = {}
    for i, w in enumerate(ws):
        groups.setdefault((w.device, w.dtype), []).append(i)
    sums: list[torch.Tensor | None] = [None] * len(ws)
    for idx in groups.values():
        dense = [ws[i] if ws[i].is_contiguous() else ws[i].contiguous() for i in idx]
        for i, s in zip(idx, torch._foreach_norm(dense, 1, dtype=torch.float32)):
            sums[i] = s
    return sums


def weight_abs_sum(w: torch.Tensor) -> torch.Tensor:
    """sum |W| over all elements of ``w``, fp32 0-d: ``weight_abs_sums`` of one tensor."""
    return weight_abs_sums([w])[0]


def div_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b for fp32 tensors, correctly rounded on CPU and CUDA and inside Inductor's
    generated code (whose fp32 division may be approximate): divided in fp64 and rounded
    once to fp32. The fp64 quotient rounded to fp32 is the correctly rounded fp32 quotient
    (double rounding through 53 >= 2 * 24 + 2 bits is innocuous), i.e. the kernels'
    ``div_rn``. Used on per-row and per-tensor scales only."""
    return (a.double() / b.double()).float()


def _check_row_amax(amax: torch.Tensor | None, x: torch.Tensor) -> None:
    if amax is not None and (amax.dtype != torch.float32 or tuple(amax.shape) != (x.shape[0],)
                             or amax.device != x.device or not amax.is_contiguous()):
        raise ValueError(
            f"BitNet: row abs-max must be a contiguous fp32 tensor of shape ({x.shape[0]},) on "
            f"{x.device}, got {amax.dtype} {tuple(amax.shape)} on {amax.device}"
        )


@triton.jit
def _max_nan(a, b):
    """max(a, b) that propagates NaN, as torch's amax and clamp do: Triton's max and
    maximum return the other operand, which would turn a NaN activation or weight into
    finite codes with a finite scale (a diverging run would show no NaN loss)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, amax_ptr, M, K, stride_xm, stride_qm,
    EPS_C: tl.constexpr, QMAX_C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_PASS: tl.constexpr,
    AMAX_GIVEN: tl.constexpr,
):
    # AMAX_GIVEN: the row abs-max is read from amax_ptr instead of computed from this
    # x (tensor parallelism: the max over all shards of a row, all-reduced by the caller).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_row = q_ptr + rows.to(tl.int64)[:, None] * stride_qm
    if SINGLE_PASS:
        mask = row_ok[:, None] & (cols[None, :] < K)
        x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if AMAX_GIVEN:
            amax = tl.load(amax_ptr + rows, mask=row_ok, other=0.0)
        else:
            amax = tl.reduce(tl.abs(x), 1, _max_nan)
        scale = tl.math.div_rn(_max_nan(amax, EPS_C), tl.full(amax.shape, QMAX_C, tl.float32))
        recip = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)
        q = tl.minimum(tl.maximum(tl.floor(x * recip[:, None] + 0.5), -QMAX_C), QMAX_C)
        tl.store(q_row + cols[None, :], q.to(tl.int8), mask=mask)
    else:
        if AMAX_GIVEN:
            amax = tl.load(amax_ptr + rows, mask=row_ok, other=0.0)
        else:
            amax = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in _range(0, K, BLOCK_K):
                mask = row_ok[:, None] & ((k0 + cols)[None, :] < K)
                x = tl.load(x_row + (k0 + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
                amax = _max_nan(amax, tl.reduce(tl.abs(x), 1, _max_nan))
        scale = tl.math.div_rn(_max_nan(amax, EPS_C), tl.full(amax.shape, QMAX_C, tl.float32))
        recip = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)
        for k0 in _range(0, K, BLOCK_K):
            mask = row_ok[:, None] & ((k0 + cols)[None, :] < K)
            x = tl.load(x_row + (k0 + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.floor(x * recip[:, None] + 0.5), -QMAX_C), QMAX_C)
            tl.store(q_row + (k0 + cols)[None, :], q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=row_ok)


@functools.lru_cache(maxsize=None)
def _quantize_tiles(K: int, block_k: int | None) -> tuple[int, int, bool, int]:
    full = triton.next_power_of_2(max(K, 16))  # once per K (cached)
    if block_k is None:
        block_k = min(full, MAX_SINGLE_PASS_COLS)
    single = block_k >= K
    # Aim for ~4K elements per program so short rows still give each program real work.
    block_m = max(1, min(16, 4096 // block_k)) if single else 1
    num_warps = 4 if block_k * block_m <= 4096 else (8 if block_k * block_m <= 8192 else 16)
    return block_m, block_k, single, num_warps


_QUANTIZE_ROWS = FastKernel(_quantize_rows_kernel)


def quantize_rows(x: torch.Tensor, block_k: int | None = None,
                  amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise abs-max int8 quantization of a 2-D tensor in one fused kernel.

    Returns (q int8 [M, K], scale fp32 [M]) with x ~= q * scale[:, None]. One read of x
    and one write of q: the scale never leaves registers before the quantization.
    ``amax`` (fp32 [M]) gives each row's abs-max instead (a row sharded over tensor-
    parallel ranks is quantized with the max over all its shards, as if unsharded).
    ``block_k`` forces the column tile (tests use it to exercise the two-pass path).
    """
    _check_2d("quantize_rows input", x)
    check_float_input("quantize_rows input", x)
    _check_row_amax(amax, x)
    if x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, scale
    block_m, block_k, single, num_warps = _quantize_tiles(K, block_k)
    _QUANTIZE_ROWS(
        (_cdiv(M, block_m),), (x, q, scale, scale if amax is None else amax, M, K, x.stride(0), K),
        EPS_C=EPS, QMAX_C=float(QMAX), BLOCK_M=block_m, BLOCK_K=block_k,
        SINGLE_PASS=single, AMAX_GIVEN=amax is not None, num_warps=num_warps,
    )
    return q, scale


def quantize_rows_reference(x: torch.Tensor,
                            amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch reference of ``quantize_rows`` (same math, any device)."""
    _check_2d("quantize_rows input", x)
    check_float_input("quantize_rows input", x)
    _check_row_amax(amax, x)
    xf = x.float()
    if amax is None:
        amax = row_absmax(x)
    scale = div_rn(amax.clamp_min(EPS), torch.full_like(amax, QMAX))
    recip = div_rn(torch.ones_like(scale), scale)
    q = torch.floor(xf * recip[:, None] + 0.5).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


@triton.jit
def _dequantize_rows_kernel(
    q_ptr, scale_ptr, out_ptr, M, K, stride_qm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    q = tl.load(q_ptr + r64 * stride_qm + cols[None, :], mask=mask, other=0)
    s = tl.load(scale_ptr + rows, mask=rows < M, other=0.0)
    out = q.to(tl.float32) * s[:, None]
    tl.store(out_ptr + r64 * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


_DEQUANTIZE_ROWS = FastKernel(_dequantize_rows_kernel)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out[m, k] = q[m, k] * scale[m], rounded once to ``dtype`` (the saved activation x^)."""
    _check_2d("dequantize_rows codes", q)
    if dtype not in SUPPORTED_FLOAT_DTYPES:
        raise TypeError(f"BitNet: dequantize_rows cannot produce dtype {dtype}")
    if q.stride(1) != 1:
        q = q.contiguous()
    M, K = q.shape
    out = torch.empty((M, K), dtype=dtype, device=q.device)
    if M == 0 or K == 0:
        return out
    block_m, block_k = 8, 512
    _DEQUANTIZE_ROWS((_cdiv(M, block_m), _cdiv(K, block_k)), (q, scale, out, M, K, q.stride(0), K),
                     BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4)
    return out


def dequantize_rows_reference(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pure-PyTorch reference of ``dequantize_rows``."""
    return (q.float() * scale.float()[:, None]).to(dtype)


# --------------------------------------------------------------------------------------
# Weights: ternary values (int8) or ternary values packed four per byte
# --------------------------------------------------------------------------------------


def absmean_scale_reference(w: torch.Tensor, abs_sum: torch.Tensor | None = None,
                            numel: int | None = None) -> torch.Tensor:
    """g = max(sum|W| / numel, EPS) as an fp32 0-d tensor.

    ``abs_sum``/``numel`` let a sharded caller pass the all-reduced global sum and the
    global element count instead of this tensor's own.
    """
    if abs_sum is None:
        abs_sum = weight_abs_sum(w)
    n = w.numel() if numel is None else numel
    abs_sum = abs_sum.float()
    # An IEEE division by fp32(n), as the kernels do.
    return div_rn(abs_sum, torch.full_like(abs_sum, n)).clamp_min(EPS)


@triton.jit
def _ternarize_kernel(
    w_ptr, scale_ptr, out_ptr, scale_out_ptr, out_t_ptr, numel, R, C, stride_wr, stride_or,
    PACK: tl.constexpr, FROM_SUM: tl.constexpr, TRANSPOSED: tl.constexpr, EPS_C: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # t = clamp(floor(w / g + 0.5), -1, 1)   (w / g as w * div_rn(1, g))
    # BLOCK_C counts output columns: ternary columns (PACK=False) or packed bytes (PACK=True).
    # FROM_SUM: scale_ptr holds sum |W|; every program computes g = max(sum / numel, EPS)
    # (IEEE division) and program (0, 0) writes it to scale_out_ptr.
    # TRANSPOSED (not with PACK): the codes also go to out_t [C, R] (contiguous), the
    # K-major operand of grad_input's int8 matmul, from the same load of w.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ocols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = (rows < R)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    if FROM_SUM:
        # numel: a Python float (fp32(numel), however the launcher passes it).
        g = _max_nan(tl.math.div_rn(tl.load(scale_ptr), tl.cast(numel, tl.float32)), EPS_C)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scale_out_ptr, g)
    else:
        g = tl.load(scale_ptr)
    recip = tl.math.div_rn(1.0, g)
    if PACK:
        # One contiguous load of the 4 * BLOCK_C columns, viewed as [BLOCK_R, BLOCK_C, 4]:
        # byte j of a row packs columns 4j .. 4j + 3. Past the row's end w = 0: code 1.
        c = tl.program_id(1) * BLOCK_C * 4 + tl.arange(0, BLOCK_C * 4)
        m = row_ok & (c < C)[None, :]
        w = tl.load(w_ptr + r64 * stride_wr + c[None, :], mask=m, other=0.0).to(tl.float32)
        t = tl.minimum(tl.maximum(tl.floor(w * recip + 0.5), -1.0), 1.0)
        codes = tl.reshape(t.to(tl.int32) + 1, [BLOCK_R, BLOCK_C, 4])
        packed = tl.sum(codes << (tl.arange(0, 4) * 2)[None, None, :], axis=2)
        m = row_ok & (ocols < tl.cdiv(C, 4))[None, :]
        tl.store(out_ptr + r64 * stride_or + ocols[None, :], packed.to(tl.uint8), mask=m)
    else:
        m = row_ok & (ocols < C)[None, :]
        w = tl.load(w_ptr + r64 * stride_wr + ocols[None, :], mask=m, other=0.0).to(tl.float32)
        t = tl.minimum(tl.maximum(tl.floor(w * recip + 0.5), -1.0), 1.0).to(tl.int8)
        tl.store(out_ptr + r64 * stride_or + ocols[None, :], t, mask=m)
        if TRANSPOSED:
            t_ptrs = out_t_ptr + ocols.to(tl.int64)[:, None] * R + rows[None, :]
            tl.store(t_ptrs, tl.trans(t), mask=tl.trans(m))


_TERNARIZE = FastKernel(_ternarize_kernel)


def _check_scale(scale: torch.Tensor, like: torch.Tensor) -> None:
    _check_scale_input("the weight scale", scale, like)


def _check_scale_input(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.numel() != 1 or t.dtype != torch.float32 or t.device != like.device:
        raise ValueError(
            f"BitNet: {name} must be a one-element fp32 tensor on the weight's "
            f"device, got shape {tuple(t.shape)} {t.dtype} on {t.device}"
        )


def _ternarize_args(w, scale_in, scale_out, out, numel: float, pack: bool, from_sum: bool,
                    out_t=None):
    """(grid, runtime arguments, constexprs) of one ternarize launch of contiguous-row w
    (and, with ``out_t``, of its transposed codes too)."""
    R, C = w.shape
    out_cols = out.shape[1]
    # Square tiles when the codes are also stored transposed: both stores write rows of
    # 64 bytes.
    block_r, block_c = (8, 128) if pack else ((64, 64) if out_t is not None else (16, 256))
    return ((_cdiv(R, block_r), _cdiv(out_cols, block_c)),
            (w, scale_in, out, scale_out, out if out_t is None else out_t, numel, R, C,
             w.stride(0), out_cols),
            dict(PACK=pack, FROM_SUM=from_sum, TRANSPOSED=out_t is not None, EPS_C=EPS,
                 BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4))


def _ternarize_out(w, pack: bool) -> torch.Tensor:
    R, C = w.shape
    return torch.empty((R, _cdiv(C, 4) if pack else C),
                       dtype=torch.uint8 if pack else torch.int8, device=w.device)


def _ternarize_launch(w, scale_in, scale_out, numel: float, pack: bool, from_sum: bool,
                      transposed: bool = False):
    """codes, or (codes, transposed codes) when ``transposed``."""
    if w.stride(1) != 1:
        w = w.contiguous()
    out = _ternarize_out(w, pack)
    out_t = torch.empty((w.shape[1], w.shape[0]), dtype=torch.int8, device=w.device) if transposed else None
    if out.numel() == 0:
        if from_sum:  # no program would write the scale
            scale_out.copy_(absmean_scale_reference(w, scale_in, int(numel)))
        return (out, out_t) if transposed else out
    grid, args, meta = _ternarize_args(w, scale_in, scale_out, out, numel, pack, from_sum, out_t)
    _TERNARIZE(grid, args, **meta)
    return (out, out_t) if transposed else out


def ternarize(w: torch.Tensor, scale: torch.Tensor, pack: bool = False) -> torch.Tensor:
    """Ternary codes of a 2-D weight given its (global) abs-mean scale, in one kernel.

    pack=False: int8 [R, C] in {-1, 0, 1} (the matmul operand).
    pack=True: uint8 [R, ceil(C / 4)], four 2-bit codes per byte (the all-gather payload).
    """
    _check_2d("ternarize weight", w)
    check_float_input("ternarize weight", w)
    _check_scale(scale, w)
    return _ternarize_launch(w, scale, scale, 1.0, pack, False)


def _check_from_sum_inputs(w: torch.Tensor, abs_sum: torch.Tensor) -> None:
    _check_2d("ternarize weight", w)
    check_float_input("ternarize weight", w)
    _check_scale_input("the abs-sum of the weight", abs_sum, w)


def ternarize_from_sum(w: torch.Tensor, abs_sum: torch.Tensor, numel: int,
                       pack: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Ternary codes of a 2-D weight and its abs-mean scale from ``abs_sum`` = sum |W|, in
    one kernel: (codes as ``ternarize`` returns them, g = max(abs_sum / numel, EPS)).

    ``abs_sum`` (fp32, one element) and ``numel`` cover the whole weight: under FSDP the
    all-reduced sum and the global element count. The scale is the one
    ``absmean_scale_reference(w, abs_sum, numel)`` computes (an IEEE division by fp32(numel)).
    """
    _check_from_sum_inputs(w, abs_sum)
    scale = torch.empty((), dtype=torch.float32, device=w.device)
    return _ternarize_launch(w, abs_sum, scale, float(numel), pack, True), scale


def ternarize_from_sum_transposed(w: torch.Tensor, abs_sum: torch.Tensor, numel: int
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ternarize_from_sum`` (unpacked) that also writes the codes transposed, from the
    same read of ``w``: (codes [R, C], codes^T [C, R] contiguous, g). The transposed codes
    are grad_input's K-major int8 operand, which would otherwise be a copy of the codes."""
    _check_from_sum_inputs(w, abs_sum)
    scale = torch.empty((), dtype=torch.float32, device=w.device)
    codes, codes_t = _ternarize_launch(w, abs_sum, scale, float(numel), False, True, True)
    return codes, codes_t, scale


def record_ternarize_from_sum_transposed(w: torch.Tensor, abs_sum: torch.Tensor, numel: int
                                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ternarize_from_sum_transposed`` recorded in the graph torch.compile is building
    (inside a ``torch.library.triton_op``): Inductor launches the kernel itself. ``w``
    must have contiguous rows."""
    codes = _ternarize_out(w, pack=False)
    codes_t = torch.empty((w.shape[1], w.shape[0]), dtype=torch.int8, device=w.device)
    scale = torch.empty((), dtype=torch.float32, device=w.device)
    grid, args, meta = _ternarize_args(w, abs_sum, scale, codes, float(numel), False, True, codes_t)
    record_launch(_ternarize_kernel, grid, args, meta)
    return codes, codes_t, scale


def prepare_ternarize_from_sum(w: torch.Tensor, abs_sum: torch.Tensor, numel: int,
                               pack: bool = False):
    """``ternarize_from_sum`` prepared for repeated calls: returns (launch, codes, scale).

    Each ``launch()`` rewrites the ``codes`` and ``scale`` buffers from the current values
    of ``w`` and ``abs_sum`` (what ``ternarize_from_sum`` would return), reusing the
    buffers, the arguments and the compiled kernel: a few microseconds of host time per
    call. ``w`` and ``abs_sum`` must stay the same tensors (their values may change);
    ``w``'s rows must be contiguous (a copy would freeze its values).
    """
    launch, out, _, scale = _prepare_ternarize(w, abs_sum, numel, pack, transposed=False)
    return launch, out, scale


def prepare_ternarize_from_sum_transposed(w: torch.Tensor, abs_sum: torch.Tensor, numel: int):
    """``ternarize_from_sum_transposed`` prepared for repeated calls (as
    ``prepare_ternarize_from_sum``): returns (launch, codes, codes^T, scale)."""
    return _prepare_ternarize(w, abs_sum, numel, False, transposed=True)


def _prepare_ternarize(w, abs_sum, numel, pack: bool, transposed: bool):
    _check_from_sum_inputs(w, abs_sum)
    if w.stride(1) != 1:
        raise ValueError(f"BitNet: a prepared ternarize needs contiguous rows, got strides {w.stride()}")
    scale = torch.empty((), dtype=torch.float32, device=w.device)
    out = _ternarize_out(w, pack)
    out_t = torch.empty((w.shape[1], w.shape[0]), dtype=torch.int8, device=w.device) if transposed else None
    if out.numel() == 0:
        def launch() -> None:
            scale.copy_(absmean_scale_reference(w, abs_sum, int(numel)))
    else:
        grid, args, meta = _ternarize_args(w, abs_sum, scale, out, float(numel), pack, True, out_t)
        launch = _TERNARIZE.prepare(grid, args, **meta)
    return launch, out, out_t, scale


def ternarize_reference(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch reference of ``ternarize(pack=False)``."""
    _check_2d("ternarize weight", w)
    check_float_input("ternarize weight", w)
    _check_scale(scale, w)
    recip = div_rn(torch.ones_like(scale), scale)
    return torch.floor(w.float() * recip + 0.5).clamp_(-1, 1).to(torch.int8)


def pack_ternary_reference(t: torch.Tensor) -> torch.Tensor:
    """Pack int8 ternary values [R, C] into uint8 [R, ceil(C / 4)] (pads with zeros)."""
    _check_2d("pack_ternary input", t)
    if t.dtype != torch.int8:
        raise TypeError(f"BitNet: pack_ternary takes int8 ternary values, got {t.dtype}")
    R, C = t.shape
    pad = (-C) % 4
    codes = torch.nn.functional.pad(t.to(torch.int32) + 1, (0, pad), value=1)
    if t.device.type != "meta" and ((codes < 0) | (codes > 2)).any():
        raise ValueError("BitNet: pack_ternary input holds values outside {-1, 0, 1}")
    codes = codes.view(R, -1, 4)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=t.device)
    return (codes << shifts).sum(dim=2).to(torch.uint8)


@triton.jit
def _unpack_kernel(p_ptr, out_ptr, R, C, stride_pr, stride_or,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pcols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = (rows < R)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    m = row_ok & (pcols < tl.cdiv(C, 4))[None, :]
    p = tl.load(p_ptr + r64 * stride_pr + pcols[None, :], mask=m, other=0).to(tl.int32)
    # [BLOCK_R, BLOCK_C, 4] codes, stored as the 4 * BLOCK_C contiguous columns they are
    # (one coalesced store; four strided byte stores ran at a few percent of bandwidth).
    t = ((p[:, :, None] >> (tl.arange(0, 4) * 2)[None, None, :]) & 3) - 1
    t = tl.reshape(t, [BLOCK_R, BLOCK_C * 4])
    c = tl.program_id(1) * BLOCK_C * 4 + tl.arange(0, BLOCK_C * 4)
    tl.store(out_ptr + r64 * stride_or + c[None, :], t.to(tl.int8), mask=row_ok & (c < C)[None, :])


_UNPACK = FastKernel(_unpack_kernel)


def unpack_ternary(packed: torch.Tensor, cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Unpack uint8 [R, ceil(cols / 4)] into int8 ternary values [R, cols] (into ``out`` if given)."""
    _check_2d("unpack_ternary input", packed)
    if packed.dtype != torch.uint8:
        raise TypeError(f"BitNet: unpack_ternary takes uint8 packed codes, got {packed.dtype}")
    R, pcols = packed.shape
    if pcols != _cdiv(cols, 4):
        raise ValueError(f"BitNet: {pcols} packed bytes per row cannot hold {cols} columns")
    if out is None:
        out = torch.empty((R, cols), dtype=torch.int8, device=packed.device)
    elif out.shape != (R, cols) or out.dtype != torch.int8 or not out.is_contiguous():
        raise ValueError(f"BitNet: unpack_ternary out must be contiguous int8 {(R, cols)}")
    if R == 0 or cols == 0:
        return out
    if packed.stride(1) != 1:
        packed = packed.contiguous()
    block_r, block_c = 16, 128
    _UNPACK((_cdiv(R, block_r), _cdiv(pcols, block_c)),
            (packed, out, R, cols, packed.stride(0), cols),
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return out


def unpack_ternary_reference(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Pure-PyTorch reference of ``unpack_ternary``."""
    _check_2d("unpack_ternary input", packed)
    if packed.dtype != torch.uint8:
        raise TypeError(f"BitNet: unpack_ternary takes uint8 packed codes, got {packed.dtype}")
    if packed.shape[1] != (cols + 3) // 4:
        raise ValueError(f"BitNet: {packed.shape[1]} packed bytes per row cannot hold {cols} columns")
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=packed.device)
    codes = (packed.to(torch.int32)[:, :, None] >> shifts) & 3
    return (codes.reshape(packed.shape[0], -1)[:, :cols] - 1).to(torch.int8)


@triton.jit
def _transpose_codes_kernel(src_ptr, dst_ptr, R, C, stride_sr,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # dst[c, r] = src[r, c]: src int8 [R, C] (rows stride_sr apart), dst int8 [C, R]
    # contiguous. One tile read row-major and written transposed, both coalesced (the
    # compiler moves the tile through shared memory for tl.trans).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    t = tl.load(src_ptr + rows.to(tl.int64)[:, None] * stride_sr + cols[None, :], mask=m)
    tl.store(dst_ptr + cols.to(tl.int64)[:, None] * R + rows[None, :], tl.trans(t),
             mask=tl.trans(m))


_TRANSPOSE_CODES = FastKernel(_transpose_codes_kernel)


def transpose_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 [R, C] -> its transpose [C, R], contiguous: grad_input's K-major operand for a
    weight whose codes came without it (FSDP2's all-gathered weight). torch's generic
    ``codes.t().contiguous()`` moves single bytes along strided rows; on the H100 it took
    longer than quantizing the weight from its bf16 values (docs/bitnet.md)."""
    _check_codes("transpose_codes", codes)
    R, C = codes.shape
    out = torch.empty((C, R), dtype=torch.int8, device=codes.device)
    if R == 0 or C == 0:
        return out
    if codes.stride(1) != 1:
        codes = codes.contiguous()
    block = 64
    _TRANSPOSE_CODES((_cdiv(R, block), _cdiv(C, block)), (codes, out, R, C, codes.stride(0)),
                     BLOCK_R=block, BLOCK_C=block, num_warps=4)
    return out


def transpose_codes_reference(codes: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch reference of ``transpose_codes``."""
    _check_codes("transpose_codes", codes)
    return codes.t().contiguous()


def _check_codes(name: str, codes: torch.Tensor) -> None:
    _check_2d(f"{name} input", codes)
    if codes.dtype != torch.int8:
        raise TypeError(f"BitNet: {name} takes int8 codes, got {codes.dtype}")
