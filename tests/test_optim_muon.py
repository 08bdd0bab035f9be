"""LowBitMuon: the published Muon algorithm, low-bit momentum against fp32, the split of
parameters between Muon and the inner LowBitAdamW, and torch's optimizer contract.

Small matrices, a few steps each, on the CPU (the PyTorch reference of the step).
"""

import copy
import io
import math

import pytest
import torch

from titan_lowbit.kernels.adamw_lowbit_ref import quantize_blockwise
from titan_lowbit.kernels.quant_maps import CODEC_DYN4_SIGNED, CODEC_NF4_SIGNED
from titan_lowbit.optim import LowBitAdamW, LowBitMuon
from titan_lowbit.optim.adamw import WEIGHT_UPDATES

FORMATS = ["fp32", "bf16", "8bit", "4bit", "fp8"]


def published_muon(params, grads_per_step, lr, beta, wd, nesterov):
    """Muon as published, transcribed here on its own: Keller Jordan's muon_update
    (momentum as an EMA, Nesterov look-ahead, quintic Newton-Schulz in bf16 with
    a, b, c = 3.4445, -4.7750, 2.0315 for 5 steps) with Moonshot's update scale
    0.2 * sqrt(max(A, B)) (arXiv 2502.16982) and decoupled weight decay."""
    def zeropower(g):
        a, b, c = (3.4445, -4.7750, 2.0315)
        x = g.bfloat16()
        if g.size(-2) > g.size(-1):
            x = x.mT
        x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        for _ in range(5):
            gram = x @ x.mT
            poly = b * gram + c * gram @ gram
            x = a * x + poly @ x
        if g.size(-2) > g.size(-1):
            x = x.mT
        return x

    params = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for p, buf, g in zip(params, bufs, grads):
            buf.lerp_(g, 1 - beta)
            update = g.lerp(buf, beta) if nesterov else buf
            update = zeropower(update).float() * (0.2 * math.sqrt(max(p.shape)))
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr)
    return params


@pytest.mark.parametrize("nesterov", [True, False])
def test_fp32_muon_is_the_published_algorithm(nesterov):
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 48), (40, 24)]  # wide and tall (transposed for Newton-Schulz)
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(6)]
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = LowBitMuon(params, lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=nesterov, state_format="fp32")
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    want = published_muon(start, grads, lr=0.02, beta=0.9, wd=0.1, nesterov=nesterov)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-6)


def test_update_is_near_orthogonal_with_adamws_rms():
    """Moonshot's rule: the update's RMS is 0.2 (x lr) whatever the matrix's shape."""
    for shape in ((32, 96), (96, 32), (64, 64)):
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        LowBitMuon([p], lr=1.0, weight_decay=0.0, state_format="fp32").step()
        rms = float(p.detach().pow(2).mean().sqrt())
        assert 0.15 < rms < 0.25, (shape, rms)
        sv = torch.linalg.svdvals(p.detach() / (0.2 * math.sqrt(max(shape))))
        assert float(sv.min()) > 0.5 and float(sv.max()) < 1.3, (shape, sv)


