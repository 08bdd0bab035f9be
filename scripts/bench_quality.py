#!/usr/bin/env python3
"""Quality benchmark of the low-bit states: how far each optimizer's weights end from
torch.optim.AdamW's (fp32) after the same seeded run.

Task: noisy linear regression, ``y = x @ W*^T + noise``, a ``[256, 512]`` weight trained from
zero with AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0) on minibatches of
64 for 300 steps. The input features have scales spread over four decades
(``10**U(-4, 0)``), so each weight row (a quantization block) holds gradients from its
largest down to 1e-4 of it and below: the elements whose second moment a quantized state
can lose. Every optimizer sees the same initial weight and the same minibatches.

Reported per optimizer: the final training loss (mean squared error over all samples),
the distance of its final weight from torch AdamW's, ``|W - W_adam| / |W_adam - W_0|``
(Frobenius norms: the error as a fraction of the way AdamW moved), and the largest
element difference in units of lr; LowBitMuon (fp32, 8-bit, 4-bit momentum) at the same lr
follows its own trajectory: compare its rows' losses with each other and with AdamW's. Peers, if importable: torchao's AdamW8bit / AdamW4bit
/ AdamWFp8 and bitsandbytes' AdamW8bit (CUDA only).

    python3 scripts/bench_quality.py                      # CUDA if there is one, else CPU
    python3 scripts/bench_quality.py --device cpu         # LowBitAdamW's reference path
    python3 scripts/bench_quality.py --no-peers --steps 300 --seed 0
    python3 scripts/bench_quality.py --codec-error        # the second moment's coding error

``--codec-error`` measures instead, on second moments drawn like Adam's (per element a
scale ``10**U(-spread, 0)`` times a chi-square average of 10 squared normals, blocks of the
format's size), the relative error of ``sqrt(v)`` as stored (what divides the update):
the zero-free encoder, the older one (a positive v below half the smallest code stored as
0), and storing ``sqrt(v)`` in the same code book instead (v = stored**2).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def make_task(seed: int, n: int, d_in: int, d_out: int, device: str):
    """(x, y, w_star) of a seeded regression with feature scales over four decades."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (-4.0 * torch.rand(d_in, generator=gen))
    x = torch.randn(n, d_in, generator=gen) * scale
    w_star = torch.randn(d_out, d_in, generator=gen) / scale.sqrt()  # every feature matters
    y = x @ w_star.T + 0.1 * torch.randn(n, d_out, generator=gen)
    return x.to(device), y.to(device), w_star.to(device)


def batches(seed: int, n: int, batch: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, n, (batch,), generator=gen) for _ in range(steps)]


