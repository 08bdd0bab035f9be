#!/usr/bin/env python3
"""Benchmark BitNet b1.58 linear layers against BF16 (and torchao's BitNet) on one GPU.

    python scripts/bench_bitnet.py                      # GPU: the four shapes, 16384 tokens
    python scripts/bench_bitnet.py --allgather-only     # FSDP2 all-gather bytes (CPU is fine)
    python scripts/bench_bitnet.py --host-only          # GPU: host time of one layer and its pieces
    python scripts/bench_bitnet.py --host-breakdown     # GPU: host us per piece of one layer
    python scripts/bench_bitnet.py --matmul-only --tokens 8192 --shapes 2048x2048,2048x512,2048x5632,5632x2048
                                                        # GPU: int8 matmul variants (the 1B model's GEMMs)

For each (in -> out) shape it times forward+backward of one linear layer (median of
triton.testing.do_bench on random bf16 inputs, seeded (torch.manual_seed(0)), drawn once
per shape and reused across repetitions) for
  bf16         nn.Linear in bf16 (cuBLAS)
  bitnet       titan_lowbit's BitNet linear fed the all-gathered ternary weight (as under
               FSDP2: the weight arrives quantized)
  bitnet+wq    the same from the latent bf16 weight (abs-mean and ternarize every forward)
  bitnet-bf16bwd  grad_input in bf16 ([lowbit] bitnet_int8_backward = false)
  torchao      torchao's BitNet training weight under torch.compile (when importable)
and the pieces (activation quantization, int8 matmuls, dequantization, bf16 grad_weight,
torch._int_mm as the int8 ceiling), with the floor: two int8 GEMMs at the measured
int8 rate plus one bf16 GEMM at the measured bf16 rate plus the quantization bytes at
the measured copy bandwidth.

The all-gather part reports FSDP2's all-gather payload per training step (forward plus
the backward re-gather) for llama3 flavors, converted vs bf16, through the real
fsdp_pre_all_gather of each weight on meta tensors; with --measure-gloo it also counts
the bytes two gloo processes actually send for the debug model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SHAPES = [(2048, 5632), (5632, 2048), (4096, 14336), (14336, 4096)]
ROUNDS = 3


def _bench(fn, grad_to_none=None):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                   return_mode="median")


def _ceilings(dev):
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    bf16_ms = _bench(lambda: a @ b)
    ai = torch.randint(-127, 128, (n, n), device=dev, dtype=torch.int8)
    bi = torch.randint(-127, 128, (n, n), device=dev, dtype=torch.int8).t()
    int8_ms = _bench(lambda: torch._int_mm(ai, bi))
    src = torch.randn(1 << 28, device=dev, dtype=torch.bfloat16)  # 512 MiB
    dst = torch.empty_like(src)
    copy_ms = _bench(lambda: dst.copy_(src))
    return {
        "bf16_tflops": 2 * n**3 / bf16_ms / 1e9,
        "int8_tops_cublas": 2 * n**3 / int8_ms / 1e9,
        "copy_tbps": 2 * src.numel() * 2 / copy_ms / 1e9,
    }


def _linear_rows(tokens, k, n, dev, ceil, with_torchao):
    from titan_lowbit.bitnet import BitNetTrainingWeight
    from titan_lowbit.bitnet import ops
    from titan_lowbit.kernels import bitnet_matmul as mm
    from titan_lowbit.kernels import bitnet_quant as bq

    torch.manual_seed(0)
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=dev) * k**-0.5).to(torch.bfloat16).requires_grad_()
    row = {"shape": f"{k}->{n}", "tokens": tokens}

    def fwd_bwd(weight, compiled=False):
        linear = torch.compile(F.linear, fullgraph=True, dynamic=False) if compiled else F.linear

        def run():
            linear(x, weight).backward(dy)
        return run

    gathered = _gathered_weight(w.detach())
    codes, g = gathered._codes, gathered._scale
    latent = nn.Parameter(BitNetTrainingWeight(w.detach().clone()))
    gathered_bf16bwd = _gathered_weight(w.detach(), int8_backward=False)
    variants = {
        "bf16": (fwd_bwd(w), [x, w]),
        "bitnet": (fwd_bwd(gathered), [x, gathered]),
        "bitnet_wq": (fwd_bwd(latent), [x, latent]),
        "bitnet_bf16bwd": (fwd_bwd(gathered_bf16bwd), [x, gathered_bf16bwd]),
        # Under torch.compile (Inductor), as torchtitan's compile.enable runs the layers.
        "bf16_compiled": (fwd_bwd(w, True), [x, w]),
        "bitnet_compiled": (fwd_bwd(gathered, True), [x, gathered]),
    }
    # Interleaved rounds, median per variant: clocks drift under sustained load, and a
    # variant timed only after the others would pay for it.
    times = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, (fn, grads) in variants.items():
            times[name].append(_bench(fn, grads))
    for name, ts in times.items():
        row[f"{name}_ms"] = statistics.median(ts)
        row[f"{name}_spread"] = (max(ts) - min(ts)) / statistics.median(ts)

    # Correctness of what was timed: the forward against the reference formulation.
    with torch.no_grad():
        y = F.linear(x, gathered).float()
        y_ref = ops.bitnet_linear_reference(x.detach().float(), w.detach().float(), w_scale=g).float()
        row["fwd_rel_err_vs_reference"] = ((y - y_ref).norm() / y_ref.norm()).item()

    # Pieces.
    xd = x.detach()
    xq, xs = bq.quantize_rows(xd)
    dq, ds = bq.quantize_rows(dy)
    codes_t = codes.t().contiguous()
    row["quant_x_ms"] = _bench(lambda: bq.quantize_rows(xd))
    row["quant_dy_ms"] = _bench(lambda: bq.quantize_rows(dy))
    row["dequant_x_ms"] = _bench(lambda: bq.dequantize_rows(xq, xs, torch.bfloat16))
    kernels = {"tma": mm._int8_matmul_tma_kernel, "pointer": mm._int8_matmul_kernel}
    for name, kernel in kernels.items():
        row[f"int8_fwd_{name}_ms"] = _bench(lambda: mm.int8_matmul_scaled(xq, codes, xs, g, torch.bfloat16, impl=name))
        row[f"int8_fwd_{name}_config"] = str(kernel.best_config)
        row[f"int8_dgrad_{name}_ms"] = _bench(lambda: mm.int8_matmul_scaled(dq, codes_t, ds, g, torch.bfloat16, impl=name))
        row[f"int8_dgrad_{name}_config"] = str(kernel.best_config)
    row.update(_matmul_gpu_times(xq, xs, dq, ds, codes, codes_t, g))
    row["int_mm_cublas_fwd_ms"] = _bench(lambda: torch._int_mm(xq, codes.t()))
    xh = bq.dequantize_rows(xq, xs, torch.bfloat16)
    row["bf16_wgrad_ms"] = _bench(lambda: dy.t() @ xh)
    row["bf16_fwd_ms"] = _bench(lambda: xd @ w.detach().t())
    flops = 2 * tokens * k * n
    row["int8_fwd_tops"] = flops / min(row["int8_fwd_tma_ms"], row["int8_fwd_pointer_ms"]) / 1e9
    row["bf16_fwd_tflops"] = flops / row["bf16_fwd_ms"] / 1e9
    # Floor: two int8 GEMMs at the best int8 rate measured on this machine (cuBLAS at
    # 8192^3 or our kernel on this shape), one bf16 GEMM at this shape's measured bf16
    # rate, and the quantization bytes (x: 2 B read + 1 B write; dy the same; x^: 1 B
    # read + 2 B write) at the copy bandwidth.
    int8_rate = max(ceil["int8_tops_cublas"], row["int8_fwd_tops"])
    q_bytes = 3 * tokens * k + 3 * tokens * n + 3 * tokens * k
    floor = (2 * flops / int8_rate + flops / row["bf16_fwd_tflops"]) / 1e9 \
        + q_bytes / ceil["copy_tbps"] / 1e9
    row["floor_ms"] = floor
    row["speedup"] = row["bf16_ms"] / row["bitnet_ms"]
    row["speedup_compiled"] = row["bf16_compiled_ms"] / row["bitnet_compiled_ms"]
    row["speedup_floor"] = row["bf16_ms"] / floor
    # With int8 at exactly twice the bf16 rate and free quantization the bound is
    # 3 GEMMs / (2 half-price GEMMs + 1 GEMM) = 1.5x; at the measured int8:bf16 ratio:
    row["speedup_bound_no_quant"] = 3 / (2 * row["bf16_fwd_tflops"] / int8_rate + 1)

    if with_torchao:
        try:
            from torchao import quantize_
            from torchao.prototype.quantized_training import bitnet_training
        except ImportError as e:
            row["torchao_error"] = f"not importable: {e}"
        else:
            try:
                lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
                quantize_(lin, bitnet_training())
                clin = torch.compile(lin)
                def ao():
                    clin(x).backward(dy)
                row["torchao_ms"] = _bench(ao, [x, lin.weight])
            except Exception as e:  # report, never hide: the row says why it is missing
                row["torchao_error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def _matmul_gpu_times(xq, xs, dq, ds, codes, codes_t, g) -> dict:
    """GPU time (CUDA-graph replays: no host time) of the forward and grad_input int8
    matmuls in each variant, and the variant a compiled graph records for each."""
    from titan_lowbit.kernels import bitnet_matmul as mm

    row = {}
    for what, (a, s, b) in {"fwd": (xq, xs, codes), "dgrad": (dq, ds, codes_t)}.items():
        for impl in ("pointer", "tma", "device_tma"):
            row[f"int8_{what}_{impl}_gpu_ms"] = mm._gpu_ms(
                lambda: mm.int8_matmul_scaled(a, b, s, g, torch.bfloat16, impl=impl))
        row[f"int8_{what}_compiled_variant"] = mm._traced_variant(
            a, b, a.shape[0], b.shape[0], a.shape[1], torch.bfloat16)
    return row


def matmul_rows(tokens, k, n, dev) -> dict:
    """Only the int8 matmuls of one layer (``--matmul-only``): GPU times per variant."""
    from titan_lowbit.kernels import bitnet_quant as bq

    torch.manual_seed(0)
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
    gathered = _gathered_weight((torch.randn(n, k, device=dev) * k**-0.5).to(torch.bfloat16))
    codes, g = gathered._codes, gathered._scale
    xq, xs = bq.quantize_rows(x)
    dq, ds = bq.quantize_rows(dy)
    return {"shape": f"{k}->{n}", "tokens": tokens,
            **_matmul_gpu_times(xq, xs, dq, ds, codes, codes.t().contiguous(), g)}


def _matmul_table(rows) -> str:
    lines = ["| in -> out | GEMM | pointer ms | TMA, host descriptors ms | TMA, descriptors in "
             "the kernel ms | compiled graph records |", "|---|---|---|---|---|---|"]
    for r in rows:
        for what in ("fwd", "dgrad"):
            lines.append(f"| {r['shape']} | {what} | " + " | ".join(
                f"{r[f'int8_{what}_{impl}_gpu_ms']:.4f}" for impl in ("pointer", "tma", "device_tma"))
                + f" | {r[f'int8_{what}_compiled_variant']} |")
    return "\n".join(lines)


CHAIN = 8


def _gathered_weight(w: torch.Tensor, int8_backward: bool = True):
    """The ternary weight FSDP2's all-gather would hand a layer for the bf16 weight w."""
    from titan_lowbit.bitnet import BitNetTernaryWeight
    from titan_lowbit.kernels import bitnet_quant as bq

    g = bq.absmean_scale_reference(w)
    return BitNetTernaryWeight(bq.ternarize(w, g), g, torch.bfloat16,
                               int8_backward=int8_backward).requires_grad_()


