"""Muon's fused kernels (kernels/muon_lowbit.py) against their PyTorch reference
(kernels/muon_ref.py), bit for bit under TRITON_INTERPRET=1: every state format, every
weight update, Nesterov on and off, ragged and tiny matrices, shards of a matrix, zeros,
huge values and inf/nan with and without the non-finite guard; and LowBitMuon's fused path
against its reference path.

Compiled on a GPU the kernels fuse multiply-adds and the reference does not: there the
tests compare against the reference on the CPU to an ulp (as the AdamW kernel's tests do).
"""

import copy

import pytest
import torch

from conftest import INTERPRET
from titan_lowbit.kernels import muon_lowbit as K
from titan_lowbit.kernels import muon_ref as R
from titan_lowbit.kernels.adamw_interface import WEIGHT_UPDATES
from titan_lowbit.kernels.adamw_lowbit_ref import quantize_blockwise
from titan_lowbit.kernels.quant_maps import CODEC_NONE
from titan_lowbit.optim import LowBitMuon
from titan_lowbit.optim.formats import STATE_FORMATS
from titan_lowbit.optim.muon import COL_FACTOR as C_FACTOR_STATE
from titan_lowbit.optim.muon import ROW_FACTOR as R_FACTOR_STATE
from titan_lowbit.optim.muon_groups import DEFAULT_MOMENTUM_4BIT_LEVELS, MOMENTUM_4BIT_LEVELS, momentum_codec

DEV = "cpu" if INTERPRET else "cuda"
FORMATS = ["fp32", "bf16", "8bit", "4bit", "fp8"]
# (parameter dtype, weight update): fp32 weights take the plain write
UPDATES = [(torch.float32, "nearest")] + [(torch.bfloat16, u) for u in WEIGHT_UPDATES]
# ragged rows and columns (not multiples of any block, odd for packed 4-bit codes), a
# single row, a tall matrix (Newton-Schulz transposes it), rows of whole blocks in whole
# programs (the unmasked, aligned variant)
SHAPES = [(5, 37), (1, 300), (12, 10), (4, 256)]


def make(fmt, dtype, update, shape, gen, *, nesterov=True, block=0, weight_scale=1.0,
         levels=DEFAULT_MOMENTUM_4BIT_LEVELS):
    """(config, tensor) of a matrix with a random weight and a random (stored) momentum, in
    the codec LowBitMuon gives format ``fmt`` (a 4-bit momentum: ``levels``)."""
    f = STATE_FORMATS[fmt]
    block = block or f.default_block
    codec = momentum_codec(f, {MOMENTUM_4BIT_LEVELS: levels})
    wu = WEIGHT_UPDATES[update] if dtype == torch.bfloat16 else WEIGHT_UPDATES["nearest"]
    cfg = R.MuonConfig(codec=codec, state_bf16=f.plain_dtype == torch.bfloat16, block=block,
                       weight_update=wu, nesterov=nesterov)
    w = torch.randn(shape, generator=gen) * weight_scale
    m = torch.randn(shape, generator=gen) * 0.1
    if f.quantized:
        momentum, scale = quantize_blockwise(m, codec, block)
    else:
        momentum, scale = m.to(f.plain_dtype), None
    extra = None
    if dtype == torch.bfloat16 and update == "master":
        extra = w.clone()
    elif dtype == torch.bfloat16 and update == "master_remainder":
        extra = (w.view(torch.int32) & 0xFFFF).to(torch.int16)  # any remainder is a valid master
    elif dtype == torch.bfloat16 and update == "kahan":
        extra = (torch.randn(shape, generator=gen) * 1e-3).to(torch.bfloat16)
    t = R.MuonTensor(param=w.to(dtype), momentum=momentum, momentum_scale=scale, extra=extra, sr_key=12345)
    return cfg, t


def hyper(step=3, lr=0.02, wd=0.1):
    return R.MuonHyper(lr=lr, momentum=0.95, weight_decay=wd, ns_steps=5, ns_coefficients=R.NS_COEFFICIENTS,
                       matched_rms=R.MATCHED_RMS, step=step)


def to_dev(t):
    return copy.deepcopy(R.MuonTensor(**{k: (v.to(DEV) if isinstance(v, torch.Tensor) else v)
                                         for k, v in vars(t).items()}))


def buffers(t):
    return {k: v for k, v in vars(t).items() if isinstance(v, torch.Tensor)}


