"""Does a checkpoint fit this run? Its optimizer layout, parameter dtypes, BitNet layers,
data-loader ranks and completeness, compared with the run's before DCP loads anything.

DCP loads into the tensors the run allocated, so a 4-bit checkpoint loaded by an 8-bit run
fails with a bare "Size mismatch", an 8-bit one loaded by an FP8 run (codes of the same
shape) would be cast silently into garbage state, and bf16 weights into fp32 ones (or back)
are cast silently too. :func:`check_compatible` names both sides and the setting to change
(:class:`CheckpointMismatch`), or, with ``[lowbit] convert_optimizer_states = true``,
returns the :class:`~titan_lowbit.torchtitan.checkpoint_convert.Conversion` to do.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_lowbit.bitnet.weight import local_training_weight
from titan_lowbit.optim.convert import weight_dtype_problem
from titan_lowbit.optim.formats import STATE_FORMATS, block_of
from titan_lowbit.optim.muon_groups import (
    MOMENTUM_4BIT_FACTOR_RANK,
    MOMENTUM_4BIT_LEVELS,
    MOMENTUM_4BIT_OPTIONS,
    USE_MUON,
    muon_fixed_value,
)
from titan_lowbit.torchtitan.checkpoint_convert import (
    ANY_GROUP_KEY,
    GROUP_ENTRY,
    Conversion,
    fp32_selection,
)
from titan_lowbit.torchtitan.checkpoint_verify import other_steps, step_folders
from titan_lowbit.torchtitan.unrecorded_options import unrecorded_entries


LAYOUT_KEYS = ("state_format", "block_size", "weight_update", "min_quantized_numel")
# Set by the [optimizer] name (AdamW* decouples weight decay, Adam* adds it to the gradient);
# compared for torch's Adam/AdamW too, whose load_state_dict would silently keep the saved one.
NAME_KEYS = ("decoupled_weight_decay",)
TORCH_LAYOUT = {"optimizer": "torch Adam/AdamW (fp32 or parameter-dtype moments)"}
# The "optimizer" of a LowBitMuon's parameters (a Muon name), whose param groups say
# use_muon: the matrices' groups True (a momentum), its inner AdamW's False (two moments).
LOWBIT_LAYOUT, MUON_LAYOUT = "titan_lowbit", "titan_lowbit Muon"
FORMAT_SUFFIX = {"8bit": "8bit", "4bit": "4bit", "fp8": "Fp8", "fp32": ""}  # of the names
DATALOADER_RANK = re.compile(r"dataloader\.dp_rank_(\d+)")
# titan_lowbit's own entry in the checkpoints it writes: how the model was converted.
RECORD = "titan_lowbit"
BITNET_WEIGHTS = f"{RECORD}.bitnet_weights"
# The param-group options a layout is read from (beside ANY_GROUP_KEY).
RECORDED_KEYS = (*LAYOUT_KEYS, *NAME_KEYS, USE_MUON, *MOMENTUM_4BIT_OPTIONS)
LOWBIT_OPTION = {"state_format": "[optimizer] name", "decoupled_weight_decay": "[optimizer] name",
                 "block_size": "[lowbit] block_size", "weight_update": "[lowbit] weight_update",
                 "min_quantized_numel": "[lowbit] min_quantized_numel",
                 MOMENTUM_4BIT_LEVELS: "[lowbit] muon_4bit_levels",
                 MOMENTUM_4BIT_FACTOR_RANK: "[lowbit] muon_4bit_factor_rank"}


class CheckpointMismatch(ValueError):
    """A checkpoint that is fine but was written with another configuration than this
    run's; the message names the setting to change. Never a reason to remove it."""