def run(build, x, y, idx, d_out: int) -> tuple[torch.Tensor, float, float]:
    """(final weight, final loss, seconds) of one optimizer on the task."""
    w = torch.nn.Parameter(torch.zeros(d_out, x.shape[1], device=x.device))
    opt = build(w)
    start = time.perf_counter()
    for i in idx:
        xb, yb = x[i.to(x.device)], y[i.to(x.device)]
        loss = ((xb @ w.T - yb) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if x.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        final = float(((x @ w.T - y) ** 2).mean())
    return w.detach().clone(), final, seconds


def optimizers(args, device: str) -> list[tuple[str, object]]:
    from titan_lowbit.optim import LowBitAdamW, LowBitMuon

    kw = dict(lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    rows = [("torch AdamW fp32", lambda w: torch.optim.AdamW([w], **kw))]
    for fmt in ("fp32", "8bit", "4bit", "fp8"):
        rows.append((f"LowBitAdamW {fmt}", lambda w, f=fmt: LowBitAdamW([("w", w)], state_format=f,
                                                                        min_quantized_numel=0, **kw)))
    # Muon at AdamW's lr and weight decay (its update is scaled to AdamW's RMS): another
    # trajectory, so its row's distance from torch AdamW is no error; compare the losses
    for fmt in ("fp32", "8bit", "4bit"):
        rows.append((f"LowBitMuon {fmt}", lambda w, f=fmt: LowBitMuon([("w", w)], lr=args.lr, weight_decay=0.0,
                                                                      state_format=f, min_quantized_numel=0)))
    if not args.peers:
        return rows
    try:
        import torchao.optim as tao

        for cls in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
            rows.append((f"torchao {cls}", lambda w, c=cls: getattr(tao, c)([w], **kw)))
    except Exception as e:  # noqa: BLE001 -- a peer that cannot load is reported, not fatal
        print(f"torchao unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    if device == "cuda":
        try:
            import bitsandbytes as bnb

            rows.append(("bitsandbytes AdamW8bit", lambda w: bnb.optim.AdamW8bit([w], **kw)))
        except Exception as e:  # noqa: BLE001
            print(f"bitsandbytes unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    return rows


def codec_error(seed: int) -> None:
    """The table of ``--codec-error`` (CPU, the reference's quantize_blockwise)."""
    from titan_lowbit.kernels import adamw_lowbit_ref as R
    from titan_lowbit.kernels import quant_maps as Q

    def stored(v, codec, block, how):
        if how == "sqrt(v) stored":
            codes, absmax = R.quantize_blockwise(v.sqrt(), codec, block, zero_free=True)
            return R.dequantize_blockwise(codes, absmax, codec, block, v.shape[1]) ** 2
        codes, absmax = R.quantize_blockwise(v, codec, block, zero_free=True)
        if how == "older encoder" and codec != Q.CODEC_LIN4_NOZERO:
            # what it coded 0: a positive v at most half the smallest code of its block
            xn = v * (1.0 / absmax.repeat_interleave(block, dim=1)[:, :v.shape[1]])
            half = float(Q.code_book(codec)[Q.SMALLEST_POSITIVE_CODE]) / 2
            codes = torch.where((codes == Q.SMALLEST_POSITIVE_CODE) & (xn <= half), 0, codes.to(torch.int32))
        return R.dequantize_blockwise(codes, absmax, codec, block, v.shape[1])

    gen = torch.Generator().manual_seed(seed)
    print("\n| format | spread | encoder | sqrt(v): median rel. error | p99 | max | stored 0 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for fmt, codec, block in (("8bit", Q.CODEC_DYN8_UNSIGNED, 256), ("fp8", Q.CODEC_FP8_E4M3, 128),
                              ("4bit", Q.CODEC_LIN4_NOZERO, 128)):
        for spread in (0, 2, 4, 8):
            scale = 10.0 ** (-spread * torch.rand(256, 1024, 1, generator=gen))
            v = (scale * torch.randn(256, 1024, 10, generator=gen)).square().mean(-1)
            for how in ("zero-free", "older encoder", "sqrt(v) stored"):
                err = ((stored(v, codec, block, how).sqrt() - v.sqrt()).abs() / v.sqrt()).flatten()
                zeros = float((stored(v, codec, block, how) == 0).float().mean())
                q = torch.quantile(err[torch.randperm(err.numel(), generator=gen)[:100000]], torch.tensor([0.5, 0.99]))
                print(f"| {fmt} | 1e-{spread} | {how} | {float(q[0]):.3g} | {float(q[1]):.3g} | {float(err.max()):.3g} "
                      f"| {zeros:.2%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--d-in", type=int, default=512)
    ap.add_argument("--d-out", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--no-peers", dest="peers", action="store_false", help="skip torchao and bitsandbytes")
    ap.add_argument("--codec-error", action="store_true", help="the second moment's coding error instead")
    args = ap.parse_args()
    if args.codec_error:
        codec_error(args.seed)
        return
    torch.manual_seed(args.seed)
    x, y, _ = make_task(args.seed, args.samples, args.d_in, args.d_out, args.device)
    idx = batches(args.seed, args.samples, args.batch, args.steps)
    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        pass
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"# {args.steps} steps, seed {args.seed}, lr {args.lr}, weight [{args.d_out}, {args.d_in}], "
          f"batch {args.batch}, {dev}, {versions}")
    results = {}
    for label, build in optimizers(args, args.device):
        try:
            results[label] = run(build, x, y, idx, args.d_out)
        except Exception as e:  # noqa: BLE001 -- a peer that fails on this device is reported
            print(f"{label}: failed: {type(e).__name__}: {e}", file=sys.stderr)
    ref = results["torch AdamW fp32"][0]
    moved = float(ref.norm())  # from W_0 = 0
    print("\n| optimizer | final loss | distance from torch AdamW | max diff / lr | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for label, (w, loss, seconds) in results.items():
        dist = float((w - ref).norm()) / moved
        print(f"| {label} | {loss:.5g} | {dist:.3e} | {float((w - ref).abs().max()) / args.lr:.3g} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
