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


class BitNetLinear(nn.Linear):
    """nn.Linear with a BitNet weight (``BitNetTrainingWeight``)."""

    # The TP process group when the TP plan shards this layer (enable_tensor_parallel).
    bitnet_tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return tensor_parallel_linear(self, x)
        return F.linear(x, self.weight, self.bias)
