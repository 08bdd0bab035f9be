"""The torchtitan 0.3 integration (titan_lowbit.torchtitan.v03 and config_registry).

Runs where torchtitan 0.3 is installed (CI's second environment, README "torchtitan 0.3");
with torchtitan 0.2 installed the 0.2 integration's tests run instead and this module is
skipped. In-process: the optimizer container (titan_lowbit's names as param-group
optimizer names, mixed with torch's AdamW), its refusals, torchtitan's zero-gradient
initialisation step, the fp32 initialization that master weights start from, the
overrides, the BitNet converter and the optimizer health metrics processor. End to end, on 2 gloo processes through ``torchrun -m
torchtitan.train`` (the ranks forked from the session's server, tests/fork_launcher.py,
as for the 0.2 line's runs; README's command and the refused start-up through real
torchrun): the ready debug config from README's command; the debug config with three
titan_lowbit optimizers at once (fp32 states for the small parameters and 8-bit states
for the attention matrices, both with bf16 master_remainder weights, and Muon8bit through
its override with stochastic rounding for the feed-forward matrices:
tests/v03_mixed_optimizers.py), reporting the optimizer's health to the console and
TensorBoard; BitNet, and SubLN + BitNet with 4-bit states and stochastic rounding through
the override. A run checkpointed at step 4 and resumed ends bit for bit where the
straight run ends (every model and optimizer tensor of the last checkpoint), and a
2-process checkpoint continues on 1 process with the model compiled, resuming bit for bit
there too. On 4 processes: HSDP with BitNet, resumed
bit for bit from an async checkpoint, its last save a Hugging Face export; pipeline x
tensor parallelism with 4-bit states, resumed bit for bit.
"""

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import types

import pytest

from titan_lowbit.compat import torchtitan_line

if torchtitan_line() != (0, 3):
    pytest.skip("needs torchtitan 0.3 (the 0.2 line's integration is tested by the other modules)",
                allow_module_level=True)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from conftest import (LAUNCHER_VARIABLE, ROOT, SMALL_STEPS, check_health_reported, cpu_run_env,  # noqa: E402
                      step_losses, torchrun)
from fork_launcher import WAITED_FOR_OTHER_RANKS  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig, default_adamw  # noqa: E402
from torchtitan.components.optimizer.utils import init_optim_state  # noqa: E402

from titan_lowbit.optim import LowBitAdamW  # noqa: E402
from titan_lowbit.torchtitan import v03  # noqa: E402
from titan_lowbit.torchtitan.lr_schedule import SCHEDULE_FILE  # noqa: E402

WEIGHT_UPDATES = ("nearest", "stochastic", "kahan", "master", "master_remainder")


class Tiny(nn.Module):
    """Matrices big enough for quantized states, a norm and an embedding."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.tok_embeddings = nn.Parameter(torch.randn(64, 96, generator=g).to(dtype))
        self.w1 = nn.Parameter(torch.randn(96, 160, generator=g).to(dtype))
        self.w2 = nn.Parameter(torch.randn(160, 96, generator=g).to(dtype))
        self.norm = nn.Parameter(torch.ones(96, dtype=dtype))

    def loss(self, x):
        h = self.tok_embeddings[x] * self.norm
        return ((h @ self.w1).relu() @ self.w2).float().square().mean()


def container(model, name="AdamW8bit", weight_update="master_remainder", **extra):
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "weight_update": weight_update}
    config = v03.LowBitOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"norm|tok_embeddings", optimizer_name="AdamW",
                         optimizer_kwargs={**kw, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs={**kw, "min_quantized_numel": 1024}),
    ], **extra)
    return config.build(model_parts=[model])


def train(model, opt, steps, start=0):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (8,), generator=g) for _ in range(start + steps)][start:]
    for x in batches:
        model.loss(x).backward()
        opt.step()
        opt.zero_grad()


def snapshot(model, opt):
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for key, value in opt.state_dict().items():
        out[key] = value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_lowbit_names_are_param_group_optimizers_beside_torch_adamw():
    model = Tiny(torch.float32)
    opt = container(model, weight_update="nearest")
    kinds = {type(o).__name__: o for o in opt}
    assert set(kinds) == {"AdamW", "LowBitAdamW"}, kinds  # torch's AdamW stays torch's
    lowbit = kinds["LowBitAdamW"]
    assert {g["state_format"] for g in lowbit.param_groups} == {"8bit"}
    assert lowbit.param_groups[0]["param_names"] == ["w1", "w2"]
    sd = opt.state_dict()  # torchtitan's flat, FQN-keyed state dict
    assert "state.w1.exp_avg_codes" in sd and "state.norm.exp_avg" in sd
    assert sd["param_groups.w1.state_format"] == "8bit"


def test_muon_names_are_param_group_optimizers_split_by_shape_and_name_inside():
    """A Muon name's group goes to one LowBitMuon, which steps its 2-D parameters with Muon
    and the rest (here the head, by name) with its inner AdamW; the groups of other names
    stay as they are. betas and eps reach the inner AdamW, momentum Muon."""
    model = Tiny()
    model.lm_head = nn.Parameter(torch.randn(96, 64).to(torch.bfloat16))
    kinds = {type(o).__name__: o for o in container(model, name="Muon8bit")}
    assert set(kinds) == {"LowBitAdamW", "LowBitMuon"}, kinds  # the AdamW group: fp32, master_remainder
    muon = kinds["LowBitMuon"]
    assert [(g["use_muon"], g["param_names"]) for g in muon.param_groups] == [(True, ["w1", "w2"]),
                                                                             (False, ["lm_head"])]
    assert muon.param_groups[0]["momentum"] == 0.95 and muon.param_groups[1]["betas"] == (0.9, 0.95)
    opt = container(model, name="Muon4bit", weight_update="stochastic")
    other = Tiny()
    assert "titan_lowbit 4bit states (Muon momentum for 2 matrices" in v03.describe(opt)
    sd = opt.state_dict()  # torchtitan's flat, FQN-keyed state dict
    assert "state.w1.momentum_buffer_codes" in sd and "state.lm_head.exp_avg_codes" in sd
    assert sd["param_groups.w1.use_muon"] is True and sd["param_groups.lm_head.use_muon"] is False
    with pytest.raises(ValueError, match=r"nonfinite_grad = 'skip' with Muon beside other optimizers"):
        container(other, name="Muon8bit", optimizer_factory_kwargs_by_name={"Muon8bit": {"nonfinite_grad": "skip"}})
    with pytest.raises(ValueError, match=r"optimizer_factory_kwargs_by_name\['Muon8bit'\] has \['betas'\]; Muon8bit "
                                         r"takes \['nonfinite_grad', 'seed', 'adamw_fqns'\]"):
        container(other, name="Muon8bit", optimizer_factory_kwargs_by_name={"Muon8bit": {"betas": (0.9, 0.9)}})
    # one Muon name for every parameter: its own skip decides for the whole step
    only = v03.LowBitOptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=".*", optimizer_name="Muon8bit", optimizer_kwargs={"lr": 1e-2})],
        optimizer_factory_kwargs_by_name={"Muon8bit": {"nonfinite_grad": "skip"}}).build(model_parts=[other])
    other.loss(torch.arange(8)).backward()
    other.norm.grad[0] = float("nan")
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    only.step()
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())
    assert only.optimizers[0].skipped_steps == 1


def test_torch_adamw_group_with_a_bf16_update_rule_is_lowbit_fp32():
    opt = container(Tiny(), name="AdamW4bit", weight_update="kahan")
    formats = sorted(g["state_format"] for o in opt for g in o.param_groups)
    assert formats == ["4bit", "fp32"]
    assert all(isinstance(o, LowBitAdamW) for o in opt)


def test_param_groups_give_chosen_parameters_fp32_states_as_the_02_lines_fp32_states():
    """The 0.2 line's ``[lowbit] fp32_states = ["tok_embeddings"]`` on 0.3 (docs/reference.md):
    a param group per fragment named "AdamW" before the 8-bit one; with bf16 weights and
    round-to-nearest the AdamW optimizer is titan_lowbit's (through its non-finite policy),
    so its moments are fp32, not torch's bf16. A fragment that matches nothing is refused
    by torchtitan, naming it. The start-up line's B/param is the mixed figure."""
    from titan_lowbit.optim.formats import STATE_FORMATS

    def build(*fragments):
        return v03.LowBitOptimizersContainer.Config(param_groups=[
            *[ParamGroupConfig(pattern=f, optimizer_name="AdamW") for f in fragments],
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW8bit"),
        ], optimizer_factory_kwargs_by_name={"AdamW": {"nonfinite_grad": "raise"}}).build(model_parts=[model])

    model = Tiny()
    opt = build("tok_embeddings")
    assert all(isinstance(o, LowBitAdamW) for o in opt)
    sd = opt.state_dict()
    assert sd["state.tok_embeddings.exp_avg"].dtype == torch.float32
    assert "state.w1.exp_avg_codes" in sd and sd["state.norm.exp_avg"].dtype == torch.float32
    eight = STATE_FORMATS["8bit"]
    nbytes = {n: (sum(math.prod(shape) * dtype.itemsize for shape, dtype in
                      eight.state_shapes(tuple(p.shape), eight.default_block).values())
                  if n in ("w1", "w2") else 8 * p.numel()) for n, p in model.named_parameters()}
    numel = sum(p.numel() for p in model.parameters())
    assert f"optimizer state {sum(nbytes.values()) / numel:.3f} B/param" in v03.describe(opt)
    with pytest.raises(ValueError, match="pattern 'lm_head' matched no parameters"):
        build("tok_embeddings", "lm_head")


