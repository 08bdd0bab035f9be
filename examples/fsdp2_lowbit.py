"""LowBitAdamW in a plain PyTorch loop: FSDP2 (``fully_shard``) and a DCP checkpoint,
without torchtitan.

    torchrun --nproc_per_node=2 examples/fsdp2_lowbit.py --checkpoint-dir ckpt

Each rank uses its own GPU (NCCL) when the host has one for every process started on it;
otherwise every rank uses its CPU (gloo), and the script says so. The script
trains a small MLP to imitate a fixed random one for ``--steps`` steps with 8-bit AdamW
states sharded like the parameters, saves model and optimizer with
torch.distributed.checkpoint halfway, then builds a fresh model and optimizer, loads the
checkpoint into them and trains the second half again: the resumed run repeats the
first one's losses bit for bit, which the script checks.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from titan_lowbit.optim import LowBitAdamW

WIDTH, HIDDEN, BATCH = 128, 256, 32


def build(device: torch.device) -> tuple[nn.Module, LowBitAdamW]:
    """The model, sharded with FSDP2 layer by layer, and its optimizer. Parameters below
    ``min_quantized_numel`` elements (the biases) keep fp32 states."""
    torch.manual_seed(0)  # the same initial weights on every rank, and in every build
    model = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH)).to(device)
    # The mesh on the device the ranks train on (fully_shard's default mesh takes CUDA
    # whenever it exists).
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Named parameters: the optimizer's errors then name the parameter.
    optimizer = LowBitAdamW(model.named_parameters(), lr=3e-3, weight_decay=0.01,
                            state_format="8bit")
    return model, optimizer


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of one step on one rank: a function of (step, rank) only, so a
    resumed run sees the same data."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    teacher = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)) / WIDTH**0.5
    return x.to(device), torch.tanh(x @ teacher).to(device)


def train(model: nn.Module, optimizer: LowBitAdamW, steps: range, device) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, dist.get_rank(), device)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # SUM: the one reduction every backend has
        losses.append(total.item() / dist.get_world_size())
    return losses


def save(model, optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)


def load(model, optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the layout to load into
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def pick_device() -> torch.device:
    """This rank's device: its GPU (``LOCAL_RANK``) when the host has a GPU for each of its
    ``LOCAL_WORLD_SIZE`` processes, else the CPU. Every rank of a host decides the same
    way, so all of them take one backend; a run over several hosts needs the same number
    of GPUs on each."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= local_ranks:
        return torch.device("cuda", local_rank)
    if gpus and local_rank == 0:
        print(f"{local_ranks} processes on this host but {gpus} GPU(s): every rank trains on "
              f"the CPU (gloo). Start at most {gpus} (torchrun --nproc_per_node={gpus}) to "
              "train on the GPUs.", flush=True)
    return torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-dir", required=True)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: use at least 2 (a checkpoint is saved halfway)")

    device = pick_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    half = args.steps // 2
    try:
        model, optimizer = build(device)
        first = train(model, optimizer, range(half), device)
        save(model, optimizer, args.checkpoint_dir)
        rest = train(model, optimizer, range(half, args.steps), device)

        model, optimizer = build(device)  # a fresh start, e.g. after a restart
        load(model, optimizer, args.checkpoint_dir)
        resumed = train(model, optimizer, range(half, args.steps), device)
        if rank == 0:
            print(f"loss: step 1 {first[0]:.4f}, step {args.steps} {rest[-1]:.4f}")
            print(f"resumed from step {half}: "
                  f"{'same losses, bit for bit' if resumed == rest else 'DIFFERENT losses'}")
        if resumed != rest:
            raise RuntimeError(f"rank {rank}: the resumed run's losses {resumed} differ "
                               f"from the first run's {rest}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
