"""LowBitAdamW: math against torch.optim.AdamW/Adam, state layout, bad input, checkpoints,
stochastic-rounding reproducibility, non-finite gradients, and (on a GPU) the fused path
against the reference path."""

import copy
import math

import pytest
import torch

from titan_lowbit.optim import OPTIMIZERS, STATE_FORMATS, LowBitAdamW


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(96, 80), torch.nn.LayerNorm(80), torch.nn.Linear(80, 45, bias=False))
    return m.to(dtype)


def _train(model, opt, steps, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 96, generator=gen).to(dtype)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("decoupled", [True, False])
def test_fp32_state_matches_torch(decoupled):
    a, b = _model(), _model()
    ours = LowBitAdamW(list(a.named_parameters()), lr=1e-2, weight_decay=0.1, state_format="fp32",
                       decoupled_weight_decay=decoupled)
    ref_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = ref_cls(b.parameters(), lr=1e-2, weight_decay=0.1)
    _train(a, ours, 10)
    _train(b, ref, 10)
    for (n, x), y in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("fmt,tol", [("bf16", 2e-3), ("8bit", 5e-3), ("fp8", 1e-2), ("4bit", 3e-2)])
def test_low_bit_formats_track_fp32(fmt, tol):
    """Quantized states follow the fp32 trajectory closely (relative to how far it moved)."""
    a, b, start = _model(), _model(), _model()
    ours = LowBitAdamW(a.parameters(), lr=1e-2, state_format=fmt, min_quantized_numel=1000)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2)
    _train(a, ours, 10)
    _train(b, ref, 10)
    for x, y, s in zip(a.parameters(), b.parameters(), start.parameters()):
        moved = (y - s).norm()
        assert (x - y).norm() <= tol * 10 * moved + 1e-7


def test_state_layout_and_small_tensors():
    m = torch.nn.Linear(300, 70)  # weight 21000 >= 4096: quantized; bias 70: fp32
    opt = LowBitAdamW(m.parameters(), state_format="4bit")
    st = opt.state[m.weight]
    assert st["exp_avg_codes"].shape == (70, 150) and st["exp_avg_codes"].dtype == torch.uint8
    assert st["exp_avg_absmax"].shape == (70, 3) and st["exp_avg_absmax"].dtype == torch.float32
    assert set(opt.state[m.bias]) == {"exp_avg", "exp_avg_sq", "step"}
    assert opt.state[m.bias]["exp_avg"].dtype == torch.float32
    odd = torch.nn.Parameter(torch.randn(9, 4097))
    opt = LowBitAdamW([odd], state_format="4bit", block_size=64)
    assert opt.state[odd]["exp_avg_sq_codes"].shape == (9, 2049)
    assert opt.state[odd]["exp_avg_sq_absmax"].shape == (9, 65)
    opt = LowBitAdamW([odd], state_format="fp8")
    assert opt.state[odd]["exp_avg_codes"].dtype == torch.float8_e4m3fn
    assert opt.state[odd]["exp_avg_codes"].shape == (9, 4097)


def test_state_bytes_per_param():
    w = torch.nn.Parameter(torch.randn(64, 4096))
    for fmt, want in (("8bit", 2 + 8 / 256), ("4bit", 1 + 8 / 128), ("fp8", 2 + 8 / 128), ("fp32", 8), ("bf16", 4)):
        opt = LowBitAdamW([w], state_format=fmt)
        assert math.isclose(opt.state_bytes_per_param(), want), fmt
        assert math.isclose(STATE_FORMATS[fmt].bytes_per_element(STATE_FORMATS[fmt].default_block), want)
    wb = torch.nn.Parameter(torch.randn(64, 4096, dtype=torch.bfloat16))
    assert math.isclose(LowBitAdamW([wb], weight_update="master").state_bytes_per_param(), 2 + 8 / 256 + 4)
    assert math.isclose(LowBitAdamW([wb], weight_update="kahan").state_bytes_per_param(), 2 + 8 / 256 + 2)


def test_registry_names():
    assert set(OPTIMIZERS) == {"AdamW8bit", "AdamW4bit", "AdamWFp8", "Adam8bit", "Adam4bit", "AdamFp8",
                               "AdamW", "Adam"}
    for kw in OPTIMIZERS.values():
        LowBitAdamW([torch.nn.Parameter(torch.randn(4))], **kw)