@pytest.mark.parametrize("weight_update", WEIGHT_UPDATES)
def test_zero_gradient_initialisation_step_changes_nothing(weight_update):
    """torchtitan's checkpointer calls init_optim_state (a zero-gradient step at lr 0)
    before every save and load; titan_lowbit's optimizers have their states from the
    start, so it is a no-op: training after a state_dict() (which runs it) and a
    load_state_dict() of that same state is bit for bit the training without them. (The
    AdamW group is LowBitAdamW with fp32 states here, through its non-finite policy:
    torch's own AdamW does take that step, and counts it.)"""
    lowbit_only = {"optimizer_factory_kwargs_by_name": {"AdamW": {"nonfinite_grad": "raise"}}}
    ref_model = Tiny()
    ref = container(ref_model, weight_update=weight_update, **lowbit_only)
    train(ref_model, ref, 3)

    model = Tiny()
    opt = container(model, weight_update=weight_update, **lowbit_only)
    assert all(isinstance(o, LowBitAdamW) for o in opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for o in opt:
        if isinstance(o, LowBitAdamW):
            init_optim_state(o)
    sd = opt.state_dict()
    assert all(float(v) == 0 for k, v in sd.items() if k.endswith(".step")), "a step was taken"
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    opt.load_state_dict(sd)
    train(model, opt, 3)
    assert_same(snapshot(model, opt), snapshot(ref_model, ref))


@pytest.mark.parametrize("name,weight_update", [("AdamW8bit", "stochastic"), ("AdamW8bit", "master_remainder"),
                                                ("Muon8bit", "stochastic")])
def test_state_dict_round_trip_resumes_bit_for_bit(name, weight_update):
    ref_model = Tiny()
    ref = container(ref_model, name=name, weight_update=weight_update)
    train(ref_model, ref, 6)

    first = Tiny()
    opt = container(first, name=name, weight_update=weight_update)
    train(first, opt, 3)
    saved = snapshot(first, opt)
    second = Tiny()
    with torch.no_grad():
        for n, p in second.named_parameters():
            p.copy_(saved[n])
    resumed = container(second, name=name, weight_update=weight_update)
    resumed.load_state_dict({k: v for k, v in saved.items() if "." in k})
    train(second, resumed, 3, start=3)
    assert_same(snapshot(second, resumed), snapshot(ref_model, ref))


def _debug_model(dtype, optimizer=None, seed=0):
    """A 1-layer llama3 debug model (vocabulary 256) as torchtitan's Trainer builds it: on the meta device in
    the training dtype, parallelized (an identity here) through LowBitTrainer's wrapper of a
    run with ``optimizer`` (None: not wrapped), materialized and initialized."""
    from torchtitan.models.llama3 import model_registry
    from torchtitan.tools.utils import set_default_dtype

    config = model_registry("debugmodel").model
    config.layers = config.layers[:1]
    config.vocab_size = config.tok_embeddings.num_embeddings = config.lm_head.out_features = 256
    with torch.device("meta"), set_default_dtype(dtype):
        model = config.build()
    if optimizer is not None:
        parallelize = v03._wrap_parallelize(lambda m, **kwargs: m, False, types.SimpleNamespace(optimizer=optimizer))
        model = parallelize(model, parallel_dims=types.SimpleNamespace(tp=1))
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _init_optimizer(weight_update):
    """AdamW8bit for the matrices (fp32 states through min_quantized_numel: a cheap step),
    torch's AdamW made titan_lowbit's by the update for the embedding, and in that same
    optimizer the norms with round-to-nearest, which keeps no masters."""
    kw = {"lr": 0.0, "weight_decay": 0.0, "weight_update": weight_update}
    return v03.LowBitOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"norm", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.0, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r"tok_embeddings", optimizer_name="AdamW", optimizer_kwargs=kw),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW8bit", optimizer_kwargs={**kw, "min_quantized_numel": 2**30}),
    ])


def _masters(opts) -> dict[torch.Tensor, torch.Tensor]:
    from titan_lowbit.kernels.adamw_lowbit_ref import master_rebuild

    out = {}
    for opt in opts:
        for p, state in opt.state.items():
            if "master" in state:
                out[p] = state["master"]
            elif "master_remainder" in state:
                out[p] = master_rebuild(p.detach(), state["master_remainder"])
    return out


