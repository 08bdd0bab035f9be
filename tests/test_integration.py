"""The torchtitan integration: config section, registration, flavors, CPU path,
offline data, and bad input stopping before any training."""

import hashlib
import json
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch

import titan_lowbit.torchtitan  # noqa: F401  (registers everything, as custom_import does)
from conftest import PREPARE_DATA, ROOT, DEBUG_CONFIG, parse_job_config, run_train, step_losses


# ---- [lowbit] section -----------------------------------------------------------------

def test_lowbit_section_defaults_and_overrides():
    cfg = parse_job_config("--job.config_file", str(DEBUG_CONFIG), "--lowbit.weight_update", "kahan",
                "--lowbit.block_size", "64")
    assert cfg.lowbit.weight_update == "kahan"
    assert cfg.lowbit.block_size == 64
    assert cfg.lowbit.weight_dtype == "auto"
    assert cfg.lowbit.bitnet_filter == ["output"]
    assert cfg.experimental.custom_import == "titan_lowbit.torchtitan"


@pytest.mark.parametrize("where", ["toml", "command line"])
def test_old_custom_import_names_the_key_and_the_module(tmp_path, where):
    toml = '[job]\ncustom_config_module = "titan_lowbit.config"\n'
    args = ("--experimental.custom_import", "titan_lowbit")
    if where == "toml":
        toml, args = toml + '[experimental]\ncustom_import = "titan_lowbit"\n', ()
    with pytest.raises(ValueError) as err:
        parse_job_config(*args, toml=toml, tmp_path=tmp_path)
    msg = str(err.value)
    assert '[experimental] custom_import = "titan_lowbit"' in msg
    assert 'custom_import = "titan_lowbit.torchtitan"' in msg


def test_unknown_lowbit_key_names_key_and_valid_keys(tmp_path):
    toml = '[job]\ncustom_config_module = "titan_lowbit.config"\n[lowbit]\nweight_updat = "kahan"\n'
    with pytest.raises(ValueError) as err:
        parse_job_config(toml=toml, tmp_path=tmp_path)
    msg = str(err.value)
    assert "[lowbit] weight_updat" in msg and "'weight_update'" in msg and "'block_size'" in msg


@pytest.mark.parametrize("key,value,choices", [
    ("weight_update", '"stochastik"', "'stochastic'"),
    ("weight_dtype", '"fp16"', "'bfloat16'"),
    ("nonfinite_grad", '"ignore"', "'skip'"),
])
def test_bad_lowbit_value_names_key_and_choices(tmp_path, key, value, choices):
    toml = f'[job]\ncustom_config_module = "titan_lowbit.config"\n[lowbit]\n{key} = {value}\n'
    with pytest.raises(ValueError) as err:
        parse_job_config(toml=toml, tmp_path=tmp_path)
    assert f"[lowbit] {key}" in str(err.value) and choices in str(err.value)


@pytest.mark.parametrize("block", [-1, 3, 96])
def test_bad_block_size(tmp_path, block):
    toml = f'[job]\ncustom_config_module = "titan_lowbit.config"\n[lowbit]\nblock_size = {block}\n'
    with pytest.raises(ValueError, match=r"\[lowbit\] block_size"):
        parse_job_config(toml=toml, tmp_path=tmp_path)


@pytest.mark.parametrize("key,value,kind", [
    ("block_size", '"128"', "int"), ("block_size", "128.0", "int"), ("min_quantized_numel", '"4096"', "int"),
    ("bitnet_int8_backward", '"false"', "bool"), ("bitnet_keep_codes", '"no"', "bool"),
    ("bitnet_filter", "3", "list of strings"), ("bitnet_filter", "[1, 2]", "list of strings"),
    ("fp32_states", "[1]", "list of strings"), ("fp32_states", '["output", ""]', "list of strings"),
])
def test_lowbit_value_of_the_wrong_type_is_refused(tmp_path, key, value, kind):
    """tyro hands a TOML value of the wrong type through as it is: a string "false" for
    a bool would read as true."""
    toml = f'[job]\ncustom_config_module = "titan_lowbit.config"\n[lowbit]\n{key} = {value}\n'
    with pytest.raises(ValueError, match=rf"\[lowbit\] {key} = .* must be a (TOML )?{kind}"):
        parse_job_config(toml=toml, tmp_path=tmp_path)


