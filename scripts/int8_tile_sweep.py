"""GPU experiment: int8 TMA matmul tiles beyond the autotuner's list, on the 2048-wide
shapes of docs/bitnet.md, each config alone in the kernel's autotuner (outputs compared with
the first config's). Figures in docs/bitnet.md ("Where the 2048-wide shapes stand").

    TITAN_LOWBIT_FAST_LAUNCH=0 python3 scripts/int8_tile_sweep.py

(every launch through Triton's autotuner object, so each swapped config is the one run)."""
import torch, triton
from titan_lowbit.kernels import bitnet_matmul as MM

K_ = MM._int8_matmul_tma_kernel
def cfg(bm, bn, bk, w, st, per_sm=1, store=True, split=True, group=8, maxnreg=None):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, PER_SM=per_sm,
                              TMA_STORE=store, SPLIT_N=split), num_warps=w, num_stages=st,
                         pre_hook=MM._set_tma_blocks, maxnreg=maxnreg)
cands = {
    "base 128x256x128 w8 s3": cfg(128, 256, 128, 8, 3),
    "128x128x128 w8 s3 x2/SM": cfg(128, 128, 128, 8, 3, per_sm=2),
    "128x256x128 w8 s3 g4": cfg(128, 256, 128, 8, 3, group=4),
    "128x256x128 w8 s3 g16": cfg(128, 256, 128, 8, 3, group=16),
    "128x256x64 w8 s6": cfg(128, 256, 64, 8, 6),
    "256x128x64 w8 s6": cfg(256, 128, 64, 8, 6),
    "256x256x64 w16 s3": cfg(256, 256, 64, 16, 3),
    "256x256x64 w16 s4": cfg(256, 256, 64, 16, 4),
    "256x256x128 w16 s2": cfg(256, 256, 128, 16, 2),
    "128x256x128 w12 s3": cfg(128, 256, 128, 12, 3) ,
    "256x128x128 w12 s3": cfg(256, 128, 128, 12, 3),
}
torch.manual_seed(0)
for M, K, N in [(16384, 2048, 5632), (16384, 5632, 2048), (8192, 2048, 8192)]:
    a = torch.randint(-127, 128, (M, K), device="cuda", dtype=torch.int8)
    b = torch.randint(-1, 2, (N, K), device="cuda", dtype=torch.int8)
    sa = torch.rand(M, device="cuda"); sb = torch.rand((), device="cuda")
    ref = None
    for name, c in cands.items():
        K_.configs = [c]
        K_.cache.clear()
        try:
            out = MM.int8_matmul_scaled(a, b, sa, sb, torch.bfloat16, impl="tma")
            torch.cuda.synchronize()
        except Exception as e:
            print(f"{M}x{K}x{N} {name}: FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if ref is None:
            ref = out
        ok = torch.equal(out, ref)
        ms = min(triton.testing.do_bench(lambda: MM.int8_matmul_scaled(a, b, sa, sb, torch.bfloat16, impl="tma"),
                                         warmup=30, rep=200) for _ in range(2))
        print(f"{M}x{K}x{N} {name}: {ms*1e3:.1f} us {2*M*K*N/ms/1e9:.0f} TOP/s equal={ok}", flush=True)