@pytest.mark.parametrize("update", ["master", "master_remainder"])
def test_bf16_weights_with_master_updates_initialize_in_fp32_and_the_masters_start_there(update):
    """``--training.dtype bfloat16`` with a master update: each model part initializes the
    weights of the groups that keep masters in fp32, each such bf16 weight is that init's
    rounding (to nearest, ties away), and each master is the fp32 init bit for bit, at
    the container's construction and after the first step; the fp32 values are then let
    go. Two model parts, as under pipeline parallelism."""
    from titan_lowbit.kernels.adamw_lowbit_ref import master_split
    from titan_lowbit.torchtitan import fp32_init

    config = _init_optimizer(update)
    parts = [_debug_model(torch.bfloat16, config, seed) for seed in (0, 1)]
    fp32 = [dict(_debug_model(torch.float32, seed=seed).named_parameters()) for seed in (0, 1)]
    opt = config.build(model_parts=parts)
    assert not fp32_init._INIT_MASTERS
    for part in parts:
        for p in part.parameters():
            p.grad = torch.zeros_like(p)
    for after_step in (False, True):
        masters = _masters(opt)
        for part, init in zip(parts, fp32):
            for name, p in part.named_parameters():
                if "norm" in name:  # round-to-nearest, no master: torchtitan's bf16 init (ones)
                    assert p not in masters and torch.equal(p, torch.ones_like(p)), name
                    continue
                assert torch.equal(p.detach().view(torch.int16), master_split(init[name].detach())[0].view(torch.int16)), name
                assert torch.equal(masters[p].view(torch.int32), init[name].detach().view(torch.int32)), (name, after_step)
        opt.step()
    assert any(master_split(m)[1].any() for m in masters.values())  # not on the bf16 grid


def test_bf16_weights_without_master_updates_initialize_in_bf16():
    config = _init_optimizer("stochastic")
    model = _debug_model(torch.bfloat16, config)
    assert "init_weights" not in vars(model)
    for (name, p), q in zip(model.named_parameters(), _debug_model(torch.bfloat16).parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), name


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match=r"'AdamW9bit' is not a known optimizer.*AdamW8bit"):
        container(Tiny(), name="AdamW9bit")
    with pytest.raises(ValueError, match=r"weight_update = 'stochastic'.*all fp32.*--training.dtype bfloat16"):
        container(Tiny(torch.float32), weight_update="stochastic")
    with pytest.raises(ValueError, match=r"state_format.*the name fixes"):
        v03.LowBitOptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="AdamW8bit", optimizer_kwargs={"lr": 1e-3, "state_format": "4bit"})]
        ).build(model_parts=[Tiny()])
    with pytest.raises(ValueError, match=r"optimizer_factory_kwargs_by_name\['AdamW8bit'\] has \['fused'\]"):
        container(Tiny(), optimizer_factory_kwargs_by_name={"AdamW8bit": {"fused": True}})
    with pytest.raises(ValueError, match=r"torch's AdamW, which has no option block_size"):
        v03.LowBitOptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3, "block_size": 64})]
        ).build(model_parts=[Tiny()])


def test_step_hooks_run_once_per_step_after_a_plain_container_exists():
    """torch wraps a container class's step with the step hooks when its first instance is
    built; titan_lowbit's container must not step through torchtitan's wrapped one."""
    default_adamw().build(model_parts=[Tiny(torch.float32)])  # wraps OptimizersContainer.step
    model = Tiny()
    opt = container(model)
    calls = []
    opt.register_step_pre_hook(lambda *args, **kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda *args, **kwargs: calls.append("post"))
    model.loss(torch.arange(8)).backward()
    opt.step()
    assert calls == ["pre", "post"]


def test_nonfinite_skip_skips_every_optimizer_of_the_container():
    model = Tiny()
    opt = container(model, optimizer_factory_kwargs_by_name={"AdamW8bit": {"nonfinite_grad": "skip"}})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.loss(torch.arange(8)).backward()
    model.w1.grad[0, 0] = float("nan")
    opt.step()
    for n, p in model.named_parameters():  # torch's AdamW (norm, embeddings) did not step either
        assert torch.equal(p, before[n]), n
    assert next(o for o in opt if isinstance(o, LowBitAdamW) and o.nonfinite_grad == "skip").skipped_steps == 1


