"""Where the fp32 master weights of a bf16 parameter start (``weight_update`` "master" or
"master_remainder").

By default a master starts as the bf16 weight itself, taken at the parameter's first step
(so weights loaded after the optimizer was built count). A bf16 weight is then exactly
on the bf16 grid: an early update smaller than half a bf16 step moves the master but not
the weight the forward sees, until the updates add up. Weights that were initialized in
fp32 and rounded sit anywhere inside their bf16 cell, so the same small updates move a
share of them at once, as the bf16 cast of an fp32-weight run does.

An optimizer can therefore be handed the fp32 values its masters should start from
(``start_masters_from``): they are written into the master state at once, and kept at the
first step only if the weight is still the one they were handed with. A weight replaced
in between (a model-only checkpoint, pretrained weights) starts its master from itself,
as without them; a state dict loaded before the first step replaces them, as any state.
Whether a weight is still the same is told by a fingerprint of its bits (two int64
sums, one weighted by position), not by a copy of it: the check costs no memory.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_lowbit.kernels.adamw_lowbit_ref import master_split

from .formats import WEIGHT_UPDATE_STATE
from .tensors import local

MASTER_UPDATES = ("master", "master_remainder")
_CHUNK = 1 << 22  # elements per pass: bounds the int64 temporaries of a large shard
_POSITION_PRIME = 65521


def weight_fingerprint(weight: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over a bf16 tensor's bit patterns, the second weighted by position
    (so a permutation or a shifted copy changes it): a different weight matches only by
    an exact coincidence of both."""
    bits = weight.detach().contiguous().view(torch.int16).flatten()
    total = torch.zeros(2, dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start:start + _CHUNK].to(torch.int64)
        position = torch.arange(start, start + chunk.numel(), device=bits.device) % _POSITION_PRIME + 1
        total[0] += chunk.sum()
        total[1] += (chunk * position).sum()
    return total


def write_start(p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], master: torch.Tensor,
                name: str) -> torch.Tensor:
    """Check ``master`` (fp32, the local shape of ``p``, rounding to ``p``'s bf16 weight to
    nearest with ties away from zero, as the master updates round) and write it into
    ``state``'s master entry; returns the weight's fingerprint to check at the first step."""
    update = group["weight_update"]
    if update not in MASTER_UPDATES or p.dtype != torch.bfloat16:
        raise ValueError(f"param '{name}': fp32 master weights to start from were given, but it is a {p.dtype} "
                         f"parameter with weight_update={update!r}, which keeps no master weights; give them "
                         f"only for bf16 parameters whose group uses weight_update in {MASTER_UPDATES}")
    weight = local(p).detach()
    if master.dtype != torch.float32 or tuple(master.shape) != tuple(weight.shape) or master.device != weight.device:
        raise ValueError(f"param '{name}': the master weights to start from are {master.dtype} of shape "
                         f"{tuple(master.shape)} on {master.device}; they must be float32 of the parameter's "
                         f"local shape {tuple(weight.shape)} on {weight.device}")
    key = WEIGHT_UPDATE_STATE[update][0]
    dst = local(state[key]).view(-1)
    flat_master, flat_weight = master.reshape(-1), weight.reshape(-1)
    for start in range(0, flat_master.numel(), _CHUNK):
        rounded, remainder = master_split(flat_master[start:start + _CHUNK])
        if not torch.equal(rounded.view(torch.int16), flat_weight[start:start + _CHUNK].view(torch.int16)):
            raise ValueError(f"param '{name}': the fp32 master weights to start from do not round to its bf16 "
                             "weight (to nearest, ties away from zero, as weight_update "
                             f"{update!r} rounds): set the weight to that rounding first (master_split)")
        dst[start:start + _CHUNK].copy_(flat_master[start:start + _CHUNK] if key == "master" else remainder)
    return weight_fingerprint(weight)


def take_start(p: torch.Tensor, state: dict[str, Any], offered: dict[torch.Tensor, torch.Tensor]) -> None:
    """At ``p``'s first step: keep the master written by ``write_start`` if the weight is
    still the one it was given for, else start the master from the weight (the fp32 copy
    of it, or a zero remainder)."""
    fingerprint = offered.pop(p, None)
    if fingerprint is not None and torch.equal(weight_fingerprint(local(p)), fingerprint):
        return
    if "master" in state:
        local(state["master"]).copy_(local(p))
    else:
        local(state["master_remainder"]).zero_()
