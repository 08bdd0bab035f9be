"""GPU experiment: grad_weight of the BitNet linear with the saved activation dequantized
inside the matmul, against today's path (dequantize_rows kernel, then cuBLAS dy^T x^).

    dW[n, k] = sum_t dy[t, n] * bf16(x_codes[t, k] * s_x[t])

Variant "x-regs": computes dW^T = x^T dy, x^ as wgmma's A operand made in registers from
the int8 tile; the tile leaves transposed. Variant "x-smem": dW = dy^T x^, x^ as the B
operand (Triton stages it through shared memory). Outputs compared with the cuBLAS path
(max abs difference: the sums are the same products in another order). Figures in
docs/bitnet.md, next to those of scripts/gemm_ws_probe.py.

    python3 scripts/wgrad_probe.py
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gemm_ws_probe import bench, first_run  # scripts/, this script's directory
from titan_lowbit.kernels import bitnet_matmul as MM
from titan_lowbit.kernels import bitnet_quant as Q


@triton.jit
def _one(tile, x_desc, s_ptr, dy_desc, o_desc, T, K, N,
         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
         X_REGS: tl.constexpr):
    if X_REGS:
        # tile of dW^T [K, N]: rows over x's columns, columns over dy's
        pid_m, pid_n = MM._tile_of(tile, K, N, BM, BN, GROUP_M)
    else:
        # tile of dW [N, K]
        pid_m, pid_n = MM._tile_of(tile, N, K, BM, BN, GROUP_M)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for t0 in range(0, T, BK):
        offs_t = t0 + tl.arange(0, BK)
        s = tl.load(s_ptr + offs_t, mask=offs_t < T, other=0.0)
        if X_REGS:
            xq = x_desc.load([t0, pid_m * BM])                       # [BK, BM] int8
            xd = (xq.to(tl.float32) * s[:, None]).to(tl.bfloat16)
            d = dy_desc.load([t0, pid_n * BN])                       # [BK, BN]
            acc = tl.dot(xd.T, d, acc)
        else:
            d = dy_desc.load([t0, pid_m * BM])                       # [BK, BM]
            xq = x_desc.load([t0, pid_n * BN])                       # [BK, BN] int8
            xd = (xq.to(tl.float32) * s[:, None]).to(tl.bfloat16)
            acc = tl.dot(d.T, xd, acc)
    if X_REGS:
        o_desc.store([pid_n * BN, pid_m * BM], acc.to(tl.bfloat16).T)
    else:
        o_desc.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))


@triton.jit
def wgrad_kernel(x_desc, s_ptr, dy_desc, o_desc, T, K, N,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 X_REGS: tl.constexpr, PERSIST: tl.constexpr):
    if PERSIST:
        if X_REGS:
            num_tiles = tl.cdiv(K, BM) * tl.cdiv(N, BN)
        else:
            num_tiles = tl.cdiv(N, BM) * tl.cdiv(K, BN)
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
            _one(tile, x_desc, s_ptr, dy_desc, o_desc, T, K, N, BM, BN, BK, GROUP_M, X_REGS)
    else:
        _one(tl.program_id(0), x_desc, s_ptr, dy_desc, o_desc, T, K, N, BM, BN, BK, GROUP_M,
             X_REGS)


def launch(xq, s, dy, out, bm, bn, bk, w, st, x_regs, persist, group=8):
    T, K = xq.shape
    N = dy.shape[1]
    if x_regs:
        x_desc = TensorDescriptor.from_tensor(xq, [bk, bm])
        dy_desc = TensorDescriptor.from_tensor(dy, [bk, bn])
        o_desc = TensorDescriptor.from_tensor(out, [bn, bm])
        tiles = triton.cdiv(K, bm) * triton.cdiv(N, bn)
    else:
        x_desc = TensorDescriptor.from_tensor(xq, [bk, bn])
        dy_desc = TensorDescriptor.from_tensor(dy, [bk, bm])
        o_desc = TensorDescriptor.from_tensor(out, [bm, bn])
        tiles = triton.cdiv(N, bm) * triton.cdiv(K, bn)
    grid = (min(tiles, persist * MM._cuda_sm_count(0)),) if persist else (tiles,)
    wgrad_kernel[grid](x_desc, s, dy_desc, o_desc, T, K, N, BM=bm, BN=bn, BK=bk, GROUP_M=group,
                       X_REGS=x_regs, PERSIST=persist > 0, num_warps=w, num_stages=st)
    return out


CANDS = [  # bm, bn, bk, warps, stages, x_regs, persist
    (128, 256, 64, 8, 3, True, 0), (128, 256, 64, 8, 4, True, 0), (128, 256, 64, 8, 3, True, 1),
    (128, 128, 64, 8, 4, True, 0), (128, 128, 64, 4, 4, True, 0), (256, 128, 64, 8, 3, True, 0),
    (128, 256, 64, 8, 3, False, 0), (128, 256, 64, 8, 4, False, 0), (128, 256, 64, 8, 3, False, 1),
    (128, 128, 64, 8, 4, False, 0), (256, 128, 64, 8, 3, False, 0),
    (128, 256, 128, 8, 2, True, 0), (128, 128, 128, 8, 3, True, 0),
]

if __name__ == "__main__":
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    torch.manual_seed(0)
    for T, K, N in [(16384, 2048, 5632), (16384, 5632, 2048), (16384, 4096, 14336),
                    (16384, 14336, 4096)]:
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        xq, s = Q.quantize_rows(x)
        dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
        ref = dy.t() @ Q.dequantize_rows(xq, s, torch.bfloat16)
        tag = f"{K}->{N} (T={T})"
        ms_d = bench(lambda: Q.dequantize_rows(xq, s, torch.bfloat16))
        xd = Q.dequantize_rows(xq, s, torch.bfloat16)
        ms_mm = bench(lambda: dy.t() @ xd)
        ms_both = bench(lambda: dy.t() @ Q.dequantize_rows(xq, s, torch.bfloat16))
        fl = 2 * T * K * N
        print(f"{tag} today: dequantize {ms_d*1e3:.1f} us + cuBLAS {ms_mm*1e3:.1f} us "
              f"({fl/ms_mm/1e9:.0f} TFLOP/s); both {ms_both*1e3:.1f} us", flush=True)
        for bm, bn, bk, w, st, xr, per in CANDS:
            name = f"{'x-regs' if xr else 'x-smem'} {bm}x{bn}x{bk} w{w} s{st}{' x1/SM' if per else ''}"
            out = torch.full((N, K), float("nan"), device="cuda", dtype=torch.bfloat16)
            f = lambda: launch(xq, s, dy, out, bm, bn, bk, w, st, xr, per)
            if not first_run(f"{tag} {name}", f):
                continue
            err = (out.float() - ref.float()).abs().max().item()
            scale = ref.float().abs().max().item()
            ms = bench(f)
            print(f"{tag} {name}: {ms*1e3:.1f} us ({fl/ms/1e9:.0f} TFLOP/s) "
                  f"max|diff| {err:.3g} of max|dW| {scale:.3g}", flush=True)
