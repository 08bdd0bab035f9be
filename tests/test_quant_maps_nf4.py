"""The NormalFloat4 codec (quant_maps.CODEC_NF4_SIGNED): its levels, its encoder (exactly
the nearest level, ties toward 0) in the reference, and the fused kernels' encode and
decode against the reference through Muon's momentum kernel, bit for bit under
TRITON_INTERPRET=1 (on a GPU, to a code at a rounding boundary, as test_muon_kernels.py)."""

import copy

import pytest
import torch

from conftest import INTERPRET
from titan_lowbit.kernels import adamw_lowbit_ref as R
from titan_lowbit.kernels import muon_lowbit as MK
from titan_lowbit.kernels import muon_ref as MR
from titan_lowbit.kernels import quant_maps as Q
from titan_lowbit.kernels.adamw_interface import UPDATE_STOCHASTIC

DEV = "cpu" if INTERPRET else "cuda"
NF4 = Q.CODEC_NF4_SIGNED


def _levels_by_code() -> torch.Tensor:
    """The stored (float32) level of every code, as the reference decodes it."""
    return R.decode(torch.arange(16, dtype=torch.int32), NF4)


def test_levels_are_the_normal_quantile_construction():
    """16 ascending levels with -1, 0 and 1; 8 positive, 7 negative; QLoRA's published
    values (to their float32 print: they were built from a float32 linspace); the code
    book is the levels by code, zero at code 0; the decode table holds them in float32."""
    lv = Q.nf4_levels()
    assert lv.numel() == 16 and torch.all(lv[1:] > lv[:-1])
    assert lv[0] == -1 and lv[-1] == 1 and lv[7] == 0
    assert int((lv > 0).sum()) == 8 and int((lv < 0).sum()) == 7
    published = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                              -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                              0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                              0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                              0.7229568362236328, 1.0], dtype=torch.float64)
    torch.testing.assert_close(lv, published, rtol=0, atol=3e-7)
    book = Q.code_book(NF4)
    assert book[0] == 0 and torch.equal(book.sort().values, lv)
    assert torch.equal(_levels_by_code().double(), book.float().double())


def test_every_level_round_trips_exactly():
    """Every stored level encodes to its own code (and -0.0 to the code of 0)."""
    codes = torch.arange(16, dtype=torch.int32)
    assert torch.equal(R.encode(_levels_by_code(), NF4), codes)
    assert int(R.encode(torch.tensor([-0.0]), NF4)) == 0


def test_encoder_is_the_nearest_level_ties_toward_zero():
    """Against a brute-force argmin over the stored levels (in float64, exact for float32
    inputs): random values, every exact midpoint and its float32 neighbours, ±0, tiny
    values, ±1. Ties (an exact midpoint) go to the level nearer to 0."""
    lv = _levels_by_code()
    srt = lv.double().sort().values
    gen = torch.Generator().manual_seed(0)
    mids = (srt[:-1] + srt[1:]) / 2
    near = mids.float()
    neighbours = torch.cat([near, torch.nextafter(near, torch.tensor(2.0)), torch.nextafter(near, torch.tensor(-2.0))])
    x = torch.cat([torch.rand(50000, generator=gen) * 2 - 1, torch.randn(5000, generator=gen) * 0.3,
                   neighbours, lv, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-30, -1e-30, 1.0, -1.0])]).clamp(-1, 1)
    dist = (lv.double()[None, :] - x.double()[:, None]).abs()
    best = dist.min(dim=1, keepdim=True).values
    # among the nearest codes (two at an exact tie), the one of smaller magnitude
    mag = torch.where(dist == best, lv.double().abs()[None, :], torch.tensor(float("inf"), dtype=torch.float64))
    want = mag.argmin(dim=1).to(torch.int32)
    got = R.encode(x, NF4)
    assert torch.equal(got, want), x[got != want]
    exact_ties = mids[mids.float().double() == mids]  # midpoints that are float32 values
    assert exact_ties.numel() > 0  # the tie rule is exercised
    tie_codes = R.encode(exact_ties.float(), NF4).long()
    lo_hi = torch.stack([srt[:-1], srt[1:]])[:, mids.float().double() == mids]
    assert torch.equal(lv.double()[tie_codes], torch.where(exact_ties > 0, lo_hi[0], lo_hi[1]))


def test_nan_encodes_as_the_reference_writes_it():
    """A nan compares below every threshold: the code of -1 (its block's absmax is nan,
    so the block decodes to nans whatever its codes)."""
    assert int(R.encode(torch.tensor([float("nan")]), NF4)) == int(R.encode(torch.tensor([-1.0]), NF4))
    codes, absmax = R.quantize_blockwise(torch.tensor([[0.5, float("nan"), 0.25]]), NF4, 4)
    assert absmax.isnan().all()
    assert R.dequantize_blockwise(codes, absmax, NF4, 4, 3).isnan().all()