def layouts(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{parameter FQN: the optimizer layout of its param group} from the flattened
    param-group entries (``param_groups.<fqn>.<option>``, one per parameter and option, as
    torchtitan's container saves an optimizer): titan_lowbit's layout where the
    parameter's group has a ``state_format`` (a Muon name's where it also has
    ``use_muon``, which the layout keeps: Muon's matrix or its inner AdamW's parameter),
    else torch's Adam/AdamW. The same reading of the run's state dict and of a
    checkpoint's entries, so the two compare parameter by parameter."""
    options: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith(GROUP_ENTRY):
            fqn, _, option = key[len(GROUP_ENTRY):].rpartition(".")
            if option in (ANY_GROUP_KEY, *RECORDED_KEYS):
                options.setdefault(fqn, {})[option] = value
    return {fqn: _layout_of(o) for fqn, o in options.items()}


def _layout_of(options: dict[str, Any]) -> dict[str, Any]:
    """A parameter's layout from its param group's recorded options."""
    if options.get("state_format") is None:
        return {**TORCH_LAYOUT, **{k: options.get(k) for k in NAME_KEYS}}
    layout = {"optimizer": MUON_LAYOUT if USE_MUON in options else LOWBIT_LAYOUT,
              **{k: options.get(k) for k in LAYOUT_KEYS + NAME_KEYS}}
    if USE_MUON in options:
        layout[USE_MUON] = options[USE_MUON]
        # a Muon matrix's 4-bit momentum options (levels, factor), as they act (a
        # checkpoint may not record them)
        for key in MOMENTUM_4BIT_OPTIONS:
            value = muon_fixed_value(options, key) if options[USE_MUON] else None
            if value is not None:
                layout[key] = value
    return layout


def is_muon_layout(layout: dict[str, Any]) -> bool:
    return layout.get("optimizer") == MUON_LAYOUT


def saved_layouts(checkpoint_id: str, metadata) -> dict[str, dict[str, Any]]:
    """The checkpoint's optimizer layout of each parameter (as :func:`layouts`); empty
    when it holds no optimizer entries at all (e.g. a model-only checkpoint)."""
    prefix = "optimizer."
    keys = [k[len(prefix):] for k in metadata.state_dict_metadata if k.startswith(prefix + GROUP_ENTRY)]
    values: dict[str, Any] = {prefix + k: None for k in keys if k.rpartition(".")[2] in RECORDED_KEYS}
    if values:
        dcp.load(values, checkpoint_id=checkpoint_id)
    return layouts({k: values.get(prefix + k) for k in keys})


def _acting(layout: dict[str, Any]) -> dict[str, Any]:
    """``layout`` as it acts on the state: block_size 0 is its format's default block."""
    if layout.get("state_format") in STATE_FORMATS and isinstance(layout.get("block_size"), int):
        return {**layout, "block_size": block_of(layout["state_format"], layout["block_size"])}
    return layout


def _describe(layout: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in layout.items())


def optimizer_name(layout: dict[str, Any]) -> str:
    """The [optimizer] name that builds an optimizer of ``layout``."""
    if is_muon_layout(layout):
        suffix = FORMAT_SUFFIX.get(layout.get("state_format"))
        return f"the Muon name of state_format={layout.get('state_format')!r}" if suffix is None else "Muon" + suffix
    decoupled = layout.get("decoupled_weight_decay")
    base = {True: "AdamW", False: "Adam"}.get(decoupled, "AdamW or Adam")
    if layout["optimizer"] != LOWBIT_LAYOUT:
        return base
    suffix = FORMAT_SUFFIX.get(layout.get("state_format"))
    if suffix is None or decoupled is None:
        return f"the one of state_format={layout.get('state_format')!r}"
    return base if not suffix else base + suffix


def _settings(layout: dict[str, Any]) -> dict[str, Any]:
    """The [optimizer] / [lowbit] settings that give ``layout`` ({'[section] key': value})."""
    if layout["optimizer"] not in (LOWBIT_LAYOUT, MUON_LAYOUT):  # torch's: built only with weight_update nearest
        return {"[optimizer] name": optimizer_name(layout), "[lowbit] weight_update": "nearest"}
    return {"[optimizer] name": optimizer_name(layout),
            **{f"[lowbit] {k}": layout[k] for k in ("block_size", "weight_update",
                                                      "min_quantized_numel")}}


def _as_setting(option: str, value: Any) -> str:
    section, key = option[1:].split("] ")
    shown = f'"{value}"' if isinstance(value, str) else value
    return f"{option} = {shown} (--{section}.{key} {value})"


def _convertible(saved: dict[str, Any], have: dict[str, Any]) -> bool:
    """Whether ``[lowbit] convert_optimizer_states`` can take the checkpoint's optimizer
    layout ``saved`` into ``have``: any state format, block size, update rule and threshold,
    torch's or titan_lowbit's AdamW, but not Adam* into AdamW* (another update, not a
    layout), nor a Muon name's states (:data:`MUON_CONVERSION`)."""
    return (all(saved.get(k) == have.get(k) for k in NAME_KEYS)
            and not is_muon_layout(saved) and not is_muon_layout(have))


MUON_CONVERSION = (
    "[lowbit] convert_optimizer_states converts AdamW states between layouts; it does not convert "
    "the states of a Muon name (Muon, Muon8bit, Muon4bit, MuonFp8), nor Muon into AdamW or back: a "
    "Muon matrix holds one momentum, an AdamW parameter two moments, and neither is the other's")


def _muon_split(layouts: dict[str, dict[str, Any]]) -> list[str]:
    """The parameters a Muon name's inner AdamW steps (``use_muon`` False)."""
    return sorted(f for f, lay in layouts.items() if is_muon_layout(lay) and not lay.get(USE_MUON))


def _few(fqns: list[str]) -> str:
    if not fqns:
        return "no parameter"
    return f"{len(fqns)} parameter{'s' if len(fqns) > 1 else ''} {fqns[:4]}{' ...' if len(fqns) > 4 else ''}"


def _layout_problem(saved: dict[str, dict[str, Any]], have: dict[str, dict[str, Any]],
                    differ: list[str], convert: bool = False) -> str:
    """Why the per-parameter layouts ``saved`` (the checkpoint's) and ``have`` (the run's)
    differ in the parameters ``differ``: the first of them named with both layouts, and
    the settings that wrote the checkpoint (the optimizer's own layout, and which
    parameters ``[lowbit] fp32_states`` gave fp32 states)."""
    (own_saved, fp32_saved), (own_have, fp32_have) = fp32_selection(saved), fp32_selection(have)
    first = differ[0]
    text = (f"optimizer layout of param '{first}'"
            + (f" (and {len(differ) - 1} more)" if len(differ) > 1 else "")
            + f": checkpoint {_describe(saved[first])}; this run {_describe(have[first])}. ")
    if fp32_saved != fp32_have:
        text += (f"[lowbit] fp32_states gave fp32 states to {_few(fp32_saved)} in the checkpoint, "
                 f"to {_few(fp32_have)} in this run. ")
    muon = any(is_muon_layout(saved[f]) or is_muon_layout(have[f]) for f in differ)
    split_saved, split_have = _muon_split(saved), _muon_split(have)
    both_muon = is_muon_layout(own_saved) and is_muon_layout(own_have)
    if both_muon and split_saved != split_have:
        text += (f"[lowbit] muon_adamw_fqns gave the inner AdamW {_few(split_saved)} in the checkpoint, "
                 f"{_few(split_have)} in this run. ")
    if is_muon_layout(own_saved) != is_muon_layout(own_have):
        text += (f"The checkpoint was written by {'a Muon name' if is_muon_layout(own_saved) else 'AdamW'}, this "
                 f"run steps with {'a Muon name' if is_muon_layout(own_have) else 'AdamW'}. ")
    if muon and convert:
        text += MUON_CONVERSION + ". "
    if own_saved.get("decoupled_weight_decay") != own_have.get("decoupled_weight_decay") and not muon:
        text += ("decoupled_weight_decay is set by [optimizer] name: AdamW* names decouple weight "
                 "decay, Adam* names add it to the gradient"
                 + ("; [lowbit] convert_optimizer_states converts the states' format, not the "
                    "update. " if convert else ". "))
    want, now = _settings(own_saved), _settings(own_have)
    settings = [_as_setting(option, want[option]) for option in want if now.get(option) != want[option]]
    if fp32_saved != fp32_have:
        settings.append(f"[lowbit] fp32_states selecting exactly the checkpoint's {_few(fp32_saved)}"
                        if fp32_saved else "no [lowbit] fp32_states")
    for key in MOMENTUM_4BIT_OPTIONS:
        values = next(((saved[f][key], have[f].get(key)) for f in differ if key in saved[f]), None)
        if values is not None and values[0] != values[1]:
            settings.append(_as_setting(LOWBIT_OPTION[key], values[0]))
    if both_muon and split_saved != split_have:
        settings.append(f"[lowbit] muon_adamw_fqns giving the inner AdamW exactly the checkpoint's "
                        f"{_few(split_saved)} (2-D parameters; the others always go to AdamW)")
    convertible = all(_convertible(saved[f], have[f]) for f in differ)
    return text + (
        "Resume with the settings the checkpoint was written with: " + "; ".join(settings)
        + ". Or start the optimizer state afresh with --checkpoint.exclude_from_loading optimizer "
        "(the model, schedule and step still resume), or train into a new job.dump_folder"
        + ("." if convert or not convertible else
           ", or convert the checkpoint's states into this run's layout with [lowbit] "
           "convert_optimizer_states = true (--lowbit.convert_optimizer_states).")
    )


def full_steps(checkpoint_id: str, names: list[str]) -> list[int]:
    """The other complete checkpoints beside ``checkpoint_id`` (:func:`other_steps`) that
    hold entries for every top-level state in ``names``."""
    folder, others = other_steps(checkpoint_id)
    paths = step_folders(folder)
    steps = []
    for step in others:
        path = paths[step]
        try:
            keys = FileSystemReader(path).read_metadata().state_dict_metadata
        except Exception:  # noqa: BLE001  (an unreadable one is no candidate)
            continue
        if {k.split(".", 1)[0] for k in keys} >= set(names):
            steps.append(step)
    return steps


def _absent_problem(checkpoint_id: str, stateful: list[str], absent: list[str]) -> str:
    folder = os.path.dirname(os.path.normpath(checkpoint_id))
    others = full_steps(checkpoint_id, stateful)
    where = (f"Resume from a checkpoint that holds them with --checkpoint.load_step N (those in "
             f"{folder}: steps {others})" if others else
             f"There is no checkpoint in {folder} that holds them")
    if absent == stateful:
        return (
            f"the checkpoint holds the model weights only (no {', '.join(stateful)} state), so "
            "training cannot resume from it: torchtitan writes its last checkpoint model-only "
            "when [checkpoint] last_save_model_only = true (its default). " + where + "; or "
            "start a new run from these weights in a new --job.dump_folder with "
            f"--checkpoint.initial_load_path {checkpoint_id} (model only: the optimizer, "
            "schedule and step start afresh). To make the last checkpoint resumable, set "
            "[checkpoint] last_save_model_only = false (--checkpoint.no_last_save_model_only)."
        )
    return (
        f"the checkpoint holds no {', '.join(absent)} state. " + where + "; or start "
        f"{'it' if len(absent) == 1 else 'them'} afresh with [checkpoint] exclude_from_loading "
        f"= {absent!r} (--checkpoint.exclude_from_loading {','.join(absent)})."
    )


def dataloader_advice(saved: "int | None" = None) -> str:
    """How to resume a checkpoint written with another data-parallel degree (``saved``
    ranks, where known): without its data loader state, or on the degree it was written with."""
    ranks = f"on {saved} data-parallel ranks" if saved else "with the data-parallel degree it was written with"
    return ("torchtitan cannot reshard a data loader. To resume on another number of processes "
            "(another data-parallel degree), add --checkpoint.exclude_from_loading dataloader "
            '([checkpoint] exclude_from_loading = ["dataloader"], with any other states you '
            "exclude): the model, optimizer, schedule and step resume, and the data loader "
            "starts again from the beginning of its data, split over the new ranks. Or resume "
            f"{ranks} to restore the data loader too.")


def _dataloader_problem(saved: int, now: int) -> str:
    return (f"dataloader: the checkpoint holds the data loader positions of {saved} data-parallel "
            f"ranks, this run has {now}; " + dataloader_advice(saved))


# What dcp.load(no_dist=True) warns every time it is called (torch 2.13).
SINGLE_PROCESS_WARNING = r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming"


def load_on_this_rank(state_dict: dict[str, Any], checkpoint_id: str) -> None:
    """``dcp.load(state_dict, no_dist=True)``: each rank reads a few small entries by
    itself, with no collective. DCP warns at every such call that it assumes a single
    process, which is what is meant here; users read that warning at each resume as a
    fault, so exactly that warning is silenced around this call (any other stays)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING, category=UserWarning)
        dcp.load(state_dict, checkpoint_id=checkpoint_id, no_dist=True)


def conversion_record(model_parts) -> dict[str, torch.Tensor]:
    """What a checkpoint records of the model's conversion: the number of BitNet weights
    (``[model] converters`` with ``bitnet``). Their state-dict entries are the plain latent
    weights, the same keys and shapes as without the converter, so nothing else in the
    checkpoint tells a BitNet run from a plain one. Counted over the whole model: under
    pipeline parallelism a rank holds some stages only, so the names are gathered from
    every rank (a collective)."""
    names = [n for m in model_parts for n, p in m.named_parameters() if local_training_weight(p) is not None]
    if dist.is_available() and dist.is_initialized():
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, names)
        names = [n for part in gathered for n in part or []]
    return {"bitnet_weights": torch.tensor(len(set(names)), dtype=torch.int64)}


def _conversion_problem(checkpoint_id: str, keys, model_parts) -> str | None:
    """A resume whose model is converted otherwise than the checkpoint's (BitNet layers
    added or dropped): it would load and train on, a different model from the step on."""
    if BITNET_WEIGHTS not in keys:
        return None  # written before titan_lowbit recorded it
    saved = {RECORD: {"bitnet_weights": torch.zeros((), dtype=torch.int64)}}
    load_on_this_rank(saved, checkpoint_id)
    was = int(saved[RECORD]["bitnet_weights"])
    now = int(conversion_record(model_parts)["bitnet_weights"])
    if was == now:
        return None
    return (f"model: the checkpoint was written with {was} BitNet linear weights "
            f"({'[model] converters with bitnet' if was else 'no bitnet converter'}), this run has "
            f"{now}. Resume with the [model] converters (and [lowbit] bitnet_filter) it was "
            "written with; to start a new run from its weights with this run's converters, use "
            f"--checkpoint.initial_load_path {checkpoint_id} in a new --job.dump_folder.")


def check_compatible(state_dict: dict[str, Any], checkpoint_id: str, metadata=None,
                     model_parts=None, convert: bool = False):
    """Raise CheckpointMismatch when the checkpoint at ``checkpoint_id`` cannot resume
    ``state_dict`` (the run's states) as it is: another optimizer layout, other parameter
    dtypes, another data-parallel degree, states the run loads and it lacks, or (a resume,
    with ``model_parts`` given) another BitNet conversion of the model. With ``convert``
    (``[lowbit] convert_optimizer_states``) another optimizer layout is no problem but a
    conversion, and so are weights whose dtype changes without a bit lost (fp32 weights
    into bf16 weights with an fp32 master, and back; ``convert.weight_dtype_problem``):
    returned as a :class:`Conversion`; None when there is none."""
    converted = None
    have = saved = None
    if metadata is None:
        metadata = FileSystemReader(checkpoint_id).read_metadata()
    keys = metadata.state_dict_metadata
    saved_prefixes = {k.split(".", 1)[0] for k in keys}
    stateful = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    absent = [k for k in stateful if k not in saved_prefixes]
    problems = [_absent_problem(checkpoint_id, stateful, absent)] if absent else []
    loader = state_dict.get("dataloader")
    saved_ranks = {int(m.group(1)) for k in keys if (m := DATALOADER_RANK.fullmatch(k))}
    now_ranks = getattr(loader, "dp_world_size", None)
    if saved_ranks and isinstance(now_ranks, int) and len(saved_ranks) != now_ranks:
        problems.append(_dataloader_problem(len(saved_ranks), now_ranks))
    optimizers = state_dict.get("optimizer")
    run_entries = optimizers.state_dict() if optimizers is not None else {}
    if optimizers is not None and "optimizer" not in absent:
        have, saved = layouts(run_entries), saved_layouts(checkpoint_id, metadata)
        for fqn in have.keys() & saved.keys():
            for key in NAME_KEYS:  # not recorded (an older torch): cannot be compared
                if saved[fqn].get(key) is None:
                    saved[fqn].pop(key, None)
                    have[fqn].pop(key, None)
        differ = [f for f in have if f in saved and _acting(have[f]) != _acting(saved[f])]
        if differ:
            if convert and all(_convertible(saved[f], have[f]) for f in differ):
                converted = _conversion(saved, have, {})
            else:
                problems.append(_layout_problem(saved, have, differ, convert))
    recast = {key: (keys[key].properties.dtype, value.dtype) for key, value in state_dict.items()
              if isinstance(value, torch.Tensor) and isinstance(keys.get(key), TensorStorageMetadata)
              and keys[key].properties.dtype != value.dtype}
    if recast:
        problem = _weight_dtype_problem(recast, saved, have, convert)
        if problem:
            problems.append(problem)
        elif not problems:
            converted = _conversion(saved, have, {key: was for key, (was, _) in recast.items()})
    if optimizers is not None and not problems and converted is None:  # converted: its own keys
        unrecorded = set(unrecorded_entries(run_entries, keys))  # loaded by unrecorded_options
        missing = sorted({f"optimizer.{key}" for key in run_entries if key not in unrecorded} - set(keys))
        if missing:
            problems.append(
                f"{len(missing)} optimizer entries are missing from the checkpoint, e.g. "
                f"{missing[:3]}; the checkpoint is incomplete or from another model. Restore "
                "it, or drop the optimizer with [checkpoint] exclude_from_loading = "
                '["optimizer"] to start the optimizer afresh.'
            )
    if model_parts is not None and "train_state" in state_dict:  # a resume, not a model-only load
        conversion = _conversion_problem(checkpoint_id, keys, model_parts)
        if conversion:
            problems.insert(0, conversion)
    if problems:
        raise CheckpointMismatch(
            f"checkpoint {checkpoint_id} does not match this run:\n  " + "\n  ".join(problems)
        )
    return converted


def _conversion(saved, have, weight_dtypes) -> Conversion:
    return Conversion({f: _acting(lay) for f, lay in saved.items()},
                      {f: _acting(lay) for f, lay in have.items()}, weight_dtypes)


def _weight_dtype_problem(recast: dict[str, tuple], saved, have, convert: bool) -> str | None:
    """Why the weights ``recast`` ({key: (the checkpoint's dtype, the run's)}) cannot
    resume in the run's dtype (None where ``[lowbit] convert_optimizer_states`` converts
    them: ``saved`` and ``have`` are the checkpoint's and run's optimizer layouts, None
    when the optimizer is not loaded)."""
    key, (was, now) = next(iter(recast.items()))
    why = None
    muon = have is not None and any(is_muon_layout(lay) for lay in (*have.values(), *(saved or {}).values()))
    if convert and muon:
        why = MUON_CONVERSION
    elif convert and have is not None:
        for key, (was, now) in recast.items():
            if key not in have:
                why = (f"param '{key}' is not trained by this run's optimizer, so no conversion can "
                       "change its dtype")
            else:
                why = weight_dtype_problem(was, now, saved.get(key, {}).get("weight_update"),
                                           have[key].get("weight_update"))
            if why:
                break
        if why is None:
            return None
    elif convert:
        why = ("the optimizer is not loaded ([checkpoint] exclude_from_loading), and only a conversion of "
               "its states changes the weight dtype")
    text = (f"parameter {key}: checkpoint holds {was}, this run {now}"
            + (f" ({len(recast) - 1} more)" if len(recast) > 1 else "") + ". ")
    advice = ("Set [lowbit] weight_dtype (and [training] dtype) as when the checkpoint was written"
              + ("." if convert else
                 "; fp32 weights move into bf16 weights with weight_update \"master\" or "
                 "\"master_remainder\" (and back) with [lowbit] convert_optimizer_states = true "
                 "(--lowbit.convert_optimizer_states), the fp32 weights kept exactly as the master."))
    return text + (f"{why}. " if why else "") + advice