def test_checkpoint_of_another_optimizer_layout_is_named_before_dcp_loads_it(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    eight = container(Tiny())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group says it loads in one process
        dcp.save({"optimizer": eight.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = FileSystemReader(str(tmp_path)).read_metadata()
    assert v03.optimizer_layout_problem({"optimizer": container(Tiny())}, metadata) is None
    four = v03.optimizer_layout_problem({"optimizer": container(Tiny(), name="AdamW4bit")}, metadata)
    assert "optimizer.state.w1.exp_avg_codes': (96, 160) in the checkpoint, (96, 80) in this run" in four
    fp32 = v03.optimizer_layout_problem({"optimizer": container(Tiny(), weight_update="master")}, metadata)
    assert "param 'w1': the checkpoint holds ['exp_avg_absmax', 'exp_avg_codes', 'exp_avg_sq_absmax', " \
           "'exp_avg_sq_codes', 'master_remainder', 'step'], this run ['exp_avg_absmax', 'exp_avg_codes', " \
           "'exp_avg_sq_absmax', 'exp_avg_sq_codes', 'master', 'step']" in fp32

    # A pipeline stage holds some of the parameters (here the embedding, the norm and w1, not
    # w2): the checkpoint's other parameters are another stage's, and its own are compared.
    stage = Tiny()
    del stage.w2
    assert v03.optimizer_layout_problem({"optimizer": container(stage)}, metadata) is None
    four = v03.optimizer_layout_problem({"optimizer": container(stage, name="AdamW4bit")}, metadata)
    assert "'optimizer.state.w1.exp_avg_codes': (96, 160) in the checkpoint, (96, 80) in this run" in four
    assert "w2" not in four, four


def test_muon4bit_checkpoint_without_its_momentum_options_resumes_with_the_dynamic_map_and_no_factor(tmp_path):
    """A Muon4bit checkpoint that records no momentum_4bit_levels and no
    momentum_4bit_factor_rank (written before the options existed) holds the dynamic map
    and no factor: the checkpoint manager loads it into a run of momentum_4bit_levels
    "dynamic" (rank 0), which goes on as the original; a run of the default levels (NF4),
    or with a factor, is refused, naming the option. A checkpoint with a factor resumes
    bit for bit."""
    import warnings

    import torch.distributed.checkpoint as dcp

    def muon4(model, **options):
        return v03.LowBitOptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="Muon4bit", optimizer_kwargs={"lr": 1e-2, **options})]).build(model_parts=[model])

    def load(opt, folder=tmp_path):  # as the trainer's checkpoint manager loads a resume (no model states here)
        manager = object.__new__(v03.CheckedCheckpointManager)
        manager.states = {}
        manager.dcp_load({"optimizer": opt}, str(folder), False, False)

    model = Tiny()
    opt = muon4(model, momentum_4bit_levels="dynamic")
    train(model, opt, 2)
    saved = {k: v for k, v in opt.state_dict().items()
             if not k.endswith((".momentum_4bit_levels", ".momentum_4bit_factor_rank"))}
    assert len(saved) < len(opt.state_dict())
    factored = muon4(Tiny(), momentum_4bit_factor_rank=4)
    factored_model = factored.model_parts[0]
    train(factored_model, factored, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group says it works in one process
        dcp.save({"optimizer": saved}, checkpoint_id=str(tmp_path), no_dist=True)
        with pytest.raises(Exception, match="saved with momentum_4bit_levels='dynamic', this optimizer was built "
                                            "with momentum_4bit_levels='nf4'"):
            load(muon4(Tiny()))
        with pytest.raises(Exception, match=r"param 'w1': the checkpoint holds \['momentum_buffer_absmax', "
                                            r"'momentum_buffer_codes', 'step'\], this run \['momentum_buffer_absmax', "
                                            r"'momentum_buffer_codes', 'momentum_buffer_col_factor', .*"
                                            r"momentum_4bit_factor_rank of the param groups"):
            load(muon4(Tiny(), momentum_4bit_levels="dynamic", momentum_4bit_factor_rank=4))
        resumed = copy.deepcopy(model)
        again = muon4(resumed, momentum_4bit_levels="dynamic")
        load(again)
        dcp.save({"optimizer": factored.state_dict()}, checkpoint_id=str(tmp_path / "factored"), no_dist=True)
        factored_again = muon4(copy.deepcopy(factored_model), momentum_4bit_factor_rank=4)
        load(factored_again, tmp_path / "factored")
    train(model, opt, 2, start=2)
    train(resumed, again, 2, start=2)
    assert_same(snapshot(model, opt), snapshot(resumed, again))
    train(factored_model, factored, 2, start=2)
    train(factored_again.model_parts[0], factored_again, 2, start=2)
    assert_same(snapshot(factored_model, factored), snapshot(factored_again.model_parts[0], factored_again))


def test_lowbit_adamw_override_turns_torch_adamw_groups_into_lowbit():
    config = default_adamw(lr=3e-4)
    new = v03.lowbit_adamw(config, name="AdamW4bit", weight_update="stochastic", seed=7)
    assert isinstance(new, v03.LowBitOptimizersContainer.Config) and new.seed == 7
    assert [(g.optimizer_name, g.optimizer_kwargs["weight_update"]) for g in new.param_groups] == [
        ("AdamW4bit", "stochastic")]
    with pytest.raises(ValueError, match="replaces the Adam groups"):
        v03.lowbit_adamw(config, name="Adam8bit")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['weight_updat'\]"):
        v03.lowbit_adamw(config, weight_updat="stochastic")


def test_lowbit_muon_override_turns_the_lowbit_adamw_groups_into_muon():
    from titan_lowbit.torchtitan.config_registry import lowbit_optimizer

    ready = v03.lowbit_muon(lowbit_optimizer(lr=3e-3), name="Muon4bit", momentum=0.9, adamw_fqns=["lm_head"],
                            nonfinite_grad="raise", momentum_4bit_factor_rank=4)
    assert [(g.optimizer_name, g.optimizer_kwargs.get("momentum"), g.optimizer_kwargs.get("momentum_4bit_factor_rank"))
            for g in ready.param_groups] == [("AdamW", None, None), ("Muon4bit", 0.9, 4)]  # torch's AdamW keeps norms,
    # biases and embeddings
    assert ready.optimizer_factory_kwargs_by_name["Muon4bit"] == {"nonfinite_grad": "raise", "adamw_fqns": ["lm_head"]}
    plain = v03.lowbit_muon(default_adamw(lr=3e-4))  # no low-bit AdamW group: torch's AdamW groups
    assert [g.optimizer_name for g in plain.param_groups] == ["Muon8bit"]
    with pytest.raises(ValueError, match=r"lowbit_muon: name = 'AdamW8bit'; choose one of"):
        v03.lowbit_muon(default_adamw(lr=3e-4), name="AdamW8bit")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['betas'\]"):
        v03.lowbit_muon(default_adamw(lr=3e-4), betas=(0.9, 0.9))


def test_bitnet_converter_converts_the_layers_linears_only():
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel", converters=[v03.BitNetConverter.Config()])
    with torch.device("meta"):
        model = spec.model.build()
    bitnet = sorted(n for n, m in model.named_modules() if isinstance(m, v03.BitNetLinear))
    linears = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear))
    assert bitnet and all(n.startswith("layers.") for n in bitnet)
    assert set(linears) - set(bitnet) == {"lm_head"}
    model.verify_module_protocol()
    with pytest.raises(ValueError, match="match no Linear"):
        model_registry("debugmodel", converters=[v03.BitNetConverter.Config(fqns=["nothing.*"])])
    with pytest.raises(ValueError, match="int8_backward=True is converted again with int8_backward=False"):
        model_registry("debugmodel", converters=[v03.BitNetConverter.Config(),
                                                 v03.BitNetConverter.Config(int8_backward=False)])


def _replace_linears(model_config, make):
    from torchtitan.models.common.linear import Linear

    for _, cfg, parent, attr in list(model_config.traverse(Linear.Config)):
        if isinstance(parent, list):
            parent[attr] = make(cfg)
        else:
            setattr(parent, attr, make(cfg))
    return model_config


def test_a_converter_that_replaces_bitnet_linears_is_refused_in_either_order():
    """float8, MX and NVFP4 converters replace every Linear config they match with a
    Linear subclass of their own; stand-ins of both kinds here (torchao is not a
    dependency)."""
    from dataclasses import dataclass

    from torchtitan.config.override import derive
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.llama3 import model_registry
    from torchtitan.protocols.model import ModelConfigConverter

    class OwnMathLinear(Linear):
        @dataclass(kw_only=True, slots=True)
        class Config(Linear.Config):
            pass

    class OwnMath(ModelConfigConverter):
        @dataclass(kw_only=True, slots=True)
        class Config(ModelConfigConverter.Config):
            pass

        def __init__(self, config):
            self.config = config

        def convert(self, model_config):
            return _replace_linears(model_config, lambda cfg: derive(cfg, OwnMathLinear.Config))

    kept = model_registry("debugmodel", converters=[v03.BitNetConverter.Config()])
    v03.check_bitnet_kept(kept.model)
    lost = model_registry("debugmodel", converters=[v03.BitNetConverter.Config(), OwnMath.Config()])
    with pytest.raises(ValueError, match=r"replaced 30 of its linears \(layers\.0\.attention"):
        v03.check_bitnet_kept(lost.model)
    with pytest.raises(ValueError, match="math of its own"):
        model_registry("debugmodel", converters=[OwnMath.Config(), v03.BitNetConverter.Config()])