def _problem(seed=0):
    """A small two-layer regression, with an embedding and biases for the AdamW part."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    x = torch.randn(256, 32)
    y = torch.randn(256, 16)
    return model, x, y


def _train(model, opt, x, y, steps):
    for i in range(steps):
        sl = slice((i * 32) % 256, (i * 32) % 256 + 32)
        loss = (model(x[sl]) - y[sl]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float((model(x) - y).pow(2).mean())


# Distance from fp32 Muon's weights after 50 steps, as a fraction of how far fp32 moved
# them (measured: bf16 0.011, 8-bit 0.041, fp8 0.11, 4-bit 0.43 with NF4 levels and 0.60 with
# the dynamic map; momentum 0 instead: 0.78), and final loss over fp32 Muon's (4-bit: 1.010
# with NF4 levels, 1.025 with the dynamic map).
@pytest.mark.parametrize("fmt,levels,tol,loss_tol", [("bf16", "nf4", 0.03, 1.002), ("8bit", "nf4", 0.08, 1.002),
                                                     ("fp8", "nf4", 0.2, 1.005), ("4bit", "nf4", 0.5, 1.015),
                                                     ("4bit", "dynamic", 0.7, 1.04)])
def test_low_bit_momentum_tracks_fp32(fmt, levels, tol, loss_tol):
    ref_model, x, y = _problem()
    model, start = copy.deepcopy(ref_model), copy.deepcopy(ref_model)
    kw = dict(lr=0.01, min_quantized_numel=0)
    ref_loss = _train(ref_model, LowBitMuon(ref_model.named_parameters(), state_format="fp32", **kw), x, y, 50)
    loss = _train(model, LowBitMuon(model.named_parameters(), state_format=fmt, momentum_4bit_levels=levels, **kw),
                  x, y, 50)
    assert loss <= loss_tol * ref_loss
    for (name, a), b, s in zip(model.named_parameters(), ref_model.parameters(), start.parameters()):
        moved = float((b - s).detach().norm())
        assert float((a - b).detach().norm()) <= tol * moved, (name, float((a - b).norm()) / moved)


def test_params_split_by_shape_and_name():
    emb = torch.nn.Embedding(10, 8)
    hidden = torch.nn.Linear(8, 8)
    head = torch.nn.Linear(8, 10)
    named = [("tok_embeddings.weight", emb.weight), ("layers.0.w.weight", hidden.weight),
             ("layers.0.w.bias", hidden.bias), ("output.weight", head.weight)]
    opt = LowBitMuon(named)
    assert [(g["use_muon"], g["param_names"]) for g in opt.param_groups] == [
        (True, ["layers.0.w.weight"]), (False, ["tok_embeddings.weight", "layers.0.w.bias", "output.weight"])]
    assert opt.adamw.param_groups[0] is opt.param_groups[1]  # one group, one dict
    assert opt.state[emb.weight] is opt.adamw.state[emb.weight]
    # fragments of one's own; unnamed parameters by shape alone
    opt = LowBitMuon(named, adamw_fqns=["tok_embeddings"])
    assert opt.param_groups[0]["param_names"] == ["layers.0.w.weight", "output.weight"]
    opt = LowBitMuon([hidden.weight, hidden.bias])
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    # groups that say use_muon are taken as they say, with their own options
    opt = LowBitMuon([{"params": [hidden.weight], "use_muon": True, "momentum": 0.9},
                      {"params": [emb.weight, hidden.bias], "use_muon": False, "betas": (0.9, 0.95)}], lr=3e-4)
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[1]["betas"] == (0.9, 0.95)
    assert opt.param_groups[1]["lr"] == 3e-4


@pytest.mark.parametrize("build,match", [
    (lambda lin: LowBitMuon([{"params": [lin.bias], "use_muon": True}]), "Muon orthogonalises 2-D"),
    (lambda lin: LowBitMuon([{"params": [lin.weight], "use_muon": True, "betas": (0.9, 0.9)}]), "AdamW only"),
    (lambda lin: LowBitMuon([{"params": [lin.bias], "use_muon": False, "nesterov": False}]), "Muon only"),
    (lambda lin: LowBitMuon(lin.named_parameters(), adamw_fqns=["embed"]), "select no parameter"),
    (lambda lin: LowBitMuon(lin.parameters(), adamw_fqns=["embed"]), "named_parameters"),
    (lambda lin: LowBitMuon(lin.parameters(), momentum=1.0), "momentum=1.0"),
    (lambda lin: LowBitMuon(lin.parameters(), ns_steps=0), "ns_steps=0"),
    (lambda lin: LowBitMuon(lin.parameters(), state_format="2bit"), "state_format='2bit'"),
    (lambda lin: LowBitMuon(lin.parameters(), weight_update="fancy"), "weight_update='fancy'"),
    (lambda lin: LowBitMuon(lin.parameters(), state_format="4bit", momentum_4bit_levels="nf3"),
     r"momentum_4bit_levels='nf3'; choose one of \['nf4', 'dynamic'\]"),
    (lambda lin: LowBitMuon(lin.parameters(), state_format="8bit", momentum_4bit_levels="dynamic"),
     "sets the levels of a 4-bit momentum, but state_format='8bit'"),
    (lambda lin: LowBitMuon([lin.bias], adamw_options={"momentum_4bit_levels": "dynamic"}), "on LowBitMuon itself"),
    (lambda lin: LowBitMuon([{"params": [lin.weight], "use_muon": True, "state_format": "fp8",
                              "momentum_4bit_levels": "dynamic"}], state_format="4bit"),
     "param group 0: momentum_4bit_levels='dynamic' sets the levels of a 4-bit momentum, but state_format='fp8'"),
    (lambda lin: LowBitMuon(lin.parameters(), adamw_options={"seed": 3}), "on LowBitMuon itself"),
    (lambda lin: LowBitMuon(lin.parameters(), adamw_options={"betaz": 3}), "not LowBitAdamW keywords"),
    (lambda lin: LowBitMuon([lin.weight, lin.weight]), "listed twice"),
    (lambda lin: LowBitMuon([torch.nn.Parameter(lin.weight.detach().half())]), "LowBitMuon holds float32 or bfloat16"),
    (lambda lin: LowBitMuon([torch.nn.Parameter(lin.weight.detach().t())]), "not contiguous; LowBitMuon updates"),
])
def test_bad_input_is_refused_naming_what(build, match):
    lin = torch.nn.Linear(8, 4)
    with pytest.raises((ValueError, TypeError), match=match):
        build(lin)


def test_bad_grad_names_the_parameter():
    lin = torch.nn.Linear(8, 4)
    opt = LowBitMuon(lin.named_parameters())
    lin.weight.grad = torch.zeros(4, 8).to_sparse()
    with pytest.raises(RuntimeError, match="param 'weight' has a sparse gradient"):
        opt.step()


def _bf16_lin(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8)).to(torch.bfloat16)


def _steps(model, opt, n, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(16, 32, generator=gen).to(torch.bfloat16)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


CASES = [("8bit", u) for u in WEIGHT_UPDATES] + [(f, "stochastic") for f in FORMATS if f != "8bit"]


@pytest.mark.parametrize("fmt,update", CASES)
def test_torch_save_load_resumes_bit_for_bit(fmt, update):
    """Both parts (Muon matrices, AdamW biases) resume bit for bit through torch.save and
    torch.load(weights_only=True) into a fresh optimizer."""
    kw = dict(lr=1e-3, state_format=fmt, weight_update=update, min_quantized_numel=0)
    model = _bf16_lin()
    opt = LowBitMuon(model.named_parameters(), **kw)
    _steps(model, opt, 3, seed=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    _steps(model, opt, 3, seed=2)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = _bf16_lin(seed=5)
    resumed.load_state_dict(saved["model"])
    opt2 = LowBitMuon(resumed.named_parameters(), **kw)
    opt2.load_state_dict(saved["optim"])
    _steps(resumed, opt2, 3, seed=2)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    for p, q in zip(model.parameters(), resumed.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                               opt2.state[q][k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn
                               else opt2.state[q][k]), k


def test_bitnet_weights_are_stepped_in_their_latent_weight():
    """A BitNet linear's weight (``BitNetTrainingWeight``) is a 2-D matrix that wraps its
    latent weight: Muon steps it, in place, bit for bit as a plain matrix of the same
    values, and the step makes its kept ternary codes stale, so the forward and the
    converter's post-step hook quantize the new values."""
    from titan_lowbit.bitnet import BitNetTrainingWeight, convert_to_bitnet, refresh_ternary_codes

    torch.manual_seed(0)  # BitNet layers have at least 16 inputs and outputs
    plain = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 24)).to(torch.bfloat16)
    bitnet = copy.deepcopy(plain)
    convert_to_bitnet(bitnet, [])
    latent = [m.weight for m in (bitnet[0], bitnet[2])]
    assert all(type(w) is BitNetTrainingWeight for w in latent)
    before = [w._data.clone() for w in latent]
    kw = dict(lr=1e-2, state_format="8bit", weight_update="stochastic", min_quantized_numel=0)
    opts = [LowBitMuon(m.named_parameters(), **kw) for m in (bitnet, plain)]
    assert [len(g["params"]) for g in opts[0].param_groups if g["use_muon"]] == [2]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        assert refresh_ternary_codes(latent) == 2
        grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in plain.parameters()]
        for model, opt in zip((bitnet, plain), opts):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            opt.step()
        assert all(w.ternary_codes() is None for w in latent)
    for w, m, old in zip(latent, (plain[0], plain[2]), before):
        assert torch.equal(w._data.view(torch.int16), m.weight.detach().view(torch.int16))
        assert not torch.equal(w._data, old)