@pytest.mark.parametrize("make,kw,match", [
    (lambda: torch.nn.Parameter(torch.randn(3, dtype=torch.complex64)), {}, "complex"),
    (lambda: torch.nn.Parameter(torch.ones(3, dtype=torch.int32), requires_grad=False), {}, "integer"),
    (lambda: torch.nn.Parameter(torch.randn(3, dtype=torch.float16)), {}, "float16"),
    (lambda: torch.nn.Parameter(torch.randn(3)), {"lr": -1.0}, "lr=-1.0"),
    (lambda: torch.nn.Parameter(torch.randn(3)), {"betas": (0.9, 1.0)}, r"\[0, 1\)"),
    (lambda: torch.nn.Parameter(torch.randn(3)), {"state_format": "3bit"}, "state_format"),
    (lambda: torch.nn.Parameter(torch.randn(3)), {"weight_update": "round"}, "weight_update"),
    (lambda: torch.nn.Parameter(torch.randn(3)), {"block_size": 100}, "power of two"),
    (lambda: torch.nn.Parameter(torch.randn(3)), {"nonfinite_grad": "warn"}, "nonfinite_grad"),
])
def test_bad_input_errors(make, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LowBitAdamW([("layers.0.w", make())], **kw)


def test_error_names_the_parameter():
    with pytest.raises(TypeError, match="'blocks.3.scale'.*float16"):
        LowBitAdamW([("blocks.3.w", torch.nn.Parameter(torch.randn(3))),
                     ("blocks.3.scale", torch.nn.Parameter(torch.randn(3, dtype=torch.float16)))])


def test_sparse_grad_error():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = LowBitAdamW(list(emb.named_parameters()))
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="'weight' has a sparse gradient"):
        opt.step()


def test_nonfinite_grad_raise_and_skip():
    m = _model()
    opt = LowBitAdamW(list(m.named_parameters()))
    _train(m, opt, 1)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    m[2].weight.grad[3, 4] = float("nan")
    with pytest.raises(FloatingPointError, match="'2.weight'"):
        opt.step()

    m = _model()
    opt = LowBitAdamW(list(m.named_parameters()), nonfinite_grad="skip")
    _train(m, opt, 1)
    before = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in m.parameters()]
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    m[0].bias.grad[0] = float("inf")
    opt.step()
    assert opt.skipped_steps == 1
    for p, w in zip(m.parameters(), weights):
        assert torch.equal(p, w)
    after = opt.state_dict()
    for k, st in before["state"].items():
        for key, val in st.items():
            assert torch.equal(val, after["state"][k][key])
    m[0].bias.grad[0] = 1.0
    opt.step()
    assert opt.skipped_steps == 1 and int(opt.state[m[0].bias]["step"]) == 2


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "bf16", "fp32"])
def test_state_dict_round_trip_resumes_identically(fmt):
    """Save after 3 steps, load into a fresh optimizer (before any step), continue: the
    result equals an uninterrupted run bit for bit (stochastic rounding included)."""
    kw = dict(lr=1e-2, state_format=fmt, weight_update="stochastic", min_quantized_numel=1000, seed=7)
    a = _model(dtype=torch.bfloat16)
    opt_a = LowBitAdamW(list(a.named_parameters()), **kw)
    _train(a, opt_a, 3, seed=1, dtype=torch.bfloat16)
    saved_model = copy.deepcopy(a.state_dict())
    saved_opt = copy.deepcopy(opt_a.state_dict())
    _train(a, opt_a, 3, seed=2, dtype=torch.bfloat16)

    b = _model(seed=5, dtype=torch.bfloat16)
    b.load_state_dict(saved_model)
    opt_b = LowBitAdamW(list(b.named_parameters()), **kw)
    opt_b.load_state_dict(saved_opt)
    # every state keeps its dtype (torch would cast fp32 scales and moments to the bf16 param's)
    for key, value in opt_a.state[a[0].weight].items():
        assert opt_b.state[b[0].weight][key].dtype == value.dtype, key
    _train(b, opt_b, 3, seed=2, dtype=torch.bfloat16)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)


def test_load_state_dict_with_other_format_is_refused():
    m = _model()
    sd = LowBitAdamW(m.parameters(), state_format="8bit", min_quantized_numel=1000).state_dict()
    opt = LowBitAdamW(m.parameters(), state_format="4bit", min_quantized_numel=1000)
    sd["param_groups"][0]["state_format"] = "4bit"
    with pytest.raises(ValueError, match="does not match state_format='4bit'"):
        opt.load_state_dict(sd)


