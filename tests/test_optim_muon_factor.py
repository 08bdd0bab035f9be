"""LowBitMuon's factor beside a 4-bit momentum (``momentum_4bit_factor_rank``): the
product F = P R^T, the step against a transcription of its math, what it buys, the guard,
state dicts and resumes, DTensor placements, and the refusals.

Small ragged matrices, a few steps each, on the CPU (the PyTorch reference of the step).
"""

import copy
import io
import math

import pytest
import torch

from titan_lowbit.kernels.adamw_lowbit_ref import dequantize_blockwise, quantize_blockwise
from titan_lowbit.kernels.muon_ref import factor_product, newton_schulz
from titan_lowbit.kernels.quant_maps import CODEC_NF4_SIGNED
from titan_lowbit.optim import LowBitMuon

RANK = "momentum_4bit_factor_rank"
P, R = "momentum_buffer_row_factor", "momentum_buffer_col_factor"
CODES, ABSMAX = "momentum_buffer_codes", "momentum_buffer_absmax"
# wide with a short last block, tall, square and smaller than the rank asked for
SHAPES = [(40, 300), (130, 24), (6, 6)]


def _grads(shapes, steps, seed=0, rank=3, noise=0.3):
    """A stream of gradients per shape: a slowly turning rank-``rank`` part plus noise."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rows, cols in shapes:
        a, b = torch.randn(rows, rank, generator=gen), torch.randn(cols, rank, generator=gen)
        stream = []
        for _ in range(steps):
            a = a + 0.1 * torch.randn(rows, rank, generator=gen)
            stream.append(a @ b.T / math.sqrt(rank) + noise * torch.randn(rows, cols, generator=gen))
        out.append(stream)
    return [list(step) for step in zip(*out)]


def _params(shapes, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _run(params, grads, **kw):
    opt = LowBitMuon(params, **{**dict(lr=0.02, state_format="4bit", min_quantized_numel=0), **kw})
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return opt


def _decoded(opt, p):
    """A matrix's stored momentum, as the step reads it: codes decoded plus F."""
    st = opt.state[p]
    m = dequantize_blockwise(st[CODES], st[ABSMAX], CODEC_NF4_SIGNED, 128, p.shape[1])
    return m + factor_product(st[P], st[R]) if P in st else m


def test_factor_product_is_p_times_r_transposed_and_the_same_on_any_slice():
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(37, 8, generator=gen).bfloat16()
    r = torch.randn(301, 8, generator=gen).bfloat16()
    f = factor_product(p, r)
    assert f.dtype == torch.float32 and f.shape == (37, 301)
    exact = p.double() @ r.double().T
    # bf16 x bf16 products are exact in fp32; only the 7 additions round
    assert float((f.double() - exact).abs().max()) <= 8 * 2 ** -24 * float(exact.abs().max())
    # a shard's rows and columns give the whole matrix's F there, bit for bit
    assert torch.equal(factor_product(p[5:19], r[100:260]), f[5:19, 100:260])
    assert torch.equal(factor_product(p[:, :0], r[:, :0]), torch.zeros(37, 301))


def _transcribed(w0, grads, r0, *, k, lr, beta, wd):
    """Muon with a 4-bit NF4 momentum and a rank-k factor, transcribed from its
    description in fp32 (Newton-Schulz and the codes as the optimizer's):
    M_prev = deq(codes) + F(P, R); M = lerp(M_prev, G, 1 - beta); U = lerp(M, G, 1 - beta);
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) NS(U); from Mb = bf16(M):
    P = bf16(qr(Mb qr(R))), R = bf16(Mb^T P); codes <- quant(M - F(P, R)); F(P, R)[i, j]
    the sum over l, in order, of the fp32 products P[i, l] R[j, l]. Returns the weights,
    the factors and the exact momenta (no rounding at all, fp64), per step."""
    def f(p, r):
        return sum(p[:, l, None].float() * r[None, :, l].float() for l in range(k))

    rows, cols = w0.shape
    w = w0.clone()
    codes, absmax = quantize_blockwise(torch.zeros(rows, cols), CODEC_NF4_SIGNED, 128)
    p, r = torch.zeros(rows, k, dtype=torch.bfloat16), r0.clone()
    exact = torch.zeros(rows, cols, dtype=torch.float64)
    out = []
    for g in grads:
        m = dequantize_blockwise(codes, absmax, CODEC_NF4_SIGNED, 128, cols) + f(p, r)
        m = torch.lerp(m, g, 1 - beta)
        u = torch.lerp(m, g, 1 - beta)
        w = w * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(rows, cols)) * newton_schulz(u).float()
        mb = m.bfloat16().float()
        p = torch.linalg.qr(mb @ torch.linalg.qr(r.float()).Q).Q.bfloat16()
        r = (mb.T @ p.float()).bfloat16()
        codes, absmax = quantize_blockwise(m - f(p, r), CODEC_NF4_SIGNED, 128)
        exact = torch.lerp(exact, g.double(), 1 - beta)
        out.append((w.clone(), p, r, exact.clone()))
    return out