def equal_bits(a, b):
    """Bit for bit, except that any nan equals any nan (an unguarded step writes nans whose
    payload no one reads); fp8 codes as their bytes."""
    if a.is_floating_point() and a.element_size() > 1:
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_same(ref, fused, what):
    for k, want in buffers(ref).items():
        got = buffers(fused)[k].cpu()
        if INTERPRET:
            assert equal_bits(want, got), (what, k)
        elif want.is_floating_point():  # compiled: fused multiply-adds, one ulp or one code
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2, equal_nan=True)


def step_both(cfg, t, grad, h, guarded):
    """The reference step on a copy of t and the fused one on another: (ref, fused, the
    reference's result, the fused flag)."""
    ref, fused = copy.deepcopy(t), to_dev(t)
    wrote = R.muon_step_reference(cfg, ref, grad.clone(), h, guarded=guarded)
    flag = torch.zeros(1, dtype=torch.int32, device=DEV) if guarded else None
    K.muon_step_fused(cfg, fused, grad.to(DEV), h, flag)
    return ref, fused, wrote, flag


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype,update", UPDATES, ids=[u if d == torch.bfloat16 else "fp32" for d, u in UPDATES])
def test_step_matches_reference(fmt, dtype, update):
    """A whole step of each shape (Nesterov on the even shapes, off on the odd), guarded:
    weights, momentum (codes and absmax), extra state bit for bit; the Newton-Schulz input
    too."""
    gen = torch.Generator().manual_seed(10 * FORMATS.index(fmt) + list(WEIGHT_UPDATES).index(update))
    for i, shape in enumerate(SHAPES):
        cfg, t = make(fmt, dtype, update, shape, gen, nesterov=i % 2 == 0)
        grad = torch.randn(shape, generator=gen).to(dtype)
        h = hyper(step=i + 1)
        _, u_ref = R.momentum_and_input(cfg, copy.deepcopy(t), grad, h)
        u, _ = K.momentum_and_input(cfg, to_dev(t), grad.to(DEV), h)
        assert torch.equal(u.cpu().view(torch.int16), u_ref.to(torch.bfloat16).view(torch.int16)) or not INTERPRET
        ref, fused, wrote, flag = step_both(cfg, t, grad, h, guarded=True)
        assert wrote and int(flag) == 0
        assert_same(ref, fused, (fmt, update, shape))
        assert not torch.equal(ref.param.float(), t.param.float())  # the step did step


@pytest.mark.parametrize("fmt,block,levels", [("8bit", 64, "nf4"), ("4bit", 32, "nf4"), ("4bit", 256, "dynamic"),
                                              ("fp8", 256, "nf4"), ("fp32", 64, "nf4")])
def test_other_blocks_and_unguarded_match_reference(fmt, block, levels):
    """block_size other than the format's default (more or fewer blocks per row), and the
    unguarded step (the momentum written in place, no CHECK launch); a 4-bit momentum
    also in the dynamic map (``momentum_4bit_levels="dynamic"``)."""
    gen = torch.Generator().manual_seed(block)
    for shape in SHAPES:
        cfg, t = make(fmt, torch.bfloat16, "stochastic", shape, gen, block=block, levels=levels)
        grad = torch.randn(shape, generator=gen, dtype=torch.bfloat16)
        ref, fused, wrote, flag = step_both(cfg, t, grad, hyper(), guarded=False)
        assert wrote and flag is None
        assert_same(ref, fused, (fmt, block, shape))


