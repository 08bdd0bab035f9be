"""Second moments that a checkpoint of the older encoder stored as zero.

The second moment's encoder is zero-free (``titan_lowbit.kernels.quant_maps``): a positive
``v`` is never coded 0. The encoder before it rounded a positive ``v`` below half the
smallest code of its block (8-bit: 5e-8 of the block's absmax; fp8: 2**-10 / 448) to 0,
and that is the only difference: codes, scales and layout are the same, so such a
checkpoint is a valid state except where an element's ``v`` code is 0 while its ``m`` code
is not. There the history of ``v`` is already lost, and a step with a zero gradient would
move the weight by ``lr * m / eps``. A ``v`` stored as 0 next to a nonzero ``m`` was
positive when it was written (``m`` is nonzero only after a nonzero gradient, which made
``v`` positive), so the zero-free encoder would have written the smallest positive code
for it: ``restore_second_moments`` writes exactly that, and says so in one log line per
parameter. (The one exception: a gradient so small that ``(1 - beta2) * g * g`` underflows
fp32, below about 1e-21, leaves ``v`` exactly 0 with ``m`` nonzero; the smallest code then
raises that ``v`` to 1e-7 (8-bit) of its block's absmax, which only shortens its step.)
The 4-bit format's second-moment map has no zero code: nothing to restore.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch

from titan_lowbit.kernels.quant_maps import CODEC_DYN8_UNSIGNED, SMALLEST_POSITIVE_CODE

from .formats import StateFormat

logger = logging.getLogger(__name__)

# magnitude bits of the signed one-byte codes (8-bit signed dynamic tree, fp8 e4m3): the
# sign bit off, so -0 counts as 0; the unsigned 8-bit map's 8 bits are all magnitude
_MAGNITUDE = 0x7F


def lost_second_moments(fmt: StateFormat, state: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """Bool mask, shaped like the codes, of the elements of one parameter's (local)
    quantized ``state`` whose second-moment code is 0 while their first moment's is not;
    None for formats whose second moment has no zero code (plain, 4-bit)."""
    if not fmt.quantized or fmt.codes_per_byte != 1:
        return None
    m = state["exp_avg_codes"].view(torch.uint8)
    v = state["exp_avg_sq_codes"].view(torch.uint8)
    v_zero = (v == 0) if fmt.v_codec == CODEC_DYN8_UNSIGNED else ((v & _MAGNITUDE) == 0)
    return v_zero & ((m & _MAGNITUDE) != 0)


def restore_second_moments(params: Iterable[tuple[str, StateFormat, dict[str, torch.Tensor]]]) -> int:
    """For each ``(name, format, local state)``: give every second moment that
    ``lost_second_moments`` finds the smallest positive code, in place (what the zero-free
    encoder writes for it), with one log line naming the parameter and the count. Returns
    the number of elements restored."""
    total = 0
    for name, fmt, state in params:
        lost = lost_second_moments(fmt, state)
        if lost is None:
            continue
        n = int(lost.sum())
        if n:
            v = state["exp_avg_sq_codes"].view(torch.uint8)
            v.copy_(torch.where(lost, torch.full_like(v, SMALLEST_POSITIVE_CODE), v))
            logger.warning(f"LowBitAdamW: param '{name}': {n} second moments of the loaded optimizer state were "
                           "stored as 0 next to a nonzero first moment (a checkpoint of the older, not "
                           "zero-free encoder); set to the smallest positive code, as the encoder now writes them")
        total += n
    return total
