"""Optimizer front end: formats, AdamW math, Muon, param groups, DTensor handling.

``OPTIMIZERS`` is the one list of AdamW names the plugin adds (torchtitan's
``[optimizer] name``), each mapped to ``LowBitAdamW`` keyword arguments;
``MUON_OPTIMIZERS`` the Muon names, each mapped to ``LowBitMuon`` keyword arguments. A
name says the optimizer and its state format as the AdamW names do: ``Muon`` keeps fp32
states (as torch's ``AdamW``), ``Muon8bit``, ``Muon4bit`` and ``MuonFp8`` keep the
momentum of Muon's matrices and the moments of its inner AdamW in that format.
"""

from .adamw import LowBitAdamW
from .convert import convert_state_dict
from .formats import STATE_FORMATS, StateFormat
from .health import OptimizerHealth, optimizer_health
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

MUON_OPTIMIZERS: dict[str, dict] = {
    "Muon": dict(state_format="fp32"),
    "Muon8bit": dict(state_format="8bit"),
    "Muon4bit": dict(state_format="4bit"),
    "MuonFp8": dict(state_format="fp8"),
}

__all__ = ["LowBitAdamW", "LowBitMuon", "MUON_OPTIMIZERS", "OPTIMIZERS", "OptimizerHealth", "STATE_FORMATS",
           "StateFormat", "convert_state_dict", "optimizer_health"]
