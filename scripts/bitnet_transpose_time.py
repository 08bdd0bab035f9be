"""GPU: torch's int8 ``codes.t().contiguous()`` against ``bitnet_quant.transpose_codes``
(grad_input's K-major operand of an all-gathered BitNet weight), equality checked first.
Figures in docs/bitnet.md ("grad_input's transposed operand by a kernel").

    python3 scripts/bitnet_transpose_time.py
"""
import torch, triton
from titan_lowbit.kernels import bitnet_quant as Q
for R, C in [(5632, 2048), (2048, 5632), (14336, 4096), (4096, 14336), (2048, 2048), (8192, 2048)]:
    c = torch.randint(-1, 2, (R, C), device="cuda", dtype=torch.int8)
    assert torch.equal(Q.transpose_codes(c), c.t().contiguous())
    t_torch = triton.testing.do_bench(lambda: c.t().contiguous(), warmup=50, rep=300)
    t_ours = triton.testing.do_bench(lambda: Q.transpose_codes(c), warmup=50, rep=300)
    print(f"{R}x{C}: torch .t().contiguous() {t_torch*1e3:.1f} us, transpose_codes {t_ours*1e3:.1f} us "
          f"({2*R*C/t_ours/1e9:.2f} TB/s)", flush=True)
