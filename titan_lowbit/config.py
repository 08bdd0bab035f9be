"""The ``[lowbit]`` section of torchtitan's JobConfig.

torchtitan merges this module's ``JobConfig`` into its own when a TOML file says
``[job] custom_config_module = "titan_lowbit.config"``. Every value is checked here,
at parse time, so a typo stops the job before a model is built.

The optimizer itself is chosen by torchtitan's own ``[optimizer] name`` (``AdamW8bit``,
``AdamW4bit``, ...); this section only holds what torchtitan has no key for.
"""


import inspect
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Literal, get_args

from titan_lowbit.bitnet.converter import DEFAULTS as BITNET_DEFAULTS
from titan_lowbit.compat import torchtitan_line
from titan_lowbit.kernels.private_apis import patch, private_api_ok
# (the block rule lives with the code books, which kernels and optimizer share)
from titan_lowbit.kernels.quant_maps import is_block_size
from titan_lowbit.log_notes import drop_notes, keep_notes
from titan_lowbit.optim.adamw import NONFINITE_POLICIES as OPTIMIZER_NONFINITE_POLICIES
from titan_lowbit.optim.adamw import WEIGHT_UPDATES as OPTIMIZER_WEIGHT_UPDATES
from titan_lowbit.optim.adamw import LowBitAdamW
from titan_lowbit.optim.muon import LowBitMuon
from titan_lowbit.optim.muon_groups import DEFAULT_ADAMW_FQNS as MUON_DEFAULT_ADAMW_FQNS
from titan_lowbit.optim.muon_groups import MOMENTUM_4BIT_CODECS
from titan_lowbit.prepare_data import DATASET_SPLITS

# The optimizer's own defaults (LowBitAdamW's signature) are the section's.
_OPTIMIZER_DEFAULTS = {name: p.default for name, p in inspect.signature(LowBitAdamW).parameters.items()}
_MUON_DEFAULTS = {name: p.default for name, p in inspect.signature(LowBitMuon).parameters.items()}

WeightDtype = Literal["auto", "float32", "bfloat16"]
WeightUpdate = Literal[tuple(OPTIMIZER_WEIGHT_UPDATES)]
# "ignore" (no check at all) is left to LowBitAdamW's own users and benchmarks.
NonfinitePolicy = Literal[tuple(p for p in OPTIMIZER_NONFINITE_POLICIES if p != "ignore")]
Momentum4bitLevels = Literal[tuple(MOMENTUM_4BIT_CODECS)]
WEIGHT_DTYPES = get_args(WeightDtype)
WEIGHT_UPDATES = get_args(WeightUpdate)
NONFINITE_POLICIES = get_args(NonfinitePolicy)


def _check_choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(
            f"[lowbit] {key} = {value!r} is not valid; choose one of {list(choices)}"
        )


# The keys that hold FQN fragments (titan_lowbit/fqn_fragments.py), with an example each.
FRAGMENT_LISTS = {"bitnet_filter": '["output"]', "fp32_states": '["tok_embeddings", "output"]',
                  "muon_adamw_fqns": '["tok_embeddings", "output"]'}


