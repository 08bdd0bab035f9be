"""Each "no" of docs/compatibility.md and each setting that would do nothing stops the job
at start-up, naming the key and the fix: the check functions called on parsed configs,
without a Trainer."""

from types import SimpleNamespace

import pytest
import torch

import titan_lowbit.torchtitan  # noqa: F401  (registers everything, as custom_import does)
from torchtitan.config import ConfigManager
from torchtitan.distributed.parallel_dims import ParallelDims

from titan_lowbit.config import check_bitnet_keys

HEADER = '[job]\ncustom_config_module = "titan_lowbit.config"\n'


def job(tmp_path, converters=(), lowbit: str = "", compile_on: bool = False):
    path = tmp_path / "job.toml"
    path.write_text(HEADER + f"[model]\nconverters = {list(converters)!r}\n"
                    f"[compile]\nenable = {str(compile_on).lower()}\n[lowbit]\n{lowbit}\n")
    return ConfigManager().parse_args(["--job.config_file", str(path)])


def dims(dp_shard=1, tp=1, cp=1, dp_replicate=1):
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=1, ep=1,
                        etp=1, world_size=dp_replicate * dp_shard * cp * tp)


# ---- [lowbit] bitnet_* keys -----------------------------------------------------------

@pytest.mark.parametrize("converters", [[], ["bitnet_subln"]])
@pytest.mark.parametrize("setting", [
    'bitnet_filter = ["output", "w2"]', "bitnet_precompute_scale = false",
    "bitnet_keep_codes = true", "bitnet_int8_backward = false", "bitnet_persistent_rows = false"])
def test_bitnet_key_without_the_bitnet_converter_is_refused(tmp_path, converters, setting):
    key = setting.split(" =")[0]
    cfg = job(tmp_path, converters, setting)
    with pytest.raises(ValueError) as err:
        check_bitnet_keys(cfg, dims())
    msg = str(err.value)
    assert f"[lowbit] {key} set" in msg and f"[model] converters = {converters}" in msg
    assert 'Add "bitnet" to [model] converters, or remove it' in msg


def test_bitnet_keys_name_every_key_set_and_defaults_pass(tmp_path):
    cfg = job(tmp_path, [], "bitnet_keep_codes = true\nbitnet_int8_backward = false")
    with pytest.raises(ValueError, match=r"\[lowbit\] bitnet_keep_codes, bitnet_int8_backward set"):
        check_bitnet_keys(cfg, dims())
    # The shipped configs restate the defaults: not a setting, nothing to refuse.
    defaults = ('bitnet_filter = ["output"]\nbitnet_precompute_scale = true\n'
                "bitnet_keep_codes = false\nbitnet_int8_backward = true\nbitnet_persistent_rows = true")
    assert check_bitnet_keys(job(tmp_path, [], defaults), dims()) == []
    assert check_bitnet_keys(job(tmp_path, ["bitnet"], defaults, compile_on=True), dims(dp_shard=2)) == []


@pytest.mark.parametrize("sharding,names", [
    (dict(dp_shard=2), "[parallelism] data_parallel_shard_degree = 2"),
    (dict(tp=2), "[parallelism] tensor_parallel_degree = 2"),
    (dict(cp=2), "[parallelism] context_parallel_degree = 2"),
    (dict(dp_shard=2, tp=2), "data_parallel_shard_degree = 2, [parallelism] tensor_parallel_degree = 2"),
])
def test_keep_codes_with_sharded_weights_is_refused(tmp_path, sharding, names):
    cfg = job(tmp_path, ["bitnet"], "bitnet_keep_codes = true")
    with pytest.raises(ValueError) as err:
        check_bitnet_keys(cfg, dims(**sharding))
    msg = str(err.value)
    assert "[lowbit] bitnet_keep_codes = true" in msg and names in msg and "no effect" in msg


@pytest.mark.parametrize("sharding", [dict(), dict(dp_replicate=2)])
def test_keep_codes_with_unsharded_weights_is_accepted(tmp_path, sharding):
    assert check_bitnet_keys(job(tmp_path, ["bitnet"], "bitnet_keep_codes = true"), dims(**sharding)) == []


def test_the_wrapped_parallelize_refuses_before_torchtitan_parallelizes(tmp_path):
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(spec.model_args["debugmodel"])
    cfg = job(tmp_path, ["bitnet"], "bitnet_keep_codes = true")
    with pytest.raises(ValueError, match=r"\[lowbit\] bitnet_keep_codes = true"):
        spec.parallelize_fn(model, dims(dp_shard=2), cfg)


