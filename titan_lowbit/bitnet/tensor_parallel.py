"""BitNet linear layers under tensor parallelism (ColwiseParallel / RowwiseParallel).

torchtitan's TP plan shards a linear's weight as a DTensor on the TP mesh: dim 0 (output
features) for ``ColwiseParallel``, dim 1 (input features) for ``RowwiseParallel``; the
styles turn the input into a DTensor (replicated, or sharded on its last dim) and
redistribute the output. DTensor's own matmul would see only the latent weight inside
the DTensor and silently train a plain linear, so a converted layer
(``BitNetLinear``) computes its forward here on the local shards and returns a DTensor
with the placement the style expects:

    column-wise  W = [W_0; W_1; ...] (rows),  x replicated:
        y_r = BitNet(x, W_r)                 -> Shard(-1)
        backward: dy_r holds a slice of each dy row, so the row abs-max that quantizes
        dy for the int8 grad_input is all-reduced (MAX) over the TP ranks; dx_r is a
        partial sum (the style's input redistribution reduces it)
    row-wise     W = [W_0, W_1, ...] (columns), x sharded on its last dim:
        x's row abs-max all-reduced (MAX) over the TP ranks, then
        y_r = BitNet(x_r, W_r)               -> Partial (the style reduce-scatters)

Every rank therefore quantizes exactly as the unsharded layer: the same row scales for
x and dy, and the same tensor scale g = mean |W| from the whole weight's sum |W|
(summed over the TP ranks, and over the FSDP ranks first when FSDP shards the weight
too; ``weight.sum_over_ranks``). Up to the summation order of the partial products, the
outputs and gradients equal the unsharded layer's.

Under FSDP x TP the all-gather happens in ``fsdp_pre_all_gather``, before any forward,
so the module carries its TP group (``bitnet_tp_group``, set by
``linear.enable_tensor_parallel`` after the model is parallelized) for the per-layer
scale's sum over the ranks there.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from titan_lowbit.bitnet import ops
from titan_lowbit.bitnet.weight import (
    BitNetTernaryWeight,
    BitNetTrainingWeight,
    autocast_input,
    check_dtypes,
    sum_over_ranks,
)


def _weight_codes(module: nn.Module, weight: DTensor, group,
                  sharded: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Ternary codes of this rank's weight shard, the whole weight's scale, int8 backward."""
    local = weight._local_tensor  # the persistent object (to_local() returns a fresh view)
    if isinstance(local, BitNetTernaryWeight):  # FSDP x TP: gathered over FSDP, scale done
        recorded = getattr(module, "bitnet_tp_group", None)
        # By name: a mesh may hand out a new Python handle for the same group.
        if sharded and (recorded is None or recorded.group_name != group.group_name):
            raise RuntimeError(
                "BitNet: an FSDP-gathered tensor-parallel weight whose scale was not reduced "
                "over the TP ranks; call titan_lowbit.bitnet.enable_tensor_parallel(model, "
                "tp_mesh) after applying tensor parallelism and FSDP (torchtitan runs through "
                "titan_lowbit's train spec do)."
            )
        return local._codes, local._scale, local._int8_backward
    if isinstance(local, BitNetTrainingWeight):  # TP only: the latent shard is here
        # dropped by an optimizer step or an in-place op on the weight (weight.py, _generation)
        abs_sum = local._precomputed_abs_sum
        if abs_sum is None:
            # precompute_scales' sum for this one weight (an opaque operator and a
            # functional all-gather under torch.compile: the same bits traced or eager)
            abs_sum = ops.weight_abs_sums([local._data])[0]
            if sharded:
                abs_sum = sum_over_ranks(abs_sum.view(1), [group]).view(())
        numel = module.in_features * module.out_features
        codes, scale = ops.quantize_weight_shard(local._data, abs_sum, numel)
        return codes, scale, local._int8_backward
    raise TypeError(f"BitNet: unexpected local weight {type(local).__name__} in a TP DTensor")


def tensor_parallel_linear(module: nn.Module, x: torch.Tensor) -> DTensor:
    """Forward of a BitNet linear whose weight is a DTensor on a 1-D TP mesh (module doc)."""
    weight, bias = module.weight, module.bias
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"BitNet: a weight on a {mesh.ndim}-D mesh in forward; tensor parallelism over "
            "one mesh dimension is supported (FSDP gathers its own dimension first)."
        )
    if not isinstance(x, DTensor):
        raise TypeError(
            "BitNet: a tensor-parallel BitNet linear got a plain input; apply it through a TP "
            "style (ColwiseParallel / RowwiseParallel), which makes the input a DTensor."
        )
    group = mesh.get_group()
    (placement,) = weight.placements
    codes, scale, int8_bwd = _weight_codes(module, weight, group, placement.is_shard())
    w_local = weight.to_local()  # autograd routes the local dW back to the DTensor weight
    out_shape = (*x.shape[:-1], module.out_features)
    x_amax = dy_rows_group = None
    if placement.is_shard() and placement.dim % 2 == 0:  # column-wise: output features
        # dx is a partial sum over the ranks, handed back as Partial: the style's input
        # redistribution reduces it, once for all the layers that share x (torchtitan's
        # plan: one PrepareModuleInput before wq, wk, wv, one reduce-scatter of their
        # summed dx). A redistribute to Replicate here, even one that moves nothing
        # forward, would all-reduce each layer's dx in backward instead.
        if tuple(x.placements) != (Replicate(),):
            x = x.redistribute(mesh, [Replicate()])
        x_local = x.to_local(grad_placements=[Partial()])
        dy_rows_group, out_placement = group, Shard(len(out_shape) - 1)
    elif placement.is_shard():  # row-wise: input features
        x_local = x.redistribute(mesh, [Shard(x.dim() - 1)]).to_local()
        out_placement = Partial()
    else:  # replicated weight: every rank computes the whole layer
        x_local = x.redistribute(mesh, [Replicate()]).to_local()
        out_placement = Replicate()
    x_local = autocast_input(x_local)
    check_dtypes(x_local, w_local)
    partial = out_placement.is_partial()
    if partial:
        x_amax = ops.all_reduce_row_absmax(x_local.reshape(-1, x_local.shape[-1]), group)
    # The bias joins the local output, except after a row-wise layer: there the replicated
    # bias is added once to the reduced output (DTensor's Partial + Replicate).
    b_local = None if bias is None or partial else bias.to_local()
    y = ops.BitNetLinearFunction.apply(x_local, w_local, codes, scale, b_local, int8_bwd,
                                       x_amax, dy_rows_group)
    y = DTensor.from_local(y, mesh, [out_placement], run_check=False,
                           shape=out_shape, stride=make_contiguous_strides_for(out_shape))
    return y + bias if partial and bias is not None else y
