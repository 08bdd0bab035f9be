"""BitNetLinear: the class of an ``nn.Linear`` converted by ``bitnet``, and
``enable_tensor_parallel``, which gives the tensor-parallel ones their TP group.

The converter swaps a layer's weight for a BitNet weight and its class for this subclass
of ``nn.Linear`` (the module object, its FQN, parameters, hooks and state dict stay).
Only ``forward`` differs, and only under tensor parallelism: a weight that is a DTensor
in forward has been sharded by a TP style, and DTensor's matmul would bypass the BitNet
weight, so the sharded forward runs in ``tensor_parallel.py``. Otherwise (one device,
FSDP, HSDP) ``F.linear`` reaches the BitNet weight's ``__torch_function__``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_lowbit.bitnet.tensor_parallel import tensor_parallel_linear
from titan_lowbit.bitnet.weight import (
    BitNetTernaryWeight,
    BitNetTrainingWeight,
    drop_stale_abs_sums,
    local_training_weight,
)


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


def enable_tensor_parallel(model: nn.Module, tp_mesh) -> list[str]:
    """Record the TP group on every BitNet linear whose weight the TP plan sharded.

    Call after the model is parallelized (titan_lowbit's train spec does, when
    ``parallelism.tensor_parallel_degree > 1``). BitNet linears the plan leaves alone
    train as data-parallel layers. Returns the FQNs of the tensor-parallel BitNet layers.
    """
    tp_name = (tp_mesh.mesh_dim_names or (None,))[0]
    if tp_mesh.ndim != 1 or tp_name is None:
        raise ValueError(f"BitNet: the TP mesh must be 1-D and named, got {tp_mesh}")
    done, layers = [], []
    for name, mod in model.named_modules():
        weight = getattr(mod, "weight", None)
        if not isinstance(weight, torch.Tensor) or local_training_weight(weight) is None:
            continue
        names = (weight.device_mesh.mesh_dim_names or ()) if isinstance(weight, DTensor) else ()
        if tp_name not in names or not weight.placements[names.index(tp_name)].is_shard():
            continue  # not tensor-parallel, or replicated over TP: its scale needs no TP sum
        if not isinstance(mod, BitNetLinear):
            raise TypeError(
                f"BitNet: {name!r} ({type(mod).__name__}) has a tensor-parallel BitNet weight, "
                "but only plain nn.Linear layers are converted to BitNetLinear, which computes "
                f"the sharded forward. Add {name!r} to [lowbit] bitnet_filter."
            )
        mod.bitnet_tp_group = tp_mesh.get_group()
        done.append(name)
        layers.append(mod)
    model._bitnet_tp_layers = layers
    if done and not getattr(model, "_bitnet_drops_stale_sums", False):
        model.register_forward_pre_hook(_drop_stale_sums_hook)
        model._bitnet_drops_stale_sums = True
    return done


@torch.compiler.disable
def _drop_stale_sums_hook(model: nn.Module, args) -> None:
    """Forward pre-hook (enable_tensor_parallel): the tensor-parallel forward reads a
    precomputed sum |W| as it is (it is traced, see weight.py); drop here, before it, the
    sums of weights written through a state-dict alias since, e.g. by DCP's in-place load
    without a load_state_dict after it. All ranks load together, so all fall back to the
    layer's own sum over the ranks together. One compare per weight. The weights are
    looked up here, not kept: ``model.to_empty`` (torchtitan's meta-device init, after
    this was enabled) gives every parameter a new local tensor."""
    drop_stale_abs_sums(local_training_weight(layer.weight) for layer in model._bitnet_tp_layers)
