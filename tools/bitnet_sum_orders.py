"""Do two ways of summing |W| on this GPU give a BitNet weight the same bits?

Prints, for shards of the llama3 debug and 1B BitNet weights (FSDP over 2 GPUs) in fp32
and bf16, how many of them get another fp32 sum |W| from ``torch.linalg.vector_norm`` (one
tensor) than from ``torch._foreach_norm`` over all of them (CUDA's multi-tensor kernel),
and how many get another sum from ``ops.weight_abs_sums`` of one weight than of all.

    python tools/bitnet_sum_orders.py
"""

import torch

from titan_lowbit.bitnet import ops

SHAPES = {  # (out, in) // 2 rows: one FSDP shard of 2
    "debug": [(128, 256), (384, 256), (128, 768)],
    "1B": [(1024, 2048), (128, 2048), (2816, 2048), (1024, 5632)],
}


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for model, shapes in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            ws = [(torch.randn(s, device="cuda") * 0.02).to(dtype) for s in shapes for _ in range(4)]
            one = [torch.linalg.vector_norm(w, 1, dtype=torch.float32) for w in ws]
            many = torch._foreach_norm(ws, 1, dtype=torch.float32)
            ours_many = ops.weight_abs_sums(ws)
            ours_one = [ops.weight_abs_sums([w])[0] for w in ws]
            torch.cuda.synchronize()
            print(f"{model} {str(dtype)[6:]}: {len(ws)} weights; vector_norm vs _foreach_norm: "
                  f"{sum(not torch.equal(a, b) for a, b in zip(one, many))} differ; "
                  f"weight_abs_sums one vs all: "
                  f"{sum(not torch.equal(a, b) for a, b in zip(ours_one, ours_many))} differ")


if __name__ == "__main__":
    main()