@pytest.mark.parametrize("fmt", FORMATS)
def test_shards_step_as_the_whole_matrix(fmt):
    """The phases on four shards of a matrix (rows split, columns split at a block
    boundary), each with the whole matrix's Newton-Schulz output and its own global
    stochastic-rounding offsets, give the whole matrix's bits: the fused kernels on each
    shard against the reference on the whole."""
    gen = torch.Generator().manual_seed(3)
    rows, cols, block = 9, 200, 64
    cfg, whole = make(fmt, torch.bfloat16, "stochastic", (rows, cols), gen, block=block)
    grad = torch.randn(rows, cols, generator=gen, dtype=torch.bfloat16)
    h = hyper()
    ref = copy.deepcopy(whole)
    assert R.muon_step_reference(cfg, ref, grad, h)
    _, u = R.momentum_and_input(cfg, copy.deepcopy(whole), grad, h)
    o = R.newton_schulz(u)
    packed = fmt == "4bit"
    for r0, r1 in ((0, 4), (4, rows)):
        for c0, c1 in ((0, 128), (128, cols)):
            b0, b1 = c0 // block, -(-c1 // block)
            q0, q1 = (c0 // 2, -(-c1 // 2)) if packed else (c0, c1)
            mom = whole.momentum[r0:r1, q0:q1] if STATE_FORMATS[fmt].quantized else whole.momentum[r0:r1, c0:c1]
            shard = R.MuonTensor(param=whole.param[r0:r1, c0:c1].clone(), momentum=mom.clone(),
                                 momentum_scale=None if whole.momentum_scale is None else
                                 whole.momentum_scale[r0:r1, b0:b1].clone(),
                                 extra=None, sr_key=whole.sr_key, sr_base=r0 * cols + c0, sr_row_stride=cols)
            shard = to_dev(shard)
            flag = torch.zeros(1, dtype=torch.int32, device=DEV)
            _, staged = K.momentum_and_input(cfg, shard, grad[r0:r1, c0:c1].contiguous().to(DEV), h, flag)
            o_shard = o[r0:r1, c0:c1].contiguous().to(DEV)
            K.check_weight(cfg, shard, o_shard, h, (rows, cols), flag)
            K.write_weight(cfg, shard, o_shard, h, (rows, cols), flag, staged)
            assert int(flag) == 0
            got = R.MuonTensor(param=ref.param[r0:r1, c0:c1], momentum=ref.momentum[r0:r1, q0:q1] if
                               STATE_FORMATS[fmt].quantized else ref.momentum[r0:r1, c0:c1],
                               momentum_scale=None if ref.momentum_scale is None else
                               ref.momentum_scale[r0:r1, b0:b1], extra=None)
            assert_same(got, R.MuonTensor(param=shard.param, momentum=shard.momentum,
                                          momentum_scale=shard.momentum_scale, extra=None), (fmt, r0, c0))


# (what goes wrong, how): gradients with an inf or a nan, a gradient past fp32's range for
# the momentum (g - m overflows), and a weight whose step overflows
ADVERSARIAL = ["inf_grad", "nan_grad", "overflowing_momentum", "overflowing_weight"]


@pytest.mark.parametrize("case", ADVERSARIAL)
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "ignore"])
@pytest.mark.parametrize("fmt", ["fp32", "8bit", "4bit"])
def test_nonfinite_values_match_reference(case, guarded, fmt):
    """Guarded: nothing of the matrix written, the flag set, as the reference (which
    returns False); unguarded ("ignore"): the same bits as the reference writes, nan and
    inf included."""
    gen = torch.Generator().manual_seed(1)
    dtype, update = (torch.float32, "nearest") if case == "overflowing_weight" else (torch.bfloat16, "master")
    cfg, t = make(fmt, dtype, update, (6, 70), gen, weight_scale=3e38 if case == "overflowing_weight" else 1.0)
    grad = torch.randn(6, 70, generator=gen)
    if case == "inf_grad":
        grad[2, 5] = float("inf")
    elif case == "nan_grad":
        grad[5, 69] = float("nan")
    elif case == "overflowing_momentum":
        grad[1, 1], t.momentum_scale, t.momentum = 3e38, None, torch.full((6, 70), -3e38)
        cfg = R.MuonConfig(**{**vars(cfg), "codec": CODEC_NONE, "state_bf16": False})
    elif case == "overflowing_weight":
        grad = -grad.abs() * 1e3  # the update pushes every weight up, past fp32's largest
        t.param.abs_()
    ref, fused, wrote, flag = step_both(cfg, t, grad.to(dtype), hyper(lr=1.0, wd=0.0), guarded)
    if guarded:
        assert not wrote and int(flag) == 1
        assert_same(t, fused, case)  # nothing written
    assert_same(ref, fused, case)


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "bf16"])
def test_zero_gradient_and_momentum(fmt):
    """Zeros (a zero momentum and gradient: blocks of absmax 0, the codes of 0, a zero
    Newton-Schulz input) and a huge finite gradient with a zero momentum."""
    gen = torch.Generator().manual_seed(2)
    for grad in (torch.zeros(7, 33), torch.full((7, 33), 1e30)):
        cfg, t = make(fmt, torch.bfloat16, "kahan", (7, 33), gen)
        t.momentum.zero_()
        if t.momentum_scale is not None:
            t.momentum_scale.zero_()
        ref, fused, wrote, flag = step_both(cfg, t, grad.to(torch.bfloat16), hyper(), guarded=True)
        assert wrote and int(flag) == 0
        assert_same(ref, fused, fmt)


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 12), torch.nn.LayerNorm(12), torch.nn.Linear(12, 24, bias=False),
                               torch.nn.Linear(24, 1, bias=False)).to(dtype)


