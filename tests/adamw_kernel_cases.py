"""The fused AdamW kernel's test cases, shared by the kernel tests (test_optim_kernels.py)
and the master-remainder tests: tensors of every state format on ragged shapes, one fused
launch against the reference, and the comparisons (bit for bit under the interpreter, to the
GPU tolerances of test_optim_kernels.py's docstring on a GPU)."""

import torch

from titan_lowbit.kernels import adamw_lowbit as K
from titan_lowbit.kernels import adamw_lowbit_ref as R
from titan_lowbit.kernels import quant_maps as Q

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"

FORMATS = {  # name: (m codec, v codec, block)
    "8bit": (Q.CODEC_DYN8_SIGNED, Q.CODEC_DYN8_UNSIGNED, 256),
    "4bit": (Q.CODEC_DYN4_SIGNED, Q.CODEC_LIN4_NOZERO, 128),
    "fp8": (Q.CODEC_FP8_E4M3, Q.CODEC_FP8_E4M3, 128),
    "fp32": (Q.CODEC_NONE, Q.CODEC_NONE, 256),
    "bf16": (Q.CODEC_NONE, Q.CODEC_NONE, 256),
}
# Ragged shapes: rows not a multiple of anything, 1-D, tiny, odd last dims, a partial block
# per row, a 3-D tensor, an exactly aligned one.
SHAPES = [(3, 300), (257,), (5, 33), (2, 3, 64), (7,), (4, 512), (1, 129)]


def spread_magnitudes(x, gen, spread):
    """x with each element scaled by 10**-u, u uniform in [0, spread): 0 leaves x as is."""
    return x * 10.0 ** (-spread * torch.rand(x.shape, generator=gen)) if spread else x


def make_tensor(cfg, shape, gen, small_block_quant=True, sr_dense=False, spread=0.0, sr_below_2_32=False):
    rows = 1 if len(shape) == 1 else int(torch.tensor(shape[:-1]).prod())
    cols = shape[-1]
    p = torch.randn(shape, generator=gen).to(cfg.param_dtype)

    def moment(codec, signed):
        x = spread_magnitudes(torch.randn(rows, cols, generator=gen), gen, spread)
        x = x if signed else x.abs() * 1e-2
        if codec == Q.CODEC_NONE:
            return x.view(shape).to(torch.bfloat16 if cfg.state_bf16 else torch.float32).contiguous(), None
        codes, absmax = R.quantize_blockwise(x, codec, cfg.block)
        return codes, absmax

    m, ms = moment(cfg.m_codec, True)
    v, vs = moment(cfg.v_codec, False)
    extra = None
    if cfg.param_dtype == torch.bfloat16 and cfg.weight_update == K.UPDATE_MASTER:
        extra = p.float() + torch.randn(shape, generator=gen) * 1e-3
    elif cfg.param_dtype == torch.bfloat16 and cfg.weight_update == K.UPDATE_KAHAN:
        extra = (torch.randn(shape, generator=gen) * 1e-3).to(torch.bfloat16)
    elif cfg.param_dtype == torch.bfloat16 and cfg.weight_update == K.UPDATE_MASTER_REMAINDER:
        extra = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
    mv = lambda x: None if x is None else x.to(DEV)  # noqa: E731
    stride = cols if sr_dense else cols + 3
    # sr_below_2_32: the tensor's last global index is 2**32 - 1 (the kernel's 32-bit
    # index path; lo reaches 0xFFFFFFFF); otherwise anywhere below 2**40 (64-bit path)
    sr_base = (2**32 - (rows - 1) * stride - cols if sr_below_2_32
               else int(torch.randint(0, 2**40, (1,), generator=gen)))
    return K.AdamWTensor(mv(p), mv(m), mv(v), mv(ms), mv(vs), mv(extra), rows, cols,
                         sr_base=sr_base, sr_row_stride=stride,
                         sr_key=int(torch.randint(0, 2**32, (1,), generator=gen)))


