"""Optimizer front end: formats, AdamW math, Muon, param groups, DTensor handling.

``OPTIMIZERS`` is the one list of optimizer names the plugin adds (torchtitan's
``[optimizer] name``), each mapped to ``LowBitAdamW`` keyword arguments.
"""

from .adamw import LowBitAdamW
from .convert import convert_state_dict
from .formats import STATE_FORMATS, StateFormat
from .muon import LowBitMuon

OPTIMIZERS: dict[str, dict] = {
    "AdamW8bit": dict(state_format="8bit", decoupled_weight_decay=True),
    "AdamW4bit": dict(state_format="4bit", decoupled_weight_decay=True),
    "AdamWFp8": dict(state_format="fp8", decoupled_weight_decay=True),
    "Adam8bit": dict(state_format="8bit", decoupled_weight_decay=False),
    "Adam4bit": dict(state_format="4bit", decoupled_weight_decay=False),
    "AdamFp8": dict(state_format="fp8", decoupled_weight_decay=False),
    # fp32 states: used for torch's names when a bf16 weight update other than nearest is asked for
    "AdamW": dict(state_format="fp32", decoupled_weight_decay=True),
    "Adam": dict(state_format="fp32", decoupled_weight_decay=False),
}

__all__ = ["LowBitAdamW", "LowBitMuon", "OPTIMIZERS", "STATE_FORMATS", "StateFormat", "convert_state_dict"]