def test_subln_converter_commutes_with_bitnet_and_refuses_what_it_cannot_do():
    from torchtitan.models.llama3 import model_registry

    from titan_lowbit.torchtitan.config_registry import llama3_debug_bitnet_subln

    models = []
    for order in ([v03.BitNetSubLNConverter.Config(), v03.BitNetConverter.Config()],
                  [v03.BitNetConverter.Config(), v03.BitNetSubLNConverter.Config()]):
        with torch.device("meta"):
            models.append(model_registry("debugmodel", converters=order).model.build())
    a, b = ({n: (type(m).__name__, tuple(p.shape) if (p := getattr(m, "weight", None)) is not None else None)
             for n, m in model.named_modules()} for model in models)
    assert a == b
    assert a["layers.0.attention_norm"][0] == "NoBlockNorm" and a["layers.0.feed_forward.w2.input_norm"] == (
        "RMSNorm", (768,))
    assert a["layers.0.feed_forward.w2"][0] == "BitNetLinear" and a["lm_head"][0] == "Linear"
    subln_only = model_registry("debugmodel", converters=[v03.BitNetSubLNConverter.Config()])
    assert type(subln_only.model.layers[0].attention.wo) is v03.SubLNLinear.Config
    with pytest.raises(ValueError, match="applied twice"):
        v03.BitNetSubLNConverter(v03.BitNetSubLNConverter.Config()).convert(subln_only.model)
    config = llama3_debug_bitnet_subln()
    config.checkpoint.last_save_in_hf = True
    with pytest.raises(ValueError, match="no Hugging Face llama name"):
        config.build()


def test_async_saves_stage_the_optimizer_states_that_live_in_arenas():
    """LowBitAdamW's states are views into one buffer per dtype; a DTensor over such a view
    has a storage offset, which torch's async staging mistakes for a plain tensor's storage
    and fails on. The manager hands it a copy of those DTensors: staged, every state
    equals the optimizer's."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = Tiny()
        for name, p in list(model.named_parameters()):
            setattr(model, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        opt = container(model)
        states = {k: v for k, v in opt.state_dict().items() if isinstance(v, DTensor)}
        for v in states.values():
            local = v.to_local()
            local.copy_(torch.arange(local.numel()).view(local.shape) % 97)
        assert any(v.storage_offset() != 0 for v in states.values())

        def stage(state_dict):
            return DefaultStager(StagingOptions(False, False, False, False)).stage(state_dict)

        with pytest.raises(RuntimeError, match="invalid python storage"):
            stage({"optimizer": opt.state_dict()})
        staged = stage(v03.async_stageable({"optimizer": opt}))["optimizer"]
        for key, value in states.items():
            assert torch.equal(staged[key].to_local(), value.to_local()), key
    finally:
        dist.destroy_process_group()


def test_async_checkpoints_with_pinned_memory_are_refused_on_the_cpu_path(monkeypatch):
    """torch stages an ``async_with_pinned_mem`` save with non-blocking copies, which need a
    GPU: on the CPU path the run is refused at start-up (not at its first save), naming
    ``async``, which the HSDP run below resumes from bit for bit."""
    from titan_lowbit.torchtitan.config_registry import llama3_debug

    monkeypatch.setenv("TITAN_LOWBIT_DEVICE", "cpu")
    config = llama3_debug()
    config.checkpoint.enable = True
    config.checkpoint.async_mode = "async_with_pinned_mem"
    with pytest.raises(ValueError, match=r"async_mode async_with_pinned_mem .* need a GPU.*"
                                         r"Use --checkpoint.async_mode async"):
        config.build()


def test_persistent_rows_only_for_a_compiled_bitnet_model():
    from titan_lowbit.torchtitan.config_registry import llama3_debug, llama3_debug_bitnet

    config = llama3_debug_bitnet()
    assert not v03.wants_persistent_rows(config)  # not compiled
    config.compile.enable = True
    config.compile.components = ["model", "loss"]
    assert v03.wants_persistent_rows(config)
    config.bitnet_persistent_rows = False
    assert not v03.wants_persistent_rows(config)
    plain = llama3_debug()
    plain.compile.enable = True
    assert not v03.wants_persistent_rows(plain)  # no BitNet linear


def test_llama3_1b_config_has_tinyllama_shapes():
    from titan_lowbit.torchtitan.config_registry import llama3_1b, llama3_1b_bitnet

    config = llama3_1b()
    with torch.device("meta"):
        model = config.model_spec.model.build()
    assert sum(p.numel() for p in model.parameters()) == 1_100_048_384  # TinyLlama-1.1B
    assert config.loss.loss_fn.global_vocab_size == 32000
    bitnet = llama3_1b_bitnet().model_spec.model
    assert isinstance(bitnet.layers[21].feed_forward.w2, v03.BitNetLinear.Config)
    assert type(bitnet.lm_head) is not v03.BitNetLinear.Config


def test_overrides_apply_to_a_trainer_config_as_torchtitan_applies_them():
    from torchtitan.config.override import OverrideConfig, apply_overrides

    from titan_lowbit.torchtitan.config_registry import llama3_debug

    config = llama3_debug()
    lines = apply_overrides(OverrideConfig(imports=[
        "titan_lowbit.torchtitan.v03.bitnet",
        ("titan_lowbit.torchtitan.v03.lowbit_adamw", {"name": "AdamW4bit", "weight_update": "kahan"}),
    ]), config)
    bitnet = [line for line in lines if ".v03.bitnet:" in line]
    assert len(bitnet) == 6 * 5 and not any("lm_head" in line for line in bitnet)
    # every AdamW group, torch's and titan_lowbit's (the norms below min_quantized_numel
    # keep fp32 states)
    assert [(g.optimizer_name, g.optimizer_kwargs["weight_update"]) for g in config.optimizer.param_groups] == [
        ("AdamW4bit", "kahan"), ("AdamW4bit", "kahan")]
    muon = llama3_debug()
    apply_overrides(OverrideConfig(imports=[
        ("titan_lowbit.torchtitan.v03.lowbit_muon", {"name": "Muon8bit", "weight_update": "stochastic"}),
    ]), muon)
    assert [(g.optimizer_name, g.optimizer_kwargs["weight_update"]) for g in muon.optimizer.param_groups] == [
        ("AdamW", "master_remainder"), ("Muon8bit", "stochastic")]


class RecordingLogger:
    """Stands in for torchtitan's metric loggers (TensorBoard, W&B): what they were given."""

    def __init__(self):
        self.logged = []

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def close(self):
        pass


