"""Optimizer health metrics (titan_lowbit.optim.health), each against a hand computation
in float64 from the stored states: codes decoded through the code books
(quant_maps.code_book), Adam's update written out, bf16 spacing from frexp, remainders
rebuilt from their bits. Fresh random inputs, ragged shapes (a short last block, an odd
row length for 4-bit packing), every state format and every bf16 weight update; one
2-process gloo run shows sharded numbers equal unsharded ones."""

import math

import pytest
import torch
import torch.nn as nn

from conftest import INTERPRET, run_on_gloo, sharded_small_model, small_bf16_model, train_mean_square

from titan_lowbit.kernels import health_ref
from titan_lowbit.kernels import quant_maps as Q
from titan_lowbit.optim import LowBitAdamW, LowBitMuon, optimizer_health
from titan_lowbit.optim import health as H
from titan_lowbit.optim.formats import param_format

DEV = "cpu" if INTERPRET else "cuda"  # where the fused health kernel runs (interpreted on the CPU)
FORMATS = ["8bit", "4bit", "fp8", "fp32", "bf16"]
UPDATES = ["nearest", "stochastic", "kahan", "master", "master_remainder"]
LR, WD, BETAS, EPS = 3e-3, 0.1, (0.9, 0.99), 1e-8


def _model(dtype, seed):
    """Ragged shapes: 300 columns (8-bit: blocks of 256 and a short one; 4-bit/fp8: of 128
    and a short one), 131 (odd: 4-bit packs a padding nibble), a small bias (fp32 states)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(300, 70), nn.Linear(70, 131, bias=False), nn.Linear(131, 9)).to(dtype)


def _trained(fmt, update, dtype=torch.bfloat16, steps=3, device="cpu", **kw):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs, reproducible from the failure
    model = _model(dtype, seed).to(device)
    opt = LowBitAdamW(list(model.named_parameters()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                      state_format=fmt, weight_update=update, min_quantized_numel=1000, seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed)
    train_mean_square(model, opt, [torch.randn(8, 300, generator=gen).to(dtype).to(device) for _ in range(steps)])
    return model, opt, seed


def _decoded(codes, absmax, codec, block, cols):
    """A quantized moment in float64 through the code book: value(code) * absmax of its block."""
    c = codes.reshape(codes.shape[0] if codes.dim() > 1 else 1, -1).view(torch.uint8).long()
    if codec in Q.PACKED_4BIT_CODECS:
        c = torch.stack([c & 15, c >> 4], dim=-1).reshape(c.shape[0], -1)
    c = c[:, :cols]
    scale = absmax.reshape(c.shape[0], -1).double().repeat_interleave(block, dim=1)[:, :cols]
    return Q.code_book(codec)[c] * scale, c


def _ulp(w):
    """bf16 spacing at w (float64): 2**(e - 8) for |w| = mantissa * 2**e, mantissa in [0.5, 1)."""
    _, e = torch.frexp(w.double())
    return torch.where(w == 0, torch.tensor(2.0**-133, dtype=torch.float64), torch.ldexp(torch.ones_like(w.double()),
                                                                                        e - 8))


def _master(p, state, update):
    """The fp32 weight behind a bf16 one, in float64."""
    if update == "master":
        return state["master"].double()
    if update == "master_remainder":  # bits(w) << 16 plus the signed remainder (w is the master rounded)
        bits = (((p.view(torch.int16).long() & 0xFFFF) << 16) + state["master_remainder"].long()) & 0xFFFFFFFF
        return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32).double()
    return p.double() + state["kahan_comp"].double()


def _by_hand(opt):
    """Every number of OptimizerHealth for one LowBitAdamW, in float64."""
    max_u, v_small, v_all, lost, nearest, res, res_n = 0.0, 0, 0, 0, 0, 0.0, 0
    group = opt.param_groups[0]
    b1, b2 = group["betas"]
    for p in group["params"]:
        st = opt.state[p]
        t = int(st["step"])
        fmt, block = param_format(p, group)
        cols = p.shape[-1]
        w = p.detach().double().reshape(-1, cols)
        if group["weight_update"] in ("master", "master_remainder") and p.dtype == torch.bfloat16:
            w = _master(p.detach(), st, group["weight_update"]).reshape(-1, cols)
        if fmt.quantized:
            m, _ = _decoded(st["exp_avg_codes"], st["exp_avg_absmax"], fmt.m_codec, block, cols)
            v, vc = _decoded(st["exp_avg_sq_codes"], st["exp_avg_sq_absmax"], fmt.v_codec, block, cols)
            book = Q.code_book(fmt.v_codec).abs()
            floor = book[book > 0].min()
            v_small += int((book[vc] == floor).sum())
            v_all += vc.numel()
        else:
            m, v = st["exp_avg"].double().reshape(-1, cols), st["exp_avg_sq"].double().reshape(-1, cols)
        u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + EPS) + WD * w
        max_u = max(max_u, float(u.abs().max()))
        if p.dtype != torch.bfloat16:
            continue
        wb = p.detach().reshape(-1, cols)
        if group["weight_update"] == "nearest":
            moved = (wb.double() - LR * u).float().to(torch.bfloat16)
            lost += int(((u != 0) & (moved == wb)).sum())
            nearest += wb.numel()
        elif group["weight_update"] != "stochastic":
            residual = _master(p.detach(), st, group["weight_update"]).reshape(-1, cols) - wb.double()
            res += float((residual.abs() / _ulp(wb)).sum())
            res_n += wb.numel()
    return dict(max_update_over_lr=max_u, v_at_smallest_code=v_small / v_all if v_all else None,
                updates_lost_to_rounding=lost / nearest if nearest else None,
                residual_over_ulp=res / res_n if res_n else None, n_nearest=nearest)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("update", UPDATES)
def test_each_metric_equals_the_hand_computation(fmt, update):
    model, opt, seed = _trained(fmt, update)
    got, want = optimizer_health([opt]), _by_hand(opt)
    where = f"{fmt}/{update}, seed {seed}"
    assert got.max_update_over_lr == pytest.approx(want["max_update_over_lr"], rel=1e-5), where
    assert got.skipped_steps == 0
    if want["v_at_smallest_code"] is None:
        assert got.v_at_smallest_code is None, where
    else:
        assert got.v_at_smallest_code == pytest.approx(want["v_at_smallest_code"], abs=1e-12), where
    if want["updates_lost_to_rounding"] is None:
        assert got.updates_lost_to_rounding is None, where
    else:  # float64 against fp32 arithmetic: an element at a rounding tie may fall either way
        assert abs(got.updates_lost_to_rounding - want["updates_lost_to_rounding"]) * want["n_nearest"] <= 3, where
    if want["residual_over_ulp"] is None:
        assert got.residual_over_ulp is None, where
    else:
        assert got.residual_over_ulp == pytest.approx(want["residual_over_ulp"], rel=1e-6), where
        assert 0 < got.residual_over_ulp <= 0.5 + 1e-6, where


def _same_health(got, want, where):
    """Equal numbers: the maximum and the counts exactly (same elements, same fp32
    operations), the residual up to the order of its float64 additions."""
    assert got.max_update_over_lr == want.max_update_over_lr, where
    assert got.v_at_smallest_code == want.v_at_smallest_code, where
    assert got.updates_lost_to_rounding == want.updates_lost_to_rounding, where
    assert got.skipped_steps == want.skipped_steps, where
    assert (got.residual_over_ulp is None) == (want.residual_over_ulp is None), where
    if want.residual_over_ulp is not None:
        assert got.residual_over_ulp == pytest.approx(want.residual_over_ulp, rel=1e-12), where


def _count_launches(monkeypatch):
    """The fused health kernel's launches of this test, by kind."""
    launches = {"adamw_health": 0, "residual_health": 0}
    for name in launches:
        def counted(*a, _f=getattr(H, name), _n=name, **k):
            launches[_n] += 1
            return _f(*a, **k)
        monkeypatch.setattr(H, name, counted)
    return launches


