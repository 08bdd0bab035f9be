"""LowBitAdamW: math against torch.optim.AdamW/Adam, state layout, bad input, checkpoints,
stochastic-rounding reproducibility, non-finite gradients, and the fused path against the
reference path (on a GPU; without one, the kernels interpreted on CPU, bit for bit)."""

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


@pytest.mark.parametrize("report", ["step", "state_dict", "check_nonfinite"])
def test_nonfinite_grad_raise_and_skip(report):
    """raise (default): the step with a nan leaves the nan's block alone and steps the
    rest; the next step (or state_dict, or check_nonfinite) raises naming the parameter
    and the step, and changes nothing; after it the optimizer steps on normally."""
    m = _model()
    opt = LowBitAdamW(list(m.named_parameters()), min_quantized_numel=0, block_size=32)
    _train(m, opt, 1)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    m[2].weight.grad[3, 4] = float("nan")
    w_before = m[2].weight.detach().clone()
    codes_before = opt.state[m[2].weight]["exp_avg_codes"].clone()
    opt.step()
    w = m[2].weight.detach()
    assert torch.equal(w[3, :32], w_before[3, :32]) and torch.isfinite(w).all()
    assert not torch.equal(w[3, 32:], w_before[3, 32:]) and not torch.equal(w[4], w_before[4])
    assert torch.equal(opt.state[m[2].weight]["exp_avg_codes"][3, :32], codes_before[3, :32])
    snapshot = [p.detach().clone() for p in m.parameters()]
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    with pytest.raises(FloatingPointError, match=r"in param '2.weight' at optimizer step 2: the blocks"):
        {"step": opt.step, "state_dict": opt.state_dict, "check_nonfinite": opt.check_nonfinite}[report]()
    assert all(torch.equal(a, b) for a, b in zip(snapshot, m.parameters()))
    assert all(int(opt.state[p]["step"]) == 2 for p in m.parameters())
    opt.step()  # reported once
    opt.check_nonfinite()
    assert all(int(opt.state[p]["step"]) == 3 for p in m.parameters())

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
    """Each group steps with its own options: a 4-bit group, an fp32-state group whose lr is
    a tensor (changed in place between steps, as a scheduler does) and a group without
    weight decay each equal an optimizer built for that group alone."""
    shapes = {"a": (96, 80), "b": (45, 80), "c": (80,), "d": (80,)}

    def params():
        gen = torch.Generator().manual_seed(0)
        return {k: torch.nn.Parameter(torch.randn(s, generator=gen)) for k, s in shapes.items()}

    p, q = params(), params()
    lr_b = torch.tensor(5e-3)
    opt = LowBitAdamW([
        {"params": [p["a"]], "state_format": "4bit", "min_quantized_numel": 0},
        {"params": [p["b"]], "state_format": "fp32", "lr": lr_b},
        {"params": [p["c"], p["d"]], "weight_decay": 0.0},
    ], lr=1e-2)
    assert "exp_avg_codes" in opt.state[p["a"]] and "exp_avg" in opt.state[p["b"]]
    alone_a = LowBitAdamW([q["a"]], lr=1e-2, state_format="4bit", min_quantized_numel=0)
    alone_b = torch.optim.AdamW([q["b"]], lr=5e-3, weight_decay=1e-2)
    alone_cd = torch.optim.AdamW([q["c"], q["d"]], lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        if step == 2:
            lr_b.fill_(2e-3)
            alone_b.param_groups[0]["lr"] = 2e-3
        for k in shapes:
            p[k].grad = torch.randn(shapes[k], generator=gen)
            q[k].grad = p[k].grad.clone()
        for o in (opt, alone_a, alone_b, alone_cd):
            o.step()
    assert torch.equal(p["a"], q["a"])
    for k in "bcd":  # fp32 states: torch's AdamW up to rounding
        torch.testing.assert_close(p[k], q[k], rtol=1e-5, atol=1e-6, msg=k)


# (update, format) cases of the grid below that run with a block_size other than the
# format's default (more or fewer scales per row, blocks that do or do not divide the
# ragged rows); each quantized format keeps its default block under the other updates.
OTHER_BLOCKS = {("stochastic", "8bit"): 64, ("stochastic", "4bit"): 32, ("kahan", "4bit"): 256,
                ("stochastic", "fp8"): 64}


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "bf16", "fp32"])
@pytest.mark.parametrize("update", ["nearest", "stochastic", "kahan", "master"])
def test_fused_path_matches_reference_path(fmt, update):
    """The whole optimizer's fused path (many tensors per launch, aligned and unaligned
    families, fp8 codes viewed as bytes, master and Kahan buffers; the block sizes of
    OTHER_BLOCKS) against its reference path: on CUDA against the same optimizer on CPU;
    without a GPU the fused Triton path runs on CPU under TRITON_INTERPRET=1 and must
    equal the reference bit for bit, every state included."""
    _fused_against_reference(fmt, update, block_size=OTHER_BLOCKS.get((update, fmt), 0))