def test_step_is_the_transcribed_math_and_its_momentum_stays_near_the_exact_one():
    grads = _grads(SHAPES, 6)
    params = _params(SHAPES)
    start = [p.detach().clone() for p in params]
    opt = LowBitMuon(params, lr=0.02, weight_decay=0.1, state_format="4bit", min_quantized_numel=0, **{RANK: 8})
    r0 = [opt.state[p][R].clone() for p in params]
    for (rows, cols), p, r in zip(SHAPES, params, r0):
        k = min(8, rows, cols)  # a matrix keeps at most its smaller side
        assert opt.state[p][P].shape == (rows, k) and r.shape == (cols, k) and r.dtype == torch.bfloat16
        assert torch.equal(opt.state[p][P], torch.zeros(rows, k, dtype=torch.bfloat16))
        assert torch.allclose(r.double().T @ r.double(), torch.eye(k, dtype=torch.float64), atol=2e-2)
    want = [_transcribed(w, [s[i] for s in grads], r, k=r.shape[1], lr=0.02, beta=0.95, wd=0.1)
            for i, (w, r) in enumerate(zip(start, r0))]
    for t, step in enumerate(grads):
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
        for (rows, cols), p, steps in zip(SHAPES, params, want):
            w, row, col, exact = steps[t]
            st = opt.state[p]
            assert torch.equal(p.detach(), w) and torch.equal(st[P], row) and torch.equal(st[R], col), (rows, cols, t)
            # what is stored, decoded, is near the exact momentum: the factor whole where
            # it spans the matrix (its bf16 rounding left to the codes), a few % else
            err = float((_decoded(opt, p).double() - exact).norm() / exact.norm())
            assert err < (1e-3 if min(rows, cols) <= 8 else 0.04), ((rows, cols), t, err)


def test_factor_makes_the_stored_momentum_closer_to_the_exact_one():
    """On gradients of a few slowly turning directions plus noise (a transformer's, in
    miniature), the factor takes those directions out of what the codes hold."""
    shapes = [(64, 200), (160, 48)]
    grads = _grads(shapes, 20, seed=3)
    exact = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for step in grads:
        exact = [torch.lerp(m, g.double(), 0.05) for m, g in zip(exact, step)]
    errs = {}
    for k in (0, 8):
        params = _params(shapes)
        opt = _run(params, grads, **{RANK: k})
        errs[k] = [float((_decoded(opt, p).double() - m).norm() / m.norm()) for p, m in zip(params, exact)]
    assert all(e8 < 0.7 * e0 for e8, e0 in zip(errs[8], errs[0])), errs


def test_a_nonfinite_step_writes_neither_codes_nor_factor_nor_weight():
    params = _params(SHAPES[:1])
    opt = _run(params, _grads(SHAPES[:1], 2), **{RANK: 4})
    p = params[0]
    before = {k: v.clone() for k, v in opt.state[p].items() if k != "step"}, p.detach().clone()
    p.grad = torch.full(p.shape, 1.0)
    p.grad[3, 7] = float("inf")
    with pytest.raises(FloatingPointError, match="param 'param_groups"):
        opt.step()
    assert torch.equal(p.detach(), before[1])
    for k, v in before[0].items():
        assert torch.equal(opt.state[p][k], v), k


def test_rank_0_keeps_no_factor_and_steps_as_before():
    """Rank 0 (the default) is the 4-bit momentum without a factor: no P or R, and the
    same bits as an optimizer built without the option."""
    grads = _grads(SHAPES, 3)
    a, b = _params(SHAPES), _params(SHAPES)
    opt_a, opt_b = _run(a, grads), _run(b, grads, **{RANK: 0})
    assert opt_a.param_groups[0][RANK] == 0
    for p, q in zip(a, b):
        assert set(opt_a.state[p]) == {CODES, ABSMAX, "step"}
        assert torch.equal(p, q) and all(torch.equal(v, opt_b.state[q][k]) for k, v in opt_a.state[p].items())


