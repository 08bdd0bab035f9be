"""The momentum kernel's INPUT and STORE launches with a momentum factor
(kernels/muon_lowbit.py: ``factored_input``, ``store_factored``) against the same math in
PyTorch ops, bit for bit under TRITON_INTERPRET=1 (to an ulp or a code when compiled on a
GPU): the stored momentum is its codes plus F = P R^T (fp32, l ascending), the INPUT
launch gives Newton-Schulz's input and the new momentum in bf16 and stores nothing, the
STORE launch requantizes the new momentum less the new factor; a shard of rows gives the
whole matrix's rows; the guard flags a non-finite momentum; bad factors are refused.
"""

import copy

import pytest
import torch

from conftest import INTERPRET
from test_muon_kernels import DEV, SHAPES, assert_same, equal_bits, hyper, make, to_dev
from titan_lowbit.kernels import muon_lowbit as K
from titan_lowbit.kernels import muon_ref as R

CASES = [("4bit", "nf4"), ("4bit", "dynamic"), ("8bit", "nf4")]


def factor_f32(p, r):
    """F = P R^T in fp32, one rank-1 term at a time (l ascending), each product rounded
    and then added: the kernel's order."""
    f = torch.zeros(p.shape[0], r.shape[0], dtype=torch.float32)
    for l in range(p.shape[1]):
        f = f + p[:, l:l + 1].float() * r[:, l].float()[None, :]
    return f


def new_momentum(cfg, t, grad, h, p, r):
    """(new momentum m, Newton-Schulz input u), fp32: muon_ref's ops on the stored
    momentum plus its factor."""
    g = grad.to(torch.float32)
    one_minus_beta = torch.tensor(1.0 - h.momentum, dtype=torch.float32)
    m = R.load_momentum(cfg, t) + factor_f32(p, r)
    m = m + one_minus_beta * (g - m)
    return m, (m + one_minus_beta * (g - m) if cfg.nesterov else m)


def factors(shape, rank, gen):
    rows, cols = shape
    return ((torch.randn(rows, rank, generator=gen) * 0.05).to(torch.bfloat16),
            (torch.randn(cols, rank, generator=gen) * 0.5).to(torch.bfloat16))


def on_dev(pair):
    return tuple(x.to(DEV) for x in pair)


def bits16(x):
    return x.cpu().contiguous().view(torch.int16)


@pytest.mark.parametrize("fmt,levels", CASES)
@pytest.mark.parametrize("rank", [1, 3, 8])
def test_input_and_store_launches_match_the_math(fmt, levels, rank):
    gen = torch.Generator().manual_seed(100 * rank + CASES.index((fmt, levels)))
    for i, shape in enumerate(SHAPES):
        cfg, t = make(fmt, torch.bfloat16, "stochastic", shape, gen, nesterov=i % 2 == 0, levels=levels)
        grad = torch.randn(shape, generator=gen).to(torch.bfloat16)
        h = hyper(step=i + 2)
        old, new = factors(shape, rank, gen), factors(shape, rank, gen)
        m, u = new_momentum(cfg, t, grad, h, *old)

        fused = to_dev(t)
        flag = torch.zeros(1, dtype=torch.int32, device=DEV)
        u_k, mw_k = K.factored_input(cfg, fused, grad.to(DEV), h, on_dev(old), flag)
        assert int(flag) == 0
        assert_same(t, fused, "the INPUT launch stores nothing")
        if INTERPRET:
            assert torch.equal(bits16(u_k), bits16(u.to(torch.bfloat16)))
            assert torch.equal(bits16(mw_k), bits16(m.to(torch.bfloat16)))
        else:
            torch.testing.assert_close(u_k.cpu().float(), u.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-3)
            torch.testing.assert_close(mw_k.cpu().float(), m.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-3)

        ref = copy.deepcopy(t)
        R.store_momentum(cfg, ref, m - factor_f32(*new))
        flag.zero_()
        staged = K.store_factored(cfg, fused, grad.to(DEV), h, on_dev(old), on_dev(new), flag)
        assert int(flag) == 0
        assert_same(t, fused, "a staged STORE leaves the state as it is")
        got = copy.deepcopy(t)
        got.momentum, got.momentum_scale = staged.momentum.cpu(), staged.scale.cpu()
        assert_same(ref, got, (fmt, levels, rank, shape, "staged"))
        assert K.store_factored(cfg, fused, grad.to(DEV), h, on_dev(old), on_dev(new)) is None
        assert_same(ref, fused, (fmt, levels, rank, shape, "in place"))


