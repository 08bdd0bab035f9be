"""Checkpoint safety around torchtitan's CheckpointManager (DCP, one folder per step).

Loading. Before torchtitan's ``CheckpointManager.dcp_load`` reads anything:

- the checkpoint's files are checked against the manifest every save writes beside
  ``.metadata`` (:mod:`titan_lowbit.torchtitan.checkpoint_manifest`): ``.metadata``
  itself, every file's size, and every record's place, length and CRC-32, tensor and
  non-tensor records alike, so a record swapped, moved, edited, added or dropped is
  named. A checkpoint without a manifest (written before titan_lowbit wrote them, or by
  an async save) is checked as before, with one log line saying so: every file the
  ``.metadata`` index names there, none shorter than it says, and every tensor record's
  own CRC-32 (torch.save writes one per record; DCP itself never checks it, so
  overwritten bytes would load silently). The ranks split the files between them and
  agree on the verdict. A damaged checkpoint stops the run naming the step folder, what
  is wrong, and the complete checkpoints beside it to resume from instead.
  ``TITAN_LOWBIT_VERIFY_CHECKPOINT=size`` keeps the file, size and index checks but skips
  reading the data for the CRCs;
- :func:`check_compatible` compares the checkpoint's optimizer layout (state format,
  block size, BF16 update rule, fp32-state threshold), parameter by parameter (``[lowbit]
  fp32_states`` gives some parameters a group of their own), and parameter dtypes with the
  current run's, and stops with both named: torch.distributed.checkpoint loads into the
  tensors the run allocated, so a 4-bit checkpoint loaded by an 8-bit run fails with a
  bare "Size mismatch", an 8-bit one loaded by an FP8 run (codes of the same shape) would
  be *cast* silently into garbage state, and bf16 weights into fp32 ones (or back) are
  cast silently too. An optimizer entry the run needs and the checkpoint lacks stops it,
  by name. So do a model-only checkpoint (torchtitan's last save with ``[checkpoint]
  last_save_model_only = true``: no optimizer, schedule, data loader or step to resume),
  an Adam* run resuming an AdamW* checkpoint (or back), and a data-parallel degree other
  than the checkpoint's (torchtitan cannot reshard the data loader's positions:
  ``--checkpoint.exclude_from_loading dataloader``), and a resume whose model has BitNet
  layers added or dropped (:func:`conversion_record`, which every save writes beside the
  states: a BitNet weight's entry is its plain latent weight, so nothing else tells the
  two apart; a model-only initial load may change the converters). These raise
  :class:`CheckpointMismatch` naming the setting to change; they never advise moving or
  deleting the checkpoint, which is fine for the configuration that wrote it. With
  ``[lowbit] convert_optimizer_states = true`` another optimizer layout is converted
  instead (:mod:`titan_lowbit.torchtitan.checkpoint_convert`), one log line per change,
  and so are fp32 weights into bf16 weights with an fp32 master and back (no other dtype
  change: ``titan_lowbit.optim.convert.weight_dtype_problem``);
- an error from DCP's own load (after the checks above passed) is re-raised with the step
  folder: as a :class:`CheckpointMismatch` naming the setting where it is recognized (the
  data loader's dp degree, LowBitAdamW's own load checks, model shapes or names), else as
  :class:`CheckpointNotLoaded`. Neither is labelled damage: the files passed the checks.

Saving. DCP writes the data files first and ``.metadata`` last (to a temporary name,
then renamed), and torchtitan resumes only from ``step-N`` folders that hold a
``.metadata``, so a save cut short is skipped (titan_lowbit logs a warning naming it).
But a save into an existing ``step-N`` folder (a run resumed from an earlier step
re-saves a step it had saved before) overwrites that checkpoint's files in place while
its old ``.metadata`` still stands. So synchronous saves are written to ``.saving-N``
beside the step folders and moved into place as ``step-N`` only once complete; the old
``step-N`` is removed after that. The manifest is written last, into ``.saving-N``,
so it becomes part of ``step-N`` with the rest. A save that fails (a full disk, most often: torch.save
then says only "unexpected pos") removes its ``.saving-N`` and raises
:class:`CheckpointNotSaved` naming the free space, the space a checkpoint takes and the
untouched earlier checkpoints. Async saves (``[checkpoint] async_mode``) are refused at
start-up (:func:`check_async_mode`).
"""

from __future__ import annotations

