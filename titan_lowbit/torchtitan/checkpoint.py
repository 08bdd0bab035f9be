"""Checkpoint safety around torchtitan's CheckpointManager (DCP, one folder per step).

This module wraps the manager (:func:`register`); the work is in one module per job:
:mod:`checkpoint_verify` (are the files whole), :mod:`checkpoint_layout` (does the
checkpoint fit this run), :mod:`checkpoint_errors` (what a failed DCP load means),
:mod:`checkpoint_save` (atomic saves, a failed save said plainly), beside
:mod:`checkpoint_manifest` and :mod:`checkpoint_convert`.

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

import inspect
import os

from torch.distributed.checkpoint.api import CheckpointException

from titan_lowbit.kernels.private_apis import patch, private_api_ok
from titan_lowbit.torchtitan.checkpoint_convert import (
    FittedLRSchedulers,
    conversion_requested,
    load_converted,
    saved_dtype_weights,
)
from titan_lowbit.torchtitan.checkpoint_errors import load_failure
from titan_lowbit.torchtitan.checkpoint_layout import RECORD, check_compatible, conversion_record
from titan_lowbit.torchtitan.checkpoint_manifest import write_manifest
from titan_lowbit.torchtitan.checkpoint_save import save_atomically
from titan_lowbit.torchtitan.checkpoint_verify import (
    STEP_DIR,
    VERIFY_ENV,
    read_metadata,
    step_folders,
    verify,
)
from titan_lowbit.torchtitan.lr_schedule import schedule_change, write_schedule
from titan_lowbit.torchtitan.unrecorded_options import UnrecordedOptions, unrecorded_entries


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
        if OPTIMIZER in state_dict and conversion is None and (
                unrecorded := unrecorded_entries(state_dict[OPTIMIZER].state_dict(), metadata.state_dict_metadata)):
            state_dict = {**state_dict, OPTIMIZER: UnrecordedOptions(state_dict[OPTIMIZER], unrecorded)}
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