@pytest.mark.parametrize("fmt,update", [("8bit", "nearest"), ("4bit", "kahan")])
def test_fused_read_equals_the_reference_read(fmt, update, monkeypatch):
    """The optimizer's health read through the fused kernel (one launch per parameter,
    partial rows reduced on the device) gives the reference path's numbers (every format
    and weight update: tests/test_health_kernels.py)."""
    _, opt, seed = _trained(fmt, update, device=DEV)
    launches = _count_launches(monkeypatch)
    monkeypatch.setattr(opt, "_use_fused", lambda t: False)
    want = optimizer_health([opt])
    assert launches["adamw_health"] == 0
    monkeypatch.setattr(opt, "_use_fused", lambda t: True)
    got = optimizer_health([opt])
    assert launches["adamw_health"] == len(list(opt.param_groups[0]["params"]))
    _same_health(got, want, f"{fmt}/{update}, seed {seed}")


def test_fused_read_of_muon_equals_the_reference_read(monkeypatch):
    """LowBitMuon: its matrices through the residual-only launch, its inner AdamW through
    the full one."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    model = nn.Sequential(nn.Linear(300, 70), nn.Linear(70, 131, bias=False)).to(torch.bfloat16).to(DEV)
    opt = LowBitMuon(list(model.named_parameters()), lr=LR, state_format="8bit", weight_update="master",
                     min_quantized_numel=10)
    train_mean_square(model, opt, [torch.randn(8, 300).bfloat16().to(DEV) for _ in range(3)])
    launches = _count_launches(monkeypatch)
    for o in (opt, opt.adamw):
        monkeypatch.setattr(o, "_use_fused", lambda t: False)
    want = optimizer_health([opt])
    for o in (opt, opt.adamw):
        monkeypatch.setattr(o, "_use_fused", lambda t: True)
    got = optimizer_health([opt])
    assert launches == {"adamw_health": 1, "residual_health": 2}  # the bias; the two matrices
    _same_health(got, want, "muon")


def test_fp32_weights_report_no_bf16_numbers():
    _, opt, _ = _trained("8bit", "nearest", dtype=torch.float32)
    h = optimizer_health([opt])
    assert h.updates_lost_to_rounding is None and h.residual_over_ulp is None
    assert h.max_update_over_lr == pytest.approx(_by_hand(opt)["max_update_over_lr"], rel=1e-5)
    assert set(h.metrics()) == {H.METRIC_PREFIX + k for k in ("max_update_over_lr", "v_at_smallest_code",
                                                              "skipped_steps")}


def test_a_small_second_moment_sits_at_the_smallest_code():
    """One block whose v spans far more than the 8-bit map's range: the small entries are
    held at code 1 (1e-7 of the absmax); the counted fraction is exactly theirs."""
    w = nn.Parameter(torch.zeros(4, 256))
    opt = LowBitAdamW([("w", w)], lr=1e-3, state_format="8bit", min_quantized_numel=0)
    g = torch.full((4, 256), 1e-6)
    g[:, 0] = 1.0
    g[0, 1:11] = 0.0  # exact zeros: v = 0, code 0, not the smallest positive code
    w.grad = g
    opt.step()
    h = optimizer_health([opt])
    assert h.v_at_smallest_code == pytest.approx((4 * 255 - 10) / 1024)


def test_updates_lost_to_rounding_counts_only_updates_that_round_away():
    """bf16 weights at 1 (ulp 2**-7) with an lr far below it: every element with a
    gradient lost its update; elements at 0 without a gradient have none to lose."""
    w = nn.Parameter(torch.ones(8, 512, dtype=torch.bfloat16))
    with torch.no_grad():
        w[:2] = 0.0
    opt = LowBitAdamW([("w", w)], lr=1e-5, weight_decay=0.0, state_format="fp8", min_quantized_numel=0)
    g = torch.randn(8, 512).to(torch.bfloat16)
    g[:2] = 0.0
    w.grad = g
    opt.step()
    assert optimizer_health([opt]).updates_lost_to_rounding == pytest.approx(6 / 8)


@pytest.mark.parametrize("fmt,update", [("8bit", "master_remainder"), ("fp32", "kahan"), ("4bit", "nearest")])
def test_chunks_give_the_same_numbers(fmt, update, monkeypatch):
    """A health read in chunks (quantized: whole rows; plain states: flat ranges) sums
    and maximizes to the same numbers as one read per tensor."""
    _, opt, _ = _trained(fmt, update)
    whole = optimizer_health([opt])
    monkeypatch.setattr(health_ref, "CHUNK_NUMEL", 1000)  # 3 rows of 300, 7 of 131, flat ranges of 1000
    chunked = optimizer_health([opt])
    assert chunked.max_update_over_lr == whole.max_update_over_lr
    for k in ("v_at_smallest_code", "updates_lost_to_rounding", "residual_over_ulp"):
        assert (getattr(chunked, k) is None) == (getattr(whole, k) is None), k
        if getattr(whole, k) is not None:
            assert getattr(chunked, k) == pytest.approx(getattr(whole, k), rel=1e-12), k


def test_skipped_steps_and_parameters_without_a_step():
    """A skipped step is counted; a parameter that never stepped (no gradient yet) adds
    nothing (its bias correction would divide by zero)."""
    model, opt, _ = _trained("8bit", "nearest", nonfinite_grad="skip", steps=1)
    for p in model.parameters():
        p.grad = torch.full_like(p, math.inf)
    opt.step()
    assert optimizer_health([opt]).skipped_steps == 1
    fresh = LowBitAdamW(list(_model(torch.bfloat16, 0).named_parameters()), state_format="8bit")
    h = optimizer_health([fresh])
    assert h.max_update_over_lr is None and h.v_at_smallest_code is None and h.skipped_steps == 0


def test_muon_reports_its_inner_adamw_and_its_matrices_residuals():
    """LowBitMuon: max update and v from its inner AdamW alone; the residual over every bf16
    weight of both parts."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    model = nn.Sequential(nn.Linear(300, 70), nn.Linear(70, 131, bias=False)).to(torch.bfloat16)
    opt = LowBitMuon(list(model.named_parameters()), lr=LR, state_format="8bit", weight_update="kahan",
                     min_quantized_numel=10)
    train_mean_square(model, opt, [torch.randn(8, 300).bfloat16() for _ in range(3)])
    h, inner = optimizer_health([opt]), optimizer_health([opt.adamw])
    assert opt.muon_params() and h.max_update_over_lr == inner.max_update_over_lr
    assert h.v_at_smallest_code == inner.v_at_smallest_code
    params = [p for g in opt.param_groups for p in g["params"]]
    res = sum(float((opt.state[p]["kahan_comp"].double().abs() / _ulp(p.detach())).sum()) for p in params)
    assert h.residual_over_ulp == pytest.approx(res / sum(p.numel() for p in params), rel=1e-6)


