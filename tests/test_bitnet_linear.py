"""BitNet linear layers and converters on one process (CPU: the reference kernels)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from titan_lowbit.bitnet import (
    CONVERTERS,
    BitNetTrainingWeight,
    convert_to_bitnet,
    insert_subln,
)
from titan_lowbit.bitnet import ops
from titan_lowbit.config import LowBit
from titan_lowbit.kernels import bitnet_quant as bq


def _job(**lowbit):
    return SimpleNamespace(lowbit=LowBit(**lowbit))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 40, bias=False))


def _ste_reference(model, x, int8_backward):
    """Forward and gradients of the textbook straight-through formulation."""
    x = x.detach().clone().requires_grad_()
    w0, b0, w2 = (p.detach().clone().requires_grad_() for p in (model[0].weight, model[0].bias, model[2].weight))
    h = torch.nn.functional.gelu(ops.bitnet_linear_reference(x, w0, b0))
    y = ops.bitnet_linear_reference(h, w2)
    if not int8_backward:
        y.square().sum().backward()
        return y, x.grad, w0.grad, b0.grad, w2.grad
    # int8 backward: dx = Q(dy) W^ (dy row-quantized); dW = dy^T x^ unchanged.
    def qdq(t):
        q, s = bq.quantize_rows_reference(t.reshape(-1, t.shape[-1]))
        return (q.float() * s[:, None]).view_as(t)

    # int8 backward: layer 2's grad_input is Q(dy) W^ (dy row-quantized); every dW is
    # dy^T x^ (not quantized), so layer 0's dW and db follow from that grad_input exactly.
    dy = 2 * y.detach()
    q, s = bq.quantize_rows_reference(dy.reshape(-1, 40))
    g2 = bq.absmean_scale_reference(w2.detach())
    w2_hat = bq.ternarize_reference(w2.detach(), g2).float() * g2
    dh = ((q.float() * s[:, None]) @ w2_hat).view_as(h)
    hq, hs = bq.quantize_rows_reference(h.detach().reshape(-1, 64))
    dw2 = dy.reshape(-1, 40).t() @ (hq.float() * hs[:, None])
    h.backward(dh)
    return y, None, w0.grad, b0.grad, dw2


@pytest.mark.parametrize("int8_backward", [False, True])
def test_forward_and_gradients_match_straight_through_reference(int8_backward):
    model = _mlp()
    ref = _mlp()
    convert_to_bitnet(model, [], int8_backward=int8_backward)
    assert all(isinstance(m.weight, BitNetTrainingWeight) for m in (model[0], model[2]))
    x = torch.randn(3, 5, 48)
    xm = x.clone().requires_grad_()
    y = model(xm)
    y.square().sum().backward()
    y_ref, dx_ref, dw0_ref, db0_ref, dw2_ref = _ste_reference(ref, x, int8_backward)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[2].weight.grad, dw2_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model[0].weight.grad, dw0_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model[0].bias.grad, db0_ref, rtol=1e-4, atol=1e-6)
    if not int8_backward:  # (int8 grad_input: test_int8_backward_grad_input_matches_...)
        torch.testing.assert_close(xm.grad, dx_ref, rtol=1e-4, atol=1e-6)


def test_int8_backward_grad_input_matches_quantized_reference():
    torch.manual_seed(1)
    lin = nn.Linear(40, 24)
    w = lin.weight.detach().clone()
    convert_to_bitnet(nn.Sequential(lin), [])
    x = torch.randn(7, 40, requires_grad=True)
    dy = torch.randn(7, 24)
    lin(x).backward(dy)
    g = bq.absmean_scale_reference(w)
    w_hat = bq.ternarize_reference(w, g).float() * g
    q, s = bq.quantize_rows_reference(dy)
    torch.testing.assert_close(x.grad, (q.float() * s[:, None]) @ w_hat, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lin.bias.grad, dy.sum(0))


def test_bf16_activations_give_bf16_outputs_and_weight_dtype_grads():
    lin = nn.Linear(32, 32)
    convert_to_bitnet(nn.Sequential(lin), [])
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_autocast_runs_the_layer_in_the_autocast_dtype():
    lin = nn.Linear(32, 48)
    convert_to_bitnet(nn.Sequential(lin), [])
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    # Same quantized operands (the bf16-rounded input), fp32 arithmetic: bf16 output rounding apart.
    ref = ops.bitnet_linear_reference(x.detach().bfloat16().float(), lin.weight._data, lin.bias)
    torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=2e-3)


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 32)
        self.proj = nn.Linear(32, 32)
        self.output = nn.Linear(32, 50)

    def forward(self, t):
        return self.output(torch.relu(self.proj(self.tok(t))))


def test_converter_respects_filter_and_leaves_embeddings():
    model = _Toy()
    conv = CONVERTERS["bitnet"](_job(), SimpleNamespace(tp_enabled=False))
    conv.convert(model)
    assert conv.converted == ["proj"]
    assert isinstance(model.proj.weight, BitNetTrainingWeight)
    assert type(model.output.weight) is nn.Parameter and type(model.tok.weight) is nn.Parameter
    assert set(model.state_dict()) == set(_Toy().state_dict())
    model(torch.randint(0, 50, (2, 6))).sum().backward()
    assert model.proj.weight.grad is not None


def test_converter_errors_are_clear():
    with pytest.raises(ValueError, match="no nn.Linear layers"):
        convert_to_bitnet(nn.Sequential(nn.Embedding(10, 16), nn.LayerNorm(16)), [])
    with pytest.raises(ValueError, match="'attn_out' matches no module"):
        convert_to_bitnet(_Toy(), ["output", "attn_out"])
    with pytest.raises(ValueError, match="all excluded"):
        convert_to_bitnet(_Toy(), ["proj", "output"])
    with pytest.raises(ValueError, match="at least 16 inputs.*bitnet_filter"):
        convert_to_bitnet(nn.Sequential(nn.Linear(8, 32)), [])
    with pytest.raises(TypeError, match="float64"):
        convert_to_bitnet(nn.Sequential(nn.Linear(32, 32, dtype=torch.float64)), [])
    lin = nn.Linear(32, 32)
    convert_to_bitnet(nn.Sequential(lin), [])
    with pytest.raises(TypeError, match="float64"):
        lin(torch.randn(2, 32, dtype=torch.float64))


def test_converter_refuses_what_it_would_get_wrong():
    # Tied weights: converting one user would untie them (two parameters over one storage,
    # each updated by the optimizer).
    class _Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(40, 32), nn.Linear(32, 40, bias=False)
            self.head.weight = self.emb.weight

    with pytest.raises(ValueError, match=r"'head' is shared with \['emb.weight'\].*bitnet_filter"):
        convert_to_bitnet(_Tied(), [])
    # nn.MultiheadAttention reads out_proj.weight itself: it would stay a plain linear.
    mha = nn.Sequential(nn.MultiheadAttention(32, 4, batch_first=True))
    with pytest.raises(ValueError, match="'0.out_proj' belongs to an nn.MultiheadAttention"):
        convert_to_bitnet(mha, [])
    # A string filter is one fragment, not its characters ("w", "q").
    model = nn.ModuleDict({"wq": nn.Linear(32, 32), "w1": nn.Linear(32, 32)})
    assert convert_to_bitnet(model, "wq") == ["w1"]
    # Converting again changes nothing and says so (not "all excluded by the filter"),
    # unless asked for another backward.
    assert convert_to_bitnet(model, "wq") == ["w1"]
    with pytest.raises(ValueError, match="int8_backward=True; converting it again"):
        convert_to_bitnet(model, "wq", int8_backward=False)


@pytest.mark.parametrize("converters", [["bitnet", "quantize.linear.float8"],
                                        ["quantize.linear.mx", "bitnet"]])
def test_converter_refuses_another_linear_converter(converters):
    # Float8Linear / MXLinear would read the BitNet weight as a plain latent tensor.
    job = SimpleNamespace(lowbit=LowBit(), model=SimpleNamespace(converters=converters))
    with pytest.raises(ValueError, match=r"'bitnet' and \['quantize\.linear\..*BitNet would silently not apply"):
        CONVERTERS["bitnet"](job, SimpleNamespace(tp_enabled=False))
    # MoE grouped-mm converters touch no nn.Linear.
    job.model.converters = ["quantize.grouped_mm.float8", "bitnet"]
    CONVERTERS["bitnet"](job, SimpleNamespace(tp_enabled=False))


def test_a_replaced_weight_is_refused_not_trained_as_a_plain_linear():
    lin = nn.Linear(32, 32)
    convert_to_bitnet(nn.Sequential(lin), [])
    x = torch.randn(3, 32)
    # F.linear's own argument names reach the BitNet linear.
    w = lin.weight
    assert torch.equal(torch.nn.functional.linear(input=x, weight=w, bias=lin.bias), lin(x))
    with pytest.raises(ValueError, match="linear '0' takes 32 input features, got an input of shape \\(3, 31\\)"):
        lin(x[:, :31])
    plain = {k: v.detach().clone() for k, v in lin.state_dict().items()}
    lin.load_state_dict(plain)  # copies into the BitNet weight
    assert isinstance(lin.weight, BitNetTrainingWeight)
    lin.load_state_dict(plain, assign=True)  # replaces it with a plain tensor
    with pytest.raises(TypeError, match="linear '0' .*plain Parameter.*assign=False"):
        lin(x)
    with pytest.raises(TypeError, match="replaced after conversion"):
        torch.func.functional_call(lin, {"weight": torch.randn(32, 32), "bias": lin.bias}, (x,))


@pytest.mark.parametrize("keep_codes", [False, True])
def test_assigning_weight_data_replaces_the_latent_weight(keep_codes):
    model = nn.Sequential(nn.Linear(32, 32))
    convert_to_bitnet(model, [], keep_codes=keep_codes)
    lin, x = model[0], torch.randn(3, 32)
    model(x)  # (kept codes: computed for the old values)
    w = torch.randn(32, 32)
    lin.weight.data = w  # torch's setter alone would leave the latent weight as it was
    assert isinstance(lin.weight, BitNetTrainingWeight) and torch.equal(lin.weight._data, w)
    torch.testing.assert_close(model(x), ops.bitnet_linear_reference(x, w, lin.bias))
    lin.weight.data.mul_(2)  # .data still reads the latent weight (now w's storage)
    torch.testing.assert_close(model(x), ops.bitnet_linear_reference(x, w, lin.bias))
    assert torch.equal(lin.state_dict()["weight"], w)
    with pytest.raises(ValueError, match=r"weight.data = Tensor of torch.Size\(\[16, 32\]\).*copy_"):
        lin.weight.data = torch.randn(16, 32)


def _llama(n_layers=2, seed=0):
    from torchtitan.models.llama3.model.model import Transformer, TransformerModelArgs

    torch.manual_seed(seed)
    args = TransformerModelArgs(dim=64, n_layers=n_layers, n_heads=4, vocab_size=96, max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(args)
    return model


def _materialize(model, seed=0):
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model


def test_subln_inserts_norms_and_commutes_with_bitnet():
    a = _llama()
    insert_subln(a)
    convert_to_bitnet(a, ["output"])
    b = _llama()
    convert_to_bitnet(b, ["output"])
    insert_subln(b)
    _materialize(a), _materialize(b)
    block = a.layers["0"]
    assert isinstance(block.attention_norm, nn.Identity) and isinstance(block.ffn_norm, nn.Identity)
    norms = {n for n, _ in a.named_parameters() if "bitnet_input_norm" in n}
    assert len(norms) == 2 * 7  # wq wk wv wo w1 w2 w3 per block
    # init_weights reached the new norms through the removed block norms (meta -> ones).
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in a.named_parameters() if n in norms)
    assert isinstance(a.layers["1"].feed_forward.w2.weight, BitNetTrainingWeight)
    tokens = torch.randint(0, 96, (2, 16))
    torch.testing.assert_close(a(tokens), b(tokens))
    # The first linear sees its own RMSNorm of the block input.
    seen = {}
    block.attention.wq.register_forward_hook(lambda m, i, o: seen.setdefault("wq", i[0]))
    h = a.tok_embeddings(tokens)
    a(tokens)
    torch.testing.assert_close(seen["wq"], torch.nn.functional.rms_norm(h, (64,), eps=block.attention.wq.bitnet_input_norm.eps))


def test_subln_errors_are_clear():
    with pytest.raises(ValueError, match="no.*none|has none"):
        insert_subln(_Toy())
    model = _llama(1)
    insert_subln(model)
    with pytest.raises(ValueError, match="applied twice"):
        insert_subln(model)


def test_activation_checkpointing_and_compile_keep_values():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _materialize(_llama())
    insert_subln(model)
    convert_to_bitnet(model, ["output"])
    with torch.no_grad():
        model.init_weights()
    tokens = torch.randint(0, 96, (2, 16))

    def grads():
        model.zero_grad()
        out = model(tokens)
        out.float().square().mean().backward()
        return out.detach(), model.layers["0"].attention.wq.weight.grad.clone()

    y0, g0 = grads()
    plain = dict(model.layers.named_children())
    for name, blk in plain.items():
        model.layers.register_module(name, checkpoint_wrapper(blk, preserve_rng_state=False))
    y1, g1 = grads()
    for name, blk in plain.items():
        model.layers.register_module(name, torch.compile(blk, backend="aot_eager", fullgraph=True))
    y2, g2 = grads()
    torch.testing.assert_close(y1, y0)
    torch.testing.assert_close(g1, g0)
    torch.testing.assert_close(y2, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g2, g0, rtol=1e-4, atol=1e-6)


def test_optimizer_step_and_state_dict_keep_the_subclass(tmp_path):
    model = _Toy()
    convert_to_bitnet(model, ["output"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 50, (2, 6))).sum().backward()
    before = model.proj.weight._data.clone()
    opt.step()
    assert isinstance(model.proj.weight, BitNetTrainingWeight)
    assert not torch.equal(model.proj.weight._data, before)
    assert type(opt.state[model.proj.weight]["exp_avg"]) is torch.Tensor
    sd = model.state_dict()
    assert type(sd["proj.weight"]) is torch.Tensor  # checkpoints hold plain tensors
    torch.save(sd, tmp_path / "sd.pt")
    fresh = _Toy()
    convert_to_bitnet(fresh, ["output"])
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    assert isinstance(fresh.proj.weight, BitNetTrainingWeight)
    assert torch.equal(fresh.proj.weight._data, model.proj.weight._data)
    plain = _Toy()  # a BitNet checkpoint loads into the unconverted model too
    plain.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    assert torch.equal(plain.proj.weight, model.proj.weight._data)


def _twins(seed=0):
    """The same MLP converted with and without kept ternary codes."""
    kept, fresh = _mlp(seed), _mlp(seed)
    convert_to_bitnet(kept, [], keep_codes=True)
    convert_to_bitnet(fresh, [])
    return kept, fresh


def _expected_codes(w):
    return ops.quantize_weight_from_sum(w._data, torch._foreach_norm([w._data], 1, dtype=torch.float32)[0])


def test_kept_codes_are_the_weights_codes_and_change_nothing():
    kept, fresh = _twins()
    opt_k = torch.optim.AdamW(kept.parameters(), lr=1e-2, foreach=True)
    opt_f = torch.optim.AdamW(fresh.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(1)
    for step in range(3):
        x = torch.randn(2, 5, 48)
        y_k, y_f = kept(x), fresh(x)
        torch.testing.assert_close(y_k, y_f, rtol=0, atol=0)
        for w in (kept[0].weight, kept[2].weight):
            codes = w.ternary_codes()
            assert codes is not None, f"step {step}: no codes kept after the forward"
            for got, want in zip(codes, _expected_codes(w)):
                assert torch.equal(got, want)
        assert fresh[0].weight.ternary_codes() is None  # keep_codes=False keeps none
        y_k.square().sum().backward()
        y_f.square().sum().backward()
        for pk, pf in zip(kept.parameters(), fresh.parameters()):
            torch.testing.assert_close(pk.grad, pf.grad, rtol=0, atol=0)
        opt_k.step()
        opt_f.step()
        # torch's foreach step bumps no version counter: the step itself marks codes stale
        assert kept[0].weight.ternary_codes() is None
        opt_k.zero_grad()
        opt_f.zero_grad()


class _RawWriteOptimizer(torch.optim.Optimizer):
    """Writes the latent weight the way a fused kernel does: past torch's dispatch."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p._data.mul_(-1.0)


