"""BitNet b1.58 training: weight subclass, converter, FSDP2 hooks, tensor parallelism.

``CONVERTERS`` maps the registered converter names ("bitnet", "bitnet_subln") to their
classes; titan_lowbit.torchtitan registers them with torchtitan.
"""

from titan_lowbit.bitnet.converter import (
    CONVERTERS,
    BitNetConverter,
    BitNetSubLNConverter,
    convert_to_bitnet,
    insert_subln,
)
from titan_lowbit.bitnet.linear import BitNetLinear, enable_tensor_parallel
from titan_lowbit.bitnet.weight import (
    BitNetTernaryWeight,
    BitNetTrainingWeight,
    precompute_scales,
    refresh_ternary_codes,
)

__all__ = [
    "CONVERTERS",
    "BitNetConverter",
    "BitNetLinear",
    "BitNetSubLNConverter",
    "BitNetTernaryWeight",
    "BitNetTrainingWeight",
    "convert_to_bitnet",
    "enable_tensor_parallel",
    "insert_subln",
    "precompute_scales",
    "refresh_ternary_codes",
]
