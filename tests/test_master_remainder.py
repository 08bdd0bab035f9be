"""weight_update="master_remainder": the fp32 master weights of "master", held as the bf16
weight and an int16 remainder (2 bytes per element instead of 4).

* The encoding: the remainder is the master's low 16 bits, the weight its high half
  rounded to nearest by them with ties away from zero. Every non-NaN fp32 value round
  trips bit for bit (checked over all 2**16 remainders of a spread of bf16 values and
  every special one), the kernel's integer twins give the reference's bits, and the
  weight is a plain round-to-nearest-even cast everywhere but at exact ties (no 16 bits
  can hold the master next to a round-to-nearest-even weight: an even bf16 value is the
  rounding of 2**16 + 1 fp32 values). "master" rounds its weight the same way (ties away
  from zero, reference and kernel).
* Training: for every state format, on plain tensors (reference and interpreted kernel)
  and on DTensor shards (FSDP2's Shard(0), TP's Shard(1), two gloo processes), the
  weights, the rebuilt masters and all states equal "master"'s bit for bit, ties
  included; sharded training equals unsharded; a resume through torch.save or DCP
  continues bit for bit; a "master" checkpoint is refused by a "master_remainder" run
  and back, naming the setting.
"""

import io

import pytest
import torch
import torch.nn as nn

from conftest import run_on_gloo
from whole_tensors import whole
from titan_lowbit.kernels import adamw_lowbit as K
from titan_lowbit.kernels import adamw_lowbit_ref as R
from titan_lowbit.kernels import optim_jit as J
from titan_lowbit.optim import LowBitAdamW

FORMATS = ["fp32", "bf16", "8bit", "4bit", "fp8"]
MASTER_LOW = 0xFFFF
TIE = 0x8000


def _bits32(x):
    return x.contiguous().view(torch.int32)


def _bits16(x):
    return x.contiguous().view(torch.int16)


# A spread of bf16 values (bit patterns): zeros, subnormals (smallest, largest), the smallest
# normal, 1 and its neighbours, an even and an odd pattern, bf16's largest finite value,
# infinities, NaNs (quiet, signalling, all ones), each with both signs, and random ones.
SPECIAL_BF16 = [0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x0081, 0x3F7F, 0x3F80, 0x3F81, 0x4130, 0x4131,
                0x7F7E, 0x7F7F, 0x7F80, 0x7F81, 0x7FC0, 0x7FFF]


def _bf16_spread():
    gen = torch.Generator().manual_seed(0)
    pats = SPECIAL_BF16 + [p | 0x8000 for p in SPECIAL_BF16]
    pats += torch.randint(0, 2**16, (30,), generator=gen).tolist()
    return torch.tensor(sorted(set(pats)), dtype=torch.int64)


def _pairs():
    """Every (bf16 weight, int16 remainder) pair of the spread: weights [n * 2**16]."""
    hi = _bf16_spread()
    w = hi.repeat_interleave(2**16)
    r = torch.arange(-(2**15), 2**15, dtype=torch.int64).repeat(hi.numel())
    return R._as_int(w, torch.int16).view(torch.bfloat16), r.to(torch.int16)


def test_split_and_rebuild_are_exact_for_every_remainder_and_special_value():
    w, r = _pairs()
    x = R.master_rebuild(w, r)
    xb = _bits32(x).to(torch.int64)
    # the rebuild is bits(w) << 16 + r (r sign-extended), mod 2**32
    want = (((_bits16(w).to(torch.int64) & 0xFFFF) << 16) + r.to(torch.int64)) & 0xFFFFFFFF
    assert torch.equal(xb & 0xFFFFFFFF, want)
    nan = torch.isnan(x)
    w2, r2 = R.master_split(x)
    # every non-NaN fp32 value: split then rebuild is the identity, and so is rebuild then split
    assert torch.equal(_bits32(R.master_rebuild(w2, r2))[~nan], _bits32(x)[~nan])
    assert torch.equal(_bits16(w2)[~nan], _bits16(w)[~nan]) and torch.equal(r2[~nan], r[~nan])
    # the windows of these weights hold +-0, subnormals, bf16 overflow and infinities
    for v in (0.0, -0.0, 2.0**-149, -(2.0**-149), 3.3895e38, 3.4e38, float("inf"), -float("inf")):
        assert bool((_bits32(x) == _bits32(torch.tensor([v]))).any()), v
    # a NaN master gives a NaN weight (bf16's quiet NaN of its high half) that rebuilds as a NaN
    assert nan.any() and torch.isnan(w2[nan].float()).all()
    assert torch.isnan(R.master_rebuild(w2[nan], r2[nan])).all()
    want = ((_bits32(x[nan]).to(torch.int64) >> 16) | 0x40) & 0xFFFF  # sign kept, quieted
    assert torch.equal(_bits16(w2[nan]).to(torch.int64) & 0xFFFF, want)


