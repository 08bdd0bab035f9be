"""BitNet weight tensor subclasses and their FSDP2 all-gather extension.

Two wrapper subclasses, so that an ``nn.Linear`` keeps its module, its FQNs and its
state dict while its forward becomes the BitNet one (``F.linear`` on either weight is
routed to ``BitNetLinearFunction``):

``BitNetTrainingWeight``
    The parameter the optimizer sees: a wrapper over the latent high-precision weight
    (``_data``). Shape-preserving ops that FSDP2, ``to_empty`` and checkpoint loading use
    (views, slices, copies, empty_like, ...) return the subclass again, so the sharded
    local tensor keeps the FSDP2 hooks; every other op sees the plain latent tensor.

``BitNetTernaryWeight``
    What FSDP2's all-gather produces: int8 ternary codes ``_codes`` [N, K] and the fp32
    tensor scale ``_scale``, reporting FSDP2's param dtype. It exists between the
    all-gather and the reshard and only supports ``F.linear`` and the views FSDP2 takes.

All-gather (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``): each rank ternarizes its
shard with the global scale and sends the codes packed four per byte (0.25 byte per
element, 1/8 of bf16); after the gather the codes are unpacked into int8. The global
sum |W| behind the scale is either precomputed after the optimizer step for all layers
with one collective per sharded mesh dimension (``precompute_scales``, called by the
converter's post_optimizer_hook) or, when absent, summed per layer inside
``fsdp_pre_all_gather`` (over the FSDP shards, then over the module's
``bitnet_tp_group`` under tensor parallelism, see ``tensor_parallel.py``). Both compute a
weight's sum in one order, local (``ops.weight_abs_sums``) and over the ranks
(``sum_over_ranks``), so the scale has the same bits either way: a run resumed from a
checkpoint, whose first step has no precomputed sums, continues bit for bit. The scale
travels in the all-gather metadata (every rank holds the same value), not in the payload.
With precomputed sums, the packing itself also moves out of the all-gathers: the same hook
re-packs every gathered shard into buffers kept between steps (``PackedShard``), and both
all-gathers of the next step hand them over.

With ``[lowbit] bitnet_keep_codes``, unsharded weights (one device, no FSDP or TP) keep
their ternary codes between weight updates instead of quantizing in every forward:
``refresh_ternary_codes`` (called by the converter's post-optimizer hook, and by a forward
pre-hook on the model for the first step or any other change) computes codes, transposed
codes and scale of every stale weight at once, and a weight reports them only while its
values are those they were computed from (``_generation``, below).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Iterable

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_map_only

from titan_lowbit.bitnet import ops
from titan_lowbit.kernels.bitnet_quant import check_float_input

aten = torch.ops.aten

# Ops whose result is (a view or copy of) the same weight and must keep the subclass:
# FSDP2 sharding (split, new_zeros, slice, copy_, view, as_strided), module.to_empty
# (empty_like), clone/_to_copy (device moves, state dict copies). (detach and alias,
# e.g. nn.Parameter's: _SAME_LATENT.)
_KEEP_TRAINING_SUBCLASS = {
    aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default,
    aten.empty_like.default, aten.clone.default, aten._to_copy.default, aten.copy_.default,
    aten._pin_memory.default,
}
# Ops whose result is the same tensor (BitNetTrainingWeight.__torch_dispatch__).
_SAME_LATENT = {aten.detach.default, aten.alias.default}
_TERNARY_VIEWS = {aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default}

# Generation of the BitNet weights' values: every optimizer step (a global step pre-hook,
# which also covers optimizers that write the latent weight from their own kernels) and
# every in-place op on a BitNetTrainingWeight (a checkpoint load, a manual edit) starts a
# new one. Ternary codes kept by a weight are valid only in the generation they were
# computed in, and so are FSDP2's packed shards. One counter for all weights: a change to
# one makes every weight's codes stale (they all change at every step anyway). (Tensor
# version counters cannot tell: torch's foreach and fused optimizers do not bump them on
# a wrapper subclass or its inner tensor.)
#
# Precomputed sums |W| are dropped instead (the attribute set to None) by the writes that
# every rank makes together: an optimizer step (the same hook) and an in-place op on the
# weight, which is what load_state_dict does (torchtitan's checkpoint load runs it after
# DCP's in-place load). Not by a state_dict() taken: a dropped sum falls back to the
# per-layer sum over the ranks, a collective, which must not depend on what one rank
# alone may do. A write into a state-dict alias (DCP's in-place load) bypasses __torch_dispatch__
# but bumps the latent tensor's version counter: the FSDP2 all-gather compares it; the
# tensor-parallel forward cannot (torch.compile traces it, and compares of counters there
# would recompile at every step), so a forward pre-hook that is never traced does
# (drop_stale_abs_sums, registered by enable_tensor_parallel).
_generation = 0
_step_hook = None
# weights holding a precomputed sum, by id (dropped at the next optimizer step; not a
# WeakSet, which compares its members with ==)
_weights_with_sums: "weakref.WeakValueDictionary[int, BitNetTrainingWeight]" = weakref.WeakValueDictionary()


# torch.Tensor.data (the C descriptor), which BitNetTrainingWeight.data reads through.
_TENSOR_DATA = torch.Tensor.data


def _new_generation(*_args, **_kwargs) -> None:
    global _generation
    _generation += 1


def _on_optimizer_step(*_args, **_kwargs) -> None:
    """Every optimizer step: a new generation, and every precomputed sum dropped (the
    post-optimizer hook sets them again)."""
    _new_generation()
    for w in list(_weights_with_sums.values()):
        w._precomputed_abs_sum = None
    _weights_with_sums.clear()


def _watch_optimizer_steps() -> None:
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_on_optimizer_step)


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a BitNet weight (either subclass); F.linear's argument names.

    Under torch.autocast the activation is cast to the autocast dtype first, as autocast
    does for F.linear: torchtitan without FSDP trains fp32 weights under bf16 autocast,
    and the int8 kernels then write bf16 outputs and the weight gradient is a bf16 GEMM.
    """
    x = autocast_input(input)
    check_dtypes(x, weight)
    if isinstance(weight, BitNetTernaryWeight):
        # gathered codes: backward transposes them (keeping a transposed copy from the
        # forward would hold every gathered layer's codes until its backward)
        return ops.BitNetLinearFunction.apply(x, weight, weight._codes, weight._scale, bias,
                                              weight._int8_backward)
    kept = weight.ternary_codes()
    codes, codes_t, scale = kept if kept is not None else ops.quantize_weight(weight._data)
    return ops.BitNetLinearFunction.apply(x, weight, codes, scale, bias, weight._int8_backward,
                                          None, None, codes_t)


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x in torch.autocast's dtype when autocast is on (as autocast casts F.linear's input)."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def check_dtypes(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_float_input("BitNet linear input", x)
    check_float_input("BitNet weight", weight)