def _fused_against_reference(fmt, update, block_size=0):
    cuda = torch.cuda.is_available()
    shapes = [(64, 256), (33, 300), (4096,), (2, 3, 1024), (17,), (128, 96), (256, 64)]
    if not cuda:  # the same kinds of tensor, smaller (the interpreter runs every program in Python)
        shapes = [(8, 256), (5, 300), (1100,), (2, 3, 256), (17,), (16, 96), (32, 64)]
    gen = torch.Generator().manual_seed(0)
    # fp32 parameters take no bf16 update rule: on CPU they run once per format (nearest).
    dtypes = (torch.float32, torch.bfloat16) if cuda or update == "nearest" else (torch.bfloat16,)
    for dtype in dtypes:
        cpu = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
        gpu = [torch.nn.Parameter(p.detach().clone().to("cuda" if cuda else "cpu")) for p in cpu]
        kw = dict(lr=1e-2, weight_decay=0.1, state_format=fmt, weight_update=update, min_quantized_numel=1000,
                  block_size=block_size)
        oc, og = LowBitAdamW(cpu, **kw), LowBitAdamW(gpu, **kw)
        if not cuda:
            og._use_fused = lambda t: True  # the Triton kernels, interpreted
        for _ in range(3):
            for pc, pg in zip(cpu, gpu):
                g = torch.randn(pc.shape, generator=gen).to(dtype)
                pc.grad, pg.grad = g, g.to(pg.device)
            oc.step()
            og.step()
        assert og._plans and not oc._plans  # each took the path it stands for
        if block_size:  # the block asked for is the block used (first shape: 256 wide)
            assert og.state[gpu[0]]["exp_avg_absmax"].shape[-1] == -(-256 // block_size)
        for pc, pg in zip(cpu, gpu):
            if not cuda:
                assert torch.equal(pc.view(-1).view(torch.uint8), pg.view(-1).view(torch.uint8)), (dtype, pc.shape)
                for key, val in oc.state[pc].items():
                    assert torch.equal(val.view(-1).view(torch.uint8), og.state[pg][key].view(-1).view(torch.uint8)), \
                        (dtype, pc.shape, key)
                continue
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


def test_gradient_that_turns_non_contiguous_between_steps_is_read_by_value():
    """The step plan checks each step's gradients against the first step's in one pass
    (dtype, layout, shape, contiguity); a gradient that is a transposed view at a later
    step leaves that pass and is read as its contiguous copy: the fused kernel (the
    interpreted Triton kernel without a GPU) makes the same update as with a contiguous
    gradient of the same values. (Read as raw memory, the view would be its transpose.)"""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(16, 80, generator=gen)
    ws = [torch.nn.Parameter(w0.clone().to(dev)) for _ in range(2)]
    opts = [LowBitAdamW([("w", w)], state_format="8bit", min_quantized_numel=0) for w in ws]
    for opt in opts:
        opt._use_fused = lambda t: True
    for step in range(3):
        g = torch.randn(16, 80, generator=gen).to(dev)
        ws[0].grad = g.clone()
        ws[1].grad = g.clone() if step == 0 else g.t().contiguous().t()  # a transposed view from step 1
        assert ws[1].grad.is_contiguous() == (step == 0)
        for opt in opts:
            opt.step()
    assert torch.equal(ws[0], ws[1])
    for a, b in zip(opts[0].state[ws[0]].values(), opts[1].state[ws[1]].values()):
        assert torch.equal(a, b)


def _snapshot(opt):
    """Every parameter's bytes, every state tensor's bytes, and the group options."""
    raw = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8).clone()  # noqa: E731 (fp8 too)
    params = [p for g in opt.param_groups for p in g["params"]]
    return ([raw(p) for p in params],
            [{k: raw(v) for k, v in opt.state[p].items()} for p in params],
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def _assert_same(a, b):
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    for x, y in zip(a[1], b[1]):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert a[2] == b[2]


def _two_groups(dtype=torch.float32, **kw):
    a = torch.nn.Parameter(torch.randn(48, 80).to(dtype))
    b = torch.nn.Parameter(torch.randn(32, 64).to(dtype))
    opt = LowBitAdamW([{"params": [("a", a)]}, {"params": [("b", b)], "lr": 5e-3}], **{"min_quantized_numel": 0, **kw})
    return a, b, opt


def _grads(*params):
    for p in params:
        p.grad = torch.randn_like(p)


@pytest.mark.parametrize("state_format, default", [("8bit", 256), ("4bit", 128), ("fp8", 128)])
def test_block_size_zero_and_the_formats_default_load_into_each_other(state_format, default):
    """0 means the format's default block: the same state, so neither is refused."""
    for saved, built in ((0, default), (default, 0)):
        a, b, src = _two_groups(torch.bfloat16, state_format=state_format, block_size=saved)
        _grads(a, b)
        src.step()
        sd = copy.deepcopy(src.state_dict())
        a2, b2 = a.detach().clone(), b.detach().clone()
        opt = LowBitAdamW([{"params": [("a", a2)]}, {"params": [("b", b2)], "lr": 5e-3}],
                          state_format=state_format, block_size=built, min_quantized_numel=0)
        opt.load_state_dict(sd)
        grads = [torch.randn_like(a), torch.randn_like(b)]
        for p, g in zip((a, b, a2, b2), grads * 2):
            p.grad = g.clone()
        src.step()
        opt.step()
        assert torch.equal(a, a2) and torch.equal(b, b2)


@pytest.mark.parametrize("saved,built", [
    ({"state_format": "8bit"}, {"state_format": "4bit"}),
    ({"state_format": "fp32"}, {"state_format": "bf16"}),
    ({"block_size": 0}, {"block_size": 64}),
    ({"weight_update": "master"}, {"weight_update": "nearest"}),
    ({"weight_update": "kahan"}, {"weight_update": "stochastic"}),
    ({"decoupled_weight_decay": True}, {"decoupled_weight_decay": False}),
    ({"min_quantized_numel": 0}, {"min_quantized_numel": 4096}),
])
def test_load_state_dict_refuses_other_layout_or_math_options(saved, built):
    """torch would copy the saved option over the built one and silently go on with it."""
    (key, want), (_, have) = next(iter(saved.items())), next(iter(built.items()))
    a, b, src = _two_groups(torch.bfloat16, **saved)
    _grads(a, b)
    src.step()
    sd = copy.deepcopy(src.state_dict())
    kw = {"min_quantized_numel": 0, **built}
    opt = LowBitAdamW([{"params": [("a", a)]}, {"params": [("b", b)], "lr": 5e-3}], **kw)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=rf"param group 0 .*'a'.*saved with {key}={want!r}.*built with "
                                         rf"{key}={have!r}.*Build the optimizer with {key}={want!r}"):
        opt.load_state_dict(sd)
    _assert_same(before, _snapshot(opt))
    _grads(a, b)
    opt.step()