import errno
import inspect
import io
import os
import re
import shutil
import time
import traceback
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_lowbit.bitnet.weight import local_training_weight
from titan_lowbit.kernels.private_apis import patch, private_api_ok
from titan_lowbit.optim.convert import weight_dtype_problem
from titan_lowbit.optim.formats import STATE_FORMATS, block_of
from titan_lowbit.torchtitan.checkpoint_convert import (
    ANY_GROUP_KEY,
    GROUP_ENTRY,
    Conversion,
    FittedLRSchedulers,
    conversion_requested,
    fp32_selection,
    load_converted,
    saved_dtype_weights,
)
from titan_lowbit.torchtitan.checkpoint_manifest import (
    MANIFEST,
    ManifestUnreadable,
    manifest_problems,
    read_manifest,
    write_manifest,
)
from titan_lowbit.torchtitan.lr_schedule import schedule_change, write_schedule

STEP_DIR = re.compile(r"step-(\d+)")  # torchtitan's own pattern (re.search)
VERIFY_ENV = "TITAN_LOWBIT_VERIFY_CHECKPOINT"
LAYOUT_KEYS = ("state_format", "block_size", "weight_update", "min_quantized_numel")
# Set by the [optimizer] name (AdamW* decouples weight decay, Adam* adds it to the gradient);
# compared for torch's Adam/AdamW too, whose load_state_dict would silently keep the saved one.
NAME_KEYS = ("decoupled_weight_decay",)
TORCH_LAYOUT = {"optimizer": "torch Adam/AdamW (fp32 or parameter-dtype moments)"}
FORMAT_SUFFIX = {"8bit": "8bit", "4bit": "4bit", "fp8": "Fp8", "fp32": ""}  # of the names
DATALOADER_RANK = re.compile(r"dataloader\.dp_rank_(\d+)")
# titan_lowbit's own entry in the checkpoints it writes: how the model was converted.
RECORD = "titan_lowbit"
BITNET_WEIGHTS = f"{RECORD}.bitnet_weights"
LOWBIT_OPTION = {"state_format": "[optimizer] name", "decoupled_weight_decay": "[optimizer] name",
                 "block_size": "[lowbit] block_size", "weight_update": "[lowbit] weight_update",
                 "min_quantized_numel": "[lowbit] min_quantized_numel"}


class CheckpointMismatch(ValueError):
    """A checkpoint that is fine but was written with another configuration than this
    run's; the message names the setting to change. Never a reason to remove it."""


class CheckpointNotLoaded(RuntimeError):
    """DCP could not load a checkpoint whose files passed the checks, for a reason not
    recognized as a configuration mismatch; the message says what to try."""


