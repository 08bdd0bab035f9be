"""The Muon names on the torchtitan 0.2 line (``[optimizer] name = "Muon8bit"`` ...),
without a Trainer: what the builder makes of ``[optimizer]`` and ``[lowbit]``, what it
refuses, the start-up line, and a checkpoint of a Muon name compared with the run's
optimizer before DCP loads it (a DCP checkpoint of one process).

The Trainer run (trains, resumes bit for bit) extends tests/test_train_e2e.py.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from types import SimpleNamespace

from titan_lowbit.config import LowBit
from titan_lowbit.optim import LowBitMuon
from titan_lowbit.torchtitan.checkpoint_layout import CheckpointMismatch, check_compatible
from titan_lowbit.torchtitan.unrecorded_options import UnrecordedOptions, unrecorded_entries
from titan_lowbit.torchtitan.optimizer_builder import describe, valid_optimizer_names

from optimizer_container_cases import Container, Tiny, build, step


def only(container):
    [opt] = list(container)
    return opt


def split(opt) -> dict[str, bool]:
    """{parameter name: whether Muon steps it}."""
    return {n: g["use_muon"] for g in opt.param_groups for n in g["param_names"]}


def test_muon_names_build_lowbit_muon_with_the_optimizer_and_lowbit_settings():
    for name in ("Muon", "Muon8bit", "Muon4bit", "MuonFp8"):
        assert name in valid_optimizer_names()
    model = Tiny()
    opt = only(build(model, "Muon4bit", weight_update="nearest", block_size=64))
    assert isinstance(opt, LowBitMuon)
    assert split(opt) == {"layers.0.wq.weight": True, "tok_embeddings.weight": False,
                          "layers.0.attention_norm.weight": False, "layers.0.wq.bias": False,
                          "norm.weight": False, "output.weight": False}
    muon, adamw = opt.param_groups
    assert muon["momentum"] == LowBit().muon_momentum == 0.95  # LowBitMuon's own default
    assert muon["momentum_4bit_levels"] == LowBit().muon_4bit_levels == "nf4"
    assert muon["momentum_4bit_factor_rank"] == LowBit().muon_4bit_factor_rank == 0
    # [optimizer] betas and eps go to the inner AdamW; lr, weight decay and the layout to both
    from torchtitan.config import Optimizer as OptimizerConfig
    torchtitan = OptimizerConfig()
    assert adamw["betas"] == (torchtitan.beta1, torchtitan.beta2) and adamw["eps"] == torchtitan.eps
    for group in (muon, adamw):
        assert (group["lr"], group["weight_decay"]) == (1e-2, torchtitan.weight_decay)
        assert (group["state_format"], group["block_size"]) == ("4bit", 64)
    # the [lowbit] Muon keys
    opt = only(build(model, "Muon8bit", muon_momentum=0.9, muon_adamw_fqns=["tok_embeddings"]))
    assert opt.param_groups[0]["momentum"] == 0.9
    assert only(build(model, "Muon4bit", muon_4bit_levels="dynamic")).param_groups[0]["momentum_4bit_levels"] == "dynamic"
    factored = only(build(model, "Muon4bit", muon_4bit_factor_rank=4))
    assert factored.param_groups[0]["momentum_4bit_factor_rank"] == 4
    assert factored.state[model.layers["0"].wq.weight]["momentum_buffer_row_factor"].shape == (64, 4)
    fp32_wq = only(build(model, "Muon4bit", muon_4bit_levels="dynamic", fp32_states=["wq.weight"]))
    assert [(g["state_format"], g["momentum_4bit_levels"]) for g in fp32_wq.param_groups if g["use_muon"]] == [
        ("fp32", "dynamic")]  # its one matrix keeps an fp32 momentum; the levels wait unused
    assert split(opt)["output.weight"] is True and split(opt)["tok_embeddings.weight"] is False
    # fp32_states: the selected parameters' Muon momentum and AdamW moments in fp32
    opt = only(build(model, "Muon8bit", fp32_states=["tok_embeddings", "wq.weight"]))
    formats = {(g["use_muon"], g["state_format"]): g["param_names"] for g in opt.param_groups}
    assert formats[(True, "fp32")] == ["layers.0.wq.weight"]
    assert "tok_embeddings.weight" in formats[(False, "fp32")] and (True, "8bit") not in formats


@pytest.mark.parametrize("name,lowbit,extra,match", [
    ("AdamW8bit", dict(muon_momentum=0.9), {}, r"\[lowbit\] muon_momentum set, but \[optimizer\] name = "
                                               r"'AdamW8bit' is not a Muon optimizer"),
    ("AdamW", dict(muon_adamw_fqns=["output"]), {}, r"\[lowbit\] muon_adamw_fqns set, .* Muon8bit"),
    ("AdamW4bit", dict(muon_4bit_levels="dynamic"), {}, r"\[lowbit\] muon_4bit_levels set, .* not a Muon optimizer"),
    ("Muon8bit", dict(muon_4bit_levels="dynamic"), {}, r"\[lowbit\] muon_4bit_levels = 'dynamic' sets the levels of "
                                                       r"a 4-bit momentum, but \[optimizer\] name = 'Muon8bit' keeps "
                                                       r"a 8bit one. Choose Muon4bit"),
    ("AdamW4bit", dict(muon_4bit_factor_rank=8), {}, r"\[lowbit\] muon_4bit_factor_rank set, .* not a Muon "
                                                       r"optimizer"),
    ("MuonFp8", dict(muon_4bit_factor_rank=8), {}, r"\[lowbit\] muon_4bit_factor_rank = 8 keeps a factor beside a "
                                                    r"4-bit momentum, but \[optimizer\] name = 'MuonFp8' keeps a fp8 "
                                                    r"one. Choose Muon4bit"),
    ("Muon8bit", dict(muon_adamw_fqns=["lm_head"]), {}, r"\[lowbit\] muon_adamw_fqns entry 'lm_head' matches no"),
    ("Muon", dict(block_size=64), {}, r"\[lowbit\] block_size set, but \[optimizer\] name = 'Muon' keeps fp32 "
                                      r"states.*Muon8bit"),
    ("Muon", dict(fp32_states=["output"]), {}, r"\[lowbit\] fp32_states .* 'Muon' keeps every state in fp32"),
    ("Muon8bit", dict(fp32_states=["o", "e"]), {}, r"selects every trainable parameter .* name = \"Muon\""),
    ("Muon8bit", {}, dict(early=True), r"early_step_in_backward = true .* 'Muon8bit' is Muon"),
    ("MuonFp8", {}, dict(pp=True), r"'MuonFp8' with \[parallelism\] pipeline_parallel_degree = 2"),
])
def test_settings_a_muon_name_would_ignore_or_cannot_do_are_refused(name, lowbit, extra, match):
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import Optimizer as OptimizerConfig

    from titan_lowbit.torchtitan.optimizer_builder import build_lowbit_optimizers

    dims = SimpleNamespace(pp_enabled=True, ep_enabled=False, pp=2) if extra.get("pp") else None
    if dims is not None:  # one stage's names (the names of every stage come with a collective)
        import titan_lowbit.torchtitan.optimizer_builder as builder
        trainable = builder.trainable_fqns
        builder.trainable_fqns = lambda parts, _: trainable(parts, None)
    try:
        with pytest.raises((ValueError, NotImplementedError), match=match):
            build_lowbit_optimizers([Tiny()], OptimizerConfig(name=name, early_step_in_backward=extra.get("early", False)),
                                    dims, lowbit=LowBit(**lowbit), seed=0, base_builder=build_optimizers)
    finally:
        if dims is not None:
            builder.trainable_fqns = trainable


def test_start_up_line_names_the_muon_split_format_and_bytes():
    model = Tiny()
    opts = build(model, "Muon8bit")
    line = describe(opts, "Muon8bit", LowBit(), [])
    numel = {n: p.numel() for n, p in model.named_parameters()}
    share = numel["layers.0.wq.weight"] / sum(numel.values())
    assert (f"optimizer Muon8bit (titan_lowbit, state format 8bit: Muon momentum for 1 matrix ({share:.1%} of "
            "the elements), AdamW moments for the other 5 params)") in line, line
    assert f"optimizer state {only(opts).state_bytes_per_param():.3f} B/param" in line


def checkpoint(tmp_path, name, **lowbit):
    """A one-process DCP checkpoint of ``name`` with ``lowbit``, two steps in; its model."""
    model = Tiny()
    opts = build(model, name, **lowbit)
    step(opts, model)
    dcp.save({"optimizer": Container(model, opts).state_dict()}, checkpoint_id=str(tmp_path))
    return model


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_of_a_muon_name_is_compared_with_the_run_before_loading(tmp_path):
    model = checkpoint(tmp_path, "Muon8bit")
    assert check_compatible({"optimizer": Container(model, build(model, "Muon8bit"))}, str(tmp_path)) is None

    def refusal(name, convert=False, **lowbit) -> str:
        with pytest.raises(CheckpointMismatch) as err:
            check_compatible({"optimizer": Container(model, build(model, name, **lowbit))}, str(tmp_path),
                             convert=convert)
        return str(err.value)

    text = refusal("AdamW8bit")
    assert "optimizer='titan_lowbit Muon'" in text and "optimizer='titan_lowbit'" in text, text
    assert '[optimizer] name = "Muon8bit" (--optimizer.name Muon8bit)' in text, text
    assert "The checkpoint was written by a Muon name, this run steps with AdamW." in text, text
    assert "convert_optimizer_states" not in text  # no conversion to offer
    text = refusal("Muon4bit")
    assert "state_format='8bit'" in text and '[optimizer] name = "Muon8bit"' in text, text
    for name in ("Muon4bit", "AdamW8bit"):  # converting was asked for: why it is not done
        assert "does not convert the states of a Muon name" in refusal(name, convert=True)
    text = refusal("Muon8bit", muon_adamw_fqns=["tok_embeddings"])
    assert ("optimizer layout of param 'output.weight': checkpoint" in text
            and "[lowbit] muon_adamw_fqns gave the inner AdamW 5 parameters" in text
            and "[lowbit] muon_adamw_fqns giving the inner AdamW exactly the checkpoint's 5 parameters" in text), text
    # Muon4bit's momentum levels: recorded in the checkpoint, or unrecorded (the dynamic map)
    four = tmp_path / "four"
    model = checkpoint(four, "Muon4bit", muon_4bit_levels="dynamic")
    with pytest.raises(CheckpointMismatch) as err:
        check_compatible({"optimizer": Container(model, build(model, "Muon4bit"))}, str(four))
    assert ("momentum_4bit_levels='dynamic'" in str(err.value) and "momentum_4bit_levels='nf4'" in str(err.value)
            and '[lowbit] muon_4bit_levels = "dynamic" (--lowbit.muon_4bit_levels dynamic)' in str(err.value)), err.value
    assert check_compatible({"optimizer": Container(model, build(model, "Muon4bit", muon_4bit_levels="dynamic"))},
                            str(four)) is None
    unrecorded = tmp_path / "unrecorded"
    model = Tiny()
    opts = build(model, "Muon4bit", muon_4bit_levels="dynamic")
    step(opts, model)
    flat = Container(model, opts).state_dict()
    dcp.save({"optimizer": {k: v for k, v in flat.items() if not k.endswith(".momentum_4bit_levels")}},
             checkpoint_id=str(unrecorded))
    with pytest.raises(CheckpointMismatch, match=r'\[lowbit\] muon_4bit_levels = "dynamic"'):
        check_compatible({"optimizer": Container(model, build(model, "Muon4bit"))}, str(unrecorded))
    assert check_compatible({"optimizer": Container(model, build(model, "Muon4bit", muon_4bit_levels="dynamic"))},
                            str(unrecorded)) is None
    # ... and DCP loads it (as the checkpoint wrapper does): the run goes on as the original
    run = Tiny()
    run.load_state_dict(model.state_dict())
    resumed = build(run, "Muon4bit", muon_4bit_levels="dynamic")
    entries = unrecorded_entries(resumed.state_dict(), dcp.FileSystemReader(str(unrecorded)).read_metadata()
                                 .state_dict_metadata)
    assert entries == ["param_groups.layers.0.wq.weight.momentum_4bit_levels"]
    dcp.load({"optimizer": UnrecordedOptions(resumed, entries)}, checkpoint_id=str(unrecorded))
    step(opts, model, seed=5)
    step(resumed, run, seed=5)
    for a, b in zip(model.parameters(), run.parameters()):
        assert torch.equal(a, b)
    # Muon4bit's momentum factor: recorded, and resumed bit for bit through DCP; a
    # checkpoint that records none (the unrecorded one above) has no factor
    factored = tmp_path / "factored"
    model = Tiny()
    opts = build(model, "Muon4bit", muon_4bit_factor_rank=4)
    step(opts, model)
    dcp.save({"optimizer": Container(model, opts).state_dict()}, checkpoint_id=str(factored))
    with pytest.raises(CheckpointMismatch) as err:
        check_compatible({"optimizer": Container(model, build(model, "Muon4bit"))}, str(factored))
    assert "[lowbit] muon_4bit_factor_rank = 4 (--lowbit.muon_4bit_factor_rank 4)" in str(err.value), err.value
    with pytest.raises(CheckpointMismatch, match=r"\[lowbit\] muon_4bit_factor_rank = 0 "):
        check_compatible({"optimizer": Container(model, build(model, "Muon4bit", muon_4bit_factor_rank=4))},
                         str(unrecorded))
    run = Tiny()
    run.load_state_dict(model.state_dict())
    resumed = build(run, "Muon4bit", muon_4bit_factor_rank=4)
    assert check_compatible({"optimizer": Container(run, resumed)}, str(factored)) is None
    assert "state.layers.0.wq.weight.momentum_buffer_col_factor" in Container(run, resumed).state_dict()
    dcp.load({"optimizer": resumed}, checkpoint_id=str(factored))
    step(opts, model, seed=5)
    step(resumed, run, seed=5)
    for a, b in zip(model.parameters(), run.parameters()):
        assert torch.equal(a, b)
    # an AdamW checkpoint resumed by a Muon name
    adamw = tmp_path / "adamw"
    model = checkpoint(adamw, "AdamW8bit")
    with pytest.raises(CheckpointMismatch, match='name = "AdamW8bit"'):
        check_compatible({"optimizer": Container(model, build(model, "Muon8bit"))}, str(adamw))


def test_lowbit_muon_keys_are_checked_when_the_section_is_parsed():
    with pytest.raises(ValueError, match=r"\[lowbit\] muon_momentum = '0.9' must be a TOML float"):
        LowBit(muon_momentum="0.9")
    with pytest.raises(ValueError, match=r"\[lowbit\] muon_momentum = True must be a TOML float"):
        LowBit(muon_momentum=True)
    with pytest.raises(ValueError, match=r"\[lowbit\] muon_momentum = 1.0 must lie in \[0, 1\)"):
        LowBit(muon_momentum=1.0)
    with pytest.raises(ValueError, match=r"\[lowbit\] muon_adamw_fqns = \['output', ''\] must be a list of strings"):
        LowBit(muon_adamw_fqns=["output", ""])
    # one string on the command line: comma-separated, as the other fragment lists
    assert LowBit(muon_adamw_fqns="tok_embeddings,output").muon_adamw_fqns == ["tok_embeddings", "output"]
    assert LowBit(muon_momentum=0).muon_momentum == 0
    with pytest.raises(ValueError, match=r"\[lowbit\] muon_4bit_levels = 'nf3' is not valid; choose one of "
                                         r"\['nf4', 'dynamic'\]"):
        LowBit(muon_4bit_levels="nf3")
    with pytest.raises(ValueError, match=r"\[lowbit\] muon_4bit_factor_rank = -1 must be >= 0"):
        LowBit(muon_4bit_factor_rank=-1)
    with pytest.raises(ValueError, match=r"\[lowbit\] muon_4bit_factor_rank = 8.0 must be a TOML int"):
        LowBit(muon_4bit_factor_rank=8.0)