@pytest.mark.parametrize("setting,compile_on,sharding,note", [
    ("bitnet_persistent_rows = false", False, dict(), "bitnet_persistent_rows = false changes nothing"),
    ("bitnet_persistent_rows = false", True, dict(), None),
    ("bitnet_precompute_scale = false", False, dict(), "bitnet_precompute_scale = false changes nothing"),
    ("bitnet_precompute_scale = false", False, dict(dp_shard=2), None),
    ("bitnet_precompute_scale = false", False, dict(dp_replicate=2), "every BitNet weight is unsharded"),
])
def test_opt_outs_that_change_nothing_get_a_note(tmp_path, setting, compile_on, sharding, note):
    """Turning off a default-on feature where it would not have acted is done as asked:
    a log line, not a refusal (one file serves runs with and without compile)."""
    notes = check_bitnet_keys(job(tmp_path, ["bitnet"], setting, compile_on), dims(**sharding))
    assert (notes == []) if note is None else (len(notes) == 1 and note in notes[0])


def test_subln_with_tensor_parallelism_is_refused(tmp_path):
    from titan_lowbit.bitnet import CONVERTERS

    cfg = job(tmp_path, ["bitnet_subln", "bitnet"])
    with pytest.raises(NotImplementedError) as err:
        CONVERTERS["bitnet_subln"](cfg, dims(tp=2))
    assert "'bitnet_subln'" in str(err.value) and "tensor_parallel_degree = 1" in str(err.value)
    CONVERTERS["bitnet_subln"](cfg, dims(dp_shard=2))  # FSDP alone is fine


# ---- the optimizer builder --------------------------------------------------------------

def build(name="AdamW8bit", early=False, ft_manager=None, base_builder=None, dtype=torch.float32,
          **lowbit):
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import Optimizer as OptimizerConfig

    from titan_lowbit.config import LowBit
    from titan_lowbit.torchtitan.optimizer_builder import build_lowbit_optimizers

    return build_lowbit_optimizers(
        [torch.nn.Linear(64, 64, dtype=dtype)], OptimizerConfig(name=name, early_step_in_backward=early),
        None, ft_manager, lowbit=LowBit(**lowbit), seed=0, base_builder=base_builder or build_optimizers)


def test_torchft_is_refused_for_lowbit_optimizers():
    with pytest.raises(NotImplementedError, match=r"\[optimizer\] name = 'AdamW4bit' .* torchft.*\[fault_tolerance\]"):
        build("AdamW4bit", ft_manager=SimpleNamespace(enabled=True))
    build("AdamW4bit", ft_manager=SimpleNamespace(enabled=False))


def test_a_train_spec_with_its_own_optimizer_builder_is_refused():
    def my_builder(*args, **kwargs):
        raise AssertionError("not reached")

    with pytest.raises(NotImplementedError) as err:
        build("AdamW8bit", base_builder=my_builder)
    msg = str(err.value)
    assert "[optimizer] name = 'AdamW8bit'" in msg and "my_builder" in msg and "Adam/AdamW" in msg


def test_optimizers_of_part_of_the_model_round_with_their_own_keys():
    """Stochastic rounding keys a parameter's noise by the optimizer's seed and the
    parameter's position in it: optimizers that hold part of the model (one per parameter
    with early_step_in_backward, one per model part under pipeline parallelism) each get
    a seed of their parameters' names, so no two parameters share their noise."""
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import Optimizer as OptimizerConfig

    from titan_lowbit.config import LowBit
    from titan_lowbit.torchtitan.optimizer_builder import build_lowbit_optimizers, rounding_seed

    def parts():
        torch.manual_seed(0)
        return [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
                for _ in range(2)]

    def seeds(model_parts, early=False, pp=False):
        dims = SimpleNamespace(pp_enabled=pp, ep_enabled=False, pp=2 if pp else 1)
        container = build_lowbit_optimizers(
            model_parts, OptimizerConfig(name="AdamW8bit", early_step_in_backward=early), dims, None,
            lowbit=LowBit(weight_update="stochastic"), seed=7, base_builder=build_optimizers)
        return [opt.seed for opt in container]

    one = parts()[:1]
    assert seeds(one) == [7]  # one optimizer over the whole model: the seed as given
    early = seeds(one, early=True)
    assert early == [rounding_seed(7, [n]) for n in ("0.weight", "0.bias", "1.weight", "1.bias")]
    two = parts()
    # the two parts' parameters have the same names here; torchtitan's stages keep the
    # whole model's (distinct) names, as the second part's renamed modules do below
    two[1] = torch.nn.Sequential(*([torch.nn.Identity()] * 2), *two[1])
    pipelined = seeds(two, pp=True)
    assert pipelined == [rounding_seed(7, ["0.weight", "0.bias", "1.weight", "1.bias"]),
                         rounding_seed(7, ["2.weight", "2.bias", "3.weight", "3.bias"])]
    assert len(set(early + pipelined + [7])) == len(early + pipelined) + 1


