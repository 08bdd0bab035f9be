#!/usr/bin/env python3
"""Sharded LowBitMuon step on the TinyLlama-1.1B matrix set (FSDP2's Shard(0), one mesh
dimension), and its owner-rank exchange against an fp32 one.

    torchrun --nproc_per_node 2 scripts/bench_muon_sharded.py                 # GPUs (NCCL)
    torchrun --nproc_per_node 2 scripts/bench_muon_sharded.py --bytes-only    # any machine (gloo)
    torchrun --nproc_per_node 2 scripts/bench_muon_sharded.py --layers 1 --steps 1 --warmup 0  # CPU smoke run

The Muon matrices of TinyLlama-1.1B (22 layers of q, k, v, o, gate, up, down: 154
matrices, 0.97B elements; the embedding and the output head are AdamW's and left out)
are bf16 DTensors sharded by rows over all ranks, with random bf16 gradients. Reported,
from rank 0:

* bytes each rank sends to the others per step, counted from the exchange's own routes
  (``OwnerExchange.bytes_sent``), summed over ranks, for the bf16 exchange the optimizer
  runs and for the same exchange in fp32 (what an fp32-momentum exchange would send);
* the same for the bf16 exchange with a side matrix and extras, as a rank-k momentum
  factor uses it: the momentum travels with the Newton-Schulz input, and P [rows, k] and
  R [cols, k] (bf16, k = --factor-rank) come back in slices with the result;
* (not with --bytes-only) the optimizer step's time (median of --steps steps after
  --warmup, each between host syncs); the exchange alone (the same buckets, no
  Newton-Schulz) in bf16, in fp32, and in bf16 with the side matrix and extras; peak
  memory allocated during the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench_optimizer import tinyllama_shapes  # scripts/bench_optimizer.py, beside this file


MATRICES_PER_LAYER = 7  # q, k, v, o, gate, up, down


def muon_shapes(layers: int) -> list[tuple[int, int]]:
    """The 2-D shapes of TinyLlama-1.1B's first ``layers`` layers that Muon steps (the
    embedding and the output head are AdamW's)."""
    shapes = [s for s in tinyllama_shapes() if len(s) == 2][1:-1]
    return shapes[:layers * MATRICES_PER_LAYER]


def row_sharded(shape: tuple[int, int], mesh, device, gen: torch.Generator, random: bool):
    """A bf16 DTensor of ``shape`` sharded Shard(0) over ``mesh`` (torch.chunk's split)."""
    from torch.distributed.tensor import DTensor, Shard

    rank, world = mesh.get_local_rank(), mesh.size()
    rows = [len(c) for c in torch.arange(shape[0]).chunk(world)] + [0] * world
    local_shape = (rows[rank], shape[1])
    local = (torch.randn(local_shape, generator=gen, device=device) if random else
             torch.empty(local_shape, device=device)).to(torch.bfloat16)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=(shape[1], 1))


def timed(fn, steps: int, warmup: int, sync) -> float:
    """Median wall time of ``fn`` in ms, each call between host syncs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-format", default="8bit")
    ap.add_argument("--weight-update", default="stochastic")
    ap.add_argument("--bucket-numel", type=int, default=None,
                    help="LowBitMuon's exchange_bucket_numel (default: its own default)")
    ap.add_argument("--layers", type=int, default=22, help="the first N of TinyLlama's 22 layers")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--factor-rank", type=int, default=8,
                    help="k of the extras P [rows, k] and R [cols, k] in the side-matrix exchange's figures")
    ap.add_argument("--momentum-factor-rank", type=int, default=0,
                    help="the optimizer's momentum_4bit_factor_rank (with --state-format 4bit): the step timed "
                         "with Muon4bit's factor")
    ap.add_argument("--bytes-only", action="store_true",
                    help="count the exchange's bytes only (no step, no allocation of the weights' values)")
    args = ap.parse_args()

    from torch.distributed.device_mesh import init_device_mesh

    from titan_lowbit.optim import LowBitMuon
    from titan_lowbit.optim.muon_exchange import COLS, ROWS, Extra, OwnerExchange

    cuda = torch.cuda.is_available() and not args.bytes_only
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    gen = torch.Generator(device=device).manual_seed(rank)
    random = not args.bytes_only
    params = [torch.nn.Parameter(row_sharded(s, mesh, device, gen, random)) for s in muon_shapes(args.layers)]
    kw = {} if args.bucket_numel is None else {"exchange_bucket_numel": args.bucket_numel}
    if args.momentum_factor_rank:
        kw["momentum_4bit_factor_rank"] = args.momentum_factor_rank
    opt = LowBitMuon([{"params": params, "use_muon": True}], lr=1e-4, state_format=args.state_format,
                     weight_update=args.weight_update, **kw)
    for p in params:
        p.grad = row_sharded(tuple(p.shape), mesh, device, gen, random)
    buckets = opt._sharded(opt._muon_work())
    fp32 = [(idx, OwnerExchange([params[i] for i in idx], ex.dims, wire_dtype=torch.float32)) for idx, ex in buckets]

    k = args.factor_rank
    factor = [[(Extra(ROWS, k, torch.bfloat16), Extra(COLS, k, torch.bfloat16))] * len(idx) for idx, _ in buckets]

    def factor_work(j, whole, side):
        """Stand-ins for P and R: the extras' shapes and dtypes, from the whole matrices."""
        return whole, (side[:, :k].contiguous(), whole[:k].T.contiguous())

    def total(exchanges, **kw) -> int:
        sent = torch.tensor([sum(ex.bytes_sent(**kw) for _, ex in exchanges)], dtype=torch.int64,
                            device=device if cuda else "cpu")
        dist.all_reduce(sent)
        return int(sent.item())

    numel = sum(p.numel() for p in params)
    row = {"world": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "matrices": len(params), "elements": numel, "buckets": len(buckets),
           "state_format": args.state_format, "momentum_factor_rank": args.momentum_factor_rank,
           "weight_update": args.weight_update,
           "bytes_sent_bf16": total(buckets), "bytes_sent_fp32": total(fp32),
           "bytes_sent_bf16_side": sum(total([b], side=True, extras=e) for b, e in zip(buckets, factor))}
    if not args.bytes_only:
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        row["step_ms"] = timed(opt.step, args.steps, args.warmup, sync)
        if cuda:
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        for label, exchanges, dtype in (("exchange_bf16_ms", buckets, torch.bfloat16),
                                        ("exchange_fp32_ms", fp32, torch.float32)):
            inputs = [[params[i].grad._local_tensor.to(dtype) for i in idx] for idx, _ in exchanges]

            def exchange_all(exchanges=exchanges, inputs=inputs):
                for (_, ex), x in zip(exchanges, inputs):
                    ex.run(x, lambda j, whole, _side: (whole, ()))

            row[label] = timed(exchange_all, args.steps, args.warmup, sync)
        inputs = [[params[i].grad._local_tensor for i in idx] for idx, _ in buckets]
        side = [[params[i]._local_tensor for i in idx] for idx, _ in buckets]

        def exchange_side():
            for (_, ex), x, m, e in zip(buckets, inputs, side, factor):
                ex.run(x, factor_work, side=m, extras=e)

        row["exchange_bf16_side_ms"] = timed(exchange_side, args.steps, args.warmup, sync)
    if rank == 0:
        print(json.dumps(row), flush=True)
        keys = [k for k in row if k.endswith(("_ms", "gib")) or k.startswith("bytes")]
        print("| " + " | ".join(keys) + " |\n| " + " | ".join("---" for _ in keys) + " |\n| "
              + " | ".join(f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in keys) + " |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