CASES = [("8bit", "nearest"), ("4bit", "master_remainder"), ("fp8", "kahan"), ("fp32", "master")]


def _gloo_scenarios(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(7)
    xs = [torch.randn(4, 300).to(torch.bfloat16) for _ in range(3)]
    res = {}
    for fmt, update in CASES:
        kw = dict(lr=LR, weight_decay=WD, state_format=fmt, weight_update=update, min_quantized_numel=1000)
        ref = small_bf16_model()
        opt_r = LowBitAdamW(list(ref.named_parameters()), **kw)
        sh = sharded_small_model(mesh)
        opt_s = LowBitAdamW(list(sh.named_parameters()), **kw)
        train_mean_square(ref, opt_r, xs)
        train_mean_square(sh, opt_s, xs)
        res[(fmt, update)] = (optimizer_health([opt_r]), optimizer_health([opt_s]))
    # a DTensor replicated on both ranks is counted once: beside a sharded one, whose v
    # entries are mostly at the smallest code, a replica counted twice would shift the fraction
    from torch.distributed.tensor import Shard

    torch.manual_seed(8)
    w_a, w_b = torch.randn(40, 300).to(torch.bfloat16), torch.randn(40, 256).to(torch.bfloat16)
    g_a, g_b = torch.randn(40, 300).to(torch.bfloat16), torch.full((40, 256), 1e-6).to(torch.bfloat16)
    g_b[:, 0] = 1.0
    plain = [nn.Parameter(w_a.clone()), nn.Parameter(w_b.clone())]
    placed = [nn.Parameter(distribute_tensor(w_a.clone(), mesh, [Shard(0)])),
              nn.Parameter(distribute_tensor(w_b.clone(), mesh, [Replicate()]))]
    for params, grads in ((plain, (g_a, g_b)), (placed, (distribute_tensor(g_a, mesh, [Shard(0)]),
                                                        distribute_tensor(g_b, mesh, [Replicate()])))):
        for p, g in zip(params, grads):
            p.grad = g.clone()
    opts = [LowBitAdamW(list(zip("ab", ps)), lr=LR, state_format="8bit", min_quantized_numel=0)
            for ps in (plain, placed)]
    for opt in opts:
        opt.step()
    res["replicated"] = tuple(optimizer_health([o]) for o in opts)
    return res


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return run_on_gloo(_gloo_scenarios, 2, tmp_path_factory.mktemp("health") / "res.pt")


@pytest.mark.parametrize("case", CASES + ["replicated"], ids=str)
def test_sharded_numbers_equal_unsharded(gloo_results, case):
    """FSDP2 on 2 gloo ranks trains bit for bit like one process (test_optim_fsdp), so every
    number matches; sums differ at most by their order of addition."""
    ref, sharded = gloo_results[case if isinstance(case, str) else tuple(case)]
    assert sharded.max_update_over_lr == ref.max_update_over_lr
    assert sharded.skipped_steps == ref.skipped_steps
    for k in ("v_at_smallest_code", "updates_lost_to_rounding", "residual_over_ulp"):
        assert (getattr(sharded, k) is None) == (getattr(ref, k) is None), k
        if getattr(ref, k) is not None:
            assert getattr(sharded, k) == pytest.approx(getattr(ref, k), rel=1e-12), (case, k)