def clone_tensor(t):
    c = lambda x: None if x is None else x.clone()  # noqa: E731
    return K.AdamWTensor(c(t.param), c(t.exp_avg), c(t.exp_avg_sq), c(t.exp_avg_scale), c(t.exp_avg_sq_scale),
                         c(t.extra), t.rows, t.cols, t.sr_base, t.sr_row_stride, t.sr_key, t.flag_index)


def compare_codes(name, a, b, codec):
    if not CUDA:
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} codes differ"
        return
    # GPU: fused multiply-adds may move a value across a rounding boundary: one code step.
    ai, bi = a.to(torch.int32), b.to(torch.int32)
    if codec in Q.PACKED_4BIT_CODECS:
        ai = torch.stack([ai & 15, ai >> 4], -1)
        bi = torch.stack([bi & 15, bi >> 4], -1)
    ne = (ai != bi)
    assert ne.float().mean().item() <= 2e-3, f"{name}: {ne.sum().item()} codes differ"
    va, vb = R.decode(ai[ne], codec), R.decode(bi[ne], codec)
    assert torch.all((va - vb).abs() <= 0.2), f"{name}: codes differ by more than one step"


def step_against_reference(fmt, pdtype, update, decoupled=True, lr_tensor=False, grad_dtype=None, seed=0, elems=512,
         sr_dense=False, spread=0.0, sr_below_2_32=False, tiles=None, guard=False, shapes=SHAPES):
    """One fused launch over ``shapes`` against the reference. ``guard``: with the
    non-finite guard, and inf/nan in one block of every other tensor's gradient."""
    mc, vc, block = FORMATS[fmt]
    cfg = K.AdamWConfig(mc, vc, fmt == "bf16", block, update, decoupled, pdtype, grad_dtype or pdtype)
    gen = torch.Generator().manual_seed(seed)
    ts = [make_tensor(cfg, s, gen, sr_dense=sr_dense, spread=spread, sr_below_2_32=sr_below_2_32) for s in shapes]
    grads = [spread_magnitudes(torch.randn(t.param.shape, generator=gen), gen, spread).to(cfg.grad_dtype).to(DEV)
             for t in ts]
    guards = poisoned = None
    if guard:
        for i, t in enumerate(ts):
            t.flag_index = len(ts) - 1 - i  # not the slot: the caller's numbering
        poisoned = {}
        for i, g in enumerate(grads[::2]):
            at = int(torch.randint(0, g.numel(), (1,), generator=gen))
            g.view(-1)[at] = (float("nan"), float("inf"), -float("inf"))[i % 3]
            poisoned[2 * i] = at
        before = [clone_tensor(t) for t in ts]
        guards = [K.NonfiniteGuard(torch.full((len(ts) + 1,), 3, dtype=torch.int32, device=DEV), tag=11)
                  for _ in range(2)]
    ref = [clone_tensor(t) for t in ts]
    lr = torch.tensor(3e-3, device=DEV) if lr_tensor else 3e-3
    hyper = K.AdamWHyper(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=5)
    plan = K.FusedAdamW(cfg, ts, elems_per_program=elems, num_warps=4)
    assert plan.sr_idx32 == sr_below_2_32
    if tiles is not None:
        plan.tiles_per_program = tiles
        # several programs, the last one short
        assert plan.n_tiles > 2 * tiles and (tiles == 1 or plan.n_tiles % tiles), plan.n_tiles
    plan.step(grads, hyper, None if guards is None else guards[0])
    R.adamw_step_reference(cfg, ref, grads, hyper, None if guards is None else guards[1])
    assert_matches_reference(cfg, ts, ref, f"{fmt} {pdtype} update={update}")
    if guard:
        flagged = {ts[i].flag_index for i in poisoned}
        for g in guards:  # flagged entries get the tag, the others keep what they held
            assert g.flags.tolist() == [11 if j in flagged else 3 for j in range(len(ts) + 1)]
        for i, at in poisoned.items():
            assert_block_kept(cfg, before[i], ts[i], ref[i], at)