@dataclass
class LowBit:
    weight_dtype: WeightDtype = "auto"
    """dtype of the (sharded) parameters: "auto" keeps what torchtitan builds
    (training.dtype), "bfloat16" holds parameters in bf16 (full-BF16 training: no fp32
    copy of the weights unless weight_update = "master"; "master_remainder" keeps its
    low 16 bits), "float32" insists on fp32."""

    weight_update: WeightUpdate = _OPTIMIZER_DEFAULTS["weight_update"]
    """How the fp32 AdamW result lands in a bf16 parameter: nearest (plain cast),
    stochastic (stochastic rounding, seeded by debug.seed, step and element), kahan
    (bf16 compensation buffer), master (fp32 master weights in the optimizer state),
    master_remainder (the same fp32 master weights, bit for bit, kept as the bf16 weight
    plus a 16-bit remainder in the optimizer state: 2 bytes per parameter instead of 4).
    fp32 parameters are updated exactly: a value other than nearest with every parameter
    in fp32 is refused at start-up (set weight_dtype = "bfloat16"). Where each optimizer
    holds part of the model ([optimizer] early_step_in_backward, pipeline parallelism),
    stochastic rounding keys each one by its parameters' names."""

    block_size: int = _OPTIMIZER_DEFAULTS["block_size"]
    """Quantization block length along the last dimension; 0 = the format's default
    (8-bit: 256, 4-bit: 128, fp8: 128)."""

    min_quantized_numel: int = _OPTIMIZER_DEFAULTS["min_quantized_numel"]
    """Parameters with fewer elements keep fp32 optimizer state (norms, biases)."""

    fp32_states: list[str] = field(default_factory=list)
    """Fully-qualified-name fragments of parameters that keep fp32 optimizer states (8
    bytes per element) whatever [optimizer] name's state format, e.g. ["tok_embeddings",
    "output"]: a parameter is selected when its FQN contains a fragment, as bitnet_filter
    selects modules (titan_lowbit/fqn_fragments.py). A fragment that selects no
    parameter, a selection of every parameter, and an [optimizer] name whose states are
    fp32 anyway are refused at start-up. The weights keep weight_dtype."""

    nonfinite_grad: NonfinitePolicy = _OPTIMIZER_DEFAULTS["nonfinite_grad"]
    """A NaN/inf gradient: "raise" (checked inside the optimizer kernels, at no cost)
    leaves the quantization blocks it hits unwritten and stops at the next optimizer step
    or checkpoint save, naming the parameter and the step; "skip" checks all gradients
    before each step (one more read of them and a host sync) and skips the whole step,
    counting it in the logs."""

    health_metrics: bool = False
    """Report the optimizer's health at every step torchtitan logs ([metrics] log_freq):
    the largest update relative to lr, the fraction of quantized second moments at their
    smallest code, skipped steps, and for bf16 weights the updates lost to rounding
    (nearest) or the Kahan/master residual in ulps (docs/health_metrics.md). A second
    console line after torchtitan's, and TensorBoard / Weights & Biases scalars under
    optimizer_health/. Read from the states after the step, on logged steps only (one more
    read of the optimizer states there; nothing on the other steps). For titan_lowbit's
    optimizers: refused with torch's Adam/AdamW."""

    convert_optimizer_states: bool = False
    """Resume a checkpoint whose optimizer states have another layout than this run's
    ([optimizer] name's state format, or torch's Adam/AdamW; block_size, weight_update,
    min_quantized_numel) by converting them: dequantized to fp32 and requantized into this
    run's format, master weights or remainders built from the checkpoint's master or
    weights; one log line per setting that changed. Off, such a resume stops naming the
    settings (the states would otherwise load as garbage or not at all). fp32 weights
    resume as bf16 weights with weight_update master or master_remainder (the fp32
    weights become the masters exactly) and back; Adam* against AdamW* and any other
    change of the weight dtype are not converted."""
    # Every muon_* key configures the Muon names of [optimizer] name: set to a value other
    # than its default with another name, it is refused at start-up (optimizer_builder).
    muon_momentum: float = _MUON_DEFAULTS["momentum"]
    """Muon's momentum coefficient (``M <- momentum * M + (1 - momentum) * G``) for the
    matrices of the Muon names (Muon, Muon8bit, Muon4bit, MuonFp8); their inner AdamW
    takes [optimizer] beta1 and beta2."""

    muon_4bit_levels: Momentum4bitLevels = _MUON_DEFAULTS["momentum_4bit_levels"]
    """The levels of Muon4bit's momentum codes: "nf4" (QLoRA's NormalFloat4 levels) or
    "dynamic" (the dynamic map of AdamW4bit's first moment, which Muon4bit's inner AdamW
    keeps). With NF4 levels Muon4bit ends closer to fp32 Muon (docs/muon.md). A Muon4bit
    checkpoint that records no levels was written with "dynamic": resume it with that
    value. Refused with the other names."""

    muon_4bit_factor_rank: int = _MUON_DEFAULTS["momentum_4bit_factor_rank"]
    """k > 0: Muon4bit's momentum keeps a bf16 factor of rank min(k, rows, cols) beside
    its codes, which then hold only the residual; renewed from the new momentum at every
    step (2 k (rows + cols) bytes per matrix; docs/muon.md). 0: none. Not yet with a
    matrix's columns split over ranks (tensor parallel; refused at start-up). A Muon4bit checkpoint
    that records no rank was written with 0. Refused with the other names."""

    muon_adamw_fqns: list[str] = field(default_factory=lambda: list(MUON_DEFAULT_ADAMW_FQNS))
    """Fully-qualified-name fragments of the 2-D parameters that a Muon name steps with its
    inner AdamW instead of Muon (selected as fp32_states selects, titan_lowbit/
    fqn_fragments.py). Parameters that are not 2-D (norms, biases) always go to AdamW. The
    default names the embedding tables and output heads of torchtitan and Hugging Face
    models; a fragment set here that selects no parameter is refused at start-up."""

    # Every bitnet_* key configures converter "bitnet": set to a value other than its
    # default without that converter, it is refused at start-up (check_bitnet_keys).
    bitnet_filter: list[str] = field(default_factory=lambda: list(BITNET_DEFAULTS["bitnet_filter"]))
    """Fully-qualified-name fragments of nn.Linear layers that converter "bitnet" leaves
    in high precision (default: the output head). Embeddings are never converted."""

    bitnet_precompute_scale: bool = BITNET_DEFAULTS["bitnet_precompute_scale"]
    """Compute every BitNet weight scale after the optimizer step with one collective
    for all layers (instead of one per layer inside the all-gather)."""

    bitnet_keep_codes: bool = BITNET_DEFAULTS["bitnet_keep_codes"]
    """Unsharded BitNet weights (one device, no FSDP or TP) keep their ternary codes
    (and the codes transposed, for grad_input) from one optimizer step to the next,
    computed after the optimizer step, instead of quantizing each weight in every
    forward: fewer kernel launches per forward, 2 bytes per weight element kept between
    steps. Same formula; the scale's sum |W| is added in another order. Faster where the
    step waits on the host, slower where it does not (measured in docs/bitnet.md, "Kept
    ternary codes"), hence off by default. Refused at start-up when FSDP2 or TP shards the
    weights, where it would have no effect."""

    bitnet_int8_backward: bool = BITNET_DEFAULTS["bitnet_int8_backward"]
    """Compute BitNet grad_input on int8 tensor cores (grad_output quantized row-wise);
    False computes it in the activation dtype."""

    bitnet_persistent_rows: bool = BITNET_DEFAULTS["bitnet_persistent_rows"]
    """Under compile.enable, let Inductor keep a row in registers (one read of the row)
    for the row quantizations it fuses, on rows up to 8192 elements whose inputs fit
    (titan_lowbit/bitnet/row_reductions.py); False keeps Inductor's default (rows over
    1024 elements are read twice). Same math; as with any change of Inductor's fusion, an
    intermediate may be rounded at a different point. False without compile changes nothing
    (one log line says so)."""

    def __post_init__(self) -> None:
        for key in FRAGMENT_LISTS:  # one string on the command line: comma-separated
            if isinstance(getattr(self, key), str):
                setattr(self, key, [s for s in getattr(self, key).split(",") if s])
        # Types first: tyro passes a TOML value of the wrong type through as it is (a
        # string "false" for a bool would read as true).
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in (bool, int) and (type(value) is not f.type):
                raise ValueError(
                    f"[lowbit] {f.name} = {value!r} must be a TOML {f.type.__name__} "
                    f"({'true or false' if f.type is bool else 'an integer'}, without quotes)"
                )
            if f.type is float and type(value) not in (float, int):
                raise ValueError(f"[lowbit] {f.name} = {value!r} must be a TOML float (a number, without quotes)")
        for key, example in FRAGMENT_LISTS.items():
            value = getattr(self, key)
            if not (isinstance(value, list) and all(isinstance(s, str) and s for s in value)):
                raise ValueError(
                    f"[lowbit] {key} = {value!r} must be a list of strings "
                    f"(name fragments, none empty, e.g. {example})"
                )
        _check_choice("weight_dtype", self.weight_dtype, WEIGHT_DTYPES)
        _check_choice("weight_update", self.weight_update, WEIGHT_UPDATES)
        _check_choice("nonfinite_grad", self.nonfinite_grad, NONFINITE_POLICIES)
        _check_choice("muon_4bit_levels", self.muon_4bit_levels, get_args(Momentum4bitLevels))
        if not is_block_size(self.block_size):
            raise ValueError(
                f"[lowbit] block_size = {self.block_size} must be 0 (the format's default) "
                "or a power of two >= 2"
            )
        if self.muon_4bit_factor_rank < 0:
            raise ValueError(f"[lowbit] muon_4bit_factor_rank = {self.muon_4bit_factor_rank} must be >= 0 "
                             "(0: no factor)")
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"[lowbit] muon_momentum = {self.muon_momentum} must lie in [0, 1)")
        if self.min_quantized_numel < 0:
            raise ValueError(
                f"[lowbit] min_quantized_numel = {self.min_quantized_numel} must be >= 0"
            )