@pytest.mark.parametrize("name,lowbit,early,match", [
    ("AdamW", dict(block_size=64), False, r"\[lowbit\] block_size set, but \[optimizer\] name = 'AdamW' is torch's"),
    ("AdamW", dict(nonfinite_grad="skip", min_quantized_numel=1), False, "min_quantized_numel, nonfinite_grad set"),
    ("AdamW", dict(health_metrics=True), False, r"\[lowbit\] health_metrics set, but \[optimizer\] name = 'AdamW' is torch's"),
    ("AdamW8bit", dict(weight_update="stochastic"), False, "all parameters are fp32"),
    ("AdamW", dict(weight_update="kahan"), False, "all parameters are fp32"),
    ("AdamW8bit", dict(nonfinite_grad="skip"), True, "early_step_in_backward each parameter steps on its own"),
])
def test_optimizer_settings_that_would_be_ignored_are_refused(name, lowbit, early, match):
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import Optimizer as OptimizerConfig

    from titan_lowbit.config import LowBit
    from titan_lowbit.torchtitan.optimizer_builder import build_lowbit_optimizers

    with pytest.raises(ValueError, match=match):
        build_lowbit_optimizers([torch.nn.Linear(64, 64)], OptimizerConfig(name=name, early_step_in_backward=early),
                                None, lowbit=LowBit(**lowbit), seed=0, base_builder=build_optimizers)


@pytest.mark.parametrize("lowbit", [dict(block_size=64), dict(min_quantized_numel=1)])
def test_quantization_keys_with_torch_adamw_on_bf16_weights_are_refused(lowbit):
    """torch's AdamW with a bf16 weight update is built as LowBitAdamW with fp32 states:
    nothing is quantized, so the quantization keys would change nothing."""
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import Optimizer as OptimizerConfig

    from titan_lowbit.config import LowBit
    from titan_lowbit.torchtitan.optimizer_builder import build_lowbit_optimizers

    key = next(iter(lowbit))
    with pytest.raises(ValueError, match=rf"\[lowbit\] {key} set, but \[optimizer\] name = 'AdamW' keeps fp32 "
                                         r"states.*\(Adam4bit, Adam8bit, AdamFp8, AdamW4bit, AdamW8bit, AdamWFp8\)"):
        build_lowbit_optimizers([torch.nn.Linear(64, 64).to(torch.bfloat16)], OptimizerConfig(name="AdamW"), None,
                                lowbit=LowBit(weight_update="stochastic", **lowbit), seed=0,
                                base_builder=build_optimizers)


# ---- registration -------------------------------------------------------------------

def test_unknown_converter_lists_registered_ones():
    from torchtitan.protocols.model_converter import build_model_converters

    cfg = parse_job_config("--job.config_file", str(DEBUG_CONFIG), "--model.converters", "bitnt")
    with pytest.raises(ValueError) as err:
        build_model_converters(cfg, parallel_dims=None)
    assert "'bitnt'" in str(err.value) and "'bitnet'" in str(err.value)


def test_optimizer_names_and_unknown_name():
    from titan_lowbit.torchtitan.optimizer_builder import check_optimizer_name, valid_optimizer_names

    names = valid_optimizer_names()
    for name in ("Adam", "AdamW", "AdamW8bit", "AdamW4bit", "AdamWFp8"):
        assert name in names
    with pytest.raises(ValueError) as err:
        check_optimizer_name("AdamW9bit")
    assert "'AdamW9bit'" in str(err.value) and "'AdamW8bit'" in str(err.value)


def test_train_specs_are_wrapped_and_flavor_registered():
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("llama3")
    assert spec.build_optimizers_fn.titan_lowbit_wrapped
    args = spec.model_args["1B"]
    with torch.device("meta"):
        model = spec.model_cls(args)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["tok_embeddings.weight"] == (32000, 2048)
    assert shapes["output.weight"] == (32000, 2048)
    assert shapes["layers.0.attention.wq.weight"] == (2048, 2048)
    assert shapes["layers.0.attention.wk.weight"] == (256, 2048)
    assert shapes["layers.0.feed_forward.w1.weight"] == (5632, 2048)
    assert shapes["layers.0.feed_forward.w2.weight"] == (2048, 5632)
    assert len(model.layers) == 22
    assert 1.09e9 < sum(p.numel() for p in model.parameters()) < 1.11e9


