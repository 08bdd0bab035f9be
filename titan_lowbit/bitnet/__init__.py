"""BitNet b1.58 training: weight subclass, converter, FSDP2 hooks.

``CONVERTERS`` maps the registered converter names ("bitnet", "bitnet_subln") to their
classes; titan_lowbit/__init__.py registers them with torchtitan.
"""

from titan_lowbit.bitnet.converter import (
    CONVERTERS,
    BitNetConverter,
    BitNetSubLNConverter,
    convert_to_bitnet,
    insert_subln,
)
from titan_lowbit.bitnet.weight import BitNetTernaryWeight, BitNetTrainingWeight, precompute_scales

__all__ = [
    "CONVERTERS",
    "BitNetConverter",
    "BitNetSubLNConverter",
    "BitNetTernaryWeight",
    "BitNetTrainingWeight",
    "convert_to_bitnet",
    "insert_subln",
    "precompute_scales",
]