class _RoutesLinear(torch.Tensor):
    """Sends F.linear on this weight to the BitNet linear; every other function runs as usual
    (and reaches __torch_dispatch__ of the concrete subclass)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            # Also for F.linear: nothing inside needs this method again (the autograd
            # Function's apply would otherwise come back here for a second round trip).
            if func is F.linear:
                return _linear(*args, **kwargs)
            return func(*args, **kwargs)


class BitNetTrainingWeight(_RoutesLinear):
    """Latent high-precision weight of a BitNet linear layer (see module docstring)."""

    _data: torch.Tensor
    _int8_backward: bool
    # sum |W| over the whole weight (all its shards), set after each optimizer step by
    # precompute_scales; the scale g = max(sum / numel, EPS) is derived in the kernels.
    # Dropped (None) by an in-place op on the weight or an optimizer step (module comment
    # on _generation); _abs_sum_version: the latent tensor's version counter then.
    _precomputed_abs_sum: torch.Tensor | None
    _abs_sum_version: int
    # This shard's FSDP2 all-gather input, packed by precompute_scales after the optimizer
    # step for both all-gathers of the next step (forward and backward).
    _packed_shard: PackedShard | None
    # FSDP2 all-gathers this weight (set by its first fsdp_pre_all_gather): only then does
    # precompute_scales pack it.
    _fsdp_gathered: bool
    # Unsharded weights: ternary codes [N, K], the codes transposed [K, N] and the scale,
    # computed by refresh_ternary_codes in generation _codes_generation (ternary_codes()).
    _codes: torch.Tensor | None
    _codes_t: torch.Tensor | None
    _scale: torch.Tensor | None
    _codes_generation: int
    # their buffers and prepared launch (refresh_ternary_codes)
    _kept: KeptCodes | None

    @staticmethod
    def __new__(cls, data: torch.Tensor, int8_backward: bool = True):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, layout=data.layout,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, int8_backward: bool = True):
        self._data = data
        self._int8_backward = int8_backward
        self._precomputed_abs_sum = None
        self._abs_sum_version = -1
        self._packed_shard = None
        self._fsdp_gathered = False
        self._codes = self._codes_t = self._scale = None
        self._codes_generation = -1
        self._kept = None

    def __repr__(self) -> str:
        return f"BitNetTrainingWeight({self._data!r}, int8_backward={self._int8_backward})"

    @property
    def data(self) -> torch.Tensor:
        return _TENSOR_DATA.__get__(self, type(self))

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``weight.data = t`` makes t (its latent tensor, for a BitNet weight) the latent
        weight, as for a plain parameter. torch's own setter would swap the wrapper's
        storage, which holds nothing, and leave the latent weight as it was."""
        new = value._data if isinstance(value, BitNetTrainingWeight) else value
        if not isinstance(new, torch.Tensor) or (new.shape, new.stride(), new.dtype, new.device) != (
                self.shape, self.stride(), self.dtype, self.device):
            raise ValueError(
                f"BitNet: weight.data = {type(value).__name__} of "
                f"{getattr(value, 'shape', None)}, {getattr(value, 'dtype', None)}, "
                f"{getattr(value, 'device', None)}; a BitNet weight takes only a tensor of its "
                f"own shape, strides, dtype and device ({tuple(self.shape)}, {self.stride()}, "
                f"{self.dtype}, {self.device}). Convert it first (.to, .contiguous), or copy it "
                "in with weight.copy_(t)."
            )
        _new_generation()
        self._precomputed_abs_sum = None
        self._data = new.detach()

    def set_precomputed_abs_sum(self, abs_sum: torch.Tensor) -> None:
        """Keep the whole weight's sum |W| of the current values (precompute_scales) until
        the next optimizer step or in-place op on the weight; the all-gather (FSDP) or
        forward (TP) without one sums this layer's |W| over the ranks itself."""
        self._precomputed_abs_sum = abs_sum
        self._abs_sum_version = self._data._version
        _weights_with_sums[id(self)] = self

    def current_abs_sum(self) -> torch.Tensor | None:
        """The precomputed sum |W|, or None: dropped here if the latent tensor was written
        since it was set (its version counter moved: a write into a state-dict alias)."""
        if self._precomputed_abs_sum is not None and self._abs_sum_version != self._data._version:
            self._precomputed_abs_sum = None
        return self._precomputed_abs_sum

    def ternary_codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes, codes^T, scale) of the weight's current values, or None where they were
        not computed in the current generation (module comment on _generation)."""
        if self._codes is None or self._codes_generation != _generation:
            return None
        return self._codes, self._codes_t, self._scale

    def set_ternary_codes(self, codes, codes_t, scale) -> None:
        """Keep (codes, codes^T, scale) of the current values until the next generation."""
        self._codes, self._codes_t, self._scale = codes, codes_t, scale
        self._codes_generation = _generation

    def __tensor_flatten__(self):
        # torch.compile sees fresh codes as inputs (and guards on this metadata: a weight
        # with stale or no codes runs a graph that quantizes it in the forward).
        if self.ternary_codes() is not None:
            return ["_data", "_codes", "_codes_t", "_scale"], (self._int8_backward, True)
        return ["_data"], (self._int8_backward, False)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        int8_backward, has_codes = meta
        w = BitNetTrainingWeight(inner["_data"], int8_backward)
        if has_codes:
            w.set_ternary_codes(inner["_codes"], inner["_codes_t"], inner["_scale"])
        return w

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        int8_backward = next(a._int8_backward for a in tree_flatten((args, kwargs))[0]
                             if isinstance(a, BitNetTrainingWeight))
        if func._schema.is_mutable:
            # the weight's values may change: its ternary codes are stale (kept codes and
            # packed shards are recomputed locally: any mutable op may start a generation)
            _new_generation()
            _drop_sums_of_written(func, args, kwargs)
        if func in _SAME_LATENT:
            # A new wrapper over the same latent tensor. Run here, below autograd, detach
            # would make a latent alias with a version counter of its own, so the
            # plain-tensor aliases of state dicts (nn.Module.state_dict detaches) would
            # hide their writes from the version checks of kept codes and packed shards.
            return BitNetTrainingWeight(args[0]._data, int8_backward)
        out = func(*tree_map_only(BitNetTrainingWeight, lambda t: t._data, args),
                   **tree_map_only(BitNetTrainingWeight, lambda t: t._data, kwargs))
        if func in _KEEP_TRAINING_SUBCLASS:
            return tree_map_only(torch.Tensor, lambda t: BitNetTrainingWeight(t, int8_backward), out)
        return out

    # ---- FSDP2 all-gather extension -------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Ternarize this shard with the global scale and pack it four codes per byte, or
        hand over what precompute_scales packed after the optimizer step.

        The packed shard is used while the weight is unchanged since it was packed: the
        latent tensor's version counter (a write into it, e.g. DCP's in-place load) and
        the weights' generation (an optimizer step, an in-place op on the parameter, a
        state_dict taken; module comment on _generation) are those of the pack. Otherwise
        (an optimizer step with no precompute after it, a load_state_dict) this packs
        anew."""
        shard = self._packed_shard
        if (shard is not None and shard.data is self._data and shard.version == self._data._version
                and shard.generation == _generation):
            return (shard.packed,), (shard.scale, self._data.shape[1], True)
        if self._data.dim() != 2:
            raise ValueError(f"BitNet: FSDP2 gathers 2-D linear weights, got shape {tuple(outer_size)}")
        world = mesh.size()
        if outer_size[0] % world:
            # Raised on every rank (not only the padded ones), so no rank hangs in the gather.
            raise ValueError(
                f"BitNet: a weight of shape {tuple(outer_size)} has {outer_size[0]} rows, not a "
                f"multiple of the FSDP shard count {world}; FSDP2 cannot pad a packed all-gather. "
                "Exclude the layer with [lowbit] bitnet_filter or pick a shard count dividing it."
            )
        # The whole weight's size: under tensor parallelism outer_size is the TP shard's.
        numel = module.in_features * module.out_features if isinstance(module, nn.Linear) \
            else outer_size.numel()
        # (and not written since through a state-dict alias, e.g. by DCP's in-place load:
        # current_abs_sum compares the version counter, here in eager code)
        abs_sum = self.current_abs_sum()
        if abs_sum is None:
            # precompute_scales' sum for this one weight: the same local sum, then over
            # the FSDP shards and the TP ranks (mesh-dim order) in rank order
            groups = [_shard_group(mesh)] if world > 1 else []
            tp_group = getattr(module, "bitnet_tp_group", None)
            if tp_group is not None:
                groups.append(tp_group)
            local_sum = ops.weight_abs_sums([self._data])[0]
            abs_sum = sum_over_ranks(local_sum.view(1), groups).view(())
        packed, scale = ops.pack_ternary_from_sum(self._data, abs_sum, numel)
        self._fsdp_gathered = True
        return (packed,), (scale, self._data.shape[1], False)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """Unpack the gathered codes into int8 (into ``out``'s buffers after the first gather).

        ``persistent``: the scale is a ``PackedShard``'s buffer, which each re-pack rewrites
        in place; the gathered weight then reads that buffer itself (no device copy per
        gather). A scale made inside this gather is copied: FSDP2 drops the metadata, and
        with it the tensor, as soon as this call returns."""
        (packed,) = all_gather_outputs
        scale, cols, persistent = metadata
        if not persistent and scale.is_cuda:
            # Made in fsdp_pre_all_gather, on FSDP2's all-gather copy-in stream when it
            # prefetches, and read here on this stream by the clone below, which may not
            # have run when FSDP2 drops the metadata on return. Without this the allocator
            # could hand the scale's block to the next layer's pre-all-gather on the
            # copy-in stream before the clone reads it: a race that changed the forward
            # from run to run under FSDP x TP (docs/distributed.md).
            scale.record_stream(torch.cuda.current_stream(scale.device))
        if out is not None:
            if isinstance(out, DTensor):  # FSDP x TP: the unsharded param is a TP DTensor
                out = out._local_tensor
            if not isinstance(out, BitNetTernaryWeight):
                raise TypeError(f"BitNet: FSDP2 passed out={type(out).__name__}, expected BitNetTernaryWeight")
            # FSDP2 refills the same buffers every step; autograd may hold them from the
            # last forward, so the refill must not bump their version counters.
            with torch.autograd._unsafe_preserve_version_counter((out._codes,)):
                ops.unpack_ternary(packed, cols, out=out._codes)
            # Not FSDP2's buffer: the weight takes a new tensor instead of a refill (what
            # autograd saved from the last forward keeps its own), and never writes into a
            # shard's buffer.
            out._scale = scale if persistent else scale.detach().clone()
            return None
        codes = ops.unpack_ternary(packed, cols)
        gathered = BitNetTernaryWeight(codes, scale if persistent else scale.detach().clone(),
                                       param_dtype, self._int8_backward)
        return gathered, (codes,)


