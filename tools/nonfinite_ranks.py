#!/usr/bin/env python3
"""The in-kernel non-finite check (``nonfinite_grad="raise"``) under FSDP2 on NCCL: a nan
in rank 1's gradient shard at the second step must make BOTH ranks raise at the third
``step()`` call, before it changes anything, and both must then step on. Prints each
rank's five outcomes (docs/optimizer.md has a run):

    torchrun --nproc_per_node 2 tools/nonfinite_ranks.py
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from titan_lowbit.optim import LowBitAdamW

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
mesh = init_device_mesh("cuda", (2,))
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).cuda()
for layer in m:
    fully_shard(layer, mesh=mesh)
fully_shard(m, mesh=mesh)
opt = LowBitAdamW(list(m.named_parameters()), lr=1e-3, min_quantized_numel=0)
x = torch.randn(8, 1024, device="cuda")
res = []
for step in range(5):
    opt.zero_grad()
    m(x).square().mean().backward()
    if step == 1 and rank == 1:
        m[0].weight.grad._local_tensor[3, 5] = float("nan")
    before = m[0].weight._local_tensor.detach().clone()
    try:
        opt.step()
        res.append("ok")
    except FloatingPointError as e:
        same = torch.equal(before, m[0].weight._local_tensor)
        res.append(f"raised (weights unchanged: {same}): {str(e)[:100]}")
torch.cuda.synchronize()
print(f"rank {rank}: {res}", flush=True)
dist.destroy_process_group()