def test_health_metrics_need_torchtitans_own_metrics_processor():
    """[lowbit] health_metrics adds its numbers to torchtitan's MetricsProcessor; a train
    spec with a metrics processor of its own is refused (its numbers would go nowhere),
    and kept as it is with health_metrics off."""
    from titan_lowbit.config import LowBit
    from titan_lowbit.torchtitan.train_spec import wrap_build_metrics_processor

    def own_processor(job_config, parallel_dims, model_args=None, tag=None):
        return "own"

    build = wrap_build_metrics_processor(own_processor)
    assert build(SimpleNamespace(lowbit=LowBit()), None) == "own"
    with pytest.raises(NotImplementedError, match=r"\[lowbit\] health_metrics = true: .*own_processor"):
        build(SimpleNamespace(lowbit=LowBit(health_metrics=True)), None)


@pytest.mark.trainer
def test_weight_dtype_casts_parameters_not_buffers():
    from titan_lowbit.torchtitan.train_spec import cast_parameters
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(spec.model_args["debugmodel"])
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    assert cast_parameters(model, torch.bfloat16) == len(list(model.parameters()))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert {n: b.dtype for n, b in model.named_buffers()} == buffers


def test_cpu_device_module_answers_memory_monitor():
    from titan_lowbit.torchtitan.cpu_device import CpuDeviceModule

    stats = CpuDeviceModule.memory_stats()
    assert stats["reserved_bytes.all.peak"] > 10 * 2**20  # this process holds torch
    assert CpuDeviceModule.get_device_properties().total_memory > stats["reserved_bytes.all.peak"]


# ---- offline data -------------------------------------------------------------------

def _corpus(tmp_path):
    corpus = tmp_path / "corpus"
    for i in range(60):
        sub = corpus / f"dir{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        words = " ".join(f"word{(i * 7 + j) % 97} token{j % 13}" for j in range(200))
        (sub / f"doc{i}.txt").write_text(f"Document {i}.\n{words}\n")
    (corpus / "image.bin").write_bytes(bytes(range(256)))  # not a text suffix: skipped
    return corpus


def _prepare(*args):
    return subprocess.run([*PREPARE_DATA, *args], cwd=ROOT, capture_output=True, text=True)


def test_prepare_data_is_deterministic_with_disjoint_splits(tmp_path):
    corpus = _corpus(tmp_path)
    for out in ("a", "b"):
        proc = _prepare("--corpus", str(corpus), "--out", str(tmp_path / out),
                        "--vocab-size", "300", "--validation-every", "5")
        assert proc.returncode == 0, proc.stderr
    ma = json.loads((tmp_path / "a" / "manifest.json").read_text())
    mb = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert ma["sha256"] == mb["sha256"]
    assert ma["vocab_size"] == 300

    def sources(split):
        lines = (tmp_path / "a" / f"{split}.jsonl").read_text().splitlines()
        return {json.loads(l)["source"].split("#")[0] for l in lines}

    train, val = sources("train"), sources("validation")
    assert train and val and not train & val
    assert len(train | val) == 60
    # Each split is shuffled by a hash of the document ids, not left in file order.
    for split in ("train", "validation"):
        ids = [json.loads(l)["source"]
               for l in (tmp_path / "a" / f"{split}.jsonl").read_text().splitlines()]
        assert ids == sorted(ids, key=lambda d: hashlib.sha256(d.encode()).digest())
        assert len(ids) < 3 or ids != sorted(ids)

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(str(tmp_path / "a" / "tokenizer"))
    ids = tok.encode("Document 7.\nword3 token4", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids) < 300
    assert tok.decode(ids[1:-1]) == "Document 7.\nword3 token4"