def test_state_bytes_count_the_factor():
    w = torch.nn.Parameter(torch.randn(64, 4096))
    opt = LowBitMuon([w], state_format="4bit", **{RANK: 8})
    want = 0.5 + 4 / 128 + 2 * 8 * (64 + 4096) / w.numel()
    assert math.isclose(opt.state_bytes_per_param(), want)


def _same_states(a, b):
    """Whether two LowBitMuon optimizers hold the same state tensors, bit for bit."""
    pa = [p for g in a.param_groups for p in g["params"]]
    pb = [p for g in b.param_groups for p in g["params"]]
    return all(a.state[p].keys() == b.state[q].keys() and all(torch.equal(v, b.state[q][k])
                                                              for k, v in a.state[p].items())
               for p, q in zip(pa, pb))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(300, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24)).to(torch.bfloat16)


def _steps(model, opt, n, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(8, 300, generator=gen).bfloat16()).float().pow(2).mean().backward()
        opt.step()


KW = dict(lr=1e-2, state_format="4bit", min_quantized_numel=0, weight_update="stochastic", **{RANK: 8})


def test_state_dict_round_trips_and_resumes_bit_for_bit():
    straight = _model()
    opt = LowBitMuon(straight.named_parameters(), **KW)
    _steps(straight, opt, 2, seed=1)
    sd = opt.state_dict()
    assert sd["param_groups"][0][RANK] == 8 and {P, R} <= set(sd["state"][0])
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = copy.deepcopy(straight)
    opt2 = LowBitMuon(resumed.named_parameters(), **KW)
    opt2.load_state_dict(saved)
    assert _same_states(opt, opt2)
    _steps(straight, opt, 2, seed=2)
    _steps(resumed, opt2, 2, seed=2)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert _same_states(opt, opt2)


def test_deepcopy_steps_like_the_original():
    model = _model()
    opt = LowBitMuon(model.named_parameters(), **KW)
    _steps(model, opt, 1, seed=1)
    both = copy.deepcopy((model, opt))
    _steps(model, opt, 2, seed=2)
    _steps(both[0], both[1], 2, seed=2)
    for a, b in zip(model.parameters(), both[0].parameters()):
        assert torch.equal(a, b)
    assert _same_states(opt, both[1])


def test_state_dict_without_the_rank_was_written_without_a_factor():
    """A state dict that records no momentum_4bit_factor_rank (written before the option
    existed) has no factor: it loads into rank 0 and goes on bit for bit; rank 8 is
    refused naming the option, as is a state dict of rank 8 into rank 0."""
    kw = {**KW, RANK: 0}
    model = _model()
    opt = LowBitMuon(model.named_parameters(), **kw)
    _steps(model, opt, 2, seed=1)
    old = copy.deepcopy(opt.state_dict())
    for g in old["param_groups"]:
        g.pop(RANK, None)  # the AdamW group has none
    with pytest.raises(ValueError, match=f"saved with {RANK}=0, this optimizer was built with {RANK}=8. Build the "
                                         f"optimizer with {RANK}=0 to resume it"):
        LowBitMuon(_model().named_parameters(), **KW).load_state_dict(old)
    resumed = copy.deepcopy(model)
    opt2 = LowBitMuon(resumed.named_parameters(), **kw)
    opt2.load_state_dict(old)
    _steps(model, opt, 2, seed=2)
    _steps(resumed, opt2, 2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))
    factored = LowBitMuon(model.named_parameters(), **KW)
    with pytest.raises(ValueError, match=f"saved with {RANK}=8, this optimizer was built with {RANK}=0"):
        LowBitMuon(model.named_parameters(), **kw).load_state_dict(factored.state_dict())
    # a state dict whose factor is damaged is refused naming the entry
    damaged = copy.deepcopy(factored.state_dict())
    damaged["state"][0][R][2, 1] = float("nan")
    with pytest.raises(ValueError, match=f"param '0.weight': state entry '{R}' of the state dict holds non-finite"):
        LowBitMuon(_model().named_parameters(), **KW).load_state_dict(damaged)