def test_a_shard_of_rows_gives_the_whole_matrix_rows():
    """A row shard (its rows of P, all of R, stochastic-rounding offsets aside) computes
    exactly the whole matrix's rows: U, the bf16 momentum, the stored codes and absmax."""
    gen = torch.Generator().manual_seed(7)
    shape, rank = (9, 300), 4
    cfg, t = make("4bit", torch.bfloat16, "stochastic", shape, gen)
    grad = torch.randn(shape, generator=gen).to(torch.bfloat16)
    h = hyper()
    old, new = factors(shape, rank, gen), factors(shape, rank, gen)
    whole = to_dev(t)
    u, mw = K.factored_input(cfg, whole, grad.to(DEV), h, on_dev(old))
    K.store_factored(cfg, whole, grad.to(DEV), h, on_dev(old), on_dev(new))
    for a, b in [(0, 4), (4, 9), (3, 4)]:
        shard = to_dev(R.MuonTensor(param=t.param[a:b].clone(), momentum=t.momentum[a:b].clone(),
                                    momentum_scale=t.momentum_scale[a:b].clone(), extra=None, sr_key=t.sr_key))
        rows = lambda pair: (pair[0][a:b].contiguous().to(DEV), pair[1].to(DEV))  # noqa: E731
        us, mws = K.factored_input(cfg, shard, grad[a:b].contiguous().to(DEV), h, rows(old))
        assert torch.equal(bits16(us), bits16(u[a:b])) and torch.equal(bits16(mws), bits16(mw[a:b]))
        K.store_factored(cfg, shard, grad[a:b].contiguous().to(DEV), h, rows(old), rows(new))
        assert equal_bits(shard.momentum.cpu(), whole.momentum[a:b].cpu())
        assert equal_bits(shard.momentum_scale.cpu(), whole.momentum_scale[a:b].cpu())


def test_the_guard_flags_a_non_finite_momentum_or_residual():
    gen = torch.Generator().manual_seed(8)
    shape, rank = (5, 37), 2
    cfg, t = make("4bit", torch.bfloat16, "stochastic", shape, gen)
    old, new = factors(shape, rank, gen), factors(shape, rank, gen)
    old[1][11, 1] = float("inf")  # one column of F infinite
    grad = torch.randn(shape, generator=gen).to(torch.bfloat16)
    fused = to_dev(t)
    flag = torch.zeros(1, dtype=torch.int32, device=DEV)
    K.factored_input(cfg, fused, grad.to(DEV), hyper(), on_dev(old), flag)
    assert int(flag) == 1
    assert_same(t, fused, "nothing stored")
    clean = factors(shape, rank, gen)
    flag.zero_()
    K.factored_input(cfg, fused, grad.to(DEV), hyper(), on_dev(clean), flag)
    assert int(flag) == 0
    # a finite momentum whose residual beside a non-finite new factor is not: STORE flags it
    K.store_factored(cfg, fused, grad.to(DEV), hyper(), on_dev(clean), on_dev(old), flag)
    assert int(flag) == 1
    assert_same(t, fused, "a flagged STORE is staged: the state is as it was")
    flag.zero_()
    K.store_factored(cfg, fused, grad.to(DEV), hyper(), on_dev(clean), on_dev(clean), flag)
    assert int(flag) == 0


def test_bad_factors_are_refused():
    gen = torch.Generator().manual_seed(9)
    shape = (5, 37)
    cfg, t = make("4bit", torch.bfloat16, "stochastic", shape, gen)
    grad = torch.randn(shape, generator=gen).to(torch.bfloat16).to(DEV)
    p, r = factors(shape, 3, gen)
    with pytest.raises(ValueError, match=r"P \[rows, k\] and R \[cols, k\]"):
        K.factored_input(cfg, to_dev(t), grad, hyper(), on_dev((p[:4], r)))
    with pytest.raises(ValueError, match=r"P \[rows, k\] and R \[cols, k\]"):
        K.factored_input(cfg, to_dev(t), grad, hyper(), on_dev((p, r[:, :2])))
    with pytest.raises(ValueError, match="rank differs"):
        K.store_factored(cfg, to_dev(t), grad, hyper(), on_dev((p, r)), on_dev(factors(shape, 2, gen)))
    with pytest.raises(ValueError, match="not contiguous|is not"):
        K.factored_input(cfg, to_dev(t), grad, hyper(), (p.to(DEV).t().contiguous().t(), r.to(DEV)))
    cfg32, t32 = make("fp32", torch.bfloat16, "stochastic", shape, gen)
    with pytest.raises(ValueError, match="quantized momentum"):
        K.factored_input(cfg32, to_dev(t32), grad, hyper(), on_dev((p, r)))