def test_prepare_data_missing_corpus_is_a_clear_error(tmp_path):
    proc = _prepare("--corpus", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert proc.returncode != 0
    assert "--corpus" in proc.stderr and "nope" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_missing_split_names_the_key_that_chose_its_folder(tmp_path, monkeypatch):
    """[training] dataset_path set, [validation] dataset_path not: the validation split is
    read from the default data folder, and the error says that key is the one to set."""
    from titan_lowbit.torchtitan.datasets import DATASET_CONFIGS

    load = DATASET_CONFIGS["lowbit_text_validation"].loader
    monkeypatch.setenv("TITAN_LOWBIT_DATA", str(tmp_path / "default"))
    with pytest.raises(FileNotFoundError) as err:
        load(str(tmp_path / "default"))
    msg = str(err.value)
    assert "[validation] dataset_path is not set" in msg and "[training]" not in msg
    assert str(tmp_path / "default") in msg and "`python -m titan_lowbit.prepare_data`" in msg

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "train.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(FileNotFoundError) as err:
        load(str(tmp_path / "mine"))
    msg = str(err.value)
    assert f"[validation] dataset_path = '{tmp_path / 'mine'}'" in msg
    assert f"`python -m titan_lowbit.prepare_data --out {tmp_path / 'mine'}`" in msg


def test_the_default_tokenizer_path_is_not_reported_missing_for_the_corpus(tmp_path):
    """torchtitan warns at parse time that its default hf_assets_path does not exist; for a
    job on the offline corpus that is wrong (its own tokenizer is used), for another dataset
    it is right and stays."""
    import logging

    def shown(*args) -> list[str]:
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        root, handler = logging.getLogger(), Keep()
        root.addHandler(handler)
        try:
            parse_job_config("--job.config_file", str(DEBUG_CONFIG), *args)
        finally:
            root.removeHandler(handler)
        return [m for m in records if "does not exist!" in m]

    assert shown("--training.dataset", "c4_test") == ["HF assets path ./tests/assets/tokenizer does not exist!"]
    assert shown() == []
    assert shown("--model.hf_assets_path", str(tmp_path / "mine")) == [
        f"HF assets path {tmp_path / 'mine'} does not exist!"]


def test_tokenizer_comes_from_the_corpus_unless_the_config_names_one(tmp_path):
    from titan_lowbit.torchtitan.datasets import resolve_tokenizer

    (tmp_path / "data" / "tokenizer").mkdir(parents=True)
    (tmp_path / "data" / "tokenizer" / "tokenizer.json").write_text("{}")
    base = ["--job.config_file", str(DEBUG_CONFIG), "--training.dataset_path",
            str(tmp_path / "data")]
    cfg = parse_job_config(*base)
    resolve_tokenizer(cfg)
    assert cfg.model.hf_assets_path == str(tmp_path / "data" / "tokenizer")
    cfg = parse_job_config(*base, "--model.hf_assets_path", "my/tokenizer")
    resolve_tokenizer(cfg)
    assert cfg.model.hf_assets_path == "my/tokenizer"
    cfg = parse_job_config(*base, "--training.dataset", "c4_test")
    resolve_tokenizer(cfg)
    assert cfg.model.hf_assets_path == "./tests/assets/tokenizer"  # torchtitan's default
    cfg = parse_job_config("--job.config_file", str(DEBUG_CONFIG), "--training.dataset_path",
                str(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match=r"\[training\] dataset_path = .*--out"):
        resolve_tokenizer(cfg)


def test_train_sh_turns_colours_off_where_its_output_is_not_a_terminal(tmp_path):
    """torchtitan's ANSI colour codes would fill log files: scripts/train.sh asks for plain
    lines when its output goes to a file or pipe, before the user's overrides (which may
    turn them on again). A stand-in interpreter records the command train.sh starts."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$*" in *device_count*) echo 0;; *torch.distributed.run*) '
                    'echo "$@";; esac\n')
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake))
    env.pop("TITAN_LOWBIT_DEVICE", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "train.sh"), str(DEBUG_CONFIG),
                           "--training.steps", "3"], env=env, capture_output=True, text=True,
                          check=True)
    args = proc.stdout.split()
    assert args[-3:] == ["--metrics.disable_color_printing", "--training.steps", "3"], proc.stdout
    assert args[args.index("--job.config_file") + 1] == str(DEBUG_CONFIG)


# ---- bad input stops the real launcher before training ---------------------------------

@pytest.mark.parametrize("override,expect,launcher", [
    (("--optimizer.name", "AdamW9bit"), ["'AdamW9bit'", "'AdamW8bit'"], "train.sh"),
    (("--model.converters", "bitnt"), ["'bitnt'", "'bitnet'"], "any"),
])
@pytest.mark.trainer
def test_launcher_stops_before_training_on_bad_names(override, expect, launcher, prepared_data,
                                                      tmp_path):
    """Through scripts/train.sh and torchrun once; the second name through the tests'
    launcher (the same Trainer start-up, without the imports)."""
    proc = run_train(*override, "--job.dump_folder", str(tmp_path), nproc=1, check=False,
                     launcher=launcher)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert not step_losses(out), "training started despite the bad config"
    for text in expect:
        assert text in out, out[-4000:]
