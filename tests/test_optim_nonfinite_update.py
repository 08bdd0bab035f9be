"""Non-finite protection of the whole update (issue 30, defect 3): a finite gradient whose
square overflows fp32 (|g| >= 2**64), hyperparameters that overflow the update (blamed by
name) and a non-finite scale in the state are caught by the raise/skip policy, naming the
parameter and what was found; nothing non-finite is
written into a weight or a state. The kernel (interpreter) and the reference leave the same
blocks and flag the same kind."""

import pytest
import torch

from titan_lowbit.kernels import adamw_lowbit as K
from titan_lowbit.kernels import adamw_lowbit_ref as R
from titan_lowbit.optim import LowBitAdamW
from titan_lowbit.optim.formats import STATE_FORMATS, block_of

FORMATS = ["8bit", "4bit", "fp8", "fp32", "bf16"]


def _opt(fmt, policy, pdtype=torch.float32, update="nearest"):
    w = torch.nn.Parameter(torch.randn(4, 256, generator=torch.Generator().manual_seed(0)).to(pdtype))
    opt = LowBitAdamW([("layer.w", w)], lr=1e-3, state_format=fmt, min_quantized_numel=0, nonfinite_grad=policy,
                      weight_update=update)
    w.grad = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).to(pdtype)
    opt.step()
    return w, opt


def _snapshot(w, opt):
    return [w.detach().clone()] + [v.clone() for k, v in opt.state[w].items() if k != "step"]


def _same(a, b):
    """Bit for bit (a nan equals itself)."""
    return all(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)) for x, y in zip(a, b))


@pytest.mark.parametrize("fmt,pdtype,update", [(f, torch.float32, "nearest") for f in FORMATS] + [
    ("8bit", torch.bfloat16, "master"), ("8bit", torch.bfloat16, "kahan"), ("fp8", torch.bfloat16, "stochastic")])
def test_gradient_whose_square_overflows_raises(fmt, pdtype, update):
    """|g| = 1.8e19 < inf, but g * g overflows fp32 (unguarded, 255 of 256 weights of the
    8-bit block would become nan at the next step): the block is left as it was, and the
    next step raises naming the parameter and the overflow."""
    w, opt = _opt(fmt, "raise", pdtype, update)
    before = _snapshot(w, opt)
    g = torch.zeros(4, 256, dtype=pdtype)
    g[0, 3] = 1.9e19  # (bf16 rounds it to 1.9e19 too)
    w.grad = g
    opt.step()
    with pytest.raises(FloatingPointError, match=r"square overflows fp32 .* in param 'layer.w' at optimizer step 2"):
        opt.check_nonfinite()
    after = _snapshot(w, opt)
    assert torch.equal(before[0][0, :128], after[0][0, :128]), "the flagged block's weights changed"
    for t in after:
        assert bool(t.float().isfinite().all()), "a non-finite value was written"


@pytest.mark.parametrize("fmt", FORMATS)
def test_gradient_whose_square_overflows_is_skipped(fmt, caplog):
    w, opt = _opt(fmt, "skip")
    before = _snapshot(w, opt)
    g = torch.zeros(4, 256)
    g[1, 7] = -2e19
    w.grad = g
    opt.step()
    assert opt.skipped_steps == 1 and _same(before, _snapshot(w, opt))
    assert any("param 'layer.w' (a finite gradient whose square overflows fp32" in r.getMessage()
               for r in caplog.records)
    g[1, 7] = 1.8e19  # just below 2**64: its square is finite, the step runs
    opt.step()
    assert opt.skipped_steps == 1 and bool(w.detach().isfinite().all())


