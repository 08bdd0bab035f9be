"""Optimizer states converted between layouts on request, never silently.

``titan_lowbit.optim.convert_state_dict`` (any loop) and ``[lowbit]
convert_optimizer_states`` (torchtitan 0.2 line) take a state dict or checkpoint of one
layout (torch's Adam/AdamW, or LowBitAdamW with another state format, block size, BF16
update rule or threshold) into another: each moment is dequantized to fp32 and quantized
once in the new format, the step kept, master weights taken from the source's. Without
them, a state of another layout is refused, naming the way to convert it.
"""

import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import SAVE_STEP, resume_folder, run_train, step_losses, stopped_run
from optimizer_container_cases import Container, Tiny, build, step
from test_train_e2e import VARIANTS, run_overrides
from titan_lowbit.kernels.adamw_lowbit_ref import bf16_away, master_rebuild
from titan_lowbit.optim import LowBitAdamW, convert_state_dict
from titan_lowbit.torchtitan.checkpoint_layout import CheckpointMismatch, check_compatible
from titan_lowbit.torchtitan.checkpoint_convert import load_converted, saved_dtype_weights
from titan_lowbit.torchtitan.train_spec import cast_parameters

SHAPES = ((64, 300), (16,))  # a quantized weight (rows of 300: a short last block), a small one
NAMES = ("w", "b")