def health_processor(monkeypatch, **config):
    """The 0.3 metrics processor as the Trainer builds it (on the CPU device module where
    there is no GPU), its loggers recorded."""
    import torchtitan.components.metrics as metrics

    from titan_lowbit.torchtitan.cpu_device import CpuDeviceModule

    if not torch.cuda.is_available():
        monkeypatch.setattr(metrics, "device_type", "cpu")
        monkeypatch.setattr(metrics, "device_module", CpuDeviceModule)
    processor = v03.HealthMetricsProcessor.Config(disable_color_printing=True, **config).build(
        parallel_dims=types.SimpleNamespace(non_data_parallel_size=1))
    processor.logger = RecordingLogger()
    processor.num_flops_per_token = 1
    return processor


def log_step(processor, step):
    processor.ntokens_since_last_log = 64
    processor.data_loading_times.append(0.0)
    processor.log(step, 2.0, 2.5, 0.3, extra_metrics={"lr": 1e-2})
    return processor.logger.logged[-1]


def test_health_metrics_processor_logs_the_health_to_the_console_and_the_loggers(monkeypatch, caplog):
    """--metrics.optimizer_health: at a logged step, the titan_lowbit optimizers' health
    (of both: the 8-bit one and the torch AdamW group stepped by LowBitAdamW for its bf16
    update) goes to torchtitan's loggers beside its own metrics and on a console line after
    its step line; off (the ready configs' default), the processor is torchtitan's."""
    from titan_lowbit.optim import optimizer_health

    model = Tiny()
    opt = container(model)
    train(model, opt, 3)
    want = optimizer_health(list(opt))
    assert {type(o).__name__ for o in opt} == {"LowBitAdamW"} and want.residual_over_ulp is not None

    processor = health_processor(monkeypatch, optimizer_health=True)
    processor.optimizers = opt  # as the Trainer hands it over
    with caplog.at_level("INFO"):
        step, logged = log_step(processor, 7)
    assert step == 7 and logged["lr"] == 1e-2 and logged["loss_metrics/global_avg_loss"] == 2.0
    assert {k: v for k, v in logged.items() if k.startswith("optimizer_health/")} == want.metrics()
    lines = [r.getMessage() for r in caplog.records]
    console = [i for i, line in enumerate(lines) if line.startswith("step:  7")]
    assert console and lines[console[0] + 1] == f"titan_lowbit health: step  7  {want.summary()}", lines

    off = health_processor(monkeypatch)
    off.optimizers = opt
    caplog.clear()
    with caplog.at_level("INFO"):
        _, logged = log_step(off, 8)
    assert not [k for k in logged if k.startswith("optimizer_health/")]
    assert not [r for r in caplog.records if "titan_lowbit health" in r.getMessage()]


def test_health_metrics_are_refused_without_a_lowbit_optimizer(monkeypatch):
    """torch's own AdamW keeps no state titan_lowbit reads: refused when the Trainer hands
    the optimizers to the processor (start-up), not with the health metrics off."""
    model = Tiny(torch.float32)
    torch_only = OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]).build(
        model_parts=[model])
    processor = health_processor(monkeypatch, optimizer_health=True)
    with pytest.raises(ValueError, match=r"metrics.optimizer_health: no optimizer of this run is titan_lowbit's "
                                         r"\(only torch's AdamW\).*AdamW8bit"):
        processor.optimizers = torch_only
    health_processor(monkeypatch).optimizers = torch_only


def test_optimizer_health_switch_on_the_command_line_and_through_the_override():
    """--metrics.optimizer_health on titan_lowbit's ready configs; the optimizer_health
    override on any config with torchtitan's own metrics processor (its settings kept),
    refused on a processor of a config's own."""
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    ready = ["--module", "titan_lowbit.torchtitan", "--config", "llama3_debug"]
    assert ConfigManager().parse_args([*ready, "--metrics.optimizer_health"]).metrics.optimizer_health
    assert not ConfigManager().parse_args(ready).metrics.optimizer_health

    config = llama3_debugmodel()
    config.metrics.log_freq = 3
    apply_overrides(OverrideConfig(imports=["titan_lowbit.torchtitan.v03.optimizer_health"]), config)
    assert type(config.metrics) is v03.HealthMetricsProcessor.Config
    assert config.metrics.optimizer_health and config.metrics.log_freq == 3

    class OwnProcessor(MetricsProcessor):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            pass

    config = llama3_debugmodel()
    config.metrics = OwnProcessor.Config()
    with pytest.raises(ValueError, match=r"OwnProcessor.Config, one of its own"):
        apply_overrides(OverrideConfig(imports=["titan_lowbit.torchtitan.v03.optimizer_health"]), config)