def lowbit_of(job_config) -> LowBit:
    """The ``[lowbit]`` section of a JobConfig; its defaults when the job did not add the
    section (no ``custom_config_module``)."""
    return getattr(job_config, "lowbit", None) or LowBit()


def _bitnet_keys_set(lowbit: LowBit) -> list[str]:
    """The ``[lowbit] bitnet_*`` keys whose value differs from the converter's default."""
    return [k for k, default in BITNET_DEFAULTS.items()
            if (list(getattr(lowbit, k)) != list(default) if isinstance(default, tuple)
                else getattr(lowbit, k) != default)]


def check_bitnet_keys(job_config, parallel_dims) -> list[str]:
    """Refuse the ``[lowbit] bitnet_*`` settings this job would ignore, before the model
    is parallelized; returns the notes to log for the settings that change nothing here.

    A key that asks for something the job would not do (a BitNet option without the
    ``bitnet`` converter, kept codes for weights that are all sharded) is an error naming
    the key. A default-on feature turned off where it would not have acted anyway
    (``bitnet_persistent_rows = false`` without compile, ``bitnet_precompute_scale =
    false`` with no sharded weight) gets what it asked for: a note, not an error, so one
    file serves runs with and without compile or sharding."""
    lowbit = lowbit_of(job_config)
    converters = list(job_config.model.converters or [])
    if "bitnet" not in converters:
        if keys := _bitnet_keys_set(lowbit):
            raise ValueError(
                f"[lowbit] {', '.join(keys)} set, but [model] converters = {converters} has no "
                f"'bitnet': {'these keys configure' if len(keys) > 1 else 'this key configures'} "
                'the BitNet converter only. Add "bitnet" to [model] converters, or remove '
                f"{'them' if len(keys) > 1 else 'it'}."
            )
        return []
    sharded_by = [f"[parallelism] {key} = {degree}" for key, degree in (
        ("data_parallel_shard_degree", parallel_dims.dp_shard),
        ("context_parallel_degree", parallel_dims.cp),  # FSDP2 shards over the CP ranks too
        ("tensor_parallel_degree", parallel_dims.tp)) if degree > 1]
    if lowbit.bitnet_keep_codes and sharded_by:
        raise ValueError(
            f"[lowbit] bitnet_keep_codes = true keeps the ternary codes of unsharded BitNet "
            f"weights, but with {', '.join(sharded_by)} every BitNet weight is sharded (their "
            "codes come with the all-gather or from the local shard): it would have no effect. "
            "Remove bitnet_keep_codes (or set it to false): it acts on unsharded weights, as "
            "on one device."
        )
    notes = []
    if not lowbit.bitnet_persistent_rows and not job_config.compile.enable:
        notes.append("titan_lowbit: [lowbit] bitnet_persistent_rows = false changes nothing "
                     "without [compile] enable = true (Inductor's defaults are kept either way)")
    if not lowbit.bitnet_precompute_scale and not sharded_by:
        notes.append("titan_lowbit: [lowbit] bitnet_precompute_scale = false changes nothing "
                     "here: every BitNet weight is unsharded, and unsharded weights need no "
                     "precomputed scale")
    return notes