def test_weight_updates_need_their_state_and_differ_from_nearest():
    """Every bf16 update rule keeps its extra state for the Muon matrices too, and at a
    small lr the rules other than nearest move the weights that nearest leaves stale
    (all but those near zero)."""
    extra = {"master": torch.float32, "kahan": torch.bfloat16, "master_remainder": torch.int16}
    moved = {}
    for update in WEIGHT_UPDATES:
        model = _bf16_lin()
        opt = LowBitMuon(model.named_parameters(), lr=2e-4, weight_update=update, min_quantized_numel=0)
        w = model[0].weight
        kept = [v.dtype for k, v in opt.state[w].items() if k != "step" and not k.startswith("momentum_buffer")]
        assert kept == ([extra[update]] if update in extra else [])
        before = w.detach().clone()
        _steps(model, opt, 10, seed=1)
        moved[update] = int((w.detach() != before).sum())
    assert all(moved[u] > 4 * max(moved["nearest"], 1) for u in WEIGHT_UPDATES if u != "nearest"), moved


def test_deepcopy_steps_like_the_original():
    model = _bf16_lin()
    opt = LowBitMuon(model.named_parameters(), weight_update="master")
    _steps(model, opt, 2, seed=1)
    model2, opt2 = copy.deepcopy((model, opt))
    assert opt2.adamw.param_groups[0] is opt2.param_groups[1]
    _steps(model, opt, 2, seed=3)
    _steps(model2, opt2, 2, seed=3)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_load_refuses_another_layout_or_damage_changing_nothing():
    model = _bf16_lin()
    opt = LowBitMuon(model.named_parameters(), state_format="8bit", min_quantized_numel=0)
    _steps(model, opt, 2, seed=1)
    sd = opt.state_dict()
    other = LowBitMuon(model.named_parameters(), state_format="4bit", min_quantized_numel=0)
    with pytest.raises(ValueError, match="saved with state_format='8bit'"):
        other.load_state_dict(sd)
    damaged = copy.deepcopy(sd)
    damaged["state"][0]["momentum_buffer_absmax"][0, 0] = float("nan")
    keep = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    with pytest.raises(ValueError, match="param '0.weight': state entry 'momentum_buffer_absmax'"):
        opt.load_state_dict(damaged)
    assert all(torch.equal(keep[k], v) for k, v in opt.state[model[0].weight].items())
    damaged = copy.deepcopy(sd)
    damaged["state"][2]["exp_avg_sq_absmax"][0] = float("nan")  # the AdamW part: 0.bias
    with pytest.raises(ValueError, match="param '0.bias'"):
        opt.load_state_dict(damaged)
    assert opt.adamw.param_groups[0] is opt.param_groups[1]