# FSDP2 (torch 2.11 and 2.13) calls inspect.signature on fsdp_pre_all_gather at every
# all-gather of every weight, to tell its one- and five-argument forms apart. A signature
# stored on the function spares that introspection: 13.4 -> 5.0 us per call on the
# two-H200 host (33 -> 10 us on the development CPU), for 2 x 7 weights x layers calls per
# step. At 1B on two GPUs that is about 2 ms of a 170 ms step, within run-to-run noise.
BitNetTrainingWeight.fsdp_pre_all_gather.__signature__ = inspect.signature(
    BitNetTrainingWeight.fsdp_pre_all_gather)


class PackedShard:
    """A BitNet weight shard's FSDP2 all-gather input (packed codes and scale), re-packed
    in place by ``precompute_scales`` after every optimizer step.

    The buffers, the kernel's arguments and its compiled launch are prepared once, so a
    re-pack costs one launch of host time. ``abs_sum`` is the buffer the precomputed
    sum |W| (over all shards) is copied into; ``version`` and ``generation`` are the latent
    weight's version counter and the weights' generation at the last pack (the
    all-gather hands the pack over only while both match).
    The gathered weights read ``scale`` itself, so a re-pack updates them too.
    """

    __slots__ = ("data", "numel", "abs_sum", "launch", "packed", "scale", "version", "generation")

    def __init__(self, data: torch.Tensor, numel: int):
        self.data, self.numel = data, numel
        self.abs_sum = torch.zeros((), dtype=torch.float32, device=data.device)
        self.launch, self.packed, self.scale = ops.prepare_pack_ternary_from_sum(data, self.abs_sum, numel)
        self.version = self.generation = None
        _watch_optimizer_steps()

    def repack(self) -> None:
        """Pack the latent weight's current values with the sum in ``abs_sum``."""
        self.launch()
        self.version, self.generation = self.data._version, _generation


