"""GPU experiment: does Triton's automatic warp specialization (``tl.range(...,
warp_specialize=True)``) or a 2-CTA cluster (``num_ctas=2``) make the int8 matmul of the
2048-wide BitNet shapes faster than the TMA kernel of kernels/bitnet_matmul.py, and can a
Triton bf16 matmul beat cuBLAS on grad_weight's shape (a K = 16384 reduction whose 352
output tiles fill 2.67 waves of 132 SMs)?

    python3 scripts/gemm_ws_probe.py

Every int8 candidate's output is compared with torch.equal against the repository
kernel's; for bf16 the max abs difference from cuBLAS's output is printed. Configs that
fail to compile print their error and are skipped. Figures in docs/bitnet.md ("Warp
specialization, clusters, and a grad_weight that dequantizes x itself").
"""
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from titan_lowbit.kernels import bitnet_matmul as MM


@triton.jit
def _body(tile, a_desc, b_desc, o_desc, a_scale_ptr, b_scale, M, N, K,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
          WS_INNER: tl.constexpr, INT8: tl.constexpr, A_T: tl.constexpr, SPLIT: tl.constexpr):
    pid_m, pid_n = MM._tile_of(tile, M, N, BM, BN, GROUP_M)
    if INT8:
        acc = tl.zeros((BM, BN), dtype=tl.int32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, warp_specialize=WS_INNER):
        if A_T:
            a = a_desc.load([k0, pid_m * BM]).T       # a stored [K, M] (grad_weight: dy)
            b = b_desc.load([k0, pid_n * BN])         # b stored [K, N] (grad_weight: x)
            acc = tl.dot(a, b, acc)
        else:
            a = a_desc.load([pid_m * BM, k0])
            b = b_desc.load([pid_n * BN, k0])
            if INT8:
                acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, b.T, acc)
    if INT8:
        offs_m = pid_m * BM + tl.arange(0, BM)
        s = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
        out = acc.to(tl.float32) * (s * b_scale)[:, None]
    else:
        out = acc
    if SPLIT:
        left, right = tl.split(tl.permute(tl.reshape(out, (BM, 2, BN // 2)), (0, 2, 1)))
        o_desc.store([pid_m * BM, pid_n * BN], left.to(tl.bfloat16))
        o_desc.store([pid_m * BM, pid_n * BN + BN // 2], right.to(tl.bfloat16))
    else:
        o_desc.store([pid_m * BM, pid_n * BN], out.to(tl.bfloat16))


@triton.jit
def probe_kernel(a_desc, b_desc, o_desc, a_scale_ptr, b_scale_ptr, M, N, K,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 PERSIST: tl.constexpr, WS_INNER: tl.constexpr, WS_OUTER: tl.constexpr,
                 INT8: tl.constexpr, A_T: tl.constexpr, SPLIT: tl.constexpr):
    if INT8:
        b_scale = tl.load(b_scale_ptr)
    else:
        b_scale = 1.0
    if PERSIST:
        num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0),
                             flatten=not WS_OUTER, warp_specialize=WS_OUTER):
            _body(tile, a_desc, b_desc, o_desc, a_scale_ptr, b_scale, M, N, K, BM, BN, BK,
                  GROUP_M, WS_INNER, INT8, A_T, SPLIT)
    else:
        _body(tl.program_id(0), a_desc, b_desc, o_desc, a_scale_ptr, b_scale, M, N, K, BM, BN,
              BK, GROUP_M, WS_INNER, INT8, A_T, SPLIT)


def launch(a, b, sa, sb, out, M, N, K, bm, bn, bk, w, st, persist=0, ws_in=False, ws_out=False,
           int8=True, a_t=False, split=True, ctas=1, group=8):
    if a_t:
        a_desc = TensorDescriptor.from_tensor(a, [bk, bm])
        b_desc = TensorDescriptor.from_tensor(b, [bk, bn])
    else:
        a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
        b_desc = TensorDescriptor.from_tensor(b, [bn, bk])
    o_desc = TensorDescriptor.from_tensor(out, [bm, bn // (1 + split)])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    grid = (min(tiles, persist * MM._cuda_sm_count(0)),) if persist else (tiles,)
    probe_kernel[grid](a_desc, b_desc, o_desc, sa, sb, M, N, K, BM=bm, BN=bn, BK=bk,
                       GROUP_M=group, PERSIST=persist > 0, WS_INNER=ws_in, WS_OUTER=ws_out,
                       INT8=int8, A_T=a_t, SPLIT=split, num_warps=w, num_stages=st,
                       num_ctas=ctas)
    return out


def bench(fn):
    return min(triton.testing.do_bench(fn, warmup=30, rep=200) for _ in range(2))


def first_run(label, fn) -> bool:
    """Compile and run ``fn`` once; a config Triton cannot build prints why and is skipped."""
    try:
        fn()
        torch.cuda.synchronize()
        return True
    except Exception as e:
        first = str(e).splitlines()[0][:200] if str(e) else ""
        print(f"{label}: FAILED {type(e).__name__}: {first}", flush=True)
        return False


INT8_CANDS = {
    # name: (bm, bn, bk, warps, stages, persist, ws_inner, ws_outer, split, ctas)
    "plain 128x256 w8 s3 (control)": (128, 256, 128, 8, 3, 0, False, False, True, 1),
    "plain 128x128 w8 s3 x2/SM (control)": (128, 128, 128, 8, 3, 2, False, False, True, 1),
    "ws-inner 128x256 w4 s3": (128, 256, 128, 4, 3, 0, True, False, True, 1),
    "ws-inner 128x256 w8 s3": (128, 256, 128, 8, 3, 0, True, False, True, 1),
    "ws-inner 128x256 w8 s4": (128, 256, 128, 8, 4, 0, True, False, True, 1),
    "ws-inner 256x128 w8 s3": (256, 128, 128, 8, 3, 0, True, False, True, 1),
    "ws-inner 128x128 w4 s4": (128, 128, 128, 4, 4, 0, True, False, True, 1),
    "ws-outer 128x256 w4 s3 x1/SM": (128, 256, 128, 4, 3, 1, False, True, True, 1),
    "ws-outer 128x256 w8 s3 x1/SM": (128, 256, 128, 8, 3, 1, False, True, True, 1),
    "ws-outer 128x128 w4 s4 x1/SM": (128, 128, 128, 4, 4, 1, False, True, True, 1),
    "ws-outer 128x128 w8 s3 x2/SM": (128, 128, 128, 8, 3, 2, False, True, True, 1),
    "ws-outer 256x128 w8 s3 x1/SM": (256, 128, 128, 8, 3, 1, False, True, True, 1),
    "cluster2 128x256 w8 s3": (128, 256, 128, 8, 3, 0, False, False, True, 2),
    "cluster2 256x128 w8 s3": (256, 128, 128, 8, 3, 0, False, False, True, 2),
}

BF16_CANDS = {
    "plain 128x256x64 w8 s4": (128, 256, 64, 8, 4, 0, False, False, True, 1),
    "plain 128x256x64 w8 s3 x1/SM": (128, 256, 64, 8, 3, 1, False, False, True, 1),
    "ws-inner 128x256x64 w4 s4": (128, 256, 64, 4, 4, 0, True, False, True, 1),
    "ws-inner 128x256x64 w8 s4": (128, 256, 64, 8, 4, 0, True, False, True, 1),
    "ws-outer 128x256x64 w4 s4 x1/SM": (128, 256, 64, 4, 4, 1, False, True, True, 1),
    "ws-outer 128x256x64 w8 s3 x1/SM": (128, 256, 64, 8, 3, 1, False, True, True, 1),
    "ws-outer 128x128x64 w4 s4 x2/SM": (128, 128, 64, 4, 4, 2, False, True, True, 1),
    "ws-outer 256x128x64 w8 s3 x1/SM": (256, 128, 64, 8, 3, 1, False, True, True, 1),
}


def run_int8():
    torch.manual_seed(0)
    for M, K, N in [(16384, 2048, 5632), (16384, 5632, 2048)]:
        a = torch.randint(-127, 128, (M, K), device="cuda", dtype=torch.int8)
        b = torch.randint(-1, 2, (N, K), device="cuda", dtype=torch.int8)
        sa = torch.rand(M, device="cuda") / 127
        sb = torch.rand((), device="cuda")
        ref = MM.int8_matmul_scaled(a, b, sa, sb, torch.bfloat16)
        ms = bench(lambda: MM.int8_matmul_scaled(a, b, sa, sb, torch.bfloat16))
        print(f"int8 {M}x{K}x{N} repository kernel: {ms*1e3:.1f} us "
              f"{2*M*K*N/ms/1e9:.0f} TOP/s", flush=True)
        for name, (bm, bn, bk, w, st, per, wi, wo, sp, ctas) in INT8_CANDS.items():
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            f = lambda: launch(a, b, sa, sb, out, M, N, K, bm, bn, bk, w, st, per, wi, wo,
                               True, False, sp, ctas)
            if not first_run(f"int8 {M}x{K}x{N} {name}", f):
                continue
            ok = torch.equal(out, ref)
            ms = bench(f)
            print(f"int8 {M}x{K}x{N} {name}: {ms*1e3:.1f} us {2*M*K*N/ms/1e9:.0f} TOP/s "
                  f"equal={ok}", flush=True)


def run_bf16():
    torch.manual_seed(0)
    # grad_weight = dy^T x: dy [T, N], x [T, K] -> [N, K]
    for T, N, K in [(16384, 5632, 2048), (16384, 2048, 5632)]:
        dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        ref = dy.t() @ x
        ms = bench(lambda: dy.t() @ x)
        print(f"bf16 wgrad {N}x{K} (T={T}) cuBLAS dy.t() @ x: {ms*1e3:.1f} us "
              f"{2*T*N*K/ms/1e9:.0f} TFLOP/s", flush=True)
        ms = bench(lambda: torch.mm(x.t(), dy).t())
        print(f"bf16 wgrad {N}x{K} (T={T}) cuBLAS (x.t() @ dy).t(): {ms*1e3:.1f} us "
              f"{2*T*N*K/ms/1e9:.0f} TFLOP/s", flush=True)
        for name, (bm, bn, bk, w, st, per, wi, wo, sp, ctas) in BF16_CANDS.items():
            out = torch.full((N, K), float("nan"), device="cuda", dtype=torch.bfloat16)
            f = lambda: launch(dy, x, None, None, out, N, K, T, bm, bn, bk, w, st, per, wi, wo,
                               False, True, sp, ctas)
            if not first_run(f"bf16 wgrad {N}x{K} {name}", f):
                continue
            err = (out.float() - ref.float()).abs().max().item()
            ms = bench(f)
            print(f"bf16 wgrad {N}x{K} {name}: {ms*1e3:.1f} us {2*T*N*K/ms/1e9:.0f} TFLOP/s "
                  f"max|diff vs cuBLAS|={err:.3g}", flush=True)


if __name__ == "__main__":
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    which = sys.argv[1:] or ["int8", "bf16"]
    if "int8" in which:
        run_int8()
    if "bf16" in which:
        run_bf16()