def test_early_step_in_backward_with_pipeline_or_expert_parallelism_is_refused():
    """torchtitan refuses these for its own optimizers; the same for titan_lowbit's."""
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import Optimizer as OptimizerConfig

    from titan_lowbit.config import LowBit
    from titan_lowbit.torchtitan.optimizer_builder import build_lowbit_optimizers

    for degree, key in (("pp", "pipeline_parallel_degree"), ("ep", "expert_parallel_degree")):
        dims = SimpleNamespace(pp_enabled=degree == "pp", ep_enabled=degree == "ep", pp=2, ep=2)
        with pytest.raises(NotImplementedError) as err:
            build_lowbit_optimizers([torch.nn.Linear(64, 64)], OptimizerConfig(name="AdamW8bit", early_step_in_backward=True),
                                    dims, None, lowbit=LowBit(), seed=0, base_builder=build_optimizers)
        assert f"early_step_in_backward = true is not supported with [parallelism] {key} = 2" in str(err.value)


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_checkpointing_is_refused(tmp_path, mode):
    """An async save would return before the manifest and the atomic move can be done."""
    from torchtitan.components.checkpoint import CheckpointManager

    path = tmp_path / "async.toml"
    path.write_text(HEADER + f'[checkpoint]\nenable = true\nasync_mode = "{mode}"\n')
    cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
    with pytest.raises(ValueError) as err:
        CheckpointManager(dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None,
                          states={}, checkpoint_config=cfg.checkpoint, sd_adapter=None)
    msg = str(err.value)
    assert f'[checkpoint] async_mode = "{mode}"' in msg and 'async_mode = "disabled"' in msg
    cfg.checkpoint.enable = False  # no checkpoints, nothing to refuse
    CheckpointManager(dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None,
                      states={}, checkpoint_config=cfg.checkpoint, sd_adapter=None)


def test_subln_with_hugging_face_export_is_refused(tmp_path):
    """torchtitan's llama3 adapter knows no name for the per-linear norms: the export
    would fail at the last save, after the whole run."""
    from titan_lowbit.bitnet import CONVERTERS

    path = tmp_path / "hf.toml"
    path.write_text(HEADER + '[model]\nconverters = ["bitnet_subln", "bitnet"]\n'
                    "[checkpoint]\nenable = true\nlast_save_in_hf = true\n")
    cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
    with pytest.raises(NotImplementedError) as err:
        CONVERTERS["bitnet_subln"](cfg, dims())
    assert "[checkpoint] last_save_in_hf = true" in str(err.value) and "last_save_in_hf = false" in str(err.value)
    cfg.checkpoint.last_save_in_hf = False
    CONVERTERS["bitnet_subln"](cfg, dims())


def test_float8_with_bf16_weights_under_autocast_is_refused(tmp_path):
    """Without FSDP, TP or PP torchtitan trains under torch.autocast, where torchao's
    float8 linears fail on bf16 weights; sharded, the job runs (docs/compatibility.md)."""
    from titan_lowbit.torchtitan.train_spec import check_float8_with_bf16_weights

    bf16 = 'weight_dtype = "bfloat16"'
    with pytest.raises(ValueError, match=r'weight_dtype = "bfloat16" with the float8 converter.*'
                                         r"data_parallel_shard_degree > 1.*\"float32\""):
        check_float8_with_bf16_weights(job(tmp_path, ["quantize.linear.float8"], bf16), dims())
    check_float8_with_bf16_weights(job(tmp_path, ["quantize.linear.float8"], bf16), dims(dp_shard=2))
    check_float8_with_bf16_weights(job(tmp_path, ["quantize.linear.float8"], bf16), dims(tp=2))
    check_float8_with_bf16_weights(job(tmp_path, ["quantize.linear.float8"]), dims())  # fp32 weights
    check_float8_with_bf16_weights(job(tmp_path, [], bf16), dims())
