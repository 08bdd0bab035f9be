"""GPU experiment: does running the BitNet backward's memory-bound kernel on a second CUDA
stream, beside a GEMM, hide it? fwd+bwd of one BitNet linear (given ternary weight), 16384
tokens, its kernels called in order without autograd, against bf16; results compared with
torch.equal. Figures in docs/bitnet.md ("Side streams do not hide ...").

    python3 scripts/bitnet_stream_overlap.py OUT.json
"""
import torch, triton, json, sys
from titan_lowbit.kernels import bitnet_quant as Q, bitnet_matmul as MM

torch.manual_seed(0)
dev = "cuda"
M = 16384
side = torch.cuda.Stream()
res = {}
for K, N in [(2048, 5632), (5632, 2048), (4096, 14336), (14336, 4096)]:
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.float32)
    codes, codes_t, g = Q.ternarize_from_sum_transposed(w, w.abs().sum(), w.numel())
    wb = (codes.float() * g).bfloat16()

    def bf16():
        y = x @ wb.t(); dx = dy @ wb; dw = dy.t() @ x
        return y, dx, dw

    def fwd():
        xq, xs = Q.quantize_rows(x)
        y = MM.int8_matmul_scaled(xq, codes, xs, g, torch.bfloat16)
        return xq, xs

    def serial():
        xq, xs = fwd()
        dq, ds = Q.quantize_rows(dy)
        dx = MM.int8_matmul_scaled(dq, codes_t, ds, g, torch.bfloat16)
        xd = Q.dequantize_rows(xq, xs, torch.bfloat16)
        dw = dy.t() @ xd
        return dx, dw

    def hide_dequant():  # dequant x on the side, beside the int8 dgrad
        xq, xs = fwd()
        main = torch.cuda.current_stream()
        dq, ds = Q.quantize_rows(dy)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            xd = Q.dequantize_rows(xq, xs, torch.bfloat16)
        dx = MM.int8_matmul_scaled(dq, codes_t, ds, g, torch.bfloat16)
        main.wait_stream(side)
        xd.record_stream(main)
        dw = dy.t() @ xd
        return dx, dw

    def hide_quant_dy():  # quant dy + dgrad on the side, beside the bf16 wgrad
        xq, xs = fwd()
        main = torch.cuda.current_stream()
        xd = Q.dequantize_rows(xq, xs, torch.bfloat16)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dq, ds = Q.quantize_rows(dy)
            dx = MM.int8_matmul_scaled(dq, codes_t, ds, g, torch.bfloat16)
        dw = dy.t() @ xd
        main.wait_stream(side)
        dx.record_stream(main)
        return dx, dw

    def hide_both():  # dequant first; quant dy + dgrad on the side beside wgrad; order by size
        xq, xs = fwd()
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dq, ds = Q.quantize_rows(dy)
            dx = MM.int8_matmul_scaled(dq, codes_t, ds, g, torch.bfloat16)
        xd = Q.dequantize_rows(xq, xs, torch.bfloat16)
        dw = dy.t() @ xd
        main.wait_stream(side)
        dx.record_stream(main)
        return dx, dw

    # same results
    a, b = serial(), hide_dequant()
    c, d = hide_quant_dy(), hide_both()
    torch.cuda.synchronize()
    for o in (b, c, d):
        assert torch.equal(a[0], o[0]) and torch.equal(a[1], o[1])
    fns = dict(bf16=bf16, serial=serial, hide_dequant=hide_dequant, hide_quant_dy=hide_quant_dy,
               hide_both=hide_both)
    for f in fns.values():
        f()
    rounds = {k: [] for k in fns}
    for _ in range(3):
        for k, f in fns.items():
            rounds[k].append(triton.testing.do_bench(f, warmup=50, rep=300))
    med = {k: sorted(v)[1] for k, v in rounds.items()}
    row = {k: round(v, 4) for k, v in med.items()}
    row.update({f"x_{k}": round(med["bf16"] / v, 3) for k, v in med.items() if k != "bf16"})
    res[f"{K}->{N}"] = row
    print(K, N, json.dumps(row), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