@pytest.mark.parametrize("edit", ["inplace_op", "data_attr", "load_state_dict", "state_dict_alias",
                                  "kernel_optimizer"])
def test_kept_codes_go_stale_when_the_weight_changes(edit):
    kept, fresh = _twins()
    x = torch.randn(3, 48)
    kept(x)
    w = kept[0].weight
    assert w.ternary_codes() is not None
    with torch.no_grad():
        if edit == "inplace_op":
            w.mul_(-1.0)
        elif edit == "data_attr":
            w.data.mul_(-1.0)
        elif edit == "load_state_dict":
            sd = {k: v.clone() for k, v in kept.state_dict().items()}
            sd["0.weight"].mul_(-1.0)
            kept.load_state_dict(sd)
        elif edit == "state_dict_alias":  # DCP loads in place into the state dict's tensors
            kept.state_dict()["0.weight"].mul_(-1.0)
        else:
            _RawWriteOptimizer([w]).step()
    assert w.ternary_codes() is None, f"{edit}: codes of the old values still reported"
    with torch.no_grad():
        fresh[0].weight._data.copy_(w._data)
    torch.testing.assert_close(kept(x), fresh(x), rtol=0, atol=0)
    assert w.ternary_codes() is not None


def test_kept_codes_see_a_write_through_a_state_dict_taken_before_the_forward():
    """The state_dict() starts a new generation, but the codes of that generation may be
    computed before the write into its aliases: the model's pre-hook sees the write by the
    latent tensor's version counter (the aliases are the latent tensors themselves)."""
    kept, fresh = _twins()
    x = torch.randn(3, 48)
    sd = kept.state_dict()
    kept(x)
    with torch.no_grad():
        sd["0.weight"].mul_(-1.0)
        fresh[0].weight._data.copy_(kept[0].weight._data)
    torch.testing.assert_close(kept(x), fresh(x), rtol=0, atol=0)


