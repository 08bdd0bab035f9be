"""bf16 weights with fp32 master weights ("master", "master_remainder") start their masters
from an fp32 initialization (titan_lowbit.torchtitan.fp32_init, titan_lowbit.optim.master_start),
unless the weights are replaced before the first step."""

import dataclasses

import pytest
import torch
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.protocols import train_spec

import titan_lowbit.torchtitan  # noqa: F401  (wraps the train specs)
from titan_lowbit.kernels.adamw_lowbit_ref import master_rebuild, master_split
from titan_lowbit.optim import LowBitAdamW

HEADER = '[job]\ncustom_config_module = "titan_lowbit.config"\n'


def _job(tmp_path, update: str):
    path = tmp_path / "job.toml"
    path.write_text(HEADER + '[optimizer]\nname = "AdamW8bit"\nlr = 0.0\nweight_decay = 0.0\n'
                    '[activation_checkpoint]\nmode = "none"\n'
                    f'[lowbit]\nweight_dtype = "bfloat16"\nweight_update = "{update}"\nmin_quantized_numel = 0\n')
    return ConfigManager().parse_args(["--job.config_file", str(path)])


def _model(spec, bf16_job=None, seed=0):
    """A 1-layer llama3 debug model built as torchtitan's Trainer builds it: on the meta
    device, parallelized (by the wrapped train spec when ``bf16_job`` is given), then
    materialized and initialized."""
    args = dataclasses.replace(spec.model_args["debugmodel"], n_layers=1, dim=64, n_heads=4, vocab_size=256)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if bf16_job is not None:
        model = spec.parallelize_fn(model, _dims(), bf16_job)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _dims():
    return ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)


def _masters_after_a_step(model, optimizers) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master after one step at lr 0 (the first step takes them)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizers.step()
    (opt,) = optimizers.optimizers
    return {name: _master(opt, p) for name, p in model.named_parameters()}


@pytest.mark.parametrize("update", ["master", "master_remainder"])
def test_masters_start_from_the_fp32_init_unless_the_weights_were_loaded(tmp_path, update):
    spec = train_spec.get_train_spec("llama3")  # titan_lowbit's wrapped spec
    job = _job(tmp_path, update)
    fp32 = dict(_model(spec).named_parameters())

    model = _model(spec, job)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for name, p in model.named_parameters():  # the weight is the masters' rounding of the fp32 init
        assert torch.equal(p.detach().view(torch.int16), master_split(fp32[name].detach())[0].view(torch.int16)), name
    optimizers = spec.build_optimizers_fn([model], job.optimizer, _dims())
    masters = _masters_after_a_step(model, optimizers)
    for name, master in masters.items():
        assert torch.equal(master.view(torch.int32), fp32[name].detach().view(torch.int32)), name
    assert any(master_split(m)[1].any() for m in masters.values())  # not all on the bf16 grid

    # Weights loaded after the optimizer was built (a model-only checkpoint, pretrained
    # weights): the masters start from them, not from the initialization.
    model = _model(spec, job)
    optimizers = spec.build_optimizers_fn([model], job.optimizer, _dims())
    loaded = {n: p.detach().to(torch.bfloat16) for n, p in _model(spec, seed=1).named_parameters()}
    model.load_state_dict(loaded)
    for name, master in _masters_after_a_step(model, optimizers).items():
        assert torch.equal(master.view(torch.int32), loaded[name].float().view(torch.int32)), name


def _master(opt, p) -> torch.Tensor:
    state = opt.state[p]
    return state["master"] if "master" in state else master_rebuild(p.detach(), state["master_remainder"])


@pytest.mark.parametrize("update", ["master", "master_remainder"])
def test_a_state_dict_loaded_before_the_first_step_replaces_the_given_masters(update):
    """A resume: the checkpoint's masters (here: the weights themselves) win over the fp32
    values the optimizer was given at construction."""
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    w = master_split(x)[0]
    kw = dict(lr=0.0, weight_decay=0.0, state_format="fp32", weight_update=update)
    p_saved, p = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    saved, opt = LowBitAdamW([p_saved], **kw), LowBitAdamW([p], **kw)
    p_saved.grad, p.grad = torch.zeros_like(w), torch.zeros_like(w)
    saved.step()
    opt.start_masters_from({p: x})
    assert torch.equal(_master(opt, p), x)
    opt.load_state_dict(saved.state_dict())
    opt.step()
    assert torch.equal(_master(opt, p), w.float())


def test_given_masters_must_round_to_the_weight():
    x = torch.randn(4, 64)
    p = torch.nn.Parameter(master_split(x)[0])
    opt = LowBitAdamW([("layer.weight", p)], weight_update="master_remainder")
    with pytest.raises(ValueError, match="'layer.weight'.*do not round to its bf16 weight"):
        opt.start_masters_from({p: x + 1.0})
    with pytest.raises(ValueError, match="'layer.weight'.*must be float32 of the parameter's local shape"):
        opt.start_masters_from({p: x.double()})