# ------------------------------------------------------------------------------------------
# end to end: torchrun -m torchtitan.train on gloo processes
# ------------------------------------------------------------------------------------------
def train_run(dump, *args, config="llama3_debug", nproc=2, steps=8):
    """``torchrun -m torchtitan.train`` with titan_lowbit's module and ``config``, its ranks
    forked from the session's server (conftest.torchrun)."""
    target = ["-m", "torchtitan.train", "--module", "titan_lowbit.torchtitan", "--config", config,
              "--dump_folder", str(dump), "--training.steps", str(steps), "--metrics.disable_color_printing", *args]
    proc = torchrun(target, nproc, cpu_run_env(), 900, torchrun_flags=("--local-ranks-filter", "0"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def checkpoint_tensors(folder):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder.parent / (folder.name + ".pt")
    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, weights_only=False)


def flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from flatten(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), tree


CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.no-last_save_model_only"]
# The ready config's AdamW groups with a Muon8bit group beside them (tests/v03_mixed_optimizers.py,
# imported as tests.v03_mixed_optimizers from the repository root, where the ranks start):
# Muon's 8-bit momentum sharded by FSDP2 and each matrix orthogonalised whole by its owner
# rank, its bf16 weights stochastically rounded.
MIXED_OPTIMIZERS = ["--override.imports", 'tests.v03_mixed_optimizers.muon_beside_adamw8bit='
                    '{"name": "Muon8bit", "weight_update": "stochastic"}']
READY_OPTIMIZER_LINES = ("titan_lowbit fp32 states, weights bfloat16, bf16 update master_remainder",
                         "titan_lowbit 8bit states, weights bfloat16, bf16 update master_remainder")


# The straight run also reports the optimizer's health (and the resumed runs, without it,
# end bit for bit where it ends: the read changes nothing). It and the runs resumed from it
# take conftest.SMALL_STEPS (smaller batches, whose loss falls slower, still by more than
# the tests below ask).
HEALTH = ["--metrics.optimizer_health", "--metrics.enable_tensorboard"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, prepared_data):
    dump = tmp_path_factory.mktemp("straight03")
    log = train_run(dump, *CHECKPOINT, *MIXED_OPTIMIZERS, *SMALL_STEPS, *HEALTH)
    return dump, log


@pytest.mark.trainer
def test_debug_config_trains_with_8bit_adamw_and_8bit_muon_states_at_once(straight_run):
    dump, log = straight_run
    for line in READY_OPTIMIZER_LINES:
        assert line in log, log[-3000:]
    assert "titan_lowbit 8bit states (Muon momentum for " in log and "bf16 update stochastic" in log, log[-3000:]
    losses = step_losses(log)
    assert sorted(losses) == list(range(1, 9))
    check_health_reported(log, dump / "tb", 8)
    assert float(losses[8]) < float(losses[1]) - 0.5, losses
    if os.environ.get(LAUNCHER_VARIABLE, "fork") == "fork":
        # rank 0 waited for the other rank's exit, not torchtitan's 2 s (tests/fork_launcher.py)
        assert WAITED_FOR_OTHER_RANKS in log, log[-3000:]
    from titan_lowbit.torchtitan.cpu_device import CPU_PATH_NOISE

    noise = [line for line in log.splitlines()
             if any(f in line for f in (*CPU_PATH_NOISE, "may not have complete support on cpu"))]
    assert not noise, noise  # the CPU path prints none of the warnings that are wrong there


def resumed_from(dump, step, *args, folder=None, **kwargs):
    """``train_run`` in a fresh dump folder (``folder``, else ``dump``'s name + ``-resumed``
    beside it) whose only checkpoint is ``dump``'s step ``step`` (linked), so the run resumes
    from it."""
    folder = folder or dump.parent / f"{dump.name}-resumed"
    (folder / "checkpoint").mkdir(parents=True)
    os.symlink(dump / "checkpoint" / f"step-{step}", folder / "checkpoint" / f"step-{step}")
    log = train_run(folder, *args, **kwargs)
    assert f"Training starts at step {step + 1}" in log, log[-3000:]
    return folder, log


@pytest.mark.trainer
def test_resume_from_step_4_ends_bit_for_bit_where_the_straight_run_ends(straight_run, tmp_path):
    dump, log = straight_run
    resumed, resumed_log = resumed_from(dump, 4, *CHECKPOINT, *MIXED_OPTIMIZERS, *SMALL_STEPS,
                                        folder=tmp_path / "resumed")
    # the checkpoint keeps the LR schedule's settings; the same ones resume without a word
    settings = json.loads((dump / "checkpoint" / "step-4" / SCHEDULE_FILE).read_text())
    assert settings["training.steps"] == 8 and "lr_scheduler.warmup_steps" in settings, settings
    assert "learning-rate schedule differs" not in resumed_log
    straight, again = step_losses(log), step_losses(resumed_log)
    assert {s: again[s] for s in range(5, 9)} == {s: straight[s] for s in range(5, 9)}
    a = dict(flatten(checkpoint_tensors(dump / "checkpoint" / "step-8")))
    b = dict(flatten(checkpoint_tensors(resumed / "checkpoint" / "step-8")))
    assert a.keys() == b.keys()
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    assert any("exp_avg_codes" in k for k in tensors) and any("master_remainder" in k for k in tensors)
    assert any("momentum_buffer_codes" in k for k in tensors)
    for k in tensors:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.trainer
def test_two_process_checkpoint_continues_on_one_process_compiled(straight_run, tmp_path):
    """The straight run's step-4 checkpoint (2 processes, eager) continues on 1 process with
    the model and the loss compiled (Inductor's C++ kernels on the CPU path), the same
    three titan_lowbit optimizers stepping the compiled model's bf16 weights; its
    checkpoint holds the same entries, of the same shapes, as the 2-process eager run's.
    Compiled, it resumes bit for bit too: from its step-5 checkpoint, step 6 ends where it
    ended, every model and optimizer tensor equal."""
    dump, log = straight_run
    compiled = ["--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.no-last_save_model_only",
                "--compile.enable", *MIXED_OPTIMIZERS, *SMALL_STEPS]
    resumed, one_log = resumed_from(dump, 4, "--checkpoint.exclude_from_loading", "dataloader", *compiled,
                                    folder=tmp_path / "one", nproc=1, steps=6)
    losses, straight = step_losses(one_log), step_losses(log)
    assert sorted(losses) == [5, 6]
    assert "Compiling each TransformerBlock with torch.compile" in one_log, one_log[-3000:]
    assert "Compiling the loss function with torch.compile" in one_log, one_log[-3000:]
    # The trained state was loaded: a fresh model starts near the straight run's step-1 loss
    # (ln 2048 and more); the data differ (a new data-parallel degree restarts the loader).
    assert float(losses[5]) < float(straight[1]) - 1.0, (losses, straight)
    one = dict(flatten(checkpoint_tensors(resumed / "checkpoint" / "step-6")))
    two = dict(flatten(checkpoint_tensors(dump / "checkpoint" / "step-8")))
    shapes = {k: tuple(v.shape) for k, v in one.items() if isinstance(v, torch.Tensor)}
    assert shapes == {k: tuple(v.shape) for k, v in two.items() if isinstance(v, torch.Tensor)}

    folder, again_log = resumed_from(resumed, 5, *compiled, nproc=1, steps=6)
    assert step_losses(again_log) == {6: losses[6]}
    again = dict(flatten(checkpoint_tensors(folder / "checkpoint" / "step-6")))
    assert again.keys() == one.keys()
    differ = [k for k in one if isinstance(one[k], torch.Tensor) and not torch.equal(one[k], again[k])]
    assert not differ, differ[:10]


def test_readme_03_command_trains_from_an_empty_directory(tmp_path, prepared_data):
    """README's torchtitan 0.3 launch, as written, from an empty directory (2 steps)."""
    import re
    import shlex

    block = re.search(r"## torchtitan 0.3\n.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    (line,) = [line for line in block.splitlines() if "torchrun" in line]
    words = shlex.split(line)
    env = {**cpu_run_env(), **dict(w.split("=", 1) for w in words[:words.index("torchrun")])}
    args = words[words.index("torchrun") + 1:]
    assert args[args.index("--module") + 1] == "titan_lowbit.torchtitan"
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, "--training.steps", "2",
           "--metrics.disable_color_printing"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert sorted(step_losses(out)) == [1, 2]
    for optimizer_line in READY_OPTIMIZER_LINES:  # the ready config's own optimizer
        assert optimizer_line in out, out[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]


@pytest.mark.trainer
def test_bitnet_with_tensor_parallelism_is_refused_at_start_up(tmp_path, prepared_data):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--local-ranks-filter", "0", "-m", "torchtitan.train", "--module", "titan_lowbit.torchtitan",
           "--config", "llama3_debug_bitnet", "--dump_folder", str(tmp_path),
           "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    proc = subprocess.run(cmd, env=cpu_run_env(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "BitNet linears with tensor parallelism are not supported on torchtitan 0.3" \
        in out, out[-3000:]
    assert "step:" not in out


@pytest.mark.trainer
def test_bitnet_with_subln_trains_with_4bit_states_and_stochastic_rounding_through_the_override(
        tmp_path, prepared_data):
    """The SubLN + BitNet config, its AdamW groups turned into AdamW4bit with stochastic
    rounding by the lowbit_adamw override (on the command line, as a user writes it)."""
    override = json.dumps({"name": "AdamW4bit", "weight_update": "stochastic"})
    log = train_run(tmp_path, "--override.imports", f"titan_lowbit.torchtitan.v03.lowbit_adamw={override}",
                    *SMALL_STEPS, config="llama3_debug_bitnet_subln", steps=6)
    assert "titan_lowbit 4bit states, weights bfloat16, bf16 update stochastic" in log
    losses = step_losses(log)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], losses
    assert float(losses[4]) < float(losses[1]) - 0.3 and float(losses[6]) < float(losses[1]) - 0.3, losses


@pytest.mark.trainer
def test_bitnet_trains_and_resumes_bit_for_bit(tmp_path, prepared_data):
    straight = train_run(tmp_path / "a", *CHECKPOINT, *SMALL_STEPS, config="llama3_debug_bitnet")
    import re

    (count,) = set(re.findall(r"BitNet linears (\d+)", straight))
    assert int(count) == 6 * 5  # debug model: 6 layers x (fused wqkv, wo, w1, w2, w3)
    _, again = resumed_from(tmp_path / "a", 4, *CHECKPOINT, *SMALL_STEPS, config="llama3_debug_bitnet",
                            folder=tmp_path / "b")
    a, b = step_losses(straight), step_losses(again)
    assert float(a[8]) < float(a[1]) - 0.3, a
    assert {s: b[s] for s in range(5, 9)} == {s: a[s] for s in range(5, 9)}


# ------------------------------------------------------------------------------------------
# torchtitan's other meshes, async checkpoints and the Hugging Face export, on 4 processes
# ------------------------------------------------------------------------------------------
def hf_export_as_torchtitan(folder, config):
    """The model of a Hugging Face export (``--checkpoint.last_save_in_hf``) in ``folder``,
    in torchtitan's names (the config's own state-dict adapter)."""
    from safetensors.torch import load_file

    hf = {}
    for f in sorted(folder.glob("*.safetensors")):
        hf.update(load_file(f))
    assert hf, f"no safetensors file in {folder}: {sorted(p.name for p in folder.iterdir())}"
    spec = config.model_spec
    return spec.state_dict_adapter(spec.model, config.hf_assets_path).from_hf(hf)


def model_tensors(tensors):
    return {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)
            and not k.startswith(("optimizer.", "lr_scheduler.", "dataloader.", "train_state."))}