def test_load_state_dict_restores_hyperparameters_as_torch_does():
    a, b, src = _two_groups(lr=3e-3, betas=(0.8, 0.95))
    _grads(a, b)
    src.step()
    opt = LowBitAdamW([{"params": [("a", a)]}, {"params": [("b", b)], "lr": 1.0}], min_quantized_numel=0)
    opt.load_state_dict(copy.deepcopy(src.state_dict()))
    assert [g["lr"] for g in opt.param_groups] == [3e-3, 5e-3] and opt.param_groups[0]["betas"] == (0.8, 0.95)


@pytest.mark.parametrize("bad", ["torch_adamw", "no_format_key", "no_param_groups", "unknown_id", "bad_lr",
                                 "state_shape"])
def test_failed_load_state_dict_leaves_the_optimizer_unchanged(bad):
    a, b, opt = _two_groups()
    _grads(a, b)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.5  # a valid change the failed load must not apply either
    if bad == "torch_adamw":
        ref = torch.optim.AdamW([torch.nn.Parameter(a.detach().clone())])
        ref.add_param_group({"params": [torch.nn.Parameter(b.detach().clone())]})
        sd = ref.state_dict()
        match = "not saved by LowBitAdamW"
    elif bad == "no_format_key":
        del sd["param_groups"][1]["state_format"]
        match = r"param group 1 of the state dict has no \['state_format'\]"
    elif bad == "no_param_groups":
        del sd["param_groups"]
        match = "'state' and 'param_groups'"
    elif bad == "unknown_id":
        sd["state"][7] = sd["state"][0]
        match = r"parameter ids \[7\]"
    elif bad == "bad_lr":
        sd["param_groups"][1]["lr"] = -1.0
        match = "param group 1 of the state dict: lr=-1.0"
    else:  # found only after torch replaced the groups and the state: they are put back
        sd["state"][1]["exp_avg_codes"] = sd["state"][1]["exp_avg_codes"][:, :32]
        match = "param 'b': the loaded optimizer state"
    ta, tb = (torch.nn.Parameter(p.detach().clone()) for p in (a, b))
    twin = LowBitAdamW([{"params": [("a", ta)]}, {"params": [("b", tb)]}], min_quantized_numel=0)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    _assert_same(before, _snapshot(opt))
    for _ in range(2):  # the optimizer steps on exactly as one that never saw the load
        _grads(a, b)
        ta.grad, tb.grad = a.grad.clone(), b.grad.clone()
        opt.step()
        twin.step()
    assert torch.equal(a, ta) and torch.equal(b, tb)