def unknown_keys(cls, data: dict, section: str = "") -> list[str]:
    """Every ``[section] key`` of a parsed TOML dict that the dataclass ``cls`` lacks,
    each with the valid keys of its section, recursing into nested sections."""
    valid = {f.name: f.type for f in fields(cls)}
    problems = []
    for key, value in data.items():
        where = f"[{section}] {key}" if section else f"[{key}]"
        if key not in valid:
            problems.append(f"{where} is not a known key; valid keys: {sorted(valid)}")
        elif is_dataclass(valid[key]) and isinstance(value, dict):
            problems += unknown_keys(valid[key], value, f"{section}.{key}" if section else key)
    return problems


def _wrap_config_manager(method: str, check) -> None:
    """Run ``check(manager, *args)`` before torchtitan's ``ConfigManager.<method>``. Both
    methods wrapped here are torchtitan's private ones: only with a tested torchtitan
    (kernels/private_apis.py), once per process."""
    if torchtitan_line() != (0, 2) or not private_api_ok("torchtitan"):
        return
    from torchtitan.config.manager import ConfigManager

    original = getattr(ConfigManager, method)
    if getattr(original, "titan_lowbit_checked", False):
        return

    def wrapped(self, *args):
        check(self, *args)
        return original(self, *args)

    wrapped.titan_lowbit_checked = True
    patch(ConfigManager, method, wrapped)