def test_the_weight_is_the_nearest_bf16_value_and_round_to_nearest_even_off_ties():
    w, r = _pairs()
    x = R.master_rebuild(w, r)
    keep = ~torch.isnan(x)
    x, r = x[keep], r[keep]
    w2, _ = R.master_split(x)
    rne = R.bf16_rne(x)
    tie = (_bits32(x) & MASTER_LOW) == TIE
    assert tie.any()
    assert torch.equal(_bits16(w2)[~tie], _bits16(rne)[~tie])
    # at a tie both neighbours are nearest: the weight is the one away from zero
    hi = (_bits32(x)[tie].to(torch.int64) >> 16) & 0xFFFF
    assert torch.equal(_bits16(w2)[tie].to(torch.int64) & 0xFFFF, hi + 1)
    # fp32 values from the tie above bf16's largest finite value on round to inf, as the
    # cast does (the tie too: bf16's largest value is odd); just below it to the largest value
    big = torch.tensor([0x7F7F8000, 0x7F7FFFFF, -0x00800001, 0x7F7F7FFF], dtype=torch.int64).to(torch.int32)
    big = big.view(torch.float32)
    assert torch.equal(_bits16(R.master_split(big)[0]), _bits16(R.bf16_rne(big)))
    assert torch.isinf(R.master_split(big)[0][:3].float()).all() and int(_bits16(R.master_split(big)[0])[3]) == 0x7F7F
    assert torch.equal(_bits32(R.master_rebuild(*R.master_split(big))), _bits32(big))


