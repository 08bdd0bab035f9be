"""Refuse to resume from a checkpoint written with another optimizer layout.

torch.distributed.checkpoint loads into the tensors the current run allocated: a 4-bit
checkpoint loaded by an 8-bit run fails with a bare "Size mismatch", and an 8-bit
checkpoint loaded by an FP8 run (codes of the same shape) would be *cast* silently into
garbage state; a bf16-weight checkpoint loaded into fp32 parameters, or the other way,
is cast silently too. Before torchtitan's ``CheckpointManager.dcp_load`` reads
anything, :func:`check_compatible` compares the checkpoint's optimizer layout (state
format, block size, BF16 update rule, fp32-state threshold) and parameter dtypes with
the current run's, and stops with both named; an optimizer entry the run needs and the
checkpoint lacks stops it too, by name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_lowbit.optimizer_builder import is_lowbit

LAYOUT_KEYS = ("state_format", "block_size", "weight_update", "min_quantized_numel")
TORCH_LAYOUT = {"optimizer": "torch Adam/AdamW (fp32 or parameter-dtype moments)"}


def current_layout(optimizers) -> dict[str, Any]:
    first = next(iter(optimizers))
    if not is_lowbit(first):  # torch's Adam/AdamW
        return dict(TORCH_LAYOUT)
    group = first.param_groups[0]
    return {"optimizer": "titan_lowbit", **{k: group[k] for k in LAYOUT_KEYS}}


def saved_layout(checkpoint_id: str, metadata) -> dict[str, Any]:
    keys = metadata.state_dict_metadata
    formats = sorted(k for k in keys
                     if k.startswith("optimizer.param_groups.") and k.endswith(".state_format"))
    if not formats:
        return dict(TORCH_LAYOUT)
    prefix = formats[0][: -len("state_format")]
    values: dict[str, Any] = {prefix + k: None for k in LAYOUT_KEYS if prefix + k in keys}
    dcp.load(values, checkpoint_id=checkpoint_id)
    return {"optimizer": "titan_lowbit", **{k: values.get(prefix + k) for k in LAYOUT_KEYS}}


def _describe(layout: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in layout.items())


def check_compatible(state_dict: dict[str, Any], checkpoint_id: str) -> None:
    """Raise ValueError when the checkpoint at ``checkpoint_id`` was written with another
    optimizer layout or other parameter dtypes than ``state_dict`` (the run's states)."""
    metadata = FileSystemReader(checkpoint_id).read_metadata()
    problems = []
    optimizers = state_dict.get("optimizer")
    if optimizers is not None:
        have, saved = current_layout(optimizers), saved_layout(checkpoint_id, metadata)
        if have != saved:
            problems.append(
                f"optimizer layout: checkpoint {_describe(saved)}; this run {_describe(have)}. "
                "Resume with the [optimizer] name and [lowbit] block_size, weight_update and "
                "min_quantized_numel the checkpoint was written with, or train into a new "
                "job.dump_folder."
            )
    for key, value in state_dict.items():
        saved_meta = metadata.state_dict_metadata.get(key)
        if isinstance(value, torch.Tensor) and isinstance(saved_meta, TensorStorageMetadata):
            if saved_meta.properties.dtype != value.dtype:
                problems.append(
                    f"parameter {key}: checkpoint holds {saved_meta.properties.dtype}, this run "
                    f"{value.dtype}. Set [lowbit] weight_dtype (and [training] dtype) as when "
                    "the checkpoint was written."
                )
                break  # one parameter says it; the rest would repeat it
    if optimizers is not None and not problems:
        wanted = {f"optimizer.{key}" for key in optimizers.state_dict()}
        missing = sorted(wanted - set(metadata.state_dict_metadata))
        if missing:
            problems.append(
                f"{len(missing)} optimizer entries are missing from the checkpoint, e.g. "
                f"{missing[:3]}; the checkpoint is incomplete or from another model. Restore "
                "it, or drop the optimizer with [checkpoint] exclude_from_loading = "
                '["optimizer"] to start the optimizer afresh.'
            )
    if problems:
        raise ValueError(
            f"checkpoint {checkpoint_id} does not match this run:\n  " + "\n  ".join(problems)
        )


def register() -> None:
    from torchtitan.components.checkpoint import CheckpointManager

    original = CheckpointManager.dcp_load
    if getattr(original, "titan_lowbit_checked", False):
        return

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if not from_hf:
            check_compatible(state_dict, checkpoint_id)
        return original(self, state_dict, checkpoint_id, from_hf, from_quantized)

    dcp_load.titan_lowbit_checked = True
    CheckpointManager.dcp_load = dcp_load