def test_master_weights_start_from_the_weights_at_the_first_step():
    """Weights loaded after the optimizer was built (model-only checkpoint, pretrained
    weights) are what the first step updates; a master from a loaded state dict is kept."""
    w = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
    opt = LowBitAdamW([("w", w)], weight_update="master", nonfinite_grad="skip")
    loaded = torch.randn(64, 128).to(torch.bfloat16)
    with torch.no_grad():
        w.copy_(loaded)
    w.grad = torch.full_like(w, float("nan"))
    opt.step()  # skipped: not a step that updates the weights
    with torch.no_grad():
        w.add_(1.0)
        loaded = w.detach().clone()
    w.grad = torch.zeros_like(w)
    opt.step()
    torch.testing.assert_close(w.float(), loaded.float(), atol=1e-2, rtol=0)

    # resume: the loaded master holds the bits the bf16 weight cannot; it is not re-taken
    kw = dict(lr=1e-3, weight_update="master", min_quantized_numel=0)
    a = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
    opt_a = LowBitAdamW([("a", a)], **kw)
    for _ in range(2):
        _grads(a)
        opt_a.step()
    b = torch.nn.Parameter(a.detach().clone())
    opt_b = LowBitAdamW([("a", b)], **kw)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert not torch.equal(opt_a.state[a]["master"], a.float())
    _grads(a)
    b.grad = a.grad.clone()
    opt_a.step()
    opt_b.step()
    assert torch.equal(a, b) and torch.equal(opt_a.state[a]["master"], opt_b.state[b]["master"])


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
@pytest.mark.parametrize("group,match", [
    ({"params": [("bad", torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float16)))]}, "'bad' has dtype"),
    ({"params": [("c", torch.nn.Parameter(torch.randn(4, 4)))], "lr": -1.0}, "param group 2: lr=-1.0"),
    ({"params": [("c", torch.nn.Parameter(torch.randn(4, 4)))], "state_format": "2bit"}, "state_format='2bit'"),
    ("twice", "'d' is listed twice in param group 2"),
])
def test_failed_add_param_group_leaves_the_optimizer_unchanged(group, match):
    a, b, opt = _two_groups()
    if group == "twice":
        d = torch.nn.Parameter(torch.randn(8, 8))
        group = {"params": [("d", d), ("d", d)]}
    before = _snapshot(opt)
    with pytest.raises((TypeError, ValueError), match=match):
        opt.add_param_group(group)
    _assert_same(before, _snapshot(opt))
    assert len(opt.state) == 2
    _grads(a, b)
    opt.step()


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_duplicate_parameter_in_the_constructor_is_an_error():
    w = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match="'blocks.0.w' is listed twice in param group 0"):
        LowBitAdamW([("blocks.0.w", w), ("blocks.0.w", w)])


