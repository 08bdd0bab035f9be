"""``[lowbit] fp32_states``: the parameters it selects keep fp32 optimizer states while the
rest take ``[optimizer] name``'s format (0.2 line), without a Trainer: the param groups the
builder makes, the refusals, the start-up line's mixed bytes per parameter, and checkpoints
compared and converted parameter by parameter (a DCP checkpoint of one process).

The Trainer runs with the option are extensions of existing runs: tests/test_train_e2e.py
(trains and resumes bit for bit, the start-up line), tests/test_reshard.py (a checkpoint of
another selection refused naming a parameter), tests/test_checkpoint_convert.py
(converted on request).
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from titan_lowbit.config import LowBit
from titan_lowbit.optim import LowBitAdamW, convert_state_dict
from titan_lowbit.optim.formats import STATE_FORMATS
from titan_lowbit.torchtitan.checkpoint_layout import CheckpointMismatch, check_compatible
from titan_lowbit.torchtitan.checkpoint_convert import load_converted
from titan_lowbit.torchtitan.lowbit_optimizers import FP32_ADAMW_STATE_BYTES
from titan_lowbit.torchtitan.optimizer_builder import describe

from optimizer_container_cases import DIM, Container, Tiny, build, step

SELECTION = ["tok_embeddings", "output"]


def formats(container) -> dict[str, str]:
    """{parameter name: the state format it is stepped in} (param_format's rule)."""
    from titan_lowbit.optim.formats import param_format

    [opt] = list(container)
    return {opt._name(p): param_format(p, g)[0].name for g in opt.param_groups for p in g["params"]}


def test_selected_parameters_get_a_group_of_fp32_states_and_the_rest_keep_the_format():
    model = Tiny()
    got = formats(build(model, fp32_states=SELECTION))
    assert got == {"layers.0.attention_norm.weight": "fp32", "layers.0.wq.weight": "8bit",
                   "layers.0.wq.bias": "fp32", "norm.weight": "fp32",
                   "tok_embeddings.weight": "fp32", "output.weight": "fp32"}
    [opt] = list(build(model, fp32_states=SELECTION))
    assert [g["state_format"] for g in opt.param_groups] == ["8bit", "fp32"]
    assert opt.param_groups[1]["param_names"] == ["tok_embeddings.weight", "output.weight"]
    # without the option: one group, as before
    assert formats(build(model))["tok_embeddings.weight"] == "8bit"
    assert len(list(build(model))[0].param_groups) == 1


def test_start_up_line_reports_the_mixed_bytes_per_parameter():
    model = Tiny()
    opts = build(model, fp32_states=SELECTION)
    line = describe(opts, "AdamW8bit", LowBit(fp32_states=SELECTION), [])
    numel = {n: p.numel() for n, p in model.named_parameters()}
    eight = STATE_FORMATS["8bit"]
    # wq.weight: 64 rows of one short block of 64 (codes 1 B/elem, two fp32 scales per row)
    quantized = numel["layers.0.wq.weight"]
    quantized_bytes = 2 * quantized * 1 + 2 * 4 * DIM  # codes and scales of both moments
    fp32_bytes = FP32_ADAMW_STATE_BYTES * (sum(numel.values()) - quantized)
    expected = (quantized_bytes + fp32_bytes) / sum(numel.values())
    assert eight.bytes_per_element(256) < FP32_ADAMW_STATE_BYTES
    assert f"optimizer state {expected:.3f} B/param" in line, line
    chosen = numel["tok_embeddings.weight"] + numel["output.weight"]
    assert (f"fp32 states for 2 params, {chosen / sum(numel.values()):.1%} of the elements, "
            "by [lowbit] fp32_states") in line, line


@pytest.mark.parametrize("name,selection,match", [
    ("AdamW8bit", ["tok_embeddings", "lm_head"],
     r"\[lowbit\] fp32_states entry 'lm_head' matches no trainable parameter of the model .*"
     r"'tok_embeddings.weight'"),
    ("AdamW8bit", ["e"], r"fp32_states = \['e'\] selects every trainable parameter \(6\)"),
    ("AdamW", ["output"], r"\[optimizer\] name = 'AdamW' keeps every state in fp32 already"),
])
def test_selection_that_changes_nothing_or_everything_is_refused(name, selection, match):
    with pytest.raises(ValueError, match=match):
        build(Tiny(), name=name, fp32_states=selection)


def test_fragments_are_matched_across_pipeline_stages():
    """Under pipeline parallelism each rank sees its stages only: the names are gathered
    over the pp mesh (here a one-rank one), so a fragment another stage holds is fine."""
    from titan_lowbit.torchtitan.optimizer_builder import trainable_fqns

    class PP:
        pp_enabled = True

        @staticmethod
        def get_mesh(name):
            assert name == "pp"
            return type("Mesh", (), {"get_group": staticmethod(lambda: None)})()

    gathered = []

    def all_gather_object(out, obj, group=None):
        gathered.append(obj)
        out[0], out[1] = obj, ["output.weight"]  # the other stage's names

    import titan_lowbit.torchtitan.optimizer_builder as builder
    orig = builder.dist
    builder.dist = type("D", (), {"get_world_size": staticmethod(lambda group: 2),
                                  "all_gather_object": staticmethod(all_gather_object)})
    try:
        fqns = trainable_fqns([nn.ModuleDict({"wq": nn.Linear(4, 4)})], PP())
    finally:
        builder.dist = orig
    assert fqns == ["wq.weight", "wq.bias", "output.weight"]


def test_convert_state_dict_takes_the_states_into_another_grouping():
    """A single 8-bit group converted into one whose embeddings have a group of fp32 states
    (the same parameters in the same order, grouped otherwise):
    the moments of the selected parameter become exactly what the 8-bit state held."""
    model = Tiny()
    target = list(build(model, fp32_states=["tok_embeddings"]))[0]
    # one group of the same parameters in the same order
    source = LowBitAdamW([(target._name(p), p) for g in target.param_groups for p in g["params"]], lr=1e-2)
    step(source, model)
    target.load_state_dict(convert_state_dict(source.state_dict(), to=target))
    emb = model.tok_embeddings.weight
    m, v = fp32_moments(source, emb)
    assert torch.equal(target.state[emb]["exp_avg"], m) and torch.equal(target.state[emb]["exp_avg_sq"], v)
    assert target.param_groups[1]["lr"] == source.param_groups[0]["lr"]


def test_convert_state_dict_refuses_a_group_fed_by_groups_of_other_hyperparameters():
    model = Tiny()
    ps = [("tok_embeddings.weight", model.tok_embeddings.weight), ("output.weight", model.output.weight)]
    source = LowBitAdamW([{"params": ps[:1], "lr": 1e-2}, {"params": ps[1:], "lr": 1e-3}])
    target = LowBitAdamW(ps)
    with pytest.raises(ValueError, match=r"param group 0 of the optimizer to convert into takes parameters "
                                         r"from saved groups \[0, 1\] with other hyperparameters"):
        convert_state_dict(source.state_dict(), to=target)


def checkpoint(tmp_path, **lowbit):
    """A one-process DCP checkpoint of a run with ``lowbit``, two steps in; its model."""
    model = Tiny()
    opts = build(model, **lowbit)
    step(opts, model)
    dcp.save({"optimizer": Container(model, opts).state_dict()}, checkpoint_id=str(tmp_path))
    return model


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_of_another_selection_is_refused_naming_a_parameter(tmp_path):
    model = checkpoint(tmp_path, fp32_states=["tok_embeddings"])
    same = Container(model, build(model, fp32_states=["tok_embeddings"]))
    assert check_compatible({"optimizer": same}, str(tmp_path)) is None
    other = Container(model, build(model, fp32_states=["output"]))
    with pytest.raises(CheckpointMismatch) as err:
        check_compatible({"optimizer": other}, str(tmp_path))
    text = str(err.value)
    for part in ("optimizer layout of param 'tok_embeddings.weight' (and 1 more): checkpoint",
                 "state_format='8bit'", "state_format='fp32'",
                 "[lowbit] fp32_states gave fp32 states to 1 parameter ['tok_embeddings.weight'] in "
                 "the checkpoint, to 1 parameter ['output.weight'] in this run",
                 "Resume with the settings the checkpoint was written with: [lowbit] fp32_states "
                 "selecting exactly the checkpoint's 1 parameter ['tok_embeddings.weight']",
                 "--lowbit.convert_optimizer_states"):
        assert part in text, text
    none = Container(model, build(model))
    with pytest.raises(CheckpointMismatch, match="with the settings the checkpoint was written with: "
                                                 "\\[lowbit\\] fp32_states selecting exactly"):
        check_compatible({"optimizer": none}, str(tmp_path))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_of_another_selection_converts_on_request(tmp_path):
    """Checkpoint: embeddings in fp32 states; run: the head instead. Converted, the head's
    moments are its 8-bit moments dequantized and the embeddings' the fp32 ones quantized."""
    model = checkpoint(tmp_path, fp32_states=["tok_embeddings"])
    saved_run = list(build(model, fp32_states=["tok_embeddings"]))[0]
    dcp.load({"optimizer": Container(model, [saved_run]).state_dict()}, checkpoint_id=str(tmp_path))
    run = Container(model, build(model, fp32_states=["output"]))
    conversion = check_compatible({"optimizer": run}, str(tmp_path), convert=True)
    assert conversion is not None
    lines = load_converted(run, str(tmp_path), conversion)
    assert lines == ["fp32_states: into fp32 states ['output.weight'], out of them ['tok_embeddings.weight']: "
                     "those parameters' moments dequantized into fp32 states (exactly) or quantized out of "
                     "them into the optimizer's format"], lines
    [opt] = run.optimizers
    head, emb = model.output.weight, model.tok_embeddings.weight
    for have, had in zip(fp32_moments(opt, head), fp32_moments(saved_run, head)):
        assert torch.equal(have, had)  # 8-bit moments dequantized into fp32: exact
    for have, had in zip(fp32_moments(opt, emb), fp32_moments(saved_run, emb)):
        assert not torch.equal(have, had)  # fp32 moments quantized: one 8-bit rounding
        assert (have - had).abs().max() <= 0.05 * had.abs().max()


def fp32_moments(optimizer, p) -> tuple[torch.Tensor, torch.Tensor]:
    """``p``'s moments as ``optimizer`` holds them, in fp32 (an export to torch's AdamW)."""
    exported = torch.optim.AdamW([q for g in optimizer.param_groups for q in g["params"]])
    exported.load_state_dict(convert_state_dict(optimizer.state_dict(), to=exported))
    return exported.state[p]["exp_avg"], exported.state[p]["exp_avg_sq"]


def test_lr_schedulers_take_a_checkpoint_of_another_grouping():
    """A schedule saved for one param group loads into a run whose optimizer has two
    (fp32_states added), and one saved for two into an optimizer with one (under pipeline
    parallelism, a model part without the selected parameters beside one with them): one
    entry per group, so the load and the next step work; groups of other learning rates
    are refused. The lambda is a functools.partial, as torchtitan's (torch saves its
    attributes per group)."""
    import functools

    from torch.optim.lr_scheduler import LambdaLR

    from titan_lowbit.torchtitan.checkpoint_convert import FittedLRSchedulers

    model = Tiny()
    halving = functools.partial(pow, 0.5)  # 0.5 ** step
    for saved_groups, run_groups in ((1, 2), (2, 1)):
        optimizers = {1: list(build(model))[0], 2: list(build(model, fp32_states=SELECTION))[0]}
        saved = LambdaLR(optimizers[saved_groups], halving)
        saved.step()
        run = LambdaLR(optimizers[run_groups], halving)
        schedulers = FittedLRSchedulers(type("Schedulers", (), {"schedulers": [run]})())
        schedulers.load_state_dict(saved.state_dict())
        run.step()
        assert [g["lr"] for g in optimizers[run_groups].param_groups] == [0.25 * 1e-2] * run_groups
    state = saved.state_dict()
    state["base_lrs"] = [1e-2, 1e-3, 1e-4]
    with pytest.raises(ValueError, match=r"LR scheduler holds base_lrs \[0.01, 0.001, 0.0001\] for 3 param "
                                         r"groups, this run's optimizer has 1"):
        schedulers.load_state_dict(state)