def params(dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def train(optimizer, ps, steps: int = 3, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        optimizer.step()


def lowbit(ps, **kw) -> LowBitAdamW:
    return LowBitAdamW(list(zip(NAMES, ps)), min_quantized_numel=100, **kw)


def moments(optimizer, p) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 moments of ``p`` as ``optimizer`` holds them (through an export to torch's)."""
    exported = torch.optim.AdamW([q for g in optimizer.param_groups for q in g["params"]])
    exported.load_state_dict(convert_state_dict(optimizer.state_dict(), to=exported))
    return exported.state[p]["exp_avg"], exported.state[p]["exp_avg_sq"]


def test_torch_adamw_state_into_8bit_and_back_is_one_quantization_of_each_moment():
    ps = params()
    torch_adamw = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    train(torch_adamw, ps)
    saved = torch_adamw.state_dict()

    eight = lowbit(ps, lr=1e-3, state_format="8bit")
    with pytest.raises(ValueError, match=r"convert a torch Adam/AdamW state dict explicitly: "
                                         r"optimizer\.load_state_dict\(titan_lowbit\.optim\.convert_state_dict"):
        eight.load_state_dict(saved)  # never silently
    eight.load_state_dict(convert_state_dict(saved, to=eight))
    group = eight.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["state_format"]) == (1e-2, 0.1, "8bit")
    for p in ps:
        assert float(eight.state[p]["step"]) == 3.0
        m, v = moments(eight, p)
        want_m, want_v = torch_adamw.state[p]["exp_avg"], torch_adamw.state[p]["exp_avg_sq"]
        # 8-bit dynamic tree: within a few percent of each block's absmax (the small
        # parameter keeps fp32 states: exact)
        assert (m - want_m).abs().max() <= 0.02 * want_m.abs().max(), p.shape
        assert (v - want_v).abs().max() <= 0.02 * want_v.abs().max(), p.shape
        if p.numel() < 100:
            assert torch.equal(m, want_m) and torch.equal(v, want_v)
    train(eight, ps, 1)  # the converted state steps

    # Exported back to torch's AdamW: torch's load takes it as its own.
    again = torch.optim.AdamW(ps, lr=5.0)
    again.load_state_dict(convert_state_dict(eight.state_dict(), to=again))
    assert again.param_groups[0]["lr"] == 1e-2 and float(again.state[ps[0]]["step"]) == 4.0
    train(again, ps, 1)


def test_layouts_convert_into_each_other_and_the_same_layout_is_lossless():
    ps = params()
    eight = lowbit(ps, state_format="8bit")
    train(eight, ps)
    same = lowbit(ps, state_format="8bit", block_size=256)  # block 0 is the default, 256
    same.load_state_dict(convert_state_dict(eight.state_dict(), to=same))
    for p in ps:
        for key, value in eight.state[p].items():
            assert torch.equal(same.state[p][key], value), key  # dequantized, requantized: the same codes
    for kw in (dict(state_format="4bit"), dict(state_format="fp8", block_size=64),
               dict(state_format="fp32"), dict(state_format="8bit", min_quantized_numel=10)):
        other = LowBitAdamW(list(zip(NAMES, ps)), **{"min_quantized_numel": 100, **kw})
        with pytest.raises(ValueError, match="or convert the states into this optimizer's layout"):
            other.load_state_dict(eight.state_dict())
        other.load_state_dict(convert_state_dict(eight.state_dict(), to=other))
        m, _ = moments(other, ps[0])
        want, _ = moments(eight, ps[0])
        assert (m - want).abs().max() <= 0.15 * want.abs().max(), kw  # 4-bit: coarsest
        train(other, ps, 1)


@pytest.mark.parametrize("source", ["master", "master_remainder", "kahan", "nearest"])
def test_master_weights_are_carried_or_built_from_the_weights(source):
    ps = params(torch.bfloat16)
    before = lowbit(ps, state_format="8bit", weight_update=source)
    train(before, ps)
    if source == "master":
        master = before.state[ps[0]]["master"]
    elif source == "master_remainder":
        master = master_rebuild(ps[0].detach(), before.state[ps[0]]["master_remainder"])
    else:
        master = ps[0].detach().float() + (before.state[ps[0]]["kahan_comp"].float()
                                           if source == "kahan" else 0)
    for target in ("master", "master_remainder", "kahan"):
        after = lowbit(ps, state_format="4bit", weight_update=target)
        after.load_state_dict(convert_state_dict(before.state_dict(), to=after))
        state = after.state[ps[0]]
        if target == "master":
            assert torch.equal(state["master"], master)
        elif target == "master_remainder" and source != "kahan":
            assert torch.equal(master_rebuild(ps[0].detach(), state["master_remainder"]), master)
        elif target == "kahan":
            held = ps[0].detach().float() + state["kahan_comp"].float()
            assert (held - master).abs().max() <= 2 ** -8 * (master - ps[0].detach().float()).abs().max()


def test_conversions_refused_naming_why():
    ps = params()
    eight = lowbit(ps)
    with pytest.raises(ValueError, match=r"param groups of \[2\] parameters, the optimizer to convert into \[1\]"):
        convert_state_dict(eight.state_dict(), to=lowbit(ps[:1]))
    torch_amsgrad = torch.optim.AdamW(ps, amsgrad=True)
    train(torch_amsgrad, ps, 1)
    with pytest.raises(ValueError, match="param 'w': the state dict holds amsgrad's max_exp_avg_sq"):
        convert_state_dict(torch_amsgrad.state_dict(), to=eight)
    # Muon's momentum is no AdamW moment: a LowBitMuon's state dict, or one as the target, is refused
    from titan_lowbit.optim import LowBitMuon

    mat = [torch.nn.Parameter(torch.randn(64, 300))]
    muon = LowBitMuon([("layer.w", mat[0])], state_format="8bit", min_quantized_numel=100)
    train(muon, mat, 1)
    with pytest.raises(ValueError, match="the state dict is a LowBitMuon's .* Muon's momentum has no AdamW"):
        convert_state_dict(muon.state_dict(), to=lowbit(mat))
    with pytest.raises(ValueError, match="the optimizer to convert into is a LowBitMuon's"):
        convert_state_dict(lowbit(mat[:1]).state_dict(), to=muon)


def test_fp32_weights_become_bf16_weights_and_their_exact_master_and_back():
    """fp32 weights and torch's AdamW state, converted with the weights into bf16
    parameters of a master_remainder update: the remainder and the bf16 weight rebuild
    the fp32 weight bit for bit, the weight is it rounded to nearest; back into fp32
    parameters of torch's AdamW, the weights are the master exactly."""
    fp32 = params()
    torch_adamw = torch.optim.AdamW(fp32, lr=1e-2)
    train(torch_adamw, fp32)
    bf16 = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in fp32]  # a plain cast: ties to even
    for update in ("master", "master_remainder"):
        run = lowbit(bf16, weight_update=update)
        run.load_state_dict(convert_state_dict(torch_adamw.state_dict(), to=run,
                                               weights=dict(zip(bf16, fp32))))
        for p, w in zip(bf16, fp32):
            assert torch.equal(p.detach(), bf16_away(w.detach()))
            held = (run.state[p]["master"] if update == "master"
                    else master_rebuild(p.detach(), run.state[p]["master_remainder"]))
            assert torch.equal(held.view(torch.int32), w.detach().view(torch.int32))
    train(run, bf16, 2)
    masters = [master_rebuild(p.detach(), run.state[p]["master_remainder"]) for p in bf16]
    back = [torch.nn.Parameter(torch.zeros_like(w)) for w in fp32]
    again = torch.optim.AdamW(back)
    again.load_state_dict(convert_state_dict(run.state_dict(), to=again, weights=dict(zip(back, bf16))))
    for p, master in zip(back, masters):
        assert torch.equal(p.detach().view(torch.int32), master.view(torch.int32))
    assert float(again.state[back[0]]["step"]) == 5.0


@pytest.mark.parametrize("source,target,why", [
    ("fp32", "stochastic", "the bf16 weights would be updated by weight_update 'stochastic', which keeps "
                           "no fp32 master"),
    ("kahan", "fp32", "the bf16 weights were updated by weight_update 'kahan', which kept no fp32 master"),
])
def test_weight_dtype_changes_without_a_master_are_refused(source, target, why):
    if source == "fp32":
        saved = params()
        optimizer = torch.optim.AdamW(saved)
    else:
        saved = params(torch.bfloat16)
        optimizer = lowbit(saved, weight_update=source)
    train(optimizer, saved, 1)
    dtype = torch.float32 if target == "fp32" else torch.bfloat16
    run_params = [torch.nn.Parameter(p.detach().to(dtype)) for p in saved]
    run = (torch.optim.AdamW(run_params) if target == "fp32"
           else lowbit(run_params, weight_update=target))
    before = [p.detach().clone() for p in run_params]
    name = "w" if target != "fp32" else "param_groups[0]['params'][0] (shape (64, 300))"
    with pytest.raises(ValueError, match=re.escape(f"param '{name}': weights saved in {saved[0].dtype}, "
                                                   f"converted into {dtype}: {why}")):
        convert_state_dict(optimizer.state_dict(), to=run, weights=dict(zip(run_params, saved)))
    assert all(torch.equal(p, b) for p, b in zip(run_params, before))  # nothing set


def dcp_checkpoint(path, model, container) -> None:
    """A one-process DCP checkpoint of ``model``'s weights and ``container``'s states."""
    dcp.save({"optimizer": container.state_dict(), **model.state_dict()}, checkpoint_id=str(path))


def resume_converting(path, model, container, convert=True):
    """What the resume of titan_lowbit's CheckpointManager does, on one process: check,
    load the model (the weights that change dtype in the checkpoint's), then the states
    converted. Returns the conversion's log lines."""
    state_dict = {"optimizer": container, **model.state_dict()}
    conversion = check_compatible(state_dict, str(path), convert=convert)
    weights = saved_dtype_weights(state_dict, conversion)
    rest = {k: weights.get(k, v) for k, v in state_dict.items() if k != "optimizer"}
    dcp.load(rest, checkpoint_id=str(path))
    model.load_state_dict(rest)
    return load_converted(container, str(path), conversion, weights)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_checkpoint_of_fp32_weights_resumes_as_bf16_with_master_remainder_and_back(tmp_path):
    """torch AdamW and fp32 weights -> AdamW8bit, bf16 weights + master_remainder: the
    master rebuilds each fp32 weight bit for bit; refused without the switch, and into a
    stochastic update; then that run's checkpoint back into fp32 weights, the masters."""
    model = Tiny()
    saved_run = build(model, name="AdamW")
    step(saved_run, model)
    dcp_checkpoint(tmp_path / "fp32", model, Container(model, saved_run))
    fp32 = {k: v.detach().clone() for k, v in model.state_dict().items()}

    bf16_model = Tiny()
    cast_parameters(bf16_model, torch.bfloat16)
    for update, convert, match in (
            ("master_remainder", False, r"parameter tok_embeddings.weight: checkpoint holds torch.float32, "
                                        r"this run torch.bfloat16 \(5 more\)\. Set \[lowbit\] weight_dtype .*"
                                        r"with \[lowbit\] convert_optimizer_states = true"),
            ("stochastic", True, r"checkpoint holds torch.float32, this run torch.bfloat16 \(5 more\)\. the bf16 "
                                 r"weights would be updated by weight_update 'stochastic'")):
        other = Container(bf16_model, build(bf16_model, weight_dtype="bfloat16", weight_update=update))
        with pytest.raises(CheckpointMismatch, match=match):
            check_compatible({"optimizer": other, **bf16_model.state_dict()}, str(tmp_path / "fp32"),
                             convert=convert)
    run = Container(bf16_model, build(bf16_model, weight_dtype="bfloat16", weight_update="master_remainder"))
    lines = resume_converting(tmp_path / "fp32", bf16_model, run)
    assert lines[-1] == ("weight dtype torch.float32 -> torch.bfloat16 (6 parameters): the fp32 weights kept "
                         "exactly as master weights, the bf16 weights their rounding to nearest"), lines
    [opt] = run.optimizers
    for name, p in bf16_model.named_parameters():
        assert torch.equal(p.detach(), bf16_away(fp32[name])), name
        master = master_rebuild(p.detach(), opt.state[p]["master_remainder"])
        assert torch.equal(master.view(torch.int32), fp32[name].view(torch.int32)), name
        assert float(opt.state[p]["step"]) == 2.0

    step(opt, bf16_model)
    masters = {n: master_rebuild(p.detach(), opt.state[p]["master_remainder"])
               for n, p in bf16_model.named_parameters()}
    dcp_checkpoint(tmp_path / "bf16", bf16_model, run)
    back_model = Tiny()
    back = Container(back_model, build(back_model))  # AdamW8bit, fp32 weights
    lines = resume_converting(tmp_path / "bf16", back_model, back)
    assert lines[-1].startswith("weight dtype torch.bfloat16 -> torch.float32 (6 parameters): the fp32 "
                                "weights are the checkpoint's master weights, exactly"), lines
    for name, p in back_model.named_parameters():
        assert torch.equal(p.detach().view(torch.int32), masters[name].view(torch.int32)), name


@pytest.mark.trainer
def test_torchtitan_resume_converts_on_request_and_continues_without_a_loss_jump(
        two_process_checkpoint, tmp_path):
    """The fixture (AdamW4bit, bf16 weights + master) resumed at step SAVE_STEP as
    AdamW8bit with master_remainder and the embeddings in fp32 states: refused by default,
    naming the key and the selection; converted with it, one log line per change, and
    steps SAVE_STEP + 1, + 2 close to the unconverted run's (its 4-bit states held the
    same moments less exactly)."""
    dump, full, overrides = two_process_checkpoint
    change = ("--optimizer.name", "AdamW8bit", "--lowbit.weight_update", "master_remainder",
              "--lowbit.fp32_states", "tok_embeddings", "--training.steps", str(SAVE_STEP + 2))
    out = stopped_run(*overrides, "--job.dump_folder", str(resume_folder(tmp_path / "plain",
                                                                       dump / "checkpoint")), *change)
    assert "--lowbit.convert_optimizer_states" in out, out[-3000:]
    assert ("[lowbit] fp32_states gave fp32 states to no parameter in the checkpoint, to 1 parameter "
            "['tok_embeddings.weight'] in this run") in out, out[-3000:]

    resumed = resume_folder(tmp_path / "converted", dump / "checkpoint")
    proc = run_train(*overrides, "--job.dump_folder", str(resumed), *change,
                     "--lowbit.convert_optimizer_states")
    lines = [line for line in proc.stdout.splitlines() if "optimizer states converted" in line]
    assert len(lines) == 4, proc.stdout[-3000:]
    for text, line in zip(("state_format '4bit' -> '8bit'", "block_size 128 -> 256",
                           "weight_update 'master' -> 'master_remainder'",
                           "fp32_states: into fp32 states ['tok_embeddings.weight'], out of them none"), lines):
        assert text in line, (text, lines)
    assert_no_loss_jump(step_losses(proc.stdout), full, SAVE_STEP)


def assert_no_loss_jump(resumed: dict, full: dict, saved_at: int) -> None:
    """The first resumed step's loss is the uninterrupted run's (the same weights: it is
    computed before the first step with converted states); the next is within 1e-3."""
    assert sorted(resumed) == [saved_at + 1, saved_at + 2], resumed
    assert resumed[saved_at + 1] == full[saved_at + 1], (resumed, full)
    assert abs(float(resumed[saved_at + 2]) - float(full[saved_at + 2])) <= 1e-3, (resumed, full)


@pytest.mark.trainer
def test_torch_adamw_checkpoint_resumes_as_adamw8bit_with_bf16_weights_on_request(tmp_path, shared_run):
    """A run of torch's AdamW (fp32 states and weights; test_train_e2e's, 4 steps, saved at
    step 2) resumed as AdamW8bit with bf16 weights and master_remainder: the states are
    taken into 8 bits, the fp32 weights into bf16 ones and their remainders (under FSDP2,
    2 processes), and training continues as the AdamW run does, less what bf16 weights
    change in the forward."""
    (torch_adamw,) = [v for v in VARIANTS if v[0] == "AdamW"]
    overrides = run_overrides(*torch_adamw)
    dump, first = shared_run(*overrides)
    full = step_losses(first.stdout)
    resumed = resume_folder(tmp_path, dump / "checkpoint", 2)
    proc = run_train(*overrides, "--job.dump_folder", str(resumed), "--optimizer.name", "AdamW8bit",
                     "--lowbit.weight_dtype", "bfloat16", "--lowbit.weight_update", "master_remainder",
                     "--lowbit.convert_optimizer_states")
    lines = [line for line in proc.stdout.splitlines() if "optimizer states converted" in line]
    assert len(lines) == 2, proc.stdout[-3000:]
    assert "optimizer 'torch Adam/AdamW (fp32 or parameter-dtype moments)' -> 'titan_lowbit' " \
        "(state_format='8bit', block_size=256, weight_update='master_remainder', " \
        "min_quantized_numel=4096)" in lines[0], lines
    assert "weight dtype torch.float32 -> torch.bfloat16 (" in lines[1], lines
    losses = step_losses(proc.stdout)
    assert sorted(losses) == [3, 4], losses
    for s in (3, 4):  # the forward in bf16 weights: close to the fp32 run's, not equal
        assert abs(float(losses[s]) - float(full[s])) <= 1e-2, (losses, full)