@pytest.mark.parametrize("levels,codec", [("nf4", CODEC_NF4_SIGNED), ("dynamic", CODEC_DYN4_SIGNED)])
def test_4bit_momentum_is_coded_in_the_levels_asked_for(levels, codec):
    """A "4bit" momentum holds the fp32 momentum quantized with the chosen levels (NF4 by
    default); the inner AdamW's first moment keeps the "4bit" format's dynamic map."""
    def one_step(**kw):
        model = _bf16_lin()
        opt = LowBitMuon(model.named_parameters(), lr=1e-3, min_quantized_numel=0, **kw)
        _steps(model, opt, 1, seed=1)
        return model, opt

    ref_model, ref = one_step(state_format="fp32")
    model, opt = one_step(state_format="4bit", **({} if levels == "nf4" else {"momentum_4bit_levels": levels}))
    assert opt.param_groups[0]["momentum_4bit_levels"] == levels
    # a group of another format beside them only inherits the option (fp32_states' groups)
    other = _bf16_lin()
    LowBitMuon([{"params": [other[0].weight]}, {"params": [other[2].weight], "state_format": "fp32"}],
               state_format="4bit", momentum_4bit_levels=levels)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        if p.dim() == 2:
            state = opt.state[p]
            m = ref.state[q]["momentum_buffer"]
            codes, absmax = quantize_blockwise(m, codec, 128)
            assert torch.equal(state["momentum_buffer_codes"], codes) and torch.equal(state["momentum_buffer_absmax"], absmax)
        else:  # the inner AdamW (biases)
            m = ref.state[q]["exp_avg"].reshape(1, -1)
            assert torch.equal(opt.state[p]["exp_avg_codes"], quantize_blockwise(m, CODEC_DYN4_SIGNED, 128)[0][0])