def _compiled_chain_host_us(k, n, dev, tokens, per_call_us) -> dict:
    from titan_lowbit.bitnet import BitNetTrainingWeight

    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    shapes = [(n, k) if i % 2 == 0 else (k, n) for i in range(CHAIN)]
    latent = [(torch.randn(*s, device=dev) * s[1] ** -0.5).to(torch.bfloat16) for s in shapes]
    kinds = {
        "bf16": [w.clone().requires_grad_() for w in latent],
        "bitnet": [_gathered_weight(w) for w in latent],
        "bitnet_wq": [nn.Parameter(BitNetTrainingWeight(w.clone())) for w in latent],
    }

    def chain(h, ws):
        for w in ws:
            h = F.linear(h, w)
        return h

    out = {}
    for name, ws in kinds.items():
        torch._dynamo.reset()
        compiled = torch.compile(chain, fullgraph=True, dynamic=False)

        def step(ws=ws, compiled=compiled):
            compiled(x, ws).float().sum().backward()
            x.grad = None
            for w in ws:
                w.grad = None
        out[f"compiled_{name}_host_us_per_linear"] = per_call_us(step) / CHAIN
    return out


def host_overhead(k, n, dev, tokens=16, iters=200) -> dict:
    """Host time per forward+backward of one layer: wall time per iteration at a token
    count small enough that the GPU idles, with one synchronization at the end. When a
    model's layers are small this bounds the step time from below (host-bound)."""
    from titan_lowbit.bitnet import BitNetTrainingWeight
    from titan_lowbit.kernels import bitnet_quant as bq

    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=dev) * k**-0.5).to(torch.bfloat16).requires_grad_()
    gathered = _gathered_weight(w.detach())
    g = gathered._scale
    weights = {
        "bf16": w,
        "bitnet": gathered,
        "bitnet_wq": nn.Parameter(BitNetTrainingWeight(w.detach().clone())),
    }
    out = {"shape": f"{k}->{n}", "tokens": tokens}

    def per_call_us(fn):
        for i in range(iters + 20):
            if i == 20:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters * 1e6

    for name, weight in weights.items():
        def layer(weight=weight):
            F.linear(x, weight).backward(dy)
            x.grad = weight.grad = None
        out[f"{name}_host_us"] = per_call_us(layer)
    # Under torch.compile (Inductor), as torchtitan's compile.enable runs a block: a chain
    # of CHAIN linears alternating k -> n and n -> k in one compiled graph, host time per
    # linear (a graph's fixed cost is shared by its layers, as in a transformer block).
    out.update(_compiled_chain_host_us(k, n, dev, tokens, per_call_us))
    # The pieces of one BitNet layer, each alone: which launches cost the host time.
    from titan_lowbit.bitnet import ops
    from titan_lowbit.kernels import bitnet_matmul as mm

    codes = weights["bitnet"]._codes
    xd = x.detach()
    xq, xs = bq.quantize_rows(xd)
    pieces = {
        "quantize_rows": lambda: bq.quantize_rows(xd),
        "int8_mm_tma": lambda: mm.int8_matmul_scaled(xq, codes, xs, g, torch.bfloat16, impl="tma"),
        "int8_mm_pointer": lambda: mm.int8_matmul_scaled(xq, codes, xs, g, torch.bfloat16, impl="pointer"),
        "dequantize_rows": lambda: bq.dequantize_rows(xq, xs, torch.bfloat16),
        "op_linear_forward": lambda: ops.linear_forward(xd, codes, g, None),
        "op_quantize_weight": lambda: ops.quantize_weight(w.detach()),
        "torch_mm": lambda: dy.t() @ xd.new_empty(tokens, k),
    }
    for name, fn in pieces.items():
        out[f"{name}_us"] = per_call_us(fn)
    return out