@pytest.mark.trainer
def test_hsdp_resumes_bit_for_bit_from_an_async_checkpoint_and_exports_to_hugging_face(tmp_path, prepared_data):
    """HSDP (data_parallel_replicate_degree 2 x data_parallel_shard_degree 2) with BitNet
    linears and every AdamW group made AdamW8bit with stochastic rounding (the lowbit_adamw
    override; the norms keep fp32 states): the step-2 checkpoint is saved asynchronously
    and carries the LR schedule's settings; resumed from it, the run's step-3 loss and
    model equal the straight run's, whose last save (step 3) is a Hugging Face export of
    those weights. (DCP saves one replica's shards: replicas that rounded differently
    would resume into another loss.)"""
    from titan_lowbit.torchtitan.config_registry import llama3_debug_bitnet

    override = json.dumps({"name": "AdamW8bit", "weight_update": "stochastic"})
    hsdp = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
            *SMALL_STEPS, "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async",
            "--override.imports", f"titan_lowbit.torchtitan.v03.lowbit_adamw={override}"]
    dump = tmp_path / "hsdp"
    straight = train_run(dump, *hsdp, "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only",
                         "--checkpoint.export_dtype", "bfloat16",
                         config="llama3_debug_bitnet", nproc=4, steps=3)
    assert "BitNet linears 30" in straight and "Staging the checkpoint" in straight, straight[-3000:]
    assert "titan_lowbit 8bit states, weights bfloat16, bf16 update stochastic" in straight, straight[-3000:]
    settings = json.loads((dump / "checkpoint" / "step-2" / SCHEDULE_FILE).read_text())
    assert settings["training.steps"] == 3, settings
    resumed, again = resumed_from(dump, 2, *hsdp, "--checkpoint.no-last_save_model_only",
                                  config="llama3_debug_bitnet", nproc=4, steps=3)
    assert "learning-rate schedule differs" not in again
    full, part = step_losses(straight), step_losses(again)
    assert sorted(full) == [1, 2, 3] and part == {3: full[3]}, (full, part)

    exported = hf_export_as_torchtitan(dump / "checkpoint" / "step-3", llama3_debug_bitnet())
    model = model_tensors(dict(flatten(checkpoint_tensors(resumed / "checkpoint" / "step-3"))))
    assert sorted(exported) == sorted(model)
    for key, value in exported.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, model[key]), key


@pytest.mark.trainer
def test_pipeline_x_tensor_parallel_resumes_bit_for_bit(tmp_path, prepared_data):
    """PP 2 x TP 2 with Interleaved1F1B (four stages of the 6-layer model, two model parts
    and two optimizer sets per rank), every AdamW group made AdamW4bit with bf16
    master_remainder weights by the lowbit_adamw override: the TP shards of the debug
    model's 256-wide rows hold whole 128-element blocks (64 bytes of packed 4-bit codes).
    Resumed from step 2, the step-3 checkpoint equals the straight run's in every model and
    optimizer tensor."""
    override = json.dumps({"name": "AdamW4bit", "weight_update": "master_remainder"})
    args = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
            "--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B", "--training.disable_cuda_graphs", *SMALL_STEPS,
            "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no-last_save_model_only",
            "--override.imports", f"titan_lowbit.torchtitan.v03.lowbit_adamw={override}"]
    dump = tmp_path / "pp_tp"
    straight = train_run(dump, *args, nproc=4, steps=3)
    assert "titan_lowbit 4bit states, weights bfloat16, bf16 update master_remainder" in straight, straight[-3000:]
    resumed, _ = resumed_from(dump, 2, *args, nproc=4, steps=3)

    saved = dict(flatten(checkpoint_tensors(dump / "checkpoint" / "step-2")))
    last = dict(flatten(checkpoint_tensors(dump / "checkpoint" / "step-3")))
    again = dict(flatten(checkpoint_tensors(resumed / "checkpoint" / "step-3")))
    # both ends of the pipeline trained, the row-parallel matrices with 4-bit states
    for key in ("tok_embeddings.weight", "lm_head.weight", "layers.0.attention.wo.weight",
                "layers.5.feed_forward.w2.weight"):
        assert not torch.equal(saved[key], last[key]), key
    w2 = "optimizer.state.layers.5.feed_forward.w2.weight"
    assert f"{w2}.exp_avg_codes" in last and f"{w2}.master_remainder" in last, sorted(last)[:20]
    assert tuple(last["optimizer.state.layers.5.attention.wo.weight.exp_avg_codes"].shape) == (256, 128)
    tensors = [k for k in last if isinstance(last[k], torch.Tensor)]
    assert again.keys() == last.keys()
    differ = [k for k in tensors if not torch.equal(last[k], again[k])]
    assert not differ, differ[:10]