@pytest.mark.parametrize("build,match", [
    (lambda w: LowBitMuon([w], state_format="4bit", **{RANK: -1}), f"{RANK}=-1; use an int >= 0"),
    (lambda w: LowBitMuon([w], state_format="4bit", **{RANK: 2.0}), f"{RANK}=2.0; use an int >= 0"),
    (lambda w: LowBitMuon([w], state_format="4bit", **{RANK: True}), f"{RANK}=True; use an int >= 0"),
    (lambda w: LowBitMuon([w], state_format="8bit", **{RANK: 8}),
     f"LowBitMuon: {RANK}=8 keeps a factor beside a 4-bit momentum, but state_format='8bit'"),
    (lambda w: LowBitMuon([{"params": [w], "state_format": "fp32", RANK: 4}], state_format="4bit"),
     f"param group 0: {RANK}=4 keeps a factor beside a 4-bit momentum, but state_format='fp32'"),
    (lambda w: LowBitMuon([{"params": [w], "use_muon": False, RANK: 4}]), "Muon only"),
    (lambda w: LowBitMuon([w], adamw_options={RANK: 4}), "on LowBitMuon itself"),
])
def test_bad_factor_options_are_refused_naming_them(build, match):
    with pytest.raises(ValueError, match=match):
        build(torch.nn.Parameter(torch.randn(16, 64)))


def test_a_group_of_another_format_only_inheriting_the_rank_keeps_no_factor():
    a, b = torch.nn.Parameter(torch.randn(16, 64)), torch.nn.Parameter(torch.randn(16, 64))
    opt = LowBitMuon([{"params": [a]}, {"params": [b], "state_format": "fp32"}], state_format="4bit",
                     min_quantized_numel=0, **{RANK: 4})
    assert P in opt.state[a] and set(opt.state[b]) == {"momentum_buffer", "step"}
    small = torch.nn.Parameter(torch.randn(16, 64))  # below min_quantized_numel: fp32 momentum
    assert set(LowBitMuon([small], state_format="4bit", **{RANK: 4}).state[small]) == {"momentum_buffer", "step"}


def test_dtensor_factors_are_placed_by_the_rows_and_columns_they_hold(tmp_path):
    """On a mesh whose dimensions hold one rank each (a whole matrix), the factor's
    DTensors follow the parameter's rows (P) and columns (R): a Shard(0) parameter has
    P Shard(0) and R replicated, a Shard(1) one the other way; the step and a state dict
    round trip work as with plain tensors. A placement other than Shard and Replicate is
    refused with the option (sharded matrices: tests/test_optim_muon_sharded.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1))
        gen = torch.Generator().manual_seed(0)
        plain = torch.nn.Parameter(torch.randn(40, 300, generator=gen))
        w = torch.nn.Parameter(DTensor.from_local(plain.detach().clone(), mesh, [Shard(0), Shard(1)]))
        v = torch.nn.Parameter(DTensor.from_local(plain.detach().clone(), mesh, [Shard(1), Replicate()]))
        opts = [LowBitMuon([("w", q)], **{**KW, "weight_update": "nearest"}) for q in (plain, w, v)]
        assert opts[1].state[w][P].placements == (Shard(0), Replicate())
        assert opts[1].state[w][R].placements == (Replicate(), Shard(0))
        assert opts[1].state[w][CODES].placements == (Shard(0), Shard(1))
        assert opts[2].state[v][P].placements == (Replicate(), Replicate())
        assert opts[2].state[v][R].placements == (Shard(0), Replicate())
        for _ in range(2):
            g = torch.randn(40, 300, generator=gen)
            plain.grad = g.clone()
            for q in (w, v):
                q.grad = DTensor.from_local(g.clone(), mesh, q.placements)
            for opt in opts:
                opt.step()
        for q, opt in ((w, opts[1]), (v, opts[2])):
            assert torch.equal(q.to_local(), plain.detach())
            assert all(torch.equal(opt.state[q][k].to_local(), opts[0].state[plain][k]) for k in (P, R, CODES))
            opts_again = LowBitMuon([("w", q)], **{**KW, "weight_update": "nearest"})
            opts_again.load_state_dict(opt.state_dict())
            assert torch.equal(opts_again.state[q][R].to_local(), opts[0].state[plain][R])
        strided = torch.nn.Parameter(DTensor.from_local(torch.randn(40, 300), mesh,
                                                        [_StridedShard(0, split_factor=1), Shard(0)]))
        with pytest.raises(ValueError, match=f"param 's': {RANK}=8 .* not yet supported with a matrix's columns "
                                             r"split over ranks, nor on FSDP2's strided shards \(placements "
                                             r"\(_StridedShard"):
            LowBitMuon([("s", strided)], **KW)
    finally:
        dist.destroy_process_group()
