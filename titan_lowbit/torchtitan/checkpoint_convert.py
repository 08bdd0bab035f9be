"""A resume that converts the checkpoint's optimizer states into the run's layout, on
request: ``[lowbit] convert_optimizer_states = true`` (torchtitan 0.2 line).

Why this shape: torch.distributed.checkpoint loads into the tensors a state dict offers,
with their shapes and dtypes, resharding them as it goes. So the checkpoint's states are
loaded into optimizers of the checkpoint's own layout built over the run's parameters
(the "source": a LowBitAdamW with the saved state format, block size, update rule and
threshold, or torch's Adam/AdamW), exactly as torchtitan's container loads (flattened
``get_optimizer_state_dict`` keys, the optimizers' own load checks), and each source is
then converted into the run's optimizer by ``titan_lowbit.optim.convert_state_dict``
(one definition of every format: the kernels' PyTorch reference) and loaded by its
``load_state_dict``, which checks it as any other state dict. The model is loaded first,
so a master weight or remainder that the checkpoint lacks is built from the loaded
weights. For the time of the conversion the source states take memory beside the run's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titan_lowbit.config import lowbit_of
from titan_lowbit.torchtitan.lowbit_optimizers import is_lowbit

FLATTENED = StateDictOptions(flatten_optimizer_state_dict=True)  # as torchtitan saves them
# What each converted setting does to the states, for its log line.
EFFECT = {
    "optimizer": "moments dequantized to fp32 and stored in the new optimizer's format",
    "state_format": "moments dequantized to fp32 and requantized (one quantization of each moment)",
    "block_size": "moments dequantized to fp32 and requantized in blocks of the new size",
    "min_quantized_numel": "the parameters whose states change between fp32 and quantized are converted",
    "weight_update": "fp32 master weights (or their remainders, or the Kahan compensation) from the "
                     "checkpoint's master weights where it kept them, else from its bf16 weights",
}


def conversion_requested(manager) -> bool:
    """Whether the run asked for ``[lowbit] convert_optimizer_states`` (read from the
    trainer, which torchtitan registers with its CheckpointManager as ``train_state``)."""
    job_config = getattr(manager.states.get("train_state"), "job_config", None)
    return job_config is not None and bool(lowbit_of(job_config).convert_optimizer_states)


class _SavedStates(Stateful):
    """The optimizer entries of a checkpoint as torchtitan's OptimizersContainer saves
    them (one flattened optimizer state dict per model part), loaded into ``optimizers``."""

    def __init__(self, model_parts, optimizers):
        self.model_parts, self.optimizers = model_parts, optimizers

    def state_dict(self) -> dict[str, Any]:
        return {k: v for model, opt in zip(self.model_parts, self.optimizers)
                for k, v in get_optimizer_state_dict(model, opt, options=FLATTENED).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for model, opt in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(model, opt, optim_state_dict=state_dict, options=FLATTENED)


def source_optimizer(run_optimizer, saved: dict[str, Any], names: dict[torch.Tensor, str]):
    """An optimizer of the checkpoint's layout ``saved`` (checkpoint.saved_layout) over the
    parameters of ``run_optimizer``, in its groups and order, to load the states into."""
    decoupled = saved.get("decoupled_weight_decay")
    if decoupled is None:
        decoupled = run_optimizer.param_groups[0].get("decoupled_weight_decay", True)
    hyper = ("lr", "betas", "eps", "weight_decay")
    if saved["optimizer"] != "titan_lowbit":
        groups = [{"params": list(g["params"]), **{k: g[k] for k in hyper}}
                  for g in run_optimizer.param_groups]
        return (torch.optim.AdamW if decoupled else torch.optim.Adam)(groups)
    from titan_lowbit.optim import LowBitAdamW

    groups = [{"params": [(names[p], p) for p in g["params"]], **{k: g[k] for k in hyper}}
              for g in run_optimizer.param_groups]
    return LowBitAdamW(groups, state_format=saved["state_format"], block_size=saved["block_size"],
                       weight_update=saved["weight_update"],
                       min_quantized_numel=saved["min_quantized_numel"],
                       decoupled_weight_decay=decoupled, seed=getattr(run_optimizer, "seed", 0))


def describe_changes(saved: dict[str, Any], have: dict[str, Any]) -> list[str]:
    """One line per setting in which the checkpoint's layout ``saved`` differs from the
    run's ``have`` (both as checkpoint.current_layout gives them, block sizes resolved);
    between torch's and titan_lowbit's optimizers one line with the new settings."""
    if saved["optimizer"] != have["optimizer"]:
        settings = ", ".join(f"{k}={v!r}" for k, v in (have if have["optimizer"] == "titan_lowbit"
                                                       else saved).items() if k in EFFECT and k != "optimizer")
        return [f"optimizer {saved['optimizer']!r} -> {have['optimizer']!r} ({settings}): "
                f"{EFFECT['optimizer']}"]
    return [f"{key} {saved[key]!r} -> {have[key]!r}: {EFFECT[key]}" for key in EFFECT
            if key in saved and key in have and saved[key] != have[key]]


def load_converted(container, checkpoint_id: str, saved: dict[str, Any],
                   have: dict[str, Any]) -> list[str]:
    """Load the optimizer states of ``checkpoint_id`` (layout ``saved``) into the run's
    optimizers in ``container`` (layout ``have``), converted; return the log lines
    naming each change. Every rank calls it (DCP's load and the optimizers' load checks
    are collective)."""
    from titan_lowbit.optim import convert_state_dict

    model_parts, optimizers = container.model_parts, list(container.optimizers)
    if len(optimizers) != len(model_parts):
        raise ValueError(
            "[lowbit] convert_optimizer_states converts one optimizer per model part; this run has "
            f"{len(optimizers)} optimizers for {len(model_parts)} model parts ([optimizer] "
            "early_step_in_backward): resume with the settings the checkpoint was written with, "
            "convert without early_step_in_backward, or start the optimizer afresh with "
            "--checkpoint.exclude_from_loading optimizer")
    names = {p: n for model in model_parts for n, p in model.named_parameters()}
    sources = [source_optimizer(opt, saved, names) for opt in optimizers]
    dcp.load({"optimizer": _SavedStates(model_parts, sources)}, checkpoint_id=checkpoint_id)
    for source, optimizer in zip(sources, optimizers):
        optimizer.load_state_dict(convert_state_dict(source.state_dict(), to=optimizer))
        if is_lowbit(optimizer):
            optimizer.skipped_steps = source.skipped_steps if is_lowbit(source) else 0
    return describe_changes(saved, have)
