#!/usr/bin/env python3
"""What ``[lowbit] health_metrics`` costs: a logged training step with and without the
health read, in one process, on a torchtitan llama3 flavor.

    python3 scripts/bench_health.py                               # debug model, CPU or GPU
    python3 scripts/bench_health.py --flavor 1B --weight-dtype bfloat16 --update nearest

Each round runs one training step (forward, backward, ``LowBitAdamW.step()``) without
the read and one followed by ``optimizer_health`` (what ``HealthMetricsProcessor.log``
adds to a logged step), alternating, each timed after a host sync; printed: the median
of both, their difference, the read alone, and that difference spread over
``--log-freq`` steps (a step that is not logged runs nothing of it). One JSON line per
state format, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel", help="llama3 flavor (titan_lowbit adds 1B)")
    parser.add_argument("--formats", default="8bit,4bit,fp8", help="state formats, comma-separated")
    parser.add_argument("--weight-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--update", default="nearest", help="weight_update for bf16 weights")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--log-freq", type=int, default=10)
    args = parser.parse_args()

    import titan_lowbit.torchtitan  # noqa: F401  (registers the 1B flavor; the CPU path without a GPU)
    from torchtitan.protocols.train_spec import get_train_spec

    from titan_lowbit.optim import LowBitAdamW, optimizer_health

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = get_train_spec("llama3")
    model_args = spec.model_args[args.flavor]
    rows = []
    for fmt in args.formats.split(","):
        torch.manual_seed(0)
        with torch.device(device):
            model = spec.model_cls(model_args)
            with torch.no_grad():
                model.init_weights()
        model.to(getattr(torch, args.weight_dtype))
        opt = LowBitAdamW(list(model.named_parameters()), lr=3e-4, weight_decay=0.1, state_format=fmt,
                          weight_update=args.update if args.weight_dtype == "bfloat16" else "nearest")
        tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq + 1), device=device)

        def step(health: bool) -> float:
            _sync(device)
            start = time.perf_counter()
            opt.zero_grad()
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            opt.step()
            if health:
                optimizer_health([opt])
            _sync(device)
            return time.perf_counter() - start

        for _ in range(args.warmup):
            step(False), step(True)
        off, on = [], []
        for _ in range(args.rounds):
            off.append(step(False))
            on.append(step(True))
        read = []
        for _ in range(args.rounds):
            _sync(device)
            start = time.perf_counter()
            optimizer_health([opt])
            _sync(device)
            read.append(time.perf_counter() - start)
        ms = {k: 1e3 * statistics.median(v) for k, v in (("off", off), ("on", on), ("read", read))}
        row = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", flavor=args.flavor,
                   params=sum(p.numel() for p in model.parameters()), state_format=fmt,
                   weight_dtype=args.weight_dtype, update=opt.param_groups[0]["weight_update"],
                   step_ms_off=ms["off"], step_ms_on=ms["on"], read_ms=ms["read"], log_freq=args.log_freq,
                   share_per_step=ms["read"] / args.log_freq / ms["off"], torch=torch.__version__,
                   threads=torch.get_num_threads())
        print(json.dumps(row), flush=True)
        rows.append(row)
        del model, opt
    print("\n| format | logged step, off (ms) | logged step, on (ms) | health read (ms) | "
          f"read over {args.log_freq} steps, share of a step |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['state_format']} | {r['step_ms_off']:.1f} | {r['step_ms_on']:.1f} | {r['read_ms']:.2f} | "
              f"{r['share_per_step']:.2%} |")


if __name__ == "__main__":
    main()