def _python_torch_ops(fn) -> int:
    """torch ops issued from Python (aten ops not nested in another aten op) by one call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    n = 0
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        n += parent is None
    return n


def host_breakdown(k, n, dev, tokens=16, iters=300) -> dict:
    """Host microseconds of each piece of one BitNet layer, and what one layer issues.

    Wall time per call at 16 tokens (GPU idle, one synchronization at the end); the
    fastest of five repetitions (host time only grows under interference).
    """
    from titan_lowbit.bitnet import BitNetTrainingWeight, ops
    from titan_lowbit.kernels import bitnet_matmul as mm
    from titan_lowbit.kernels import bitnet_quant as bq

    sync = torch.cuda.synchronize
    torch.manual_seed(0)
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=dev) * k**-0.5).to(torch.bfloat16).requires_grad_()
    w32 = w.detach().float()
    gathered = _gathered_weight(w.detach())
    codes, g = gathered._codes, gathered._scale
    codes_t = codes.t().contiguous()
    packed = bq.ternarize(w.detach(), g, pack=True)
    latent = nn.Parameter(BitNetTrainingWeight(w32.clone()))
    xd = x.detach()
    xq, xs = bq.quantize_rows(xd)
    dq, ds = bq.quantize_rows(dy)
    wgrad_in = torch.empty(tokens, k, device=dev, dtype=torch.bfloat16)

    def per_call_us(fn):
        reps = []
        for _ in range(5):
            for _ in range(10):
                fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync()
            reps.append((time.perf_counter() - t0) / iters * 1e6)
        return min(reps)

    def layer(weight):
        def run():
            F.linear(x, weight).backward(dy)
            x.grad = weight.grad = None
        return run

    def forward(weight):
        def run():
            with torch.no_grad():
                F.linear(xd, weight)
        return run

    def autocast_layer():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            F.linear(x, latent).backward(dy)
        x.grad = latent.grad = None

    pieces = {
        # whole layer, forward + backward
        "layer_bf16": layer(w),
        "layer_bitnet": layer(gathered),
        "layer_bitnet_wq_fp32_autocast": autocast_layer,
        "forward_bitnet_nograd": forward(gathered),
        # custom ops
        "op_quantize_weight": lambda: ops.quantize_weight(w32),
        "op_linear_forward": lambda: ops.linear_forward(xd, codes, g, None),
        "op_linear_backward": lambda: ops.linear_backward(dy, xq, xs, codes, g, None, True, True, True,
                                                          torch.float32),
        # kernels (Python wrappers + launch)
        "quantize_rows": lambda: bq.quantize_rows(xd),
        "dequantize_rows": lambda: bq.dequantize_rows(xq, xs, torch.bfloat16),
        "ternarize": lambda: bq.ternarize(w32, g),
        "ternarize_packed": lambda: bq.ternarize(w32, g, pack=True),
        "unpack_ternary": lambda: bq.unpack_ternary(packed, k),
        "int8_mm_fwd_tma": lambda: mm.int8_matmul_scaled(xq, codes, xs, g, torch.bfloat16, impl="tma"),
        "int8_mm_fwd_pointer": lambda: mm.int8_matmul_scaled(xq, codes, xs, g, torch.bfloat16,
                                                             impl="pointer"),
        "int8_mm_dgrad_auto": lambda: mm.int8_matmul_scaled(dq, codes_t, ds, g, torch.bfloat16),
        "absmean_scale_reference": lambda: bq.absmean_scale_reference(w32),
        # torch baselines
        "torch_empty": lambda: torch.empty(tokens, k, device=dev, dtype=torch.int8),
        "torch_mm": lambda: dy.t() @ wgrad_in,
        "transpose_copy_codes": lambda: codes.t().contiguous(),
    }
    out = {"shape": f"{k}->{n}", "tokens": tokens, "device": str(dev)}
    for name, fn in pieces.items():
        out[f"{name}_us"] = round(per_call_us(fn), 1)
    # What one layer's forward + backward issues; Triton's launcher calls the launch
    # hook for every launch.
    from triton import knobs

    launches = [0]

    def hook(metadata):
        launches[0] += 1

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for name in ("layer_bf16", "layer_bitnet", "layer_bitnet_wq_fp32_autocast"):
            before = launches[0]
            pieces[name]()
            sync()
            out[f"{name}_triton_launches"] = launches[0] - before
            out[f"{name}_torch_ops"] = _python_torch_ops(pieces[name])
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    return out


def allgather_bytes(flavor: str, filter_fqns=("output",)) -> dict:
    """Per-step FSDP2 all-gather payload (all ranks' shards together) for a llama3 flavor.

    Uses each weight's real fsdp_pre_all_gather on meta tensors (BitNet weights) and the
    bf16 mixed-precision cast (every other parameter). Wrapped as torchtitan 0.2.x's
    apply_fsdp does with the default fsdp_reshard_after_forward and no pipelining:
    tok_embeddings and every block are their own fully_shard units with
    reshard_after_forward=True, so a step gathers them twice (forward, and again for the
    backward); [norm, output] is one unit with reshard_after_forward=False, gathered once.
    """
    import titan_lowbit.torchtitan  # noqa: F401  (registers the 1B flavor)
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    from titan_lowbit.bitnet import convert_to_bitnet
    from titan_lowbit.bitnet.weight import local_training_weight

    class _OneRankMesh:
        def size(self):
            return 1

    with torch.device("meta"):
        model = Transformer(llama3_args[flavor])
    gathers = {n: 2 if n.startswith(("layers.", "tok_embeddings.")) else 1 for n, _ in model.named_parameters()}
    bf16 = sum(2 * p.numel() * gathers[n] for n, p in model.named_parameters())
    convert_to_bitnet(model, list(filter_fqns))
    conv = conv_bitnet = bf16_bitnet = 0
    for name, p in model.named_parameters():
        w = local_training_weight(p)
        if w is None:
            conv += 2 * p.numel() * gathers[name]
            continue
        (packed,), _ = w.fsdp_pre_all_gather(_OneRankMesh(), p.shape, p.stride(), None, None)
        conv += packed.numel() * packed.element_size() * gathers[name]
        conv_bitnet += packed.numel() * packed.element_size() * gathers[name]
        bf16_bitnet += 2 * p.numel() * gathers[name]
    return {
        "flavor": flavor,
        "bf16_bytes_per_step": bf16,
        "bitnet_bytes_per_step": conv,
        "ratio_all_params": conv / bf16,
        "ratio_bitnet_weights": conv_bitnet / bf16_bitnet,
    }


def _gloo_worker(rank, port, flavor, converted, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import titan_lowbit.torchtitan  # noqa: F401
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    from titan_lowbit.bitnet import convert_to_bitnet

    args = llama3_args[flavor]
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    if converted:
        convert_to_bitnet(model, ["output"])
    mesh = init_device_mesh("cpu", (2,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # torchtitan 0.2.x's apply_fsdp (default reshard policy, no PP), without its
    # disable_fsdp_gradient_division (PREMUL_SUM, which gloo lacks; reduce-scatter only).
    fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard([model.norm, model.output], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    orig, sent = getattr(dist, name), []

    def counting(output, inp, *a, **k):
        sent.append(inp.numel() * inp.element_size())
        return orig(output, inp, *a, **k)

    setattr(dist, name, counting)
    tokens = torch.randint(0, args.vocab_size, (1, 64))
    model(tokens).float().mean().backward()
    if rank == 0:
        torch.save({"bytes_per_rank": sum(sent), "gathers": len(sent)}, out_path)
    dist.destroy_process_group()


def measure_gloo(flavor="debugmodel") -> dict:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    res = {}
    for converted in (False, True):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.pt")
            mp.spawn(_gloo_worker, args=(port, flavor, converted, out), nprocs=2)
            r = torch.load(out)
        res["bitnet" if converted else "bf16"] = 2 * r["bytes_per_rank"]  # both ranks
    res["ratio_all_params"] = res["bitnet"] / res["bf16"]
    return res


def _table(rows, ceil):
    cols = ["shape", "bf16_ms", "bitnet_ms", "speedup", "bf16_compiled_ms", "bitnet_compiled_ms",
            "speedup_compiled", "bitnet_wq_ms", "bitnet_bf16bwd_ms",
            "torchao_ms", "floor_ms", "speedup_floor", "speedup_bound_no_quant"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        vals = []
        for c in cols:
            v = r.get(c, "-")
            vals.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(vals) + " |")
    pieces = ["shape", "quant_x_ms", "quant_dy_ms", "dequant_x_ms", "int8_fwd_tma_ms",
              "int8_fwd_pointer_ms", "int_mm_cublas_fwd_ms", "int8_dgrad_tma_ms",
              "int8_dgrad_pointer_ms", "bf16_fwd_ms", "bf16_wgrad_ms", "int8_fwd_tops",
              "bf16_fwd_tflops", "fwd_rel_err_vs_reference"]
    lines += ["", "| " + " | ".join(pieces) + " |", "|" + "---|" * len(pieces)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c])
                                        for c in pieces) + " |")
    lines.append("")
    lines.append("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in ceil.items()))
    return "\n".join(lines)


def _parse_shapes(spec: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in spec.split(",")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--shapes", default=None,
                    help="comma-separated INxOUT (default: the four shapes above; for "
                         "--host-breakdown the two 2048-wide ones)")
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--allgather-only", action="store_true")
    ap.add_argument("--host-only", action="store_true", help="only the host-overhead timing")
    ap.add_argument("--host-breakdown", action="store_true",
                    help="host microseconds of each piece of one BitNet layer (GPU)")
    ap.add_argument("--measure-gloo", action="store_true",
                    help="also count real FSDP2 all-gather bytes on 2 gloo processes (debug model)")
    ap.add_argument("--matmul-only", action="store_true",
                    help="only the int8 matmuls' GPU time per variant (pointer, TMA with "
                         "descriptors built on the host or in the kernel) and the variant a "
                         "compiled graph records")
    ap.add_argument("--json", help="write all numbers here")
    args = ap.parse_args()
    if args.host_breakdown:
        if not torch.cuda.is_available():
            sys.exit("bench_bitnet.py: --host-breakdown needs a GPU")
        dev = torch.device("cuda")
        # Host time hardly depends on the shape, GPU time does: the pieces that read the
        # whole weight (quantize_weight, ternarize, the transposed copy) stay host-bound
        # on an H100 for the 2048-wide shapes, not for the 4096 x 14336 ones.
        shapes = _parse_shapes(args.shapes) if args.shapes else SHAPES[:2]
        res = {"argv": sys.argv, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
               "torch": torch.__version__,
               "breakdown": [host_breakdown(k, n, dev) for k, n in shapes]}
        import triton
        res["triton"] = triton.__version__
        for b in res["breakdown"]:
            print(json.dumps(b), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return

    out = {"argv": sys.argv, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    out["allgather"] = [allgather_bytes(f) for f in ("debugmodel", "1B", "8B")]
    if args.measure_gloo:
        out["allgather_measured_gloo_debugmodel"] = measure_gloo()
    for a in out["allgather"]:
        print(f"all-gather per step, llama3 {a['flavor']}: bf16 {a['bf16_bytes_per_step'] / 1e6:.1f} MB, "
              f"bitnet {a['bitnet_bytes_per_step'] / 1e6:.1f} MB (x{a['ratio_all_params']:.3f} all params, "
              f"x{a['ratio_bitnet_weights']:.4f} BitNet weights)")
    if "allgather_measured_gloo_debugmodel" in out:
        print("measured (gloo, debugmodel):", out["allgather_measured_gloo_debugmodel"])
    if not args.allgather_only:
        if not torch.cuda.is_available():
            sys.exit("bench_bitnet.py: the linear benchmark needs a GPU (use --allgather-only on CPU)")
        dev = torch.device("cuda")
        out["device"] = torch.cuda.get_device_name(dev)
        if args.matmul_only:
            out["matmul"] = [matmul_rows(args.tokens, k, n, dev)
                             for k, n in (_parse_shapes(args.shapes) if args.shapes else SHAPES)]
            print(f"device {out['device']}, torch {out['torch']}, triton {out['triton']}, "
                  f"{out['date_utc']} UTC, {args.tokens} tokens")
            print(_matmul_table(out["matmul"]))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)
            return
        if args.host_only:
            out["host"] = [host_overhead(k, n, dev) for k, n in SHAPES]
            for h in out["host"]:
                print(json.dumps(h))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)
            return
        ceil = _ceilings(dev)
        out["ceilings"] = ceil
        rows = []
        for k, n in _parse_shapes(args.shapes) if args.shapes else SHAPES:
            rows.append(_linear_rows(args.tokens, k, n, dev, ceil, not args.no_torchao))
            print(json.dumps(rows[-1]), flush=True)
        out["linear"] = rows
        out["host"] = [host_overhead(k, n, dev) for k, n in SHAPES]
        for h in out["host"]:
            print(json.dumps(h))
        print(f"\ndevice {out['device']}, torch {out['torch']}, triton {out['triton']}, {out['date_utc']} UTC")
        print(_table(rows, ceil))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
