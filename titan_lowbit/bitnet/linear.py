"""BitNetLinear: the class of an ``nn.Linear`` converted by ``bitnet``.

The converter swaps a layer's weight for a BitNet weight and its class for this subclass
of ``nn.Linear`` (the module object, its FQN, parameters, hooks and state dict stay).
Only ``forward`` differs, and only under tensor parallelism: a weight that is a DTensor
in forward has been sharded by a TP style, and DTensor's matmul would bypass the BitNet
weight, so the sharded forward runs in ``tensor_parallel.py``. Otherwise (one device,
FSDP, HSDP) ``F.linear`` reaches the BitNet weight's ``__torch_function__`` as before.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_lowbit.bitnet.tensor_parallel import tensor_parallel_linear
from titan_lowbit.bitnet.weight import BitNetTernaryWeight, BitNetTrainingWeight


class BitNetLinear(nn.Linear):
    """nn.Linear with a BitNet weight (``BitNetTrainingWeight``)."""

    # The TP process group when the TP plan shards this layer (enable_tensor_parallel).
    bitnet_tp_group = None
    # The layer's FQN in the model it was converted in, for error messages.
    bitnet_name = "?"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        local = weight._local_tensor if isinstance(weight, DTensor) else weight
        if not isinstance(local, (BitNetTrainingWeight, BitNetTernaryWeight)):
            # F.linear would silently train this layer as a plain linear.
            raise TypeError(
                f"BitNet: the weight of linear {self.bitnet_name!r} ({self.in_features}->"
                f"{self.out_features}) is a plain {type(local).__name__}: it was replaced after "
                "conversion (load_state_dict(..., assign=True), module.weight = ..., "
                "torch.func.functional_call). Load with assign=False (the default), or convert "
                "the layer again with titan_lowbit.bitnet.convert_to_bitnet."
            )
        if x.shape[-1] != self.in_features:  # (a DTensor input reports its global shape)
            raise ValueError(
                f"BitNet: linear {self.bitnet_name!r} takes {self.in_features} input features, "
                f"got an input of shape {tuple(x.shape)}."
            )
        if isinstance(weight, DTensor):
            return tensor_parallel_linear(self, x)
        return F.linear(x, weight, self.bias)