@pytest.mark.parametrize("key,value,match", [
    ("betas", (0.9, 1.0), r"param group 1: betas=\(0.9, 1.0\)"),
    ("lr", -1.0, "param group 1: lr=-1.0"),
    ("lr", float("nan"), "param group 1: lr=nan"),
    ("lr", torch.tensor(float("nan")), "param group 1: lr=nan"),
    ("eps", -1e-8, "param group 1: eps=-1e-08"),
    ("state_format", "4bit", r"param group 1 \(1 params: 'b'\): state_format was changed from '8bit' to '4bit'"),
    ("state_format", "3bit", "param group 1: state_format='3bit'"),
    ("block_size", 64, "block_size was changed from 0 to 64"),
    ("weight_update", "master", "weight_update was changed from 'nearest' to 'master'"),
    ("decoupled_weight_decay", False, "decoupled_weight_decay was changed from True to False"),
])
def test_group_changed_at_runtime_is_checked_before_the_step_touches_anything(key, value, match):
    """A scheduler or user code may change a group after it was added: a later group's bad
    value must not leave the step half done (earlier groups updated, step counts bumped)."""
    a, b, opt = _two_groups()
    _grads(a, b)
    opt.step()
    _grads(a, b)
    before = _snapshot(opt)
    old = opt.param_groups[1][key]
    opt.param_groups[1][key] = value
    with pytest.raises(ValueError, match=match):
        opt.step()
    opt.param_groups[1][key] = old
    _assert_same(before, _snapshot(opt))
    b.grad[0, 0] = float("nan")  # a step that raises for an earlier step's nan changes nothing, either
    opt.step()
    before = _snapshot(opt)
    b.grad[0, 0] = 0.0
    with pytest.raises(FloatingPointError, match="'b' at optimizer step 2"):
        opt.step()
    _assert_same(before, _snapshot(opt))
    opt.step()
    assert [int(opt.state[p]["step"]) for p in (a, b)] == [3, 3]


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "fp32"])
@pytest.mark.parametrize("policy", ["raise", "skip", "ignore"])
def test_empty_parameters_are_skipped(fmt, policy):
    """A zero-size parameter (or an FSDP2 rank's empty shard) has nothing to update; the
    others step as if it were not there, and its step count keeps up with them."""
    a = torch.nn.Parameter(torch.randn(48, 80))
    twin = torch.nn.Parameter(a.detach().clone())
    empties = [torch.nn.Parameter(torch.randn(s)) for s in ((0, 80), (5, 0), (0,))]
    kw = dict(state_format=fmt, min_quantized_numel=0, nonfinite_grad=policy)
    opt = LowBitAdamW([("a", a)] + [(f"e{i}", e) for i, e in enumerate(empties)], **kw)
    ref = LowBitAdamW([("a", twin)], **kw)
    for _ in range(2):
        _grads(a, *empties)
        twin.grad = a.grad.clone()
        opt.step()
        ref.step()
    assert torch.equal(a, twin)
    assert [int(opt.state[e]["step"]) for e in empties] == [2, 2, 2]


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_container_checks_every_model_part_before_stepping_any(policy):
    """Pipeline parallelism: one optimizer per model part in torchtitan's container. An
    inf in the second part's gradients must not step the first part alone: skip skips
    both; raise lets both take that step (the inf's block left alone) and raises at the
    next before either part steps."""
    from torchtitan.config import Optimizer as OptimizerConfig

    from titan_lowbit.config import LowBit
    from titan_lowbit.torchtitan.optimizer_builder import build_lowbit_optimizers
    from torchtitan.components.optimizer import build_optimizers

    torch.manual_seed(0)
    parts = [torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)]
    opts = build_lowbit_optimizers(parts, OptimizerConfig(name="AdamW8bit"), None,
                                   lowbit=LowBit(min_quantized_numel=0, nonfinite_grad=policy),
                                   seed=0, base_builder=build_optimizers)
    before = [p.detach().clone() for m in parts for p in m.parameters()]
    for m in parts:
        m(torch.randn(4, 64)).square().mean().backward()
    parts[1].weight.grad[3, 5] = float("inf")
    if policy == "raise":
        opts.step()
        before = [p.detach().clone() for m in parts for p in m.parameters()]
        parts[1].weight.grad[3, 5] = 0.0
        with pytest.raises(FloatingPointError, match="model part 1: non-finite gradient .* in param 'weight' at "
                                                     "optimizer step 1.*; none of the model parts took this step"):
            opts.step()
    else:
        opts.step()
        assert [o.skipped_steps for o in opts.optimizers] == [1, 1]
    assert all(torch.equal(a, p) for a, p in zip(before, (p for m in parts for p in m.parameters())))
    # finite gradients again: both parts step, each checked once
    parts[1].weight.grad[3, 5] = 0.0
    opts.step()
    assert not any(torch.equal(a, p) for a, p in zip(before, (p for m in parts for p in m.parameters())))
    assert not any(o.grads_checked for o in opts.optimizers)


