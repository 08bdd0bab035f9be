"""Param-group options that a checkpoint may not record, and how such a checkpoint loads.

An optimizer option added to titan_lowbit's param groups (``momentum_4bit_levels``,
``momentum_4bit_factor_rank``) is an entry of every flattened optimizer state dict written
since (``param_groups.<fqn>.<option>``), and torch.distributed.checkpoint loads only a state
dict whose every entry the checkpoint holds. A checkpoint written before the option existed
lacks those entries; it was written with one value of the option, known beside it
(``muon_groups.UNRECORDED_MUON_OPTIONS``). Such a checkpoint is loaded without those entries, which are then filled in with that value, so the optimizer's
own ``load_state_dict`` checks them against the run's as any other option (and refuses a
run built with another value, naming it). Used by the checkpoint managers of both
torchtitan lines (``checkpoint``, ``v03``); free of torchtitan imports.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from titan_lowbit.optim.muon_groups import UNRECORDED_MUON_OPTIONS

# A flattened optimizer state dict's param-group entries (``param_groups.<fqn>.<option>``).
GROUP_ENTRY = "param_groups."


def unrecorded_entries(run_entries: dict[str, Any], keys) -> list[str]:
    """The run's flattened optimizer entries of an ``UNRECORDED_MUON_OPTIONS`` option that
    the checkpoint's ``keys`` (its metadata's state dict keys, ``optimizer.``-prefixed)
    lack."""
    return sorted(k for k in run_entries if k.startswith(GROUP_ENTRY)
                  and k.rpartition(".")[2] in UNRECORDED_MUON_OPTIONS and f"optimizer.{k}" not in keys)


class UnrecordedOptions(Stateful):
    """The optimizer container as DCP loads a checkpoint that lacks the entries
    ``unrecorded`` (:func:`unrecorded_entries`): DCP loads the others, and those are filled
    in with the values the checkpoint was written with before the optimizers load them."""

    def __init__(self, container, unrecorded: list[str]):
        self.container, self.unrecorded = container, set(unrecorded)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.container.state_dict().items() if k not in self.unrecorded}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.container.load_state_dict(
            {**state_dict, **{k: UNRECORDED_MUON_OPTIONS[k.rpartition(".")[2]] for k in self.unrecorded}})