def test_converter_option_turns_kept_codes_on():
    model = _Toy()
    CONVERTERS["bitnet"](_job(), SimpleNamespace(tp_enabled=False)).convert(model)
    model(torch.randint(0, 50, (2, 6)))
    assert model.proj.weight.ternary_codes() is None  # off by default
    model = _Toy()
    CONVERTERS["bitnet"](_job(bitnet_keep_codes=True), SimpleNamespace(tp_enabled=False)).convert(model)
    model(torch.randint(0, 50, (2, 6)))
    assert model.proj.weight.ternary_codes() is not None


def test_compiled_layers_take_kept_codes_without_recompiling_each_step():
    from torch._dynamo.utils import counters

    kept, fresh = _twins()
    torch._dynamo.reset()
    counters.clear()
    for i in (0, 2):
        kept[i].compile(backend="aot_eager", fullgraph=True)
    opt_k = torch.optim.AdamW(kept.parameters(), lr=1e-2)
    opt_f = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    for _ in range(4):
        x = torch.randn(4, 48)
        y_k, y_f = kept(x), fresh(x)
        torch.testing.assert_close(y_k, y_f, rtol=1e-5, atol=1e-5)
        y_k.square().sum().backward()
        y_f.square().sum().backward()
        torch.testing.assert_close(kept[0].weight.grad, fresh[0].weight.grad, rtol=1e-4, atol=1e-5)
        opt_k.step()
        opt_f.step()
        opt_k.zero_grad()
        opt_f.zero_grad()
    # one graph per layer (the codes are graph inputs), not one per step
    assert counters["stats"]["unique_graphs"] == 2
    # a layer called while its codes are stale gets a graph that quantizes in the forward
    with torch.no_grad():
        kept[0].weight.mul_(0.5)
        fresh[0].weight.mul_(0.5)
    torch.testing.assert_close(kept[0](x), fresh[0](x), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 3


def test_post_optimizer_hook_refreshes_kept_codes():
    model = _Toy()
    conv = CONVERTERS["bitnet"](_job(bitnet_keep_codes=True), SimpleNamespace(tp_enabled=False))
    conv.convert(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 50, (2, 6))).sum().backward()
    w = model.proj.weight
    buffers = w.ternary_codes()
    opt.step()
    assert w.ternary_codes() is None
    conv.post_optimizer_hook([model])
    codes = w.ternary_codes()
    assert codes is not None
    assert all(a is b for a, b in zip(codes, buffers))  # rewritten in place
    for got, want in zip(codes, _expected_codes(w)):
        assert torch.equal(got, want)


def test_backward_holding_old_codes_raises_after_a_refresh():
    kept, _ = _twins()
    x = torch.randn(3, 48)
    y = kept(x)
    with torch.no_grad():
        kept[2].weight.mul_(0.5)
    from titan_lowbit.bitnet import refresh_ternary_codes
    assert refresh_ternary_codes(kept.parameters()) == 2
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
