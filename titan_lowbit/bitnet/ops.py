"""BitNet b1.58 linear: custom ops over the kernels, and the straight-through autograd.

The kernels run inside ``torch.library`` operators (weight quantization, of a whole
weight or of a tensor-parallel shard, forward, backward), on CUDA through the Triton
kernels and on every other device through the pure-PyTorch references of the same math
(the design's CPU path). Outside torch.compile each is a plain ``torch.library.Library``
operator with a fake kernel, launching through ``bitnet_launch.FastKernel`` (the least
host time per call).

While torch.compile traces, the same implementations run with ``traced=True``:
- the row quantizations (activation and grad_output rows, the saved activation's
  dequantization) and a weight shard's ternarization (tensor parallelism) are their
  references' torch ops, the same math. Inductor can fuse each into the kernel that
  produces its input (the RMSNorm before wq/wk/wv, the SwiGLU product before w2, the
  gradients' producers), and the partitioner's common-subexpression pass quantizes an
  input shared by several layers once (wq/wk/wv, w1/w3): faster and less memory than
  launching our quantization kernels from the graph (figures in docs/bitnet.md);
- forward and backward are ``torch.library.triton_op`` operators, which torch.compile
  decomposes into those torch ops and a ``wrap_triton`` launch of the int8 matmul (ours:
  Inductor has no int8 GEMM with these epilogues), so Inductor allocates the buffers and
  launches the kernel from its generated code. A whole weight's quantization is a
  ``triton_op`` too: sum |W| as a torch op, then a recorded launch of our ternarize kernel,
  which writes the codes and their transpose (grad_input's operand) from one read of the
  fp32 weight. Being a kernel launch, the partitioner keeps its transposed codes for the
  backward (1 byte per weight element) rather than recomputing them there from the fp32
  weight (4 bytes read per element, and a strided transposed write), as it would with
  torch ops; the weight-shard quantization, torch ops only, is traced as it is.
A compiled BitNet layer thus costs no Python of ours per step; eager operators inside a
compiled graph would re-enter Python at every call (about 1 ms of host time per layer
per step on an H100 machine, more than the GPU time BitNet saves at 1B scale).

The public functions below (``quantize_weight``, ``linear_forward``, ...) pick the
compiled operators while torch.compile traces (``_compiling``).

Forward of ``y = x W^T + b`` (x: [..., K], W: [N, K]):
    x codes, s_x = row-wise abs-max int8 of x            (one fused kernel)
    W codes, g   = ternary codes and abs-mean scale of W  (precomputed when gathered by FSDP;
                   unsharded: one kernel also writes W codes^T for the backward)
    y            = (x codes @ W codes^T) * s_x * g        (int8 tensor cores, scales in the epilogue)
Backward (straight-through: the rounding and clamping pass gradients unchanged, i.e. the
gradients are those of y = x^ W^T with x^ = x codes * s_x and W^ = W codes * g):
    dx = dy W^     int8: dy row-quantized, (dy codes @ W codes) * s_dy * g;  or bf16 dy @ W^
    dW = dy^T x^   in the activation dtype from the saved int8 x codes (dequantized)
    db = sum over rows of dy
Only the int8 x codes and their row scales are saved for backward (1 byte per element
instead of 2 for bf16 activations). Under torch.compile, where the dequantization is torch
ops, AOTAutograd's partitioner computes x^ in the forward and saves it in bf16 instead
(once for an input that several layers read). Keeping the codes saved there (a
dequantization kernel ordered after dy) was measured on the 1B model: more peak memory,
not less (docs/bitnet.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import is_fake

from titan_lowbit.kernels import bitnet_matmul as _mm
from titan_lowbit.kernels import bitnet_quant as _q

EPS = _q.EPS


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


# Device dispatch: Triton kernels on CUDA, references of the same math elsewhere.
# ``traced`` (inside the compiled operators): the quantizations are the references' torch
# ops, for Inductor to fuse (module docstring); the int8 matmul's launch is recorded.
def _quantize_rows(x, amax=None, traced=False):
    if _on_gpu(x) and not traced:
        return _q.quantize_rows(x, amax=amax)
    return _q.quantize_rows_reference(x, amax)


def _dequantize_rows(q, scale, dtype, traced=False):
    if _on_gpu(q) and not traced:
        return _q.dequantize_rows(q, scale, dtype)
    return _q.dequantize_rows_reference(q, scale, dtype)


def _transpose_codes(codes, traced=False):
    if _on_gpu(codes) and not traced:
        return _q.transpose_codes(codes)
    return _q.transpose_codes_reference(codes)


def _int8_mm(a, b, a_scale, b_scale, out_dtype, traced=False):
    if _on_gpu(a):
        return _mm.int8_matmul_scaled(a, b, a_scale, b_scale, out_dtype, traced=traced)
    return _mm.int8_matmul_scaled_reference(a, b, a_scale, b_scale, out_dtype)


# Three coarse operators per layer (weight quantization, forward, backward) rather than
# one per kernel: each operator call costs host time in the dispatcher, and at 1B-model
# sizes a step issues hundreds of them. They are defined with torch.library.Library
# rather than torch.library.custom_op: these operators need no autograd formula (they
# run inside BitNetLinearFunction), and custom_op's per-call Python layers (autograd
# wrapper, Dynamo guard, aliasing check) cost about twice the dispatch itself.

_LIB = torch.library.Library("titan_lowbit", "FRAGMENT")


def _define(schema: str, impl, fake):
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"titan_lowbit::{name}", fake, lib=_LIB)
    return getattr(torch.ops.titan_lowbit, name).default


def _ternarize_from_sum(w: torch.Tensor, abs_sum: torch.Tensor, numel: int,
                        pack: bool, traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(ternary codes, packed four per byte if ``pack``, and g = max(abs_sum / numel, EPS))
    of a 2-D weight: one kernel on CUDA that derives g and ternarizes, the references
    elsewhere and when ``traced``."""
    if _on_gpu(w) and not traced:
        return _q.ternarize_from_sum(w, abs_sum, numel, pack=pack)
    scale = _q.absmean_scale_reference(w, abs_sum, numel)
    codes = _q.ternarize_reference(w, scale)
    return (_q.pack_ternary_reference(codes) if pack else codes), scale


