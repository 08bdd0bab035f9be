"""The fused health read (kernels/health_lowbit.py) against its PyTorch reference
(kernels/health_ref.py): every state format and weight update, ragged shapes (a short last
block, an odd row for packed 4-bit codes, tiles split over several programs, whole tiles),
fresh random inputs with zeros, tiny and huge values, eps 0 (0 / 0 updates in the
reference and in masked lanes of the kernel), maximize and L2 decay.

The kernel computes each element's update, code test, lost flag and residual term with
the reference's correctly rounded operations, so the maximum and the counts are equal
exactly. The residual sum adds the same fp32 terms in float64 in another order (per
program, then over programs); each term is below 2**25 here (residuals of at most a few
ulp, Kahan compensations of a few hundred), so each partial sum of at most 2**11 terms is
exact in float64's 53 bits and only the final additions round: 1e-12 relative is far
above their error and far below a term's contribution.
"""

import pytest
import torch

from conftest import INTERPRET
from titan_lowbit.kernels import health_lowbit as K
from titan_lowbit.kernels import health_ref as R
from titan_lowbit.kernels.adamw_interface import WEIGHT_UPDATES, AdamWConfig, AdamWHyper, AdamWTensor
from titan_lowbit.kernels.adamw_lowbit_ref import master_split, quantize_blockwise
from titan_lowbit.optim.formats import STATE_FORMATS

DEV = "cpu" if INTERPRET else "cuda"
FORMATS = ["fp32", "bf16", "8bit", "4bit", "fp8"]
UPDATES = [(torch.float32, "nearest")] + [(torch.bfloat16, u) for u in WEIGHT_UPDATES]
# a short last block (and for 4-bit an odd row); several tiles over several programs
# (TILES_PER_PROGRAM 2 below); rows of whole blocks in whole tiles (the unmasked variant)
SHAPES = [(3, 131), (9, 300), (8, 256)]


def _spread(shape, gen, lo, hi):
    """Random signs times magnitudes spread evenly over the decades [10**lo, 10**hi]."""
    mag = 10.0 ** (lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64))
    return (mag * torch.sign(torch.randn(shape, generator=gen, dtype=torch.float64))).float()


def make(fmt, dtype, update, shape, gen, *, decoupled=True):
    """(config, tensor) with adversarial moments and weights: a zero row (m = v = 0: code
    0, and 0 / 0 where eps is 0), a row of tiny v (below the 8-bit map's range, held at the
    smallest code), huge values, subnormal and large weights, weights at 0."""
    f = STATE_FORMATS[fmt]
    rows, cols = shape
    m = _spread(shape, gen, -12, 3)
    v = _spread(shape, gen, -20, 6).abs()
    m[0], v[0] = 0.0, 0.0
    v[1] = torch.where(torch.rand(cols, generator=gen) < 0.5, 1e-30, 1e-3)
    v[-1, :7] = 1e30  # huge v beside small ones in the same block
    m[-1, 7:12] = 1e15
    w = _spread(shape, gen, -3, 1)
    w[0, :5] = 0.0
    w[-1, :3] = torch.tensor([1e-39, -3e-40, 3e38])  # bf16 subnormals, a huge weight
    wu = WEIGHT_UPDATES[update] if dtype == torch.bfloat16 else WEIGHT_UPDATES["nearest"]
    cfg = AdamWConfig(m_codec=f.m_codec, v_codec=f.v_codec, state_bf16=f.plain_dtype == torch.bfloat16,
                      block=f.default_block, weight_update=wu, decoupled=decoupled, param_dtype=dtype,
                      grad_dtype=dtype)
    if f.quantized:
        (mq, ms), (vq, vs) = quantize_blockwise(m, f.m_codec, cfg.block), quantize_blockwise(
            v, f.v_codec, cfg.block, zero_free=True)
        layout = dict(rows=rows, cols=cols)
    else:
        (mq, ms), (vq, vs) = (m.to(f.plain_dtype), None), (v.to(f.plain_dtype), None)
        layout = dict(rows=1, cols=rows * cols)  # plain formats: one flat row (step_plan.kernel_tensor)
    extra, param = None, w.to(dtype)
    if dtype == torch.bfloat16 and update == "kahan":
        extra = (_spread(shape, gen, -8, 2) * 1e-2).to(torch.bfloat16)
    elif dtype == torch.bfloat16 and update == "master":
        extra = w.clone()
        param = master_split(w)[0]
    elif dtype == torch.bfloat16 and update == "master_remainder":
        param, extra = master_split(w)
    t = AdamWTensor(param=param, exp_avg=mq, exp_avg_sq=vq, exp_avg_scale=ms, exp_avg_sq_scale=vs, extra=extra,
                    **layout)
    return cfg, t