@pytest.mark.parametrize("cols", [37, 64, 1])
def test_blockwise_round_trip_packs_two_codes_a_byte(cols):
    """quantize_blockwise packs two codes a byte (element 2i low), an odd row padded with
    the code of 0 (0); dequantize gives each element its nearest level times its absmax."""
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(3, cols, generator=gen)
    codes, absmax = R.quantize_blockwise(x, NF4, 16)
    assert codes.shape == (3, (cols + 1) // 2) and codes.dtype == torch.uint8
    if cols % 2:
        assert torch.all(codes[:, -1] >> 4 == 0)
    scale = absmax.repeat_interleave(16, dim=1)[:, :cols]
    back = R.dequantize_blockwise(codes, absmax, NF4, 16, cols)
    inv = torch.where(scale > 0, 1 / scale, 0.0)
    want = _levels_by_code()[R.encode(x * inv, NF4).long()] * scale
    assert torch.equal(back, want)
    half_gap = float(Q.nf4_levels().diff().max()) / 2  # the widest gap: from -1 to the next level
    assert ((back - x).abs() <= scale * half_gap * (1 + 1e-6)).all()


def _tensor(shape, block, gen):
    m = torch.randn(shape, generator=gen) * 0.1
    m[0, : min(3, shape[1])] = 0.0  # zeros in the first block
    momentum, scale = R.quantize_blockwise(m, NF4, block)
    return MR.MuonTensor(param=torch.randn(shape, generator=gen).to(torch.bfloat16), momentum=momentum,
                         momentum_scale=scale, extra=None, sr_key=7)


def _to_dev(t):
    return copy.deepcopy(MR.MuonTensor(**{k: (v.to(DEV) if isinstance(v, torch.Tensor) else v)
                                          for k, v in vars(t).items()}))


@pytest.mark.parametrize("block", [32, 128])
def test_muon_momentum_kernel_codes_as_the_reference(block):
    """Muon's momentum kernel (decode, new momentum, encode with the new absmax) on an NF4
    momentum against the reference's momentum_and_input + store_momentum: Newton-Schulz
    input, codes and absmax bit for bit; ragged rows (odd columns: a padded byte), a single
    row, a row of whole blocks; then a whole step (guarded) against the reference."""
    gen = torch.Generator().manual_seed(block)
    hyper = MR.MuonHyper(lr=0.02, momentum=0.95, weight_decay=0.1, ns_steps=5,
                         ns_coefficients=MR.NS_COEFFICIENTS, matched_rms=MR.MATCHED_RMS, step=2)
    for i, shape in enumerate([(5, 37), (1, 300), (12, 10), (4, 256)]):
        cfg = MR.MuonConfig(codec=NF4, state_bf16=False, block=block, weight_update=UPDATE_STOCHASTIC,
                            nesterov=i % 2 == 0)
        t = _tensor(shape, block, gen)
        grad = torch.randn(shape, generator=gen).to(torch.bfloat16)
        ref = copy.deepcopy(t)
        m, u_ref = MR.momentum_and_input(cfg, ref, grad, hyper)
        MR.store_momentum(cfg, ref, m)
        fused = _to_dev(t)
        u, _ = MK.momentum_and_input(cfg, fused, grad.to(DEV), hyper)
        if INTERPRET:
            assert torch.equal(u.cpu().view(torch.int16), u_ref.to(torch.bfloat16).view(torch.int16)), shape
            assert torch.equal(fused.momentum.cpu(), ref.momentum), shape
            assert torch.equal(fused.momentum_scale.cpu(), ref.momentum_scale), shape
        else:  # compiled: fused multiply-adds, a code off by one at a rounding boundary
            got = R.dequantize_blockwise(fused.momentum.cpu(), fused.momentum_scale.cpu(), NF4, block, shape[1])
            want = R.dequantize_blockwise(ref.momentum, ref.momentum_scale, NF4, block, shape[1])
            torch.testing.assert_close(got, want, rtol=0, atol=0.3 * float(ref.momentum_scale.max()))
            torch.testing.assert_close(fused.momentum_scale.cpu(), ref.momentum_scale)
        ref, fused = copy.deepcopy(t), _to_dev(t)
        assert MR.muon_step_reference(cfg, ref, grad.clone(), hyper, guarded=True)
        flag = torch.zeros(1, dtype=torch.int32, device=DEV)
        MK.muon_step_fused(cfg, fused, grad.to(DEV), hyper, flag)
        assert int(flag) == 0
        if INTERPRET:
            assert torch.equal(fused.param.cpu().view(torch.int16), ref.param.view(torch.int16)), shape
            assert torch.equal(fused.momentum.cpu(), ref.momentum), shape
