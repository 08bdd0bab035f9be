"""Optimizer states moved into another layout, on request only: :func:`convert_state_dict`.

``LowBitAdamW.load_state_dict`` refuses a state dict saved with another layout (state
format, block size, BF16 weight update, fp32-state threshold) or by torch's Adam/AdamW:
loading one as it is would fail or, worse, be cast into garbage state. Moving a run
between layouts is still a real need (a larger model or batch mid-run, a fine-tune of a
torch AdamW checkpoint in 8-bit states, fp32 states for a final phase), and it changes
the states: each moment is quantized once more in the target format. So it is a call of
its own, never a side effect of a load::

    optimizer.load_state_dict(convert_state_dict(state_dict, to=optimizer))

What it does, per parameter, on each process's local shard (a quantization block never
spans two rows, and a sharded state holds whole blocks, so the local conversion is the
global one):

- the moments are dequantized to fp32 with the source's code books and block layout and
  quantized into the target's, by the kernels' PyTorch reference
  (``quantize_blockwise`` / ``dequantize_blockwise``: the one definition of both); a
  plain (fp32/bf16) side is cast. The error is one quantization of each moment in the
  target format (none into fp32), as after any step;
- ``step`` is kept, so bias correction and the stochastic-rounding stream continue;
- the fp32 master weight W of a bf16 parameter comes from the source: its ``master``,
  rebuilt bit for bit from the weight and its ``master_remainder``, the weight plus its
  ``kahan_comp``, else the bf16 weight itself. The target holds W as ``master``, as the
  remainder of W (exact wherever the weight is W rounded, ties away, which is so for
  either master source; elsewhere, a kahan source, the master is the weight), or as the
  compensation W - weight rounded to bf16;
- hyperparameters (lr, initial_lr, betas, eps, weight_decay) come from the source, as a
  load restores them; the layout options are the target's;
- the weight dtype changes, with ``weights`` (the weights the state dict was saved with),
  only where no bit is lost (:func:`weight_dtype_problem`): fp32 weights into bf16
  parameters updated through an fp32 master (``master``, ``master_remainder``), whose
  master is the fp32 weight exactly and whose bf16 weight is its rounding to nearest
  (ties away from zero, as the master update rounds: the remainder then rebuilds the
  fp32 weight bit for bit); and bf16 weights with such a master into fp32 parameters,
  which take the master exactly. The parameters of ``to`` are set to these weights.

Refused, naming the parameter or group: another number of parameters, a group taking
parameters from saved groups with other hyperparameters, ``amsgrad`` states and
``maximize`` (their moments would need another meaning), and any other change of the
weight dtype (it would lose the fp32 weight, or have none to take).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from titan_lowbit.kernels.adamw_lowbit_ref import (
    bf16_away,
    bf16_rne,
    dequantize_blockwise,
    master_rebuild,
    master_split,
    quantize_blockwise,
)

from .adamw import LowBitAdamW
from .formats import param_format, state_specs
from .group_options import SKIPPED
from .muon_groups import USE_MUON
from .tensors import like_param

# Group values a conversion carries over from the source (a load restores them too).
HYPERPARAMETERS = ("lr", "initial_lr", "betas", "eps", "weight_decay")
# The BF16 weight updates that keep the fp32 weight itself beside the bf16 one (as a
# master weight or its remainder): the only ones a weight dtype conversion keeps exact.
MASTER_UPDATES = ("master", "master_remainder")


def weight_dtype_problem(saved: torch.dtype, run: torch.dtype, saved_update: Optional[str],
                         run_update: Optional[str]) -> Optional[str]:
    """Why weights saved in ``saved`` dtype with the BF16 weight update ``saved_update``
    (None: torch's optimizers) cannot be converted into ``run`` dtype weights updated by
    ``run_update``; None where they can. Two moves keep every bit, and only they are
    done: fp32 weights into bf16 weights with an fp32 master (the master is the fp32
    weight), and bf16 weights with one into fp32 weights (the master is the fp32 weight).
    Any other would round the fp32 weights away or have no fp32 weight to take."""
    if saved == run:
        return None
    if (saved, run) == (torch.float32, torch.bfloat16) and run_update in MASTER_UPDATES:
        return None
    if (saved, run) == (torch.bfloat16, torch.float32) and saved_update in MASTER_UPDATES:
        return None
    if run == torch.bfloat16 and saved == torch.float32:
        why = (f"the bf16 weights would be updated by weight_update {run_update!r}, which keeps no "
               "fp32 master to hold the fp32 weights")
    elif saved == torch.bfloat16 and run == torch.float32:
        why = (f"the bf16 weights were updated by weight_update {saved_update!r}, which kept no fp32 "
               "master to become the fp32 weights")
    else:
        why = "a conversion moves weights between fp32 and bf16 only"
    return (f"{why}; the weight dtype changes only between fp32 weights and bf16 weights with an "
            f"fp32 master (weight_update {' or '.join(repr(u) for u in MASTER_UPDATES)}), which "
            "hold the same fp32 values")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _rows_cols(local: torch.Tensor) -> tuple[int, int]:
    """The [rows, cols] view the block layout takes of a (local) parameter."""
    cols = local.shape[-1] if local.dim() else 1
    return local.numel() // max(cols, 1), cols


def _is_lowbit(group: dict[str, Any]) -> bool:
    return "state_format" in group


def _source_values(name: str, p: torch.Tensor, group: dict[str, Any],
                   state: dict[str, Any]) -> dict[str, Any]:
    """{"m", "v": fp32 local moments, "step": float, "master": fp32 local master weight or
    None} of one parameter's saved ``state`` in the layout of its saved ``group``."""
    local = _local(p).detach()
    if not state:  # torch's Adam/AdamW before the parameter's first step
        zero = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
        return {"m": zero, "v": zero.clone(), "step": 0.0, "master": None}
    if "max_exp_avg_sq" in state:
        raise ValueError(f"param '{name}': the state dict holds amsgrad's max_exp_avg_sq, which a "
                         "titan_lowbit layout has no place for; convert a state saved without amsgrad")
    step = state["step"]
    step = float(_local(step).item() if isinstance(step, torch.Tensor) else step)
    if not _is_lowbit(group):
        return {"m": _local(state["exp_avg"]).float(), "v": _local(state["exp_avg_sq"]).float(),
                "step": step, "master": None}
    fmt, block = param_format(p, group)
    if fmt.quantized:
        rows, cols = _rows_cols(local)

        def moment(prefix: str, codec: int) -> torch.Tensor:
            codes = _local(state[f"{prefix}_codes"])
            codes = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes
            absmax = _local(state[f"{prefix}_absmax"]).reshape(rows, -1)
            return dequantize_blockwise(codes.reshape(rows, -1), absmax, codec, block, cols).reshape(local.shape)

        m, v = moment("exp_avg", fmt.m_codec), moment("exp_avg_sq", fmt.v_codec)
    else:
        m, v = _local(state["exp_avg"]).float(), _local(state["exp_avg_sq"]).float()
    update = group["weight_update"] if p.dtype == torch.bfloat16 else "nearest"
    master = None
    if update == "master":
        master = _local(state["master"]).float().clone()
    elif update == "master_remainder":
        master = master_rebuild(local, _local(state["master_remainder"]))
    elif update == "kahan":
        master = local.float() + _local(state["kahan_comp"]).float()
    return {"m": m, "v": v, "step": step, "master": master}


def _lowbit_state(to, p: torch.Tensor, group: dict[str, Any], values: dict[str, Any],
                  local: torch.Tensor) -> dict[str, Any]:
    """One parameter's state in ``to``'s (a LowBitAdamW) layout for ``group``; ``local`` is
    the local weight ``p`` holds with it."""
    fmt, block = param_format(p, group)
    out: dict[str, torch.Tensor] = {}
    if fmt.quantized:
        rows, cols = _rows_cols(local)
        for prefix, codec, zero_free in (("exp_avg", fmt.m_codec, False),
                                         ("exp_avg_sq", fmt.v_codec, True)):
            x = values["m" if prefix == "exp_avg" else "v"].reshape(rows, cols)
            codes, absmax = quantize_blockwise(x, codec, block, zero_free=zero_free)
            out[f"{prefix}_codes"] = codes.view(fmt.code_dtype)
            out[f"{prefix}_absmax"] = absmax
    else:
        out["exp_avg"] = values["m"].to(fmt.plain_dtype)
        out["exp_avg_sq"] = values["v"].to(fmt.plain_dtype)
    weight = local.float()
    master = values["master"] if values["master"] is not None else weight
    if "master" in (specs := state_specs(p, group)):
        out["master"] = master.clone()
    elif "master_remainder" in specs:
        pairs = bf16_away(master).view(torch.int16) == local.view(torch.int16)
        out["master_remainder"] = master_split(torch.where(pairs, master, weight))[1]
    elif "kahan_comp" in specs:
        out["kahan_comp"] = bf16_rne(master - weight)
    state = {key: like_param(p, out[key].reshape(shape).contiguous(), gshape)
             for key, (shape, _, gshape) in specs.items()}
    state["step"] = torch.tensor(values["step"])
    return state


def _torch_state(p: torch.Tensor, values: dict[str, Any]) -> dict[str, Any]:
    """One parameter's state as torch's Adam/AdamW holds it (moments in the parameter's
    dtype, a float32 step tensor)."""
    return {"step": torch.tensor(values["step"], dtype=torch.float32),
            "exp_avg": like_param(p, values["m"].to(p.dtype), p.shape),
            "exp_avg_sq": like_param(p, values["v"].to(p.dtype), p.shape)}


def _new_weight(name: str, p: torch.Tensor, weight: torch.Tensor, saved_group: dict[str, Any],
                group: dict[str, Any], values: dict[str, Any]) -> torch.Tensor:
    """The local weight of ``p`` from ``weight``, its saved weight of another dtype (see
    :func:`weight_dtype_problem`): the saved fp32 weight becomes ``values``' master exactly
    and the bf16 weight its rounding as the master update rounds (``bf16_away``); a saved
    bf16 weight's master becomes the fp32 weight."""
    problem = weight_dtype_problem(weight.dtype, p.dtype, saved_group.get("weight_update"),
                                   group.get("weight_update") if _is_lowbit(group) else None)
    if problem:
        raise ValueError(f"param '{name}': weights saved in {weight.dtype}, converted into {p.dtype}: "
                         f"{problem}. Convert into parameters of the saved dtype, or into an optimizer "
                         "with such a master")
    if values["master"] is None:  # fp32 weights saved: they are the master
        values["master"] = _local(weight).detach().float().clone()
    return bf16_away(values["master"]) if p.dtype == torch.bfloat16 else values["master"].clone()


def convert_state_dict(state_dict: dict[str, Any], to: torch.optim.Optimizer,
                       weights: Optional[dict[torch.Tensor, torch.Tensor]] = None) -> dict[str, Any]:
    """``state_dict`` (a LowBitAdamW's of any layout, or torch's Adam/AdamW's) as a state
    dict of optimizer ``to``'s layout for ``to``'s parameters, for ``to.load_state_dict``,
    which checks it as any other. ``to`` is a LowBitAdamW or torch's Adam/AdamW (export);
    its parameters are those the state dict was saved for, in the same order, and hold the
    weights that go with it (they give shapes, shards, and the master weight where the
    source kept none). The groups may split the parameters otherwise (e.g. another set of
    parameters in a group of fp32 states): each parameter is read in the layout of its
    saved group and written in that of its group in ``to``, and a group of ``to`` takes the
    hyperparameters of the saved groups of its parameters, which must agree.

    ``weights`` ({parameter of ``to``: the weight it was saved with}) is for parameters
    whose dtype changed since: fp32 weights now held in bf16 for a ``master`` or
    ``master_remainder`` update, or bf16 weights with such a master now held in fp32; the
    weights are as the state dict was saved (a DTensor placed like the parameter, for
    one). Those parameters are set to their converted weights (all checks done first);
    nothing else of ``to`` is changed. See the module docstring."""
    if not (isinstance(state_dict, dict) and "state" in state_dict and "param_groups" in state_dict):
        raise ValueError("convert_state_dict needs an optimizer state dict with 'state' and 'param_groups'")
    saved, groups = state_dict["param_groups"], to.param_groups
    for where, gs in (("the state dict", saved), ("the optimizer to convert into", groups)):
        if any(USE_MUON in g for g in gs):
            raise ValueError(f"{where} is a LowBitMuon's (its param groups carry {USE_MUON!r}): "
                             "convert_state_dict converts AdamW states, and Muon's momentum has no AdamW "
                             "equivalent. Resume a Muon state dict with the LowBitMuon it was saved by (the "
                             "same state format and options), or start the optimizer state afresh")
    sizes, have = [len(g.get("params", ())) for g in saved], [len(g["params"]) for g in groups]
    if sum(sizes) != sum(have):
        raise ValueError(f"the state dict has param groups of {sizes} parameters, the optimizer to convert "
                         f"into {have}: build it with the parameters the state dict was saved with, in "
                         "the same order")
    lowbit_target = _is_lowbit(groups[0]) if groups else False
    if lowbit_target and not isinstance(to, LowBitAdamW):
        raise TypeError(f"convert_state_dict converts into a LowBitAdamW or torch's Adam/AdamW, not a "
                        f"{type(to).__name__}")
    for where, gs in (("state dict", saved), ("optimizer to convert into", groups)):
        for gi, g in enumerate(gs):
            if g.get("maximize", False):
                raise ValueError(f"param group {gi} of the {where} has maximize=True: its first moments "
                                 "are stored with another sign convention; convert without maximize")
    weights = dict(weights or {})
    ours = {p for g in groups for p in g["params"]}
    for p, w in weights.items():
        if p not in ours:
            raise ValueError(f"weights: a tensor of shape {tuple(p.shape)} is not a parameter of the "
                             "optimizer to convert into; key weights by its parameters")
        if tuple(w.shape) != tuple(p.shape) or w.dtype == p.dtype:
            raise ValueError(f"weights: the saved weight of the parameter of shape {tuple(p.shape)} is "
                             f"{w.dtype} of shape {tuple(w.shape)}; give saved weights of the "
                             f"parameter's shape, for parameters whose dtype ({p.dtype}) changed only")
    new_weights: dict[torch.Tensor, torch.Tensor] = {}
    # every saved parameter's (key, saved group index), in the order of the groups
    sources = iter([(key, si) for si, g in enumerate(saved) for key in g["params"]])
    own_groups = to.state_dict()["param_groups"]
    state: dict[Any, dict[str, Any]] = {}
    out_groups = []
    for gi, (group, own) in enumerate(zip(groups, own_groups)):
        names = group.get("param_names") or []
        taken = []
        for pi, (own_key, p) in enumerate(zip(own["params"], group["params"])):
            key, si = next(sources)
            taken.append(si)
            name = names[pi] if pi < len(names) else getattr(to, "_names", {}).get(
                p, f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})")
            source = weights.get(p, p)  # the weights the saved state goes with
            values = _source_values(name, source, saved[si], state_dict["state"].get(key) or {})
            local = _local(p).detach()
            if p in weights:
                local = new_weights[p] = _new_weight(name, p, source, saved[si], group, values)
            state[own_key] = (_lowbit_state(to, p, group, values, local) if lowbit_target
                              else _torch_state(p, values))
        carried = [{k: saved[si][k] for k in HYPERPARAMETERS if k in saved[si]}
                   | ({SKIPPED: saved[si].get(SKIPPED, 0)} if lowbit_target and _is_lowbit(saved[si]) else {})
                   for si in dict.fromkeys(taken)]
        if any(c != carried[0] for c in carried):
            raise ValueError(f"param group {gi} of the optimizer to convert into takes parameters from "
                             f"saved groups {list(dict.fromkeys(taken))} with other hyperparameters "
                             f"({carried}): group the parameters as the state dict did")
        out_groups.append({**own, **(carried[0] if carried else {})})
    with torch.no_grad():
        for p, local in new_weights.items():
            _local(p).copy_(local)
    return {"state": state, "param_groups": out_groups}