def test_container_step_hooks_run_once_after_a_plain_container_exists():
    """torch wraps a container class's step with the step hooks when its first instance is
    built; titan_lowbit's container must not step through torchtitan's wrapped one (the
    BitNet scale precompute, a post hook, would run twice)."""
    from torchtitan.config import Optimizer as OptimizerConfig

    from titan_lowbit.config import LowBit
    from titan_lowbit.torchtitan.optimizer_builder import build_lowbit_optimizers
    from torchtitan.components.optimizer import build_optimizers

    build_optimizers([torch.nn.Linear(8, 8)], OptimizerConfig(name="AdamW"), None)
    parts = [torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)]
    opts = build_lowbit_optimizers(parts, OptimizerConfig(name="AdamW8bit"), None, lowbit=LowBit(),
                                   seed=0, base_builder=build_optimizers)
    calls = []
    opts.register_step_pre_hook(lambda *args, **kwargs: calls.append("pre"))
    opts.register_step_post_hook(lambda *args, **kwargs: calls.append("post"))
    for m in parts:
        m(torch.randn(4, 64)).square().mean().backward()
    opts.step()
    assert calls == ["pre", "post"]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_steps_like_the_original(how):
    """torch's Optimizer pickles only defaults, state and param_groups; ours keeps its
    parameter names, fixed options and the master weights still to be taken."""
    import pickle

    model = torch.nn.ParameterDict({"a": torch.randn(48, 80).bfloat16(), "b": torch.randn(32, 64).bfloat16()})
    opt = LowBitAdamW(list(model.named_parameters()), state_format="4bit", weight_update="master",
                      min_quantized_numel=0, seed=7)
    # Before the first step (masters pending), then after one.
    for _ in range(2):
        pair = (model, opt)
        model2, opt2 = copy.deepcopy(pair) if how == "deepcopy" else pickle.loads(pickle.dumps(pair))
        assert set(vars(opt2)) == set(vars(opt)) and opt2._master_pending == {
            dict(model2.named_parameters())[k] for k, p in model.named_parameters() if p in opt._master_pending}
        for p, p2 in zip(model.parameters(), model2.parameters()):
            p.grad = torch.randn_like(p)
            p2.grad = p.grad.clone()
        opt.step()
        opt2.step()
        for p, p2 in zip(model.parameters(), model2.parameters()):
            assert torch.equal(p, p2)
        for p, p2 in zip(model.parameters(), model2.parameters()):
            assert all(torch.equal(opt.state[p][k], opt2.state[p2][k]) for k in opt.state[p])
    model2.a.grad = torch.full_like(model2.a, float("nan"))
    opt2.step()
    with pytest.raises(FloatingPointError, match="non-finite gradient .* in param 'a' at optimizer step 3"):
        opt2.check_nonfinite()


def test_load_state_dict_refuses_a_parameter_without_state():
    """A LowBitAdamW state dict holds every parameter's state; one missing would restart
    that parameter from zero moments while the others resume."""
    a, b, src = _two_groups(torch.bfloat16, weight_update="master")
    _grads(a, b)
    src.step()
    sd = copy.deepcopy(src.state_dict())
    del sd["state"][1]  # b's
    opt = LowBitAdamW([{"params": [("a", a)]}, {"params": [("b", b)], "lr": 5e-3}],
                      weight_update="master", min_quantized_numel=0)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match="param 'b': the state dict holds no optimizer state for it"):
        opt.load_state_dict(sd)
    _assert_same(before, _snapshot(opt))