# The implementations, shared by the eager and the compiled operators.

def _quantize_weight(w: torch.Tensor,
                     traced: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ternary codes (int8 [N, K]), the same codes transposed (int8 [K, N], contiguous:
    grad_input's K-major operand, written by the same kernel instead of a copy in the
    backward) and the abs-mean scale (fp32, 0-d) of an unsharded 2-D weight [N, K].
    ``traced``: the kernel's launch is recorded for Inductor (module docstring), and sum
    |W| is a torch op of the graph, which Inductor fuses and orders as it likes: a
    compiled model quantizes its unsharded weights only there (kept codes, computed
    eagerly, are graph inputs instead), so the scale of such a weight has one order in a
    run, eager or compiled."""
    if traced:
        abs_sum = torch.linalg.vector_norm(w, 1, dtype=torch.float32)
    else:
        abs_sum = _q.weight_abs_sum(w)
    return quantize_weight_from_sum(w, abs_sum, traced)


def quantize_weight_from_sum(w: torch.Tensor, abs_sum: torch.Tensor, traced: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_quantize_weight`` with the weight's sum |W| given (fp32, 0-d): codes [N, K],
    codes^T [K, N] and g = max(abs_sum / numel, EPS), from one read of the weight on CUDA."""
    if _on_gpu(w):
        if traced:
            return _q.record_ternarize_from_sum_transposed(w.contiguous(), abs_sum, w.numel())
        return _q.ternarize_from_sum_transposed(w, abs_sum, w.numel())
    codes, scale = _ternarize_from_sum(w, abs_sum, w.numel(), pack=False)
    return codes, codes.t().contiguous(), scale


def _quantize_weight_shard(w: torch.Tensor, abs_sum: torch.Tensor, numel: int,
                           traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Ternary codes and scale of one shard of a weight, from the whole weight's sum |W|
    (summed over the shards) and element count (tensor parallelism)."""
    return _ternarize_from_sum(w, abs_sum, numel, pack=False, traced=traced)


def _linear_forward(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                    x_amax: torch.Tensor | None,
                    traced: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y = (x codes @ W codes^T) * s_x * g for 2-D x; also returns x's codes and row scales.
    ``x_amax``: the rows' abs-max when x is a shard of its rows (else computed from x)."""
    x_codes, x_scale = _quantize_rows(x, x_amax, traced)
    return _int8_mm(x_codes, w_codes, x_scale, w_scale, x.dtype, traced), x_codes, x_scale


def _linear_backward(dy: torch.Tensor, x_codes: torch.Tensor, x_scale: torch.Tensor,
                     w_codes: torch.Tensor, w_scale: torch.Tensor, dy_amax: torch.Tensor | None,
                     int8_backward: bool, need_dx: bool, need_dw: bool,
                     dw_dtype: torch.dtype, w_transposed: bool = False,
                     traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) of the straight-through BitNet linear for 2-D dy; an empty tensor stands
    for a gradient that is not needed. ``dy_amax``: the rows' abs-max when dy is a shard
    of its rows (else computed from dy). ``w_transposed``: ``w_codes`` holds the codes
    transposed ([K, N] contiguous, from ``_quantize_weight``), else as the forward used
    them ([N, K])."""
    if need_dx:
        if int8_backward:
            dy_codes, dy_scale = _quantize_rows(dy, dy_amax, traced)
            # The int8 tensor cores take the ternary weight K-major ([K, N]).
            w_kn = w_codes if w_transposed else _transpose_codes(w_codes, traced)
            dx = _int8_mm(dy_codes, w_kn, dy_scale, w_scale, dy.dtype, traced)
        else:
            w_nk = w_codes.t() if w_transposed else w_codes
            dx = torch.mm(dy, (w_nk.to(torch.float32) * w_scale).to(dy.dtype))
    else:
        dx = dy.new_empty((0,))
    if need_dw:
        dw = torch.mm(dy.t(), _dequantize_rows(x_codes, x_scale, dy.dtype, traced)).to(dw_dtype)
    else:
        dw = dy.new_empty((0,))
    return dx, dw


# Eager operators: plain Library definitions with fake kernels.

def _quantize_weight_fake(w):
    return (w.new_empty(w.shape, dtype=torch.int8), w.new_empty(w.shape[::-1], dtype=torch.int8),
            w.new_empty((), dtype=torch.float32))


def _quantize_weight_shard_fake(w, abs_sum, numel):
    return w.new_empty(w.shape, dtype=torch.int8), w.new_empty((), dtype=torch.float32)


def _linear_forward_fake(x, w_codes, w_scale, x_amax):
    return (x.new_empty((x.shape[0], w_codes.shape[0])), x.new_empty(x.shape, dtype=torch.int8),
            x.new_empty((x.shape[0],), dtype=torch.float32))


def _linear_backward_fake(dy, x_codes, x_scale, w_codes, w_scale, dy_amax, int8_backward,
                          need_dx, need_dw, dw_dtype, w_transposed):
    dx = dy.new_empty(x_codes.shape) if need_dx else dy.new_empty((0,))
    w_shape = w_codes.shape[::-1] if w_transposed else w_codes.shape
    dw = dy.new_empty(w_shape, dtype=dw_dtype) if need_dw else dy.new_empty((0,))
    return dx, dw


def _weight_abs_sums_fake(ws):
    return [w.new_empty((), dtype=torch.float32) for w in ws]


_QUANTIZE_WEIGHT = _define("bitnet_quantize_weight(Tensor w) -> (Tensor, Tensor, Tensor)",
                           _quantize_weight, _quantize_weight_fake)
_QUANTIZE_WEIGHT_SHARD = _define(
    "bitnet_quantize_weight_shard(Tensor w, Tensor abs_sum, int numel) -> (Tensor, Tensor)",
    _quantize_weight_shard, _quantize_weight_shard_fake)
_WEIGHT_ABS_SUMS = _define("bitnet_weight_abs_sums(Tensor[] ws) -> Tensor[]",
                            _q.weight_abs_sums, _weight_abs_sums_fake)
_LINEAR_FORWARD = _define(
    "bitnet_linear_forward(Tensor x, Tensor w_codes, Tensor w_scale, Tensor? x_amax) "
    "-> (Tensor, Tensor, Tensor)",
    _linear_forward, _linear_forward_fake)
_LINEAR_BACKWARD = _define(
    "bitnet_linear_backward(Tensor dy, Tensor x_codes, Tensor x_scale, Tensor w_codes, "
    "Tensor w_scale, Tensor? dy_amax, bool int8_backward, bool need_dx, bool need_dw, "
    "ScalarType dw_dtype, bool w_transposed) "
    "-> (Tensor, Tensor)",
    _linear_backward, _linear_backward_fake)


# Compiled operators: triton_op, traced by torch.compile into torch ops and kernel
# launches (the function is its own fake kernel). Annotated, for the schema.

@torch.library.triton_op("titan_lowbit::bitnet_quantize_weight_traced", mutates_args=())
def _quantize_weight_traced(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize_weight(w, traced=True)


@torch.library.triton_op("titan_lowbit::bitnet_linear_forward_traced", mutates_args=())
def _linear_forward_traced(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                           x_amax: Optional[torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _linear_forward(x, w_codes, w_scale, x_amax, traced=True)


@torch.library.triton_op("titan_lowbit::bitnet_linear_backward_traced", mutates_args=())
def _linear_backward_traced(dy: torch.Tensor, x_codes: torch.Tensor, x_scale: torch.Tensor,
                            w_codes: torch.Tensor, w_scale: torch.Tensor,
                            dy_amax: Optional[torch.Tensor], int8_backward: bool, need_dx: bool,
                            need_dw: bool, dw_dtype: torch.dtype, w_transposed: bool
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    return _linear_backward(dy, x_codes, x_scale, w_codes, w_scale, dy_amax, int8_backward,
                            need_dx, need_dw, dw_dtype, w_transposed, traced=True)


def _compiling(t: torch.Tensor) -> bool:
    """Whether torch.compile is tracing this call: Dynamo (``is_compiling``), or
    AOTAutograd tracing on fake tensors (a tensor subclass's ``__torch_function__`` that
    Dynamo left in the graph as one call runs there, where some torch versions report
    ``is_compiling()`` as False)."""
    return torch.compiler.is_compiling() or is_fake(t)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ternary codes (int8 [N, K]), the codes transposed ([K, N]) and abs-mean scale (fp32,
    0-d) of an unsharded 2-D weight (``_quantize_weight``)."""
    return (_quantize_weight_traced if _compiling(w) else _QUANTIZE_WEIGHT)(w)


def weight_abs_sums(ws) -> list[torch.Tensor]:
    """sum |W| of each weight (fp32, 0-d each), in the one order of
    ``bitnet_quant.weight_abs_sums``, also inside a compiled graph: there the operator is
    opaque, so Inductor runs it as it runs eagerly instead of generating its own
    reduction (a tensor-parallel forward whose weights have no precomputed sums, e.g.
    the first after a checkpoint load, then gets the bits the precompute would have)."""
    return _WEIGHT_ABS_SUMS([w.detach() for w in ws])


def quantize_weight_shard(w: torch.Tensor, abs_sum: torch.Tensor,
                          numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ternary codes and scale of one shard of a weight from the whole weight's sum |W|
    and element count (tensor parallelism)."""
    if _compiling(w):
        return _quantize_weight_shard(w, abs_sum, numel, traced=True)
    return _QUANTIZE_WEIGHT_SHARD(w, abs_sum, numel)


def linear_forward(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                   x_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, x codes, x row scales) of the BitNet forward for 2-D x (``_linear_forward``)."""
    return (_linear_forward_traced if _compiling(x) else _LINEAR_FORWARD)(x, w_codes, w_scale, x_amax)


def linear_backward(dy, x_codes, x_scale, w_codes, w_scale, dy_amax, int8_backward: bool,
                    need_dx: bool, need_dw: bool, dw_dtype: torch.dtype,
                    w_transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) of the BitNet backward for 2-D dy (``_linear_backward``)."""
    return (_linear_backward_traced if _compiling(dy) else _LINEAR_BACKWARD)(
        dy, x_codes, x_scale, w_codes, w_scale, dy_amax, int8_backward, need_dx, need_dw,
        dw_dtype, w_transposed)


def absmean_scale(w: torch.Tensor) -> torch.Tensor:
    """Tensor-wise abs-mean scale g = max(mean |W|, EPS) (fp32, 0-d) of an unsharded weight."""
    return _q.absmean_scale_reference(w)


def pack_ternary_from_sum(w: torch.Tensor, abs_sum: torch.Tensor,
                          numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ternary codes of a weight shard packed four per byte (uint8 [R, ceil(C / 4)], the
    FSDP payload) with the scale g = max(abs_sum / numel, EPS) derived in the same kernel
    from the whole weight's sum |W| (over all shards); returns (packed codes, g)."""
    return _ternarize_from_sum(w, abs_sum, numel, pack=True)


def _prepared_references(compute):
    """(launch, *buffers) for a prepared operation off CUDA: ``compute()``'s first result
    is the buffers, and each ``launch()`` runs the references again and copies into them."""
    buffers = compute()

    def launch() -> None:
        for buf, value in zip(buffers, compute()):
            buf.copy_(value)

    return (launch, *buffers)


def prepare_pack_ternary_from_sum(w: torch.Tensor, abs_sum: torch.Tensor, numel: int):
    """``pack_ternary_from_sum`` prepared for repeated calls: (launch, packed, scale), where
    each ``launch()`` rewrites the ``packed`` and ``scale`` buffers from the current values
    of ``w`` and ``abs_sum`` (same tensors every call). On CUDA the kernel launch is
    prepared once (``bitnet_quant.prepare_ternarize_from_sum``); elsewhere the references
    run and their result is copied into the buffers."""
    if _on_gpu(w):
        return _q.prepare_ternarize_from_sum(w, abs_sum, numel, pack=True)
    return _prepared_references(lambda: _ternarize_from_sum(w, abs_sum, numel, pack=True))


def prepare_quantize_weight_from_sum(w: torch.Tensor, abs_sum: torch.Tensor):
    """``quantize_weight_from_sum`` prepared for repeated calls: (launch, codes, codes^T,
    scale), where each ``launch()`` rewrites the three buffers from the current values of
    ``w`` and ``abs_sum`` (same tensors every call): one prepared kernel launch on CUDA,
    the references copied into the buffers elsewhere."""
    if _on_gpu(w):
        return _q.prepare_ternarize_from_sum_transposed(w, abs_sum, w.numel())
    return _prepared_references(lambda: quantize_weight_from_sum(w, abs_sum))


def unpack_ternary(packed: torch.Tensor, cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``pack_ternary_from_sum``: int8 [R, cols], written into ``out`` when given."""
    if _on_gpu(packed):
        return _q.unpack_ternary(packed, cols, out=out)
    codes = _q.unpack_ternary_reference(packed, cols)
    if out is None:
        return codes
    out.copy_(codes)
    return out


def all_reduce_row_absmax(x: torch.Tensor, group) -> torch.Tensor:
    """Each row's abs-max over the ranks of ``group`` that hold a shard of its columns
    (fp32 [M]; a functional all-reduce, so torch.compile can trace it)."""
    return funcol.wait_tensor(funcol.all_reduce(_q.row_absmax(x.detach()), "max", group))


class BitNetLinearFunction(torch.autograd.Function):
    """y = x^ W^T + b with straight-through gradients (see the module docstring).

    ``weight`` is passed only so autograd routes dW to it (its dtype is dW's dtype);
    the forward reads the weight through ``w_codes`` and ``w_scale``. ``w_codes_t``, when
    given, is ``w_codes`` transposed ([K, N], from ``quantize_weight``): backward keeps it
    instead of ``w_codes`` and uses it as is (else it transposes ``w_codes``).

    Tensor parallelism passes shards: ``x_amax`` is the abs-max of x's rows over all
    shards of the row (row-wise parallel: x holds a slice of the input features), and
    ``dy_rows_group`` is the group whose ranks each hold a slice of dy's columns
    (column-wise parallel), over which backward all-reduces dy's row abs-max. Each rank
    then quantizes exactly as the unsharded layer does.
    """

    @staticmethod
    def forward(ctx, x, weight, w_codes, w_scale, bias, int8_backward: bool,
                x_amax=None, dy_rows_group=None, w_codes_t=None):
        y, x_codes, x_scale = linear_forward(x.reshape(-1, x.shape[-1]), w_codes, w_scale, x_amax)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.w_transposed = w_codes_t is not None
        ctx.save_for_backward(x_codes, x_scale, w_codes if w_codes_t is None else w_codes_t, w_scale)
        ctx.x_shape = x.shape
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.int8_backward = int8_backward
        ctx.dy_rows_group = dy_rows_group
        # A fresh (non-view) tensor: FSDP2 warns about module outputs that are views.
        return torch.ops.aten._unsafe_view.default(y, (*x.shape[:-1], w_codes.shape[0]))

    @staticmethod
    def backward(ctx, dy):
        x_codes, x_scale, w_codes, w_scale = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy_amax = None
        if ctx.dy_rows_group is not None and need_dx and ctx.int8_backward:
            dy_amax = all_reduce_row_absmax(dy2, ctx.dy_rows_group)
        dx, dw = linear_backward(dy2, x_codes, x_scale, w_codes, w_scale, dy_amax,
                                 ctx.int8_backward, need_dx, need_dw, ctx.weight_dtype,
                                 ctx.w_transposed)
        db = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
            db = dy2.sum(dim=0, dtype=torch.float32).to(ctx.bias_dtype)
        return (dx.view(ctx.x_shape) if need_dx else None, dw if need_dw else None,
                None, None, db, None, None, None, None)


def bitnet_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Straight-through BitNet linear in plain autograd ops (the textbook formulation).

    x^ = x + (Q(x) - x).detach(), W^ = W + (Q(W) - W).detach(): forward value of the
    quantized layer, identity gradient through both quantizers. Tests compare the fused
    path against this.
    """
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = _q.quantize_rows_reference(x2.detach())
    x_hat = x2 + ((xq.float() * xs[:, None]).to(x.dtype) - x2).detach()
    g = absmean_scale(weight.detach()) if w_scale is None else w_scale
    wq = _q.ternarize_reference(weight.detach(), g)
    w_hat = weight + ((wq.float() * g).to(weight.dtype) - weight).detach()
    y = x_hat @ w_hat.to(x.dtype).t()
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])
