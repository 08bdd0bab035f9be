"""The one list of optimizer-state formats, and the one block layout.

A format says what a moment *is* (plain fp32/bf16, or codes + per-block absmax in one of the
codecs of ``titan_lowbit.kernels.quant_maps``) and which tensors it stores. The AdamW math
lives in the kernel (``titan_lowbit.kernels.adamw_lowbit``), in one place, for every format.

Block layout (all quantized formats): a parameter is seen as rows along its last dimension
(a 1-D tensor is one row). Blocks of ``block`` elements run along each row and never span
two rows; a row whose length is not a multiple of ``block`` ends with a short block.

* codes: shaped like the parameter (uint8; fp8 as ``float8_e4m3fn``); 4-bit codes hold two
  elements per byte, so their last dimension is ``ceil(cols / 2)``: element ``2i`` of a row in
  the low nibble, ``2i + 1`` in the high one; a row of odd length is padded with the code of
  0 in its last high nibble.
* absmax ("scales"): fp32, shaped like the parameter with the last dimension replaced by
  ``ceil(cols / block)``.

Because every state tensor keeps the parameter's leading dimensions, it can carry the
parameter's DTensor placements: FSDP2's Shard(0) shards codes and scales exactly like the
weight, and torch.distributed.checkpoint reshards them like any other tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from titan_lowbit.kernels.quant_maps import (
    CODEC_DYN4_SIGNED,
    CODEC_DYN8_SIGNED,
    CODEC_DYN8_UNSIGNED,
    CODEC_FP8_E4M3,
    CODEC_LIN4_NOZERO,
    CODEC_NONE,
)

from .tensors import local


@dataclasses.dataclass(frozen=True)
class StateFormat:
    """How one parameter's AdamW moments are stored."""

    name: str
    m_codec: int
    v_codec: int
    default_block: int  # elements per quantization block (plain formats: tile width only)
    plain_dtype: Optional[torch.dtype] = None  # plain formats: the moments' dtype
    code_dtype: torch.dtype = torch.uint8
    codes_per_byte: int = 1

    @property
    def quantized(self) -> bool:
        return self.m_codec != CODEC_NONE

    def moment_shapes(self, key: str, shape: tuple[int, ...], block: int
                      ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """State tensor name -> (shape, dtype) of one moment named ``key`` (plain: ``key``;
        quantized: ``key + "_codes"`` and ``key + "_absmax"``) of a parameter (or local
        shard) of ``shape``, coded with this format's first-moment codec."""
        if not self.quantized:
            return {key: (shape, self.plain_dtype)}
        cols = shape[-1] if shape else 1
        lead = tuple(shape[:-1])
        return {f"{key}_codes": (lead + (-(-cols // self.codes_per_byte),), self.code_dtype),
                f"{key}_absmax": (lead + (-(-cols // block),), torch.float32)}

    def state_shapes(self, shape: tuple[int, ...], block: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """State tensor name -> (shape, dtype) of AdamW's two moments for a parameter (or
        local shard) of ``shape``."""
        return {**self.moment_shapes("exp_avg", shape, block), **self.moment_shapes("exp_avg_sq", shape, block)}

    def moment_bytes_per_element(self, block: int) -> float:
        """State bytes per parameter element of one moment for a long row (scales included)."""
        if not self.quantized:
            return torch.finfo(self.plain_dtype).bits / 8
        return 1.0 / self.codes_per_byte + 4.0 / block

    def bytes_per_element(self, block: int) -> float:
        """State bytes per parameter element for a long row (both moments, scales included)."""
        return 2 * self.moment_bytes_per_element(block)


STATE_FORMATS: dict[str, StateFormat] = {
    f.name: f
    for f in (
        StateFormat("fp32", CODEC_NONE, CODEC_NONE, 256, plain_dtype=torch.float32),
        StateFormat("bf16", CODEC_NONE, CODEC_NONE, 256, plain_dtype=torch.bfloat16),
        StateFormat("8bit", CODEC_DYN8_SIGNED, CODEC_DYN8_UNSIGNED, 256),
        StateFormat("4bit", CODEC_DYN4_SIGNED, CODEC_LIN4_NOZERO, 128, codes_per_byte=2),
        StateFormat("fp8", CODEC_FP8_E4M3, CODEC_FP8_E4M3, 128, code_dtype=torch.float8_e4m3fn),
    )
}


def block_of(state_format: str, block_size: int) -> int:
    """The quantization block a group's ``block_size`` gives: 0 means the format's default,
    so 0 and the default write the same state and resume into each other."""
    return block_size or STATE_FORMATS[state_format].default_block


# Tensors smaller than the group's ``min_quantized_numel`` keep this format (as bitsandbytes
# and torchao do: the scales would cost more than they save, and norms/biases are sensitive).
SMALL_TENSOR_FORMAT = STATE_FORMATS["fp32"]


def param_format(p: torch.Tensor, group: dict) -> tuple[StateFormat, int]:
    """(state format, block) of parameter ``p`` in a param group with ``state_format``,
    ``block_size`` and ``min_quantized_numel``: small and 0-d parameters keep
    SMALL_TENSOR_FORMAT. The rule LowBitAdamW steps and stores by, and that a state
    conversion reads a saved group's states by."""
    fmt = STATE_FORMATS[group["state_format"]]
    if fmt.quantized and (p.numel() < group["min_quantized_numel"] or p.dim() == 0):
        fmt = SMALL_TENSOR_FORMAT
    return fmt, block_of(fmt.name, group["block_size"])


# weight_update -> (name, dtype) of the state it keeps beside a bf16 weight, shaped like it
WEIGHT_UPDATE_STATE: dict[str, tuple[str, torch.dtype]] = {
    "master": ("master", torch.float32),  # fp32 master weights
    "kahan": ("kahan_comp", torch.bfloat16),  # what rounding to bf16 lost
    "master_remainder": ("master_remainder", torch.int16),  # the master's low 16 bits
}


def weight_update_specs(p: torch.Tensor, group: dict[str, Any]) -> dict[str, tuple]:
    """State tensor name -> (local shape, dtype, global shape) of the extra state that
    ``group``'s ``weight_update`` keeps for parameter ``p`` (bf16 parameters only)."""
    entry = WEIGHT_UPDATE_STATE.get(group["weight_update"])
    if p.dtype != torch.bfloat16 or entry is None:
        return {}
    key, dtype = entry
    return {key: (tuple(local(p).shape), dtype, tuple(p.shape))}


def state_specs(p: torch.Tensor, group: dict[str, Any]) -> dict[str, tuple]:
    """State tensor name -> (local shape, dtype, global shape) of one parameter of
    ``group``: its format's tensors, and the extra state of its weight update."""
    fmt, block = param_format(p, group)
    loc = local(p)
    shapes = fmt.state_shapes(tuple(loc.shape), block)
    gshapes = fmt.state_shapes(tuple(p.shape), block)
    specs = {k: (shape, dtype, gshapes[k][0]) for k, (shape, dtype) in shapes.items()}
    return {**specs, **weight_update_specs(p, group)}