def test_4bit_momentum_state_dict_resumes_only_into_its_levels():
    """A state dict records momentum_4bit_levels; one without it (an optimizer that did not
    record them) holds the dynamic map. Either loads only into an optimizer of the same
    levels, and then resumes bit for bit; formats other than 4-bit ignore a missing key."""
    kw = dict(lr=1e-3, state_format="4bit", min_quantized_numel=0, momentum_4bit_levels="dynamic")
    model = _bf16_lin()
    opt = LowBitMuon(model.named_parameters(), **kw)
    _steps(model, opt, 2, seed=1)
    sd = copy.deepcopy(opt.state_dict())
    unrecorded = copy.deepcopy(sd)
    for g in unrecorded["param_groups"]:
        g.pop("momentum_4bit_levels", None)
    for saved in (sd, unrecorded):
        with pytest.raises(ValueError, match="saved with momentum_4bit_levels='dynamic', this optimizer was built "
                                             "with momentum_4bit_levels='nf4'"):
            LowBitMuon(_bf16_lin().named_parameters(), **{**kw, "momentum_4bit_levels": "nf4"}).load_state_dict(saved)
    resumed = copy.deepcopy(model)
    opt2 = LowBitMuon(resumed.named_parameters(), **kw)
    opt2.load_state_dict(unrecorded)
    assert opt2.param_groups[0]["momentum_4bit_levels"] == "dynamic"
    _steps(model, opt, 2, seed=2)
    _steps(resumed, opt2, 2, seed=2)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    eight = LowBitMuon(model.named_parameters(), lr=1e-3, state_format="8bit", min_quantized_numel=0)
    _steps(model, eight, 1, seed=3)
    sd8 = copy.deepcopy(eight.state_dict())
    for g in sd8["param_groups"]:
        g.pop("momentum_4bit_levels", None)
    LowBitMuon(model.named_parameters(), lr=1e-3, state_format="8bit", min_quantized_numel=0).load_state_dict(sd8)


def test_closure_add_param_group_and_lr_changes():
    lin, extra = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    opt = LowBitMuon(lin.named_parameters(), lr=1e-2)
    x = torch.randn(4, 8)

    calls = []

    def closure():  # runs with grad enabled inside step(), its loss returned
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        lin(x).pow(2).sum().backward()
        return torch.tensor(1.5)

    assert float(opt.step(closure)) == 1.5 and calls == [True]
    opt.add_param_group({"params": [("extra.weight", extra.weight), ("extra.bias", extra.bias)]})
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, True, False]
    assert opt.param_groups[3] is opt.adamw.param_groups[1]
    for g in opt.param_groups:  # an LR scheduler's write reaches both parts
        g["lr"] = 0.0
    before = [p.detach().clone() for p in (*lin.parameters(), *extra.parameters())]
    extra(lin(x)).pow(2).sum().backward()
    opt.step()
    for b, p in zip(before, (*lin.parameters(), *extra.parameters())):
        assert torch.equal(b, p.detach())
    opt.param_groups[0]["state_format"] = "4bit"
    with pytest.raises(ValueError, match="state_format was changed"):
        opt.step()


def test_nonfinite_gradient_raise_and_skip():
    lin = torch.nn.Linear(8, 8)
    opt = LowBitMuon(lin.named_parameters())
    lin.weight.grad = torch.full((8, 8), float("nan"))
    lin.bias.grad = torch.ones(8)
    before = lin.weight.detach().clone()
    with pytest.raises(FloatingPointError, match="param 'weight'"):
        opt.step()
    assert torch.equal(before, lin.weight.detach())
    assert torch.equal(opt.state[lin.weight]["momentum_buffer"], torch.zeros(8, 8))
    opt = LowBitMuon(lin.named_parameters(), nonfinite_grad="skip")
    before = [p.detach().clone() for p in lin.parameters()]
    opt.step()
    assert opt.skipped_steps == 1 and all(g["skipped_steps"] == 1 for g in opt.param_groups)
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, lin.parameters()))


def test_state_bytes_per_param():
    w = torch.nn.Parameter(torch.randn(64, 4096))
    for fmt in FORMATS:
        opt = LowBitMuon([w], state_format=fmt)
        want = {"fp32": 4, "bf16": 2, "8bit": 1 + 4 / 256, "4bit": 0.5 + 4 / 128, "fp8": 1 + 4 / 128}[fmt]
        assert math.isclose(opt.state_bytes_per_param(), want), fmt
    b = torch.nn.Parameter(torch.randn(64 * 4096))  # 1-D: AdamW, two moments
    opt = LowBitMuon([w, b], state_format="8bit")
    want = (64 * 4096 * (1 + 4 / 256) + LowBitAdamW([b]).state_bytes_per_param() * b.numel()) / (2 * b.numel())
    assert math.isclose(opt.state_bytes_per_param(), want)


def test_a_placement_the_exchange_cannot_assemble_is_refused(tmp_path):
    """Sharded matrices are stepped (tests/test_optim_muon_sharded.py); a placement whose
    shards are not rectangles of the matrix (here Partial) is refused at construction."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.nn.Parameter(DTensor.from_local(torch.randn(8, 8), mesh, [Partial()]))
        with pytest.raises(ValueError, match="param 'w' is placed P.*on mesh dimension 0"):
            LowBitMuon([("w", w)])
    finally:
        dist.destroy_process_group()