def test_stochastic_rounding_moves_weights_nearest_does_not():
    """Updates far below bf16 resolution: nearest leaves the weight stuck, stochastic
    rounding moves it by the right amount on average, master/kahan track it."""
    results = {}
    for update in ("nearest", "stochastic", "kahan", "master"):
        w = torch.nn.Parameter(torch.ones(64, 128, dtype=torch.bfloat16))
        opt = LowBitAdamW([w], lr=1e-4, weight_decay=0.0, betas=(0.0, 0.0), eps=0.0, state_format="fp32",
                          weight_update=update)
        for _ in range(50):
            w.grad = torch.ones_like(w)  # Adam step = -lr per step: 50 steps -> 1 - 5e-3
            opt.step()
        results[update] = w.float().mean().item()
        if update == "kahan":  # the compensation holds what the bf16 weight could not
            results["kahan+comp"] = (w.float() + opt.state[w]["kahan_comp"].float()).mean().item()
        if update == "master":
            results["master state"] = opt.state[w]["master"].mean().item()
    target = 1 - 5e-3
    assert results["nearest"] == 1.0
    assert abs(results["stochastic"] - target) < 5e-4, results
    assert abs(results["kahan+comp"] - target) < 1e-4 and abs(results["master state"] - target) < 1e-5, results
    for update in ("kahan", "master"):  # within one bf16 step (2**-8 below 1.0) of the target
        assert abs(results[update] - target) < 2**-8, results


def test_stochastic_rounding_is_seeded():
    def run(seed):
        w = torch.nn.Parameter(torch.ones(32, 128, dtype=torch.bfloat16))
        opt = LowBitAdamW([w], lr=1e-4, state_format="8bit", weight_update="stochastic", seed=seed)
        for _ in range(3):
            w.grad = torch.ones_like(w)
            opt.step()
        return w.detach().clone()

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


def test_param_groups_have_own_formats_and_lr_tensor():
    m = _model()
    opt = LowBitAdamW([
        {"params": [m[0].weight], "state_format": "4bit", "min_quantized_numel": 0},
        {"params": [m[2].weight], "state_format": "fp32", "lr": torch.tensor(5e-3)},
        {"params": [m[0].bias, m[1].weight, m[1].bias], "weight_decay": 0.0},
    ], lr=1e-2)
    assert "exp_avg_codes" in opt.state[m[0].weight] and "exp_avg" in opt.state[m[2].weight]
    _train(m, opt, 2)
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "bf16", "fp32"])
@pytest.mark.parametrize("update", ["nearest", "stochastic", "kahan", "master"])
def test_fused_cuda_matches_reference_cpu(fmt, update):
    """The whole optimizer on CUDA (fused, many tensors per launch, aligned and unaligned
    families) against the same optimizer on CPU (reference)."""
    shapes = [(64, 256), (33, 300), (4096,), (2, 3, 1024), (17,), (128, 96), (256, 64)]
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        cpu = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
        gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
        kw = dict(lr=1e-2, weight_decay=0.1, state_format=fmt, weight_update=update, min_quantized_numel=1000)
        oc, og = LowBitAdamW(cpu, **kw), LowBitAdamW(gpu, **kw)
        for _ in range(3):
            for pc, pg in zip(cpu, gpu):
                g = torch.randn(pc.shape, generator=gen).to(dtype)
                pc.grad, pg.grad = g, g.cuda()
            oc.step()
            og.step()
        for pc, pg in zip(cpu, gpu):
            # The GPU fuses multiply-adds: a value may land on the other side of a rounding
            # boundary (one bf16 ulp, or one quantization code), and that difference then
            # carries through the next steps. Nearly all elements must agree to one ulp.
            want, got = pc.detach().float(), pg.detach().cpu().float()
            tol = (1e-5 if dtype == torch.float32 else 8e-3) * want.abs() + 1e-5
            off = (got - want).abs() > tol
            assert off.float().mean() <= 2e-3, (off.sum().item(), pc.shape)
            assert (got - want).abs().max() <= 0.05 * want.abs().max(), pc.shape


def test_params_without_grad_keep_their_own_step_counts():
    """Parameters that miss a gradient are not stepped (as in torch); afterwards one family
    holds parameters at different step counts and is split by step, matching torch."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(40, 30)) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = LowBitAdamW(ours, lr=1e-2, weight_decay=0.1, state_format="fp32")
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for have in ([0, 1, 2], [0], [0, 2], [0, 1, 2], [0, 1, 2]):
        for i in range(3):
            g = torch.randn(40, 30, generator=gen) if i in have else None
            ours[i].grad = g
            ref[i].grad = None if g is None else g.clone()
        opt.step()
        ref_opt.step()
    assert [int(opt.state[p]["step"]) for p in ours] == [5, 3, 4]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradient_dtype_change_between_steps_is_an_error():
    w = torch.nn.Parameter(torch.randn(64, 80))
    opt = LowBitAdamW([("w", w)], state_format="8bit", min_quantized_numel=0)
    w.grad = torch.randn(64, 80)
    opt.step()
    if hasattr(w, "grad_dtype"):  # newer torch checks gradient dtypes itself unless told not to
        w.grad_dtype = None
    w.grad = torch.randn(64, 80).to(torch.bfloat16)
    with pytest.raises(TypeError, match="'w': gradient dtype changed"):
        opt.step()