def to_dev(t):
    return AdamWTensor(**{k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in vars(t).items()})


def hyper(lr=3e-3, eps=1e-8, wd=0.1, sign=1.0, step=3):
    return R.HealthHyper.of(AdamWHyper(lr=lr, beta1=0.9, beta2=0.99, eps=eps, weight_decay=wd, step=step), sign)


def check(got_rows, want_row, where):
    got, want = R.reduce_health(got_rows.cpu()), want_row.reshape(-1).cpu()
    mx = R.MAX_UPDATE
    assert (got[mx].isnan() and want[mx].isnan()) or got[mx] == want[mx], (where, got, want)
    for col in (R.V_SMALLEST, R.LOST):
        assert got[col] == want[col], (where, col, got, want)
    assert got[R.RESIDUAL] == pytest.approx(float(want[R.RESIDUAL]), rel=1e-12, abs=0), (where, got, want)
    return got


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype,update", UPDATES, ids=lambda x: str(x).replace("torch.", ""))
def test_kernel_matches_reference(fmt, dtype, update, monkeypatch):
    monkeypatch.setattr(K, "TILES_PER_PROGRAM", 2)
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs, reproducible from the failure
    gen = torch.Generator().manual_seed(seed)
    eps = 0.0 if seed % 2 else 1e-8  # eps 0: the zero row's 0 / 0 is a NaN update in both
    h = hyper(eps=eps)
    seen = []
    for shape in SHAPES:
        cfg, t = make(fmt, dtype, update, shape, gen)
        t = to_dev(t)
        where = (fmt, update, shape, f"seed {seed}")
        got = check(K.adamw_health(cfg, t, h), R.adamw_health_reference(cfg, t, h), where)
        seen.append(got)
    # the numbers measure something here: updates that round away and ones that do not,
    # v at the smallest code, residuals
    total = torch.stack(seen)
    if cfg.v_codec != R.CODEC_NONE:
        assert total[:, R.V_SMALLEST].sum() > 0
    if R.measures_lost(cfg):
        n = sum(a * b for a, b in SHAPES)
        assert 0 < total[:, R.LOST].sum() < n
    if R.measures_residual(dtype, cfg.weight_update):
        assert total[:, R.RESIDUAL].sum() > 0


@pytest.mark.parametrize("fmt", ["8bit", "fp32"])
def test_kernel_matches_reference_maximize_and_l2_decay(fmt):
    gen = torch.Generator().manual_seed(3)
    cfg, t = make(fmt, torch.bfloat16, "nearest", (9, 300), gen, decoupled=False)
    t = to_dev(t)
    check(K.adamw_health(cfg, t, hyper(sign=-1.0, step=1)), R.adamw_health_reference(cfg, t, hyper(sign=-1.0, step=1)),
          fmt)


@pytest.mark.parametrize("update", ["kahan", "master", "master_remainder"])
def test_residual_only_read_matches_reference(update, monkeypatch):
    """Muon's matrices: the residual alone, over a flat weight of several programs."""
    monkeypatch.setattr(K, "TILES_PER_PROGRAM", 1)
    gen = torch.Generator().manual_seed(5)
    _, t = make("fp32", torch.bfloat16, update, (7, 450), gen)
    param, extra = t.param.reshape(7, 450).to(DEV), t.extra.reshape(7, 450).to(DEV)
    rows = K.residual_health(param, extra, WEIGHT_UPDATES[update])
    assert rows.shape[0] == K.residual_health_rows(param.numel()) > 1
    got = check(rows, R.residual_health_reference(param, extra, WEIGHT_UPDATES[update]), update)
    assert got[R.MAX_UPDATE] == got[R.V_SMALLEST] == got[R.LOST] == 0 < got[R.RESIDUAL]


def test_partial_rows_are_one_per_program():
    """One partial row per program of TILES_PER_PROGRAM tiles: the buffer the caller
    allocates fits the launch exactly, and a wrong one is refused."""
    gen = torch.Generator().manual_seed(0)
    cfg, t = make("8bit", torch.bfloat16, "nearest", (9, 300), gen)
    t = to_dev(t)
    n = K.adamw_health_rows(cfg, t)
    assert n == -(-(-(-9 * 2 // 4)) // K.TILES_PER_PROGRAM)  # 18 blocks, 4 per tile, 5 tiles
    with pytest.raises(ValueError, match="float64 rows"):
        K.adamw_health(cfg, t, hyper(), torch.empty(n + 1, R.N_HEALTH, dtype=torch.float64, device=DEV))