def test_kernel_twins_give_the_reference_bits():
    """``_master_split`` / ``_master_rebuild`` (integer arithmetic, as on the GPU) against
    the reference on every pair of the spread, NaNs included."""
    import triton
    import triton.language as tl

    @triton.jit
    def twins(w_ptr, r_ptr, x_ptr, w2_ptr, r2_ptr, N: tl.constexpr):
        offs = tl.program_id(0) * N + tl.arange(0, N)
        x = J._master_rebuild(tl.load(w_ptr + offs), tl.load(r_ptr + offs))
        tl.store(x_ptr + offs, x)
        w2, r2 = J._master_split(x)
        tl.store(w2_ptr + offs, w2)
        tl.store(r2_ptr + offs, r2)

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w, r = _pairs()
    w, r = w.to(dev), r.to(dev)
    x, w2, r2 = torch.empty(w.shape, dtype=torch.float32, device=dev), torch.empty_like(w), torch.empty_like(r)
    n = 2**16 if K.interpreting() else 1024  # the interpreter: few programs of numpy arrays
    twins[(w.numel() // n,)](w, r, x, w2, r2, N=n)
    x_ref = R.master_rebuild(w.cpu(), r.cpu())
    w2_ref, r2_ref = R.master_split(x_ref)
    assert torch.equal(_bits32(x.cpu()), _bits32(x_ref))
    assert torch.equal(_bits16(w2.cpu()), _bits16(w2_ref)) and torch.equal(r2.cpu(), r2_ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_kernel_matches_reference(fmt):
    """One interpreted launch over ragged shapes against the reference, bit for bit, and
    with the non-finite guard (poisoned blocks keep weight and remainder)."""
    from adamw_kernel_cases import step_against_reference

    step_against_reference(fmt, torch.bfloat16, K.UPDATE_MASTER_REMAINDER, seed=1)
    if fmt in ("8bit", "fp32"):
        step_against_reference(fmt, torch.bfloat16, K.UPDATE_MASTER_REMAINDER, seed=5, guard=True)


# high halves of exact ties: zero, a subnormal, even and odd normal ones, bf16's largest (odd:
# its tie rounds to inf), each with both signs
TIE_HIGH = [0x0000, 0x0001, 0x3F80, 0x3F81, 0x4130, 0x7F7E, 0x7F7F]


@pytest.mark.parametrize("update", ["master", "master_remainder"])
@pytest.mark.parametrize("fused", [False, True], ids=["reference", "kernel"])
def test_the_weight_of_a_master_at_an_exact_tie_rounds_away_from_zero(update, fused):
    """Both fp32-master updates write the bf16 weight of a master exactly halfway between
    two bf16 values away from zero (a plain cast rounds to even, down for an even high
    half); a NaN master gives a NaN weight. Zero gradients and no weight decay: the step
    keeps the masters as they are and writes their weights."""
    dev = "cuda" if fused and torch.cuda.is_available() else "cpu"
    hi = torch.tensor(TIE_HIGH + [h | 0x8000 for h in TIE_HIGH], dtype=torch.int64)
    masters = R._as_int((hi << 16) | TIE, torch.int32).view(torch.float32)
    masters = torch.cat([masters, torch.tensor([float("nan")])]).to(dev)
    w = nn.Parameter(torch.zeros(masters.shape, dtype=torch.bfloat16, device=dev))
    # nonfinite_grad="ignore": the guard would leave the block of a NaN master (and of the
    # ties that round to inf) unwritten; this test is about the rounding itself.
    opt = LowBitAdamW([w], lr=1e-2, weight_decay=0.0, state_format="fp32", weight_update=update,
                      nonfinite_grad="ignore")
    if fused:
        opt._use_fused = lambda t: True
    w.grad = torch.zeros_like(w)
    opt.step()  # the state, its masters taken from the weights
    with torch.no_grad():
        if update == "master":
            opt.state[w]["master"].copy_(masters)
            w.fill_(1.0)  # only written
        else:
            wb, rem = R.master_split(masters.cpu())
            w.copy_(wb)
            opt.state[w]["master_remainder"].copy_(rem)
    opt.step()
    got = _bits16(w.detach().cpu()).to(torch.int64) & 0xFFFF
    assert torch.equal(got[:-1], hi + 1), [hex(v) for v in got.tolist()]  # one step up in magnitude
    assert torch.isnan(w[-1].float())
    assert not torch.equal(got[:-1], _bits16(R.bf16_rne(masters[:-1].cpu())).to(torch.int64) & 0xFFFF)


# ----------------------------------------------------------------------------------------
# the optimizer: master_remainder against master
# ----------------------------------------------------------------------------------------
SHAPES = [(3, 300), (64, 128), (5, 33), (7,)]  # the last two below min_quantized_numel: fp32 states
KW = dict(lr=1e-2, weight_decay=0.1, min_quantized_numel=500)


def _state_bits(v):
    v = whole(v)
    return v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v


def assert_same_as_master(opt_m, opt_r, params_m, params_r):
    """States, rebuilt masters and weights equal bit for bit; the weights are the masters
    rounded to nearest, ties away from zero."""
    for pm, pr in zip(params_m, params_r):
        sm, sr = opt_m.state[pm], opt_r.state[pr]
        assert set(sm) - {"master"} == set(sr) - {"master_remainder"}
        for k in sm:
            if k not in ("master", "step"):
                assert torch.equal(_state_bits(sm[k]), _state_bits(sr[k])), k
        assert float(sm["step"]) == float(sr["step"])
        master, wm, wr = whole(sm["master"]), whole(pm), whole(pr)
        assert torch.equal(_bits32(R.master_rebuild(wr, whole(sr["master_remainder"]))), _bits32(master))
        assert torch.equal(_bits16(wr), _bits16(R.bf16_away(master)))
        assert torch.equal(_bits16(wm), _bits16(wr))


def _params(seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16)) for s in shapes]


def _set_masters_with_ties(opt_m, opt_r, params_m, params_r, gen):
    """Give both optimizers the same fp32 masters, a tenth of them exact ties, "master" with
    the weights of a plain cast (round to nearest even: the step must rewrite those of the
    ties with an even high half) and "master_remainder" as it holds them."""
    for pm, pr in zip(params_m, params_r):
        bits = _bits32(opt_m.state[pm]["master"]).clone()
        tie = torch.rand(bits.shape, generator=gen) < 0.1
        bits[tie] = (bits[tie] & ~MASTER_LOW) | TIE
        master = bits.view(torch.float32)
        opt_m.state[pm]["master"].copy_(master)
        pm.data.copy_(R.bf16_rne(master))
        w, rem = R.master_split(master)
        pr.data.copy_(w)
        opt_r.state[pr]["master_remainder"].copy_(rem)


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_training_equals_master_bit_for_bit(fmt, fused):
    """The same gradients into both optimizers; after the first step the masters are set
    to values with exact ties, the second step (lr 0) keeps them and writes their weights,
    then more steps: weights, masters and states equal bit for bit, ties included."""
    if fused and not K.interpreting():  # the parameters are CPU tensors
        pytest.skip("the kernel runs on CPU tensors under TRITON_INTERPRET=1 only")
    # the interpreted kernel: one quantized (or plain) and one small tensor, a ragged launch each
    shapes = SHAPES[::2] if fused else SHAPES
    pm, pr = _params(shapes=shapes), _params(shapes=shapes)
    opt_m = LowBitAdamW(pm, state_format=fmt, weight_update="master", **KW)
    opt_r = LowBitAdamW(pr, state_format=fmt, weight_update="master_remainder", **KW)
    if fused:
        opt_m._use_fused = opt_r._use_fused = lambda t: True
    gen = torch.Generator().manual_seed(1)
    for step in range(3 if fused else 4):
        for a, b in zip(pm, pr):
            a.grad = torch.randn(a.shape, generator=gen).to(torch.bfloat16)
            b.grad = a.grad.clone()
        for opt in (opt_m, opt_r):
            opt.param_groups[0]["lr"] = 0.0 if step == 1 else KW["lr"]
            opt.step()
        if step == 0:  # the ties with an even high half: a plain cast's weights differ there
            _set_masters_with_ties(opt_m, opt_r, pm, pr, gen)
            assert not all(torch.equal(_bits16(a.detach()), _bits16(b.detach())) for a, b in zip(pm, pr))
            continue
        if step == 1:  # lr 0: the masters are still the ties, the weights written from them
            even_ties = [(_bits32(opt_m.state[a]["master"]) & 0x1FFFF) == TIE for a in pm]
            assert sum(int(t.sum()) for t in even_ties) > 10
        assert_same_as_master(opt_m, opt_r, pm, pr)


def test_state_bytes_per_param_are_two_less_than_master():
    for fmt in FORMATS:
        m = LowBitAdamW(_params(), state_format=fmt, weight_update="master", **KW).state_bytes_per_param()
        r = LowBitAdamW(_params(), state_format=fmt, weight_update="master_remainder", **KW).state_bytes_per_param()
        assert m - r == 2.0, (fmt, m, r)
    w = nn.Parameter(torch.zeros(4, 1024, dtype=torch.bfloat16))
    opt = LowBitAdamW([w], weight_update="master_remainder", min_quantized_numel=0)
    assert opt.state_bytes_per_param() == 2 + 8 / 256 + 2
    assert opt.state[w]["master_remainder"].dtype == torch.int16 and opt.state[w]["master_remainder"].shape == w.shape


def test_resume_through_torch_save_continues_bit_for_bit():
    gen = torch.Generator().manual_seed(2)
    grads = [[torch.randn(s, generator=gen).to(torch.bfloat16) for s in SHAPES] for _ in range(4)]

    def train(params, opt, steps):
        for gs in steps:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()

    kw = dict(state_format="8bit", weight_update="master_remainder", **KW)
    pa = _params()
    opt_a = LowBitAdamW(pa, **kw)
    train(pa, opt_a, grads[:2])
    buf = io.BytesIO()
    # each state tensor copied: the states are views of one buffer in several dtypes, which
    # torch.save refuses (issue 30 makes state_dict() itself saveable)
    sd = opt_a.state_dict()
    sd = {**sd, "state": {k: {n: v.clone() for n, v in st.items()} for k, st in sd["state"].items()}}
    torch.save({"params": [p.detach() for p in pa], "optim": sd}, buf)
    train(pa, opt_a, grads[2:])
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    pb = [nn.Parameter(t.clone()) for t in saved["params"]]
    opt_b = LowBitAdamW(pb, **kw)
    opt_b.load_state_dict(saved["optim"])
    train(pb, opt_b, grads[2:])
    for a, b in zip(pa, pb):
        assert torch.equal(_bits16(a.detach()), _bits16(b.detach()))
        for k in opt_a.state[a]:
            assert torch.equal(_state_bits(opt_a.state[a][k]), _state_bits(opt_b.state[b][k])), k


@pytest.mark.parametrize("saved,loading", [("master", "master_remainder"), ("master_remainder", "master")])
def test_a_checkpoint_of_the_other_master_layout_is_refused_naming_the_setting(saved, loading, tmp_path):
    """load_state_dict (torch.save path) and titan_lowbit's checkpoint layout check (DCP
    path, before torchtitan's load) both name weight_update and the value to resume with."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.optimizer import OptimizersContainer

    from titan_lowbit.torchtitan import checkpoint_layout

    kw = dict(state_format="8bit", **KW)
    src = LowBitAdamW(_params(), weight_update=saved, **kw)
    dst = LowBitAdamW(_params(), weight_update=loading, **kw)
    with pytest.raises(ValueError, match=f"saved with weight_update='{saved}'.*built with weight_update='{loading}'"):
        dst.load_state_dict(src.state_dict())

    model = nn.Linear(64, 64).to(torch.bfloat16)
    make = lambda update: OptimizersContainer([model], LowBitAdamW, dict(kw, weight_update=update))  # noqa: E731
    dcp.save({"optimizer": make(saved)}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(checkpoint_layout.CheckpointMismatch, match=f'lowbit\\] weight_update = "{saved}"'):
        checkpoint_layout.check_compatible({"optimizer": make(loading)}, str(tmp_path))


def test_the_toml_option_reaches_the_optimizer_and_the_start_up_line():
    """[lowbit] weight_update = "master_remainder" parses, the builder passes it to every
    optimizer, and the start-up line shows the state bytes per parameter (2 below master's)."""
    from conftest import parse_job_config
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import Optimizer as OptimizerConfig

    from conftest import DEBUG_CONFIG
    from titan_lowbit.config import LowBit
    from titan_lowbit.torchtitan.optimizer_builder import build_lowbit_optimizers, describe

    cfg = parse_job_config("--job.config_file", str(DEBUG_CONFIG), "--lowbit.weight_update", "master_remainder")
    assert cfg.lowbit.weight_update == "master_remainder"
    lines = {}
    for update in ("master", "master_remainder"):
        model = nn.Linear(256, 256).to(torch.bfloat16)
        opts = build_lowbit_optimizers([model], OptimizerConfig(name="AdamW8bit"), None,
                                       lowbit=LowBit(weight_update=update), seed=0, base_builder=build_optimizers)
        assert all(g["weight_update"] == update for opt in opts for g in opt.param_groups)
        lines[update] = describe(opts, "AdamW8bit", LowBit(weight_update=update), [])
    assert "bf16 update master_remainder; optimizer state 4.0" in lines["master_remainder"], lines
    assert "bf16 update master; optimizer state 6.0" in lines["master"], lines


# ----------------------------------------------------------------------------------------
# FSDP2 / TP on two gloo processes
# ----------------------------------------------------------------------------------------
WORLD = 2


def _scenarios(rank):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    kw = dict(lr=1e-2, weight_decay=0.1, weight_update="master_remainder", min_quantized_numel=1000)
    res = {}

    # the FSDP2 tests' bf16 model (35 rows a rank, ragged blocks) and training loop
    from conftest import sharded_small_model, small_bf16_model, train_mean_square as train

    def sharded_model():
        return sharded_small_model(mesh)

    torch.manual_seed(1)
    xs = [torch.randn(4, 300).to(torch.bfloat16) for _ in range(5)]

    # FSDP2 training (the model's own gradients): 2 processes equal 1 process, every format;
    # the remainder states are DTensors placed like their parameters.
    res["sharded_equal"] = {}
    for fmt in FORMATS:
        ref, sh = small_bf16_model(), sharded_model()
        opt_ref = LowBitAdamW(list(ref.named_parameters()), state_format=fmt, **kw)
        opt_sh = LowBitAdamW(list(sh.named_parameters()), state_format=fmt, **kw)
        train(ref, opt_ref, xs[:3])
        train(sh, opt_sh, xs[:3])
        res["sharded_equal"][fmt] = all(
            torch.equal(ps.full_tensor(), pr.detach())
            and torch.equal(_state_bits(opt_sh.state[ps]["master_remainder"]), opt_ref.state[pr]["master_remainder"])
            for ps, pr in zip(sh.parameters(), ref.parameters()))
        if fmt == "8bit":
            rem = opt_sh.state[sh[0].weight]["master_remainder"]
            res["placements"] = (type(rem).__name__, str(rem.placements), tuple(rem.shape),
                                 tuple(rem._local_tensor.shape), rem.dtype)
            # DCP's optimizer state dict round trip into a fresh optimizer, then on: as uninterrupted
            osd = get_optimizer_state_dict(sh, opt_sh)
            fresh = LowBitAdamW(list(sh.named_parameters()), state_format=fmt, **kw)
            set_optimizer_state_dict(sh, fresh, optim_state_dict=osd)
            train(ref, opt_ref, xs[3:])
            train(sh, fresh, xs[3:])
            res["resume_equal"] = all(
                torch.equal(ps.full_tensor(), pr.detach())
                and all(torch.equal(_state_bits(fresh.state[ps][k]), _state_bits(opt_ref.state[pr][k]))
                        for k in opt_ref.state[pr])
                for ps, pr in zip(sh.parameters(), ref.parameters()))

    # FSDP2's Shard(0) and TP's Shard(1) parameters with the same gradients: master_remainder
    # equals master (interpreted kernel), every format.
    res["vs_master"] = {}
    for fmt in FORMATS:
        torch.manual_seed(4)
        fulls = [torch.randn(6, 384).to(torch.bfloat16), torch.randn(4, 1024).to(torch.bfloat16)]
        places = [[Shard(0)], [Shard(1)]]

        def params():
            return [nn.Parameter(distribute_tensor(f.clone(), mesh, pl)) for f, pl in zip(fulls, places)]

        pm, pr = params(), params()
        opt_m = LowBitAdamW(pm, **dict(kw, weight_update="master", min_quantized_numel=0), state_format=fmt)
        opt_r = LowBitAdamW(pr, **dict(kw, min_quantized_numel=0), state_format=fmt)
        if K.interpreting():  # the kernel on CPU tensors
            opt_m._use_fused = opt_r._use_fused = lambda t: True
        for _ in range(2):
            for a, b, f, pl in zip(pm, pr, fulls, places):
                g = torch.randn(f.shape).to(torch.bfloat16)  # same on both ranks (seeded above)
                a.grad = distribute_tensor(g, mesh, pl)
                b.grad = distribute_tensor(g.clone(), mesh, pl)
            opt_m.step()
            opt_r.step()
        try:
            assert_same_as_master(opt_m, opt_r, pm, pr)
            res["vs_master"][fmt] = True
        except AssertionError as e:
            res["vs_master"][fmt] = str(e)
    return res


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return run_on_gloo(_scenarios, WORLD, tmp_path_factory.mktemp("master_remainder") / "results.pt")


def test_fsdp2_training_equals_one_process_for_every_format(gloo_results):
    assert gloo_results["sharded_equal"] == {fmt: True for fmt in FORMATS}
    assert gloo_results["placements"] == ("DTensor", "(Shard(dim=0),)", (70, 300), (35, 300), torch.int16)


def test_fsdp2_dcp_state_dict_round_trip_resumes_bit_for_bit(gloo_results):
    assert gloo_results["resume_equal"]


def test_dtensor_shards_equal_master_bit_for_bit(gloo_results):
    assert gloo_results["vs_master"] == {fmt: True for fmt in FORMATS}