def _check_keys(manager, cls, data) -> None:
    """Name an unknown TOML key together with the valid ones (torchtitan 0.2.x names only
    the unknown key, and tells to run a script of its own repository). Same acceptance,
    better message; ConfigManager._dict_to_dataclass builds every section."""
    top_level = is_dataclass(cls) and "job" in {f.name for f in fields(cls)}
    if top_level and isinstance(data, dict):
        if problems := unknown_keys(cls, data):
            raise ValueError("invalid TOML config:\n  " + "\n  ".join(problems))


INTEGRATION_MODULE = "titan_lowbit.torchtitan"


def check_custom_import(job_config) -> None:
    """``custom_import = "titan_lowbit"`` imports a package that registers nothing (the
    integration is the module INTEGRATION_MODULE): stop with the key and its value."""
    if job_config.experimental.custom_import == "titan_lowbit":
        raise ValueError(
            '[experimental] custom_import = "titan_lowbit" registers nothing: the torchtitan '
            f'integration is the module "{INTEGRATION_MODULE}"; write [experimental] '
            f'custom_import = "{INTEGRATION_MODULE}" (or --experimental.custom_import '
            f"{INTEGRATION_MODULE})."
        )


# Every JobConfig torchtitan parses (TOML and command line): unknown keys when a section is
# built, the old custom_import value when the whole config is validated, before the
# Trainer imports custom_import.
_wrap_config_manager("_dict_to_dataclass", _check_keys)
def _check_validated(manager) -> None:
    check_custom_import(manager.config)
    # torchtitan warns that its default hf_assets_path does not exist; for a job on the
    # offline corpus the integration uses the corpus' own tokenizer instead (and says so),
    # or names the command that builds it
    from torchtitan.config.job_config import Model as TorchtitanModel

    model, training = manager.config.model, manager.config.training
    note = f"HF assets path {TorchtitanModel().hf_assets_path} does not exist!"
    if training.dataset in DATASET_SPLITS and model.hf_assets_path == TorchtitanModel().hf_assets_path:
        drop_notes(note)
    else:
        keep_notes(note)


_wrap_config_manager("_validate_config", _check_validated)


@dataclass
class JobConfig:
    lowbit: LowBit = field(default_factory=LowBit)