def layouts(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{parameter FQN: the optimizer layout of its param group} from the flattened
    param-group entries (``param_groups.<fqn>.<option>``, one per parameter and option, as
    torchtitan's container saves an optimizer): titan_lowbit's layout where the
    parameter's group has a ``state_format``, else torch's Adam/AdamW. The same reading
    of the run's state dict and of a checkpoint's entries, so the two compare parameter
    by parameter."""
    options: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith(GROUP_ENTRY):
            fqn, _, option = key[len(GROUP_ENTRY):].rpartition(".")
            if option in (ANY_GROUP_KEY, *LAYOUT_KEYS, *NAME_KEYS):
                options.setdefault(fqn, {})[option] = value
    return {fqn: ({"optimizer": "titan_lowbit", **{k: o.get(k) for k in LAYOUT_KEYS + NAME_KEYS}}
                  if o.get("state_format") is not None else
                  {**TORCH_LAYOUT, **{k: o.get(k) for k in NAME_KEYS}})
            for fqn, o in options.items()}


def saved_layouts(checkpoint_id: str, metadata) -> dict[str, dict[str, Any]]:
    """The checkpoint's optimizer layout of each parameter (as :func:`layouts`); empty
    when it holds no optimizer entries at all (e.g. a model-only checkpoint)."""
    prefix = "optimizer."
    keys = [k[len(prefix):] for k in metadata.state_dict_metadata if k.startswith(prefix + GROUP_ENTRY)]
    values: dict[str, Any] = {prefix + k: None for k in keys
                              if k.rpartition(".")[2] in LAYOUT_KEYS + NAME_KEYS}
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
    decoupled = layout.get("decoupled_weight_decay")
    base = {True: "AdamW", False: "Adam"}.get(decoupled, "AdamW or Adam")
    if layout["optimizer"] != "titan_lowbit":
        return base
    suffix = FORMAT_SUFFIX.get(layout.get("state_format"))
    if suffix is None or decoupled is None:
        return f"the one of state_format={layout.get('state_format')!r}"
    return base if not suffix else base + suffix


def _settings(layout: dict[str, Any]) -> dict[str, Any]:
    """The [optimizer] / [lowbit] settings that give ``layout`` ({'[section] key': value})."""
    if layout["optimizer"] != "titan_lowbit":  # torch's: built only with weight_update nearest
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
    torch's or titan_lowbit's, but not Adam* into AdamW* (another update, not a layout)."""
    return all(saved.get(k) == have.get(k) for k in NAME_KEYS)


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
    if own_saved.get("decoupled_weight_decay") != own_have.get("decoupled_weight_decay"):
        text += ("decoupled_weight_decay is set by [optimizer] name: AdamW* names decouple weight "
                 "decay, Adam* names add it to the gradient"
                 + ("; [lowbit] convert_optimizer_states converts the states' format, not the "
                    "update. " if convert else ". "))
    want, now = _settings(own_saved), _settings(own_have)
    settings = [_as_setting(option, want[option]) for option in want if now.get(option) != want[option]]
    if fp32_saved != fp32_have:
        settings.append(f"[lowbit] fp32_states selecting exactly the checkpoint's {_few(fp32_saved)}"
                        if fp32_saved else "no [lowbit] fp32_states")
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


def _dataloader_advice(saved: "int | None" = None) -> str:
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
            f"ranks, this run has {now}; " + _dataloader_advice(saved))


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
        wanted = {f"optimizer.{key}" for key in run_entries}
        missing = sorted(wanted - set(keys))
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
    if convert and have is not None:
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


def _root_causes(err: BaseException) -> list[tuple[BaseException, list]]:
    """(exception, its stack frames) of what went wrong, looking inside DCP's
    CheckpointException (one per failed rank)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        return [(exc, list(trace or [])) for exc, trace in failures.values()]
    return [(err, traceback.extract_tb(err.__traceback__))]


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [repr(err)])[0]


def _from_lowbit_load(frames) -> bool:
    optim_dir = os.path.join("titan_lowbit", "optim", "")
    return any(optim_dir in frame.filename and frame.name in (
        "load_state_dict", "check_loadable", "_load", "check_group")
        for frame in frames)


def _optimizer_load_problem(cause: str) -> str:
    option = "[optimizer] name and [lowbit] block_size, weight_update and min_quantized_numel"
    m = re.search(r"saved with (\w+)=(.*?), this optimizer was built with \1=", cause)
    if m and m.group(1) in LOWBIT_OPTION:
        option = LOWBIT_OPTION[m.group(1)]
        if m.group(1) == "decoupled_weight_decay":
            decoupled = m.group(2) == "True"
            option += (f" (the checkpoint's optimizer was an {'AdamW' if decoupled else 'Adam'}* "
                       "one: AdamW* names decouple weight decay, Adam* names add it to the "
                       "gradient)")
    return (f"optimizer state: LowBitAdamW refused it: {cause}\n  Set {option} as when the "
            "checkpoint was written, or start the optimizer state afresh with "
            "--checkpoint.exclude_from_loading optimizer.")


def load_failure(checkpoint_id: str, err: BaseException, crc: bool = True) -> BaseException:
    """What to raise when DCP's load of a checkpoint whose files passed :func:`verify` and
    :func:`check_compatible` failed with ``err``: a CheckpointMismatch naming the setting
    where the cause is recognized, else a CheckpointNotLoaded. Never CheckpointDamaged."""
    problems = []
    for exc, frames in _root_causes(err):
        cause = _first_line(exc)
        if "dp_degree is inconsistent" in cause or cause.startswith(
                "Missing key in checkpoint state_dict: dataloader."):
            problem = (f"dataloader: {cause}\n  The checkpoint was written with another "
                       "data-parallel degree; " + _dataloader_advice())
        elif isinstance(exc, ValueError) and _from_lowbit_load(frames):
            problem = _optimizer_load_problem(cause)
        elif re.match(r"(Size mismatch|Missing key in checkpoint state_dict|Unexpected key)",
                      cause):
            problem = (f"{cause}\n  The run's model or optimizer differs from the one that "
                       "wrote the checkpoint: resume with the [model] name, flavor and "
                       "converters, [optimizer] name and [lowbit] settings it was written with.")
        else:
            continue
        if problem not in problems:
            problems.append(problem)
    if problems:
        return CheckpointMismatch(
            f"checkpoint {checkpoint_id} does not match this run:\n  " + "\n  ".join(problems))
    folder, others = other_steps(checkpoint_id)
    checked = ("Its files passed the size and CRC-32 checks, so this is most likely a "
               "configuration that differs from the one that wrote it" if crc else
               f"Its files were checked for size only ({VERIFY_ENV}=size): run without that "
               "setting to check the tensor data's CRC-32 too; otherwise this is most likely a "
               "configuration that differs from the one that wrote it")
    return CheckpointNotLoaded(
        f"checkpoint {checkpoint_id} could not be loaded into this run:\n  "
        f"{_first_line(_root_causes(err)[0][0])}\n{checked} ([model] name, flavor and "
        "converters, [parallelism], [optimizer], [lowbit], [checkpoint] exclude_from_loading): "
        "resume with that configuration, or train with this one into a new --job.dump_folder. "
        + (f"If the configuration is the one that wrote it, resume from another checkpoint "
           f"with --checkpoint.load_step N (steps {others} in {folder})." if others else
           "The checkpoint is left as it is.")
    )


class CheckpointDamaged(RuntimeError):
    """A checkpoint whose files cannot be trusted; the message says what to do."""

    def __init__(self, checkpoint_id: str, problems: list[str],
                 header: str = "is damaged or incomplete and was not loaded"):
        folder, others = other_steps(checkpoint_id)
        if others:
            advice = (f"Move {checkpoint_id} out of {folder} (or delete it) to resume from the "
                      f"latest other complete checkpoint there (steps {others}), or choose "
                      "one with --checkpoint.load_step N.")
        else:
            advice = (f"There is no other complete checkpoint in {folder}: restore the files "
                      "from a copy, or start afresh in a new --job.dump_folder.")
        shown = problems[:5] + ([f"... and {len(problems) - 5} more"] if len(problems) > 5 else [])
        super().__init__(f"checkpoint {checkpoint_id} {header}:\n  " + "\n  ".join(shown)
                         + "\n" + advice)


def step_folders(folder: str) -> dict[int, str]:
    """{N: path} of the ``step-N`` folders in ``folder`` (torchtitan's naming)."""
    if not os.path.isdir(folder):
        return {}
    return {int(m.group(1)): os.path.join(folder, name) for name in os.listdir(folder)
            if (m := STEP_DIR.search(name))}


def complete_steps(folder: str) -> list[int]:
    """Steps of the ``step-N`` folders in ``folder`` that hold a DCP ``.metadata``."""
    return sorted(step for step, path in step_folders(folder).items()
                  if os.path.isfile(os.path.join(path, ".metadata")))


def other_steps(checkpoint_id: str) -> tuple[str, list[int]]:
    """(the folder of ``checkpoint_id``, the steps of the complete checkpoints in it other
    than ``checkpoint_id`` itself): where to fall back to or resume from instead."""
    folder, name = os.path.split(os.path.normpath(checkpoint_id))
    step = STEP_DIR.search(name)
    return folder, [s for s in complete_steps(folder) if not step or s != int(step.group(1))]


def read_metadata(checkpoint_id: str):
    try:
        return FileSystemReader(checkpoint_id).read_metadata()
    except Exception as err:  # noqa: BLE001  (any failure here means an unreadable index)
        raise CheckpointDamaged(checkpoint_id, [f".metadata cannot be read: {err!r}"]) from err


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable file of its own
    (zipfile reads one torch.save record of a .distcp file through it)."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, min(self.length, base + offset))
        return self.pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.length - self.pos)
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


def _record_problem(path: Path, start: int, length: int) -> str | None:
    """What is wrong with the torch.save record at bytes [start, start + length) of
    ``path`` (None: its zip structure reads and every CRC-32 matches)."""
    try:
        with open(path, "rb") as f, zipfile.ZipFile(_Window(f, start, length)) as z:
            for info in z.infolist():
                if info.CRC == 0:  # written with torch's CRC-32 turned off: nothing to check
                    continue
                with z.open(info) as member:
                    while member.read(1 << 22):
                        pass
    except zipfile.BadZipFile as err:
        return f"damaged ({err})"
    except Exception as err:  # noqa: BLE001
        return f"unreadable ({err!r})"
    return None


def file_problems(checkpoint_id: str, metadata, rank: int = 0, world: int = 1,
                  crc: bool = True) -> list[str]:
    """Files of the checkpoint that are missing or shorter than ``metadata`` says, and
    (``crc``) tensors whose bytes fail torch.save's CRC-32, in the files this rank checks
    (file i of the sorted list when i % world == rank)."""
    items: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        items.setdefault(info.relative_path, []).append((index, info))
    problems, records = [], []
    for i, name in enumerate(sorted(items)):
        path = Path(checkpoint_id) / name
        need = max(info.offset + info.length for _, info in items[name])
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        if (size := path.stat().st_size) < need:
            problems.append(f"{name} is truncated: {size} bytes, the index needs {need}")
            continue
        if crc and i % world == rank:
            records += [(path, index.fqn, info) for index, info in items[name]
                        if not info.transform_descriptors and isinstance(
                            metadata.state_dict_metadata.get(index.fqn), TensorStorageMetadata)]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        verdicts = pool.map(lambda r: _record_problem(r[0], r[2].offset, r[2].length), records)
        for (path, fqn, info), verdict in zip(records, verdicts):
            if verdict:
                problems.append(f"{path.name}: {fqn} (bytes {info.offset}-"
                                f"{info.offset + info.length}) is {verdict}")
    return problems


def checkpoint_problems(checkpoint_id: str, metadata, rank: int = 0, world: int = 1,
                        crc: bool = True) -> tuple[list[str], bool]:
    """(what is wrong with the checkpoint's files in this rank's share, whether its
    manifest checked them): against the manifest where the checkpoint has one
    (:func:`manifest_problems`: every record's place and bytes), else each tensor record
    against its own CRC-32 (:func:`file_problems`)."""
    try:
        manifest = read_manifest(checkpoint_id)
    except ManifestUnreadable as err:
        return [str(err)], True
    if manifest is None:
        return file_problems(checkpoint_id, metadata, rank, world, crc), False
    return manifest_problems(checkpoint_id, metadata, manifest, rank, world, crc), True


def verify(checkpoint_id: str, metadata) -> None:
    """Raise CheckpointDamaged on every rank when any rank finds a problem with the
    checkpoint's files (see :func:`checkpoint_problems`)."""
    from torchtitan.tools.logging import logger

    begin = time.monotonic()
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    crc = os.environ.get(VERIFY_ENV, "crc").lower() != "size"
    problems, by_manifest = checkpoint_problems(checkpoint_id, metadata, rank, world, crc)
    if distributed:
        gathered: list[list[str] | None] = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = list(dict.fromkeys(p for ps in gathered for p in ps or []))
    if problems:
        raise CheckpointDamaged(checkpoint_id, problems)
    took = f"in {time.monotonic() - begin:.1f} s"
    if by_manifest:
        logger.info(f"titan_lowbit: checkpoint {checkpoint_id}: "
                    + (f"every record verified against its manifest (place, length, CRC-32) {took}"
                       if crc else f"files and index verified against its manifest {took} "
                       f"({VERIFY_ENV}=size: the data was not read)"))
    else:
        logger.info(f"titan_lowbit: checkpoint {checkpoint_id} has no manifest ({MANIFEST}: "
                    "written by titan_lowbit before manifests, or by an async save), so it is "
                    "checked by the per-record CRC-32 only, which cannot see records swapped "
                    "between tensors nor a changed non-tensor record: files "
                    f"{'and CRC-32 ' if crc else ''}verified {took}")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CheckpointNotSaved(RuntimeError):
    """A save that failed (a full disk, most often); its partial folder is removed and the
    message gives the free space, the space a checkpoint needs and what to do."""


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _folder_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (a step folder, or a link to one)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed while counting: not part of the total
    return total


# What torch.save raises when a write comes up short (a full disk, among others: the
# OSError behind it is not kept), and the errnos of a full disk or quota.
SHORT_WRITE = "unexpected pos"
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def save_failure(target: Path, staging: Path, err: BaseException, remove: bool) -> CheckpointNotSaved:
    """The error to raise when writing the checkpoint ``target`` into ``staging`` failed
    with ``err``. With ``remove`` (rank 0) it removes ``staging``, whose partial files would
    keep a full disk full, and names the free space on that file system, the space a
    checkpoint of this run takes (the newest complete one's size) and the checkpoints that
    are untouched: measured here because the OSError behind torch.save's short write is
    lost, so its message never says the disk is full. Other ranks name the cause only."""
    folder = target.parent
    causes = [exc for exc, _ in _root_causes(err)]
    shown = "; ".join(dict.fromkeys(f"{type(exc).__name__}: {_first_line(exc)}" for exc in causes))
    if not remove:  # another rank: rank 0 may be removing the folder while this one measures
        return CheckpointNotSaved(
            f"checkpoint {target} was not saved: {shown}\n  Rank 0 removes the partial folder "
            f"{staging} and reports the free space on that file system.")
    free_then = shutil.disk_usage(folder).free
    written = _folder_bytes(staging) if staging.exists() else 0
    try:
        _remove(staging)
        removal = f"The partial folder {staging} ({_size(written)} written) was removed"
    except OSError as rm_err:
        removal = (f"The partial folder {staging} could not be removed ({rm_err}): delete it "
                   "by hand to free its space")
    free_now = shutil.disk_usage(folder).free
    steps = complete_steps(str(folder))
    need = written
    needs = f"this checkpoint needs more than the {_size(written)} written before the failure"
    kept = f"there is no earlier checkpoint in {folder}"
    if steps:
        last = _folder_bytes(folder / f"step-{steps[-1]}")
        if last >= written:
            need = last
            needs = (f"a checkpoint of this run takes about {_size(last)} (the size of "
                     f"step-{steps[-1]})")
        else:
            needs += f" (step-{steps[-1]} takes {_size(last)})"
        kept = f"the earlier checkpoints in {folder} (steps {steps}) are untouched"
    full = (any(isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS for exc in causes)
            or free_then < max(need, 1 << 20))
    why = ("The disk is full: " if full else
           "If the file system is full or its quota reached: " if any(
               SHORT_WRITE in _first_line(exc) for exc in causes) else "")
    return CheckpointNotSaved(
        f"checkpoint {target} was not saved: {shown}\n"
        f"  The file system of {folder} had {_size(free_then)} free when the save failed "
        f"({_size(free_now)} now); {needs}.\n  {removal}; {kept}.\n"
        f"  {why}free space there (e.g. fewer checkpoints with [checkpoint] keep_latest_k) or "
        "write to a file system with room (--job.dump_folder, [checkpoint] folder), then "
        "start the run again to resume from the last complete checkpoint.")


def save_atomically(save, checkpoint_id: str):
    """Run ``save(staging_id)`` into ``.saving-N`` beside the ``step-N`` folder
    ``checkpoint_id``, then (rank 0) move it into place, replacing an older ``step-N``
    only after the new one is complete. A save that fails (any error of the writer, DCP's
    CheckpointException included) raises :class:`CheckpointNotSaved` on each rank, rank 0
    having removed ``.saving-N``."""
    target = Path(checkpoint_id)
    staging = target.parent / ("." + STEP_DIR.sub(r"saving-\1", target.name))
    first = not dist.is_initialized() or dist.get_rank() == 0
    if first:
        _remove(staging)  # what a save cut short left behind
    _barrier()
    try:
        result = save(str(staging))
    except (Exception, CheckpointException) as err:  # CheckpointException: BaseException
        raise save_failure(target, staging, err, remove=first) from err
    if first:
        replaced = target.parent / ("." + STEP_DIR.sub(r"replaced-\1", target.name))
        if target.exists() or target.is_symlink():
            _remove(replaced)
            os.replace(target, replaced)
        os.replace(staging, target)
        _remove(replaced)
    _barrier()
    return result


def check_async_mode(checkpoint_config) -> None:
    """Refuse ``[checkpoint] async_mode`` other than "disabled" (with checkpoints on): the
    guarantees above need every rank's files written before the manifest is written and
    the folder is moved into place. An async save returns while it writes; finishing it
    in the background would take collectives (every rank done) in a background thread
    beside training's, and a crash there would leave a step folder that looks complete."""
    mode = checkpoint_config.async_mode.lower()
    if checkpoint_config.enable and mode != "disabled":
        raise ValueError(
            f'[checkpoint] async_mode = "{mode}" writes checkpoints in the background, but '
            "titan_lowbit's checkpoint safety (a manifest of every record, written once all "
            "ranks have written theirs, and a step folder moved into place only when complete, "
            "both verified at load) needs the save finished on every rank before training "
            'goes on. Set [checkpoint] async_mode = "disabled" (--checkpoint.async_mode '
            "disabled): each save then holds training for its write time.")


def register() -> None:
    """Wrap torchtitan's CheckpointManager.dcp_load, dcp_save and _find_load_step with the
    checks above: private methods of torchtitan, so only with a tested torchtitan
    (kernels/private_apis.py); otherwise torchtitan checkpoints as it does by itself."""
    if not private_api_ok("torchtitan"):
        return
    from torchtitan.components.checkpoint import (
        LR_SCHEDULER, MODEL, OPTIMIZER, CheckpointManager)
    from torchtitan.tools.logging import logger

    original_load = CheckpointManager.dcp_load
    if getattr(original_load, "titan_lowbit_checked", False):
        return
    original_init = CheckpointManager.__init__

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(original_init).bind(self, *args, **kwargs)
        check_async_mode(bound.arguments["checkpoint_config"])
        original_init(self, *args, **kwargs)
    original_save = CheckpointManager.dcp_save
    original_find = CheckpointManager._find_load_step

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf:
            return original_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
        metadata = read_metadata(checkpoint_id)
        verify(checkpoint_id, metadata)
        conversion = check_compatible(state_dict, checkpoint_id, metadata, self.states[MODEL].model,
                                      convert=conversion_requested(self))
        if LR_SCHEDULER in state_dict:
            if (schedule_warning := schedule_change(state_dict[LR_SCHEDULER], checkpoint_id)):
                logger.warning(schedule_warning)
            state_dict = {**state_dict, LR_SCHEDULER: FittedLRSchedulers(state_dict[LR_SCHEDULER])}
        try:
            if conversion is None:
                result = original_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
            else:
                # The model first: the conversion builds master weights from the loaded weights,
                # and takes those whose dtype changes from copies in the checkpoint's dtype.
                weights = saved_dtype_weights(state_dict, conversion)
                rest = {k: weights.get(k, v) for k, v in state_dict.items() if k != OPTIMIZER}
                result = original_load(self, rest, checkpoint_id, from_hf, from_quantized)
                for line in load_converted(state_dict[OPTIMIZER], checkpoint_id, conversion, weights):
                    logger.info(f"titan_lowbit: checkpoint {checkpoint_id}: optimizer states converted "
                                f"([lowbit] convert_optimizer_states): {line}")
            return result
        except (Exception, CheckpointException) as err:  # CheckpointException: BaseException
            crc = os.environ.get(VERIFY_ENV, "crc").lower() != "size"
            raise load_failure(checkpoint_id, err, crc) from err

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False,
                 to_hf=False):
        if not to_hf:  # the record travels with every DCP checkpoint (never into HF files)
            state_dict = {**state_dict, RECORD: conversion_record(self.states[MODEL].model)}

        def save(target):
            result = original_save(self, state_dict, target, async_mode,
                                   enable_garbage_collection, to_hf)
            if not to_hf:  # written (async saves are refused): the manifest comes last
                if not dist.is_initialized() or dist.get_rank() == 0:
                    write_schedule(self.states.get(LR_SCHEDULER), target)
                write_manifest(target)
            return result

        if to_hf or not STEP_DIR.fullmatch(
                os.path.basename(os.path.normpath(checkpoint_id))):
            return save(checkpoint_id)
        return save_atomically(save, checkpoint_id)

    def _find_load_step(self, folder: str = "") -> int:
        step = original_find(self, folder)
        folder = folder or self.folder
        newer = sorted(s for s, path in step_folders(folder).items() if s > step
                       and not os.path.isfile(os.path.join(path, ".metadata"))
                       and not os.path.isfile(os.path.join(path, "model.safetensors.index.json")))
        if newer:
            logger.warning(
                f"titan_lowbit: skipping incomplete checkpoint folder(s) "
                f"{[f'step-{s}' for s in newer]} in {folder} (no .metadata: a save that did "
                f"not finish); " + (f"resuming from step-{step}" if step >= 0 else
                                    "no complete checkpoint to resume from"))
        return step

    dcp_load.titan_lowbit_checked = True
    patch(CheckpointManager, "__init__", __init__)
    patch(CheckpointManager, "dcp_load", dcp_load)
    patch(CheckpointManager, "dcp_save", dcp_save)
    patch(CheckpointManager, "_find_load_step", _find_load_step)