def assert_block_kept(cfg, before, kernel, ref, at):
    """The quantization block holding element ``at`` is as it was, in the kernel's and in
    the reference's result, and the tensor's other blocks were stepped."""
    row, col = divmod(at, before.cols)
    b0 = col // cfg.block * cfg.block
    cols = slice(b0, min(b0 + cfg.block, before.cols))
    packed = cfg.m_codec in Q.PACKED_4BIT_CODECS
    ccols = slice(b0 // 2, (cols.stop + 1) // 2) if packed else cols
    for t in (kernel, ref):
        for name in ("param", "extra", "exp_avg", "exp_avg_sq"):
            x, y = getattr(before, name), getattr(t, name)
            if x is None:
                continue
            sel = ccols if name.startswith("exp") and cfg.m_codec != Q.CODEC_NONE else cols
            if name.startswith("exp") and cfg.m_codec == Q.CODEC_NONE and before.rows * before.cols == x.numel():
                x, y = x.reshape(before.rows, before.cols), y.reshape(before.rows, before.cols)
            x, y = x.reshape(before.rows, -1), y.reshape(before.rows, -1)
            assert torch.equal(x[row, sel], y[row, sel]), f"{name} of the poisoned block changed"
        for name in ("exp_avg_scale", "exp_avg_sq_scale"):
            x, y = getattr(before, name), getattr(t, name)
            if x is not None:
                x, y = x.reshape(before.rows, -1), y.reshape(before.rows, -1)
                assert torch.equal(x[row, b0 // cfg.block], y[row, b0 // cfg.block])
        if before.param.numel() > cols.stop - cols.start:
            assert not torch.equal(before.param, t.param), "the other blocks were not stepped"


def assert_matches_reference(cfg, ts, ref, label):
    """Kernel-stepped tensors ``ts`` against reference-stepped ``ref``: bit for bit under
    the interpreter, to the GPU tolerances of the module docstring on a GPU."""
    mc, vc, pdtype = cfg.m_codec, cfg.v_codec, cfg.param_dtype
    for a, b in zip(ts, ref):
        where = f"{label} shape={tuple(a.param.shape)}"
        for name in ("exp_avg", "exp_avg_sq"):
            x, y = getattr(a, name), getattr(b, name)
            if mc == Q.CODEC_NONE:
                tol = 0 if not CUDA else (1e-6 if x.dtype == torch.float32 else 1e-2)
                torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol, msg=f"{where} {name}")
            else:
                compare_codes(f"{where} {name}", x, y, mc if name == "exp_avg" else vc)
                sa, sb = getattr(a, name + "_scale"), getattr(b, name + "_scale")
                tol = 0 if not CUDA else 1e-5
                torch.testing.assert_close(sa, sb, rtol=tol, atol=0, msg=f"{where} {name} absmax")
        if not CUDA:
            assert torch.equal(a.param.view(-1).view(torch.int16 if pdtype == torch.bfloat16 else torch.int32),
                               b.param.view(-1).view(torch.int16 if pdtype == torch.bfloat16 else torch.int32)), where
            if a.extra is not None:
                assert torch.equal(a.extra, b.extra), where
        else:
            # one bf16 ulp (stochastic: the random bits are the same, the sum may differ by 1 ulp of fp32)
            tol = 1e-5 if pdtype == torch.float32 else 8e-3
            torch.testing.assert_close(a.param.float(), b.param.float(), rtol=tol, atol=1e-6, msg=where)
            if a.extra is not None and a.extra.dtype == torch.int16:  # remainders: the masters they rebuild
                torch.testing.assert_close(R.master_rebuild(a.param.cpu(), a.extra.cpu()),
                                           R.master_rebuild(b.param.cpu(), b.extra.cpu()), rtol=1e-5, atol=1e-6,
                                           msg=where)
            elif a.extra is not None:
                torch.testing.assert_close(a.extra.float(), b.extra.float(), rtol=1e-2, atol=1e-5, msg=where)