# (optimizer options, gradient's largest magnitude, what the error must blame)
OVERFLOW_CAUSES = {
    "lr": (dict(lr=3e38), 1.0, r"lr=3e\+38 makes the step size lr / \(1 - beta1\*\*1\) = 3e\+39"),
    "lr x weight_decay": (dict(lr=1e30, weight_decay=1e10), 1.0, r"lr \* weight_decay = 1e\+40 scales weights"),
    "L2 weight_decay": (dict(weight_decay=1e20, decoupled_weight_decay=False), 1.0,
                        r"weight_decay=1e\+20 adds up to .* to the gradient \(decoupled_weight_decay=False\)"),
    "gradient": (dict(), 2e19, r"a finite gradient whose square overflows fp32"),
}


@pytest.mark.parametrize("cause,policy", [(c, p) for c in OVERFLOW_CAUSES for p in ("raise", "skip")
                                          if (c, p) != ("gradient", "skip")])  # that one is skipped: above
def test_an_overflowing_update_blames_its_cause(cause, policy):
    """A normal gradient with lr = 3e38 (or lr * weight_decay, or an L2 term, past fp32)
    overflows the update, not the gradient's square: the error says so, naming the
    hyperparameter ("skip"'s check reads gradients only: the kernels' guard raises); a
    gradient of 2e19 under normal hyperparameters is blamed itself."""
    options, gmax, match = OVERFLOW_CAUSES[cause]
    w = torch.nn.Parameter(torch.randn(4, 256, generator=torch.Generator().manual_seed(0)))
    opt = LowBitAdamW([("layer.w", w)], state_format="8bit", min_quantized_numel=0, nonfinite_grad=policy,
                      **{"lr": 1e-3, **options})
    g = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).clamp(-1, 1)
    g[2, 9] = gmax
    w.grad = g
    opt.step()
    with pytest.raises(FloatingPointError, match=rf"an update that overflows: {match}.* in param 'layer.w' at "
                                                 "optimizer step 1") as err:
        opt.check_nonfinite()
    assert ("a finite gradient whose square overflows" in str(err.value)) == (cause == "gradient")
    assert bool(w.detach().isfinite().all())


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8"])
@pytest.mark.parametrize("key", ["exp_avg_absmax", "exp_avg_sq_absmax"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_scale_in_the_state_is_caught(fmt, key, bad, caplog):
    """A state whose scale holds nan/inf (load_state_dict refuses one; this one is damaged
    in memory): under either policy the kernels' guard leaves that block unwritten and the
    next check raises naming the parameter and the state entry ("skip" does not skip: no
    number of skipped steps repairs a damaged state)."""
    for policy in ("raise", "skip"):
        w, opt = _opt(fmt, policy)
        opt.state[w][key][2, 0] = bad
        before = _snapshot(w, opt)
        w.grad = torch.ones(4, 256)
        opt.step()
        with pytest.raises(FloatingPointError, match=rf"non-finite optimizer state '{key}' .* in param 'layer.w'"):
            opt.check_nonfinite()
        assert torch.equal(before[0][2, :128], w.detach()[2, :128]) and not torch.equal(before[0][0], w.detach()[0])
        assert opt.skipped_steps == 0
        assert bool(w.detach().isfinite().all())


def test_skip_still_guards_what_its_check_cannot_see():
    """A non-finite plain (fp32) state is not read by "skip"'s check; the kernels' guard
    still leaves its block unwritten, and the next step raises naming the state entry."""
    w, opt = _opt("fp32", "skip")
    opt.state[w]["exp_avg_sq"][0, 5] = float("nan")
    w.grad = torch.ones(4, 256)
    opt.step()
    with pytest.raises(FloatingPointError, match="non-finite optimizer state 'exp_avg_sq' .* in param 'layer.w'"):
        opt.check_nonfinite()
    assert bool(w.detach().isfinite().all())


@pytest.mark.parametrize("fmt,pdtype,update", [("8bit", torch.float32, "nearest"), ("fp8", torch.bfloat16, "kahan"),
                                               ("4bit", torch.bfloat16, "master")])
def test_kernel_guard_matches_reference_on_an_overflowing_square(fmt, pdtype, update):
    """Kernel (interpreter) and reference: a ragged tensor, one block with |g| = 3e19 (m
    finite, v not: flag -tag), one with a nan gradient (flag +tag) in another tensor; the
    same bits everywhere and the same flags."""
    if not K.interpreting():
        pytest.skip("bit-exact only under TRITON_INTERPRET=1")
    f = STATE_FORMATS[fmt]
    block = block_of(fmt, 0)
    upd = K.WEIGHT_UPDATES[update] if pdtype == torch.bfloat16 else K.UPDATE_NEAREST
    cfg = K.AdamWConfig(m_codec=f.m_codec, v_codec=f.v_codec, state_bf16=False, block=block, weight_update=upd,
                        decoupled=True, param_dtype=pdtype, grad_dtype=pdtype)
    gen = torch.Generator().manual_seed(3)
    shapes = [(3, 300), (2, 256)]

    def tensors():
        out = []
        for i, (rows, cols) in enumerate(shapes):
            codes = (rows, -(-cols // f.codes_per_byte))
            nb = -(-cols // block)
            extra = {K.UPDATE_MASTER: torch.float32, K.UPDATE_KAHAN: torch.bfloat16}.get(upd) \
                if pdtype == torch.bfloat16 else None
            out.append(K.AdamWTensor(param=torch.zeros(rows, cols, dtype=pdtype),
                                     exp_avg=torch.zeros(codes, dtype=torch.uint8),
                                     exp_avg_sq=torch.zeros(codes, dtype=torch.uint8),
                                     exp_avg_scale=torch.zeros(rows, nb), exp_avg_sq_scale=torch.zeros(rows, nb),
                                     extra=None if extra is None else torch.zeros(rows, cols, dtype=extra),
                                     rows=rows, cols=cols, flag_index=i))
        return out

    a, b = tensors(), tensors()
    plan = K.FusedAdamW(cfg, a)
    for step in (1, 2):
        grads = [torch.randn(s, generator=gen).to(pdtype) for s in shapes]
        if step == 2:
            grads[0][1, 290] = 3e19
            grads[1][0, 5] = float("nan")
        hyper = K.AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=step)
        ga, gb = K.NonfiniteGuard(torch.zeros(2, dtype=torch.int32), 9), K.NonfiniteGuard(torch.zeros(2, dtype=torch.int32), 9)
        plan.step(grads, hyper, ga)
        R.adamw_step_reference(cfg, b, grads, hyper, gb)
        assert ga.flags.tolist() == gb.flags.tolist() == ([0, 0] if step == 1 else [-9, 9])
        for x, y in zip(a, b):
            for name in ("param", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale", "extra"):
                if getattr(x, name) is not None:
                    assert torch.equal(getattr(x, name), getattr(y, name)), f"step {step}: {name} differs"
                    assert bool(getattr(x, name).float().isfinite().all())


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8"])
def test_tiny_gradients_with_subnormal_second_moments_stay_finite(fmt):
    """|g| = 1e-20: v = 1e-43 is subnormal, and so is its block's largest, whose reciprocal
    overflows fp32 (fp8 then coded 0 * inf = nan into the state). Such a block is coded as
    zeros; the weights move like torch.optim.AdamW's (the update is m / eps there)."""
    g = torch.zeros(2, 256)
    g[0, :8], g[0, 8] = 1e-20, 3e-20
    ws = []
    for make in (lambda w: torch.optim.AdamW([w], lr=1e-3, weight_decay=0.0),
                 lambda w: LowBitAdamW([("w", w)], lr=1e-3, weight_decay=0.0, state_format=fmt, min_quantized_numel=0)):
        w = torch.nn.Parameter(torch.zeros(2, 256))
        opt = make(w)
        for _ in range(3):
            w.grad = g.clone()
            opt.step()
        if isinstance(opt, LowBitAdamW):
            opt.check_nonfinite()
            assert all(bool(v.float().isfinite().all()) for k, v in opt.state[w].items() if k != "step")
        ws.append(w.detach())
    torch.testing.assert_close(ws[1], ws[0], rtol=0.05, atol=1e-18)