class BitNetTernaryWeight(_RoutesLinear):
    """All-gathered BitNet weight: int8 ternary codes and an fp32 tensor scale."""

    _codes: torch.Tensor
    _scale: torch.Tensor
    _int8_backward: bool

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                int8_backward: bool = True):
        return torch.Tensor._make_wrapper_subclass(
            cls, codes.shape, strides=codes.stride(), storage_offset=codes.storage_offset(),
            dtype=dtype, device=codes.device, requires_grad=False,
        )

    def __init__(self, codes, scale, dtype, int8_backward: bool = True):
        self._codes = codes
        self._scale = scale
        self._int8_backward = int8_backward

    def __repr__(self) -> str:
        return (f"BitNetTernaryWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"scale={self._scale!r})")

    def __tensor_flatten__(self):
        return ["_codes", "_scale"], (self.dtype, self._int8_backward)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return BitNetTernaryWeight(inner["_codes"], inner["_scale"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TERNARY_VIEWS:
            w = args[0]
            codes = func(w._codes, *args[1:], **kwargs)
            return BitNetTernaryWeight(codes, w._scale, w.dtype, w._int8_backward)
        raise NotImplementedError(
            f"BitNet: {func} was called on an all-gathered BitNet weight, which only supports "
            "F.linear (its values are int8 ternary codes, not the latent weight). Use the "
            "sharded parameter, or list this layer in [lowbit] bitnet_filter."
        )


def _shard_group(mesh):
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"BitNet: FSDP2 shard mesh with {mesh.ndim} dims; the packed all-gather supports "
            "a 1-D shard mesh (FSDP or HSDP, optionally with tensor parallelism)."
        )
    return mesh.get_group()


def plain_weight_state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook of a BitNet linear: store the latent weight as a plain tensor.

    Checkpoints (torch.save, torch.distributed.checkpoint) then hold ordinary tensors
    (DTensors of ordinary tensors under FSDP2): they need no titan_lowbit class to load,
    and one trained with BitNet loads into a model with or without the converter. The
    plain tensor aliases the latent weight, so DCP's in-place load writes straight into it.
    """
    # DCP's in-place load into that alias bypasses __torch_dispatch__: whoever takes a
    # state dict may write the weights, so kept codes and packed shards become stale.
    # (Precomputed sums stay, see _generation: one rank alone may take a state dict.)
    _new_generation()
    key = prefix + "weight"
    t = state_dict.get(key)
    if isinstance(t, DTensor) and isinstance(t._local_tensor, BitNetTrainingWeight):
        state_dict[key] = DTensor.from_local(t._local_tensor._data, t.device_mesh, t.placements,
                                             run_check=False, shape=t.shape, stride=t.stride())
    elif isinstance(t, BitNetTrainingWeight):
        state_dict[key] = t._data


def local_training_weight(p: torch.Tensor) -> BitNetTrainingWeight | None:
    """The BitNetTrainingWeight behind a parameter (plain or DTensor), or None."""
    local = p._local_tensor if isinstance(p, DTensor) else p
    return local if isinstance(local, BitNetTrainingWeight) else None


def sum_over_ranks(sums: torch.Tensor, groups) -> torch.Tensor:
    """``sums`` (fp32 [n], this rank's values) summed over the ranks of each process group
    of ``groups`` in turn, each in rank order: rank 0's + rank 1's, + rank 2's, ...

    The values are all-gathered (a gather does no arithmetic) and added here, element by
    element, so each element's sum has the same bits whatever the length of ``sums`` and
    the element's place in it: the whole model's stacked sums (``precompute_scales``) and
    one layer's sum (its own all-gather or tensor-parallel forward) give one weight the
    same scale. An all-reduce promises no such order: NCCL's ring starts the sum of each
    chunk of the message at another rank, so with more than two ranks an element's
    rounding can depend on where it lies in the message. Traceable (functional
    collectives), for the tensor-parallel forward under torch.compile.
    """
    for group in groups:
        world = group.size()
        if world == 1:
            continue
        gathered = funcol.wait_tensor(funcol.all_gather_tensor(sums, 0, group))
        gathered = gathered.view(world, *sums.shape)
        total = gathered[0]
        for rank in range(1, world):
            total = total + gathered[rank]
        sums = total
    return sums


def precompute_scales(params: Iterable[torch.Tensor]) -> int:
    """Set every sharded BitNet weight's global sum |W| for the next all-gather (FSDP) or
    forward (tensor parallelism), from which the kernels derive the abs-mean scale.

    One all-gather of the stacked local |W| sums per sharded mesh dimension, summed in
    rank order (``sum_over_ranks``), replaces one per layer: one in total for a model
    sharded by FSDP, one over the FSDP and one over the TP ranks for FSDP x TP. Each
    weight's sum has the bits its layer's own sum would have (``weight_abs_sums``,
    ``sum_over_ranks``). Returns the number of collectives issued.
    Every weight FSDP2 has all-gathered is then re-packed into its ``PackedShard``, the
    all-gather input that the next step's forward and backward all-gathers hand over.
    Unsharded weights need no precompute (their forward sees the whole tensor) and are
    skipped.
    """
    # group names -> (the groups, the weights sharded over them with their global numel)
    by_groups: dict[tuple, tuple[tuple, list[tuple[BitNetTrainingWeight, int]]]] = {}
    for p in params:
        local = local_training_weight(p)
        if local is None or not isinstance(p, DTensor):
            continue
        # Sharded dims: Shard, and FSDP's _StridedShard over TP's Shard on the same dim
        # (which does not report is_shard()).
        groups = tuple(p.device_mesh.get_group(i) for i, pl in enumerate(p.placements)
                       if not (pl.is_replicate() or pl.is_partial()) and p.device_mesh.size(i) > 1)
        if groups:
            # Keyed by name: get_group returns a new Python handle on every call.
            key = tuple(g.group_name for g in groups)
            by_groups.setdefault(key, (groups, []))[1].append((local, p.numel()))
    if by_groups:
        _watch_optimizer_steps()  # an optimizer step makes the sums set here stale
    issued = 0
    for groups, weights in by_groups.values():
        with torch.no_grad():
            # One multi-tensor launch for all local sums |W| (no |W| temporaries), each
            # weight's as the per-layer path computes it alone.
            sums = torch.stack(ops.weight_abs_sums([w._data for w, _ in weights]))
            # mesh-dim order: the per-layer path sums over the ranks in the same order
            sums = sum_over_ranks(sums, groups)
            issued += len(groups)
            shards, shard_sums = [], []
            for (w, numel), s in zip(weights, sums.unbind(0)):
                w.set_precomputed_abs_sum(s)
                # (A shard with strided rows, which FSDP2 does not make, keeps packing
                # inside its all-gathers: a prepared launch cannot copy it to contiguous.)
                if w._fsdp_gathered and w._data.stride(1) == 1:
                    shard = w._packed_shard
                    if shard is None or shard.data is not w._data or shard.numel != numel:
                        shard = w._packed_shard = PackedShard(w._data, numel)
                    shards.append(shard)
                    shard_sums.append(s)
            if shards:
                # Packed here, while the GPU runs the optimizer step, not inside FSDP2's
                # all-gathers on the forward's and backward's critical path. FSDP2's root
                # forward makes the all-gather streams wait for this stream (an event set
                # with FSDPModule.set_post_optim_event must be recorded after this hook),
                # and this stream ran the last step's backward after its all-gathers had
                # read the buffers rewritten here.
                torch._foreach_copy_([sh.abs_sum for sh in shards], shard_sums)
                for shard in shards:
                    shard.repack()
    return issued


class KeptCodes:
    """An unsharded weight's ternary codes, codes^T and scale, rewritten in place by one
    prepared launch per refresh (a few microseconds of host time; the launches are
    issued after the optimizer step, queued behind its kernels, where a slower launch
    path left the GPU waiting)."""

    __slots__ = ("data", "abs_sum", "launch", "codes", "codes_t", "scale")

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.abs_sum = torch.zeros((), dtype=torch.float32, device=data.device)
        self.launch, self.codes, self.codes_t, self.scale = ops.prepare_quantize_weight_from_sum(
            data, self.abs_sum)

    def __reduce__(self):
        # A copy or pickle of the weight (copy.deepcopy, torch.save of a whole module)
        # drops the prepared launch, which is bound to these buffers: it is rebuilt on
        # the copy's first refresh.
        return type(None), ()


def refresh_ternary_codes(params: Iterable[torch.Tensor]) -> int:
    """Compute the ternary codes, transposed codes and scale of every unsharded BitNet
    weight among ``params`` whose kept codes are stale; returns how many were computed.

    The weights change once per optimizer step, while a step may run their forward
    several times (gradient accumulation, activation checkpointing's recomputation), and
    under torch.compile each quantization in the forward was four kernel launches (sum
    |W| in two, a buffer, ternarize) on the step's critical path. Here all sums are one
    multi-tensor launch (and one copy into the prepared launches' inputs) and each weight
    one prepared ternarize launch; the forward then reads the kept codes (1 + 1 bytes per
    element between steps, where the forward's transposed codes were kept for the
    backward anyway). The buffers are rewritten in place with their version counters
    bumped, so a backward still holding the codes of the old values raises instead of
    using the new ones. Sharded weights (DTensors: FSDP, TP) are skipped: their forward
    gets codes from the all-gather or quantizes its shard.
    """
    stale = [p for p in params
             if isinstance(p, BitNetTrainingWeight) and p._data.dim() == 2 and p._data.stride(1) == 1
             and p.ternary_codes() is None]
    if not stale:
        return 0
    _watch_optimizer_steps()
    with torch.no_grad():
        kept = []
        for w in stale:
            k = w._kept
            if k is None or k.data is not w._data:
                k = w._kept = KeptCodes(w._data)
            kept.append(k)
        sums = ops.weight_abs_sums([w._data for w in stale])
        torch._foreach_copy_([k.abs_sum for k in kept], sums)
        for w, k in zip(stale, kept):
            k.launch()
            w.set_ternary_codes(k.codes, k.codes_t, k.scale)
        torch.autograd.graph.increment_version(
            [t for k in kept for t in (k.codes, k.codes_t, k.scale)])
    return len(stale)


def drop_stale_abs_sums(weights) -> None:
    """Drop the precomputed sums of ``weights`` whose latent tensor was written since the
    sum was set (its version counter moved: a write into a state-dict alias)."""
    for w in weights:
        if w is not None:
            w.current_abs_sum()


def _drop_sums_of_written(func, args, kwargs) -> None:
    """Drop the precomputed sums of the BitNet weights ``func`` writes (its arguments
    marked written in the schema: the destination of a copy_, not its source). The
    dropped sum is summed over the ranks again, a collective, so only writes count, which
    every rank makes together; a read of the weights (a copy from them on one rank) must
    not."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, BitNetTrainingWeight):
                t._precomputed_abs_sum = None


@torch.compiler.disable
def refresh_ternary_codes_hook(module: nn.Module, args) -> None:
    """Forward pre-hook (``convert_to_bitnet``): the module's weights' codes, where stale.
    Cheap when nothing changed: one generation compare, and one compare of the latent
    tensors' version counters, which a write into a state-dict alias taken earlier bumps
    (the state_dict() itself started a new generation, but the write may come after the
    codes of that generation were computed). Never traced: it runs before a compiled
    model's graph (which takes the codes as inputs), not inside it."""
    weights = module.__dict__.get("_bitnet_kept_weights")
    if weights is None:
        weights = module._bitnet_kept_weights = [
            p for p in module.parameters() if isinstance(p, BitNetTrainingWeight)]
    if [w._data._version for w in weights] != module.__dict__.get("_bitnet_kept_versions"):
        _new_generation()
    if getattr(module, "_bitnet_codes_generation", None) != _generation:
        refresh_ternary_codes(weights)
        module._bitnet_codes_generation = _generation
        module._bitnet_kept_versions = [w._data._version for w in weights]