@pytest.mark.parametrize("fmt,dtype,update,nonfinite,rank", [
    ("8bit", torch.bfloat16, "stochastic", "raise", 0), ("4bit", torch.bfloat16, "master_remainder", "ignore", 0),
    ("fp32", torch.float32, "nearest", "skip", 0), ("fp8", torch.bfloat16, "kahan", "raise", 0),
    ("4bit", torch.bfloat16, "stochastic", "raise", 3), ("4bit", torch.float32, "nearest", "skip", 8)])
def test_optimizer_fused_path_matches_reference_path(fmt, dtype, update, nonfinite, rank, monkeypatch):
    """LowBitMuon with the kernels (forced on the CPU under the interpreter; on CUDA the
    path it takes) against the reference path on the CPU: identical weights and states
    after a few steps; a nan gradient in a Muon matrix stops its step on both paths alike.
    ``rank``: a 4-bit momentum's factor (``momentum_4bit_factor_rank``); compiled, the
    factor is compared as its product P R^T (a QR on another device may flip the signs of
    P's and R's columns together)."""
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("compiled kernels need a GPU")
    ref_model = _model(dtype)
    fused_model = copy.deepcopy(ref_model).to(DEV)
    kw = dict(lr=0.02, weight_decay=0.1, state_format=fmt, weight_update=update, min_quantized_numel=100,
              nonfinite_grad=nonfinite, seed=3, **({"momentum_4bit_factor_rank": rank} if rank else {}))
    ref_opt = LowBitMuon(ref_model.named_parameters(), **kw)
    fused_opt = LowBitMuon(fused_model.named_parameters(), **kw)
    if INTERPRET:
        fused_opt._use_fused = lambda t: True
    else:
        ref_opt._use_fused = lambda t: False
    write_weight, writes = K.write_weight, []
    monkeypatch.setattr(K, "write_weight", lambda *a, **k: (writes.append(1), write_weight(*a, **k))[1])
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        for p, q in zip(ref_model.parameters(), fused_model.parameters()):
            g = torch.randn(p.shape, generator=gen).to(dtype)
            if step == 2 and p.shape == (24, 12):
                g[3, 3] = float("nan")
            p.grad, q.grad = g, g.to(DEV)
        outcomes = []
        for opt in (ref_opt, fused_opt):
            try:
                opt.step()
                outcomes.append(opt.skipped_steps)
            except FloatingPointError as e:
                outcomes.append(str(e))
        assert outcomes[0] == outcomes[1]
    assert len(writes) == 3 * (4 - (nonfinite == "skip"))  # the fused path stepped every matrix
    for (name, p), q in zip(ref_model.named_parameters(), fused_model.parameters()):
        states = [(k, v, fused_opt.state[q][k]) for k, v in ref_opt.state[p].items()]
        factor = [(a, b) for k, a, b in states if k.endswith("_factor")]
        if rank and factor:
            assert [k for k, _, _ in states if k.endswith("_factor")] == [R_FACTOR_STATE, C_FACTOR_STATE]
        if factor and not INTERPRET:
            states = [x for x in states if not x[0].endswith("_factor")]
            states.append(("factor product", *(R.factor_product(*[y.cpu() for y in pair]) for pair in zip(*factor))))
        for what, a, b in [("weight", p.detach(), q.detach())] + states:
            b = b.cpu()
            if INTERPRET:
                assert equal_bits(a, b), (name, what)
            elif a.is_floating_point():
                torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2, equal_nan=True)


def test_newton_schulz_flops_count_its_matmuls():
    """muon_ref.newton_schulz_flops (bench_muon.py's TFLOP/s) is what torch's FLOP counter
    counts for newton_schulz, wide and tall (transposed) alike: per step 4 r^2 c + 2 r^3
    on the wide orientation [r, c]."""
    from torch.utils.flop_counter import FlopCounterMode

    for shape, steps in (((6, 10), 5), ((10, 6), 5), ((4, 4), 2)):
        with FlopCounterMode(display=False) as counter:
            R.newton_schulz(torch.randn(shape), steps)
        assert counter.get_total_flops() == R.newton_schulz_flops(*shape, steps), shape
    assert R.newton_schulz_flops(10, 6, 5) == 5 * (4 * 6 * 6 * 10 + 2 * 6**3)
