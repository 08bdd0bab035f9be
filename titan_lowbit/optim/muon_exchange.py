"""Owner-rank exchange of sharded Muon matrices: Newton-Schulz on whole matrices, each on one rank.

Muon's momentum, its Nesterov combination and the weight update are elementwise, so every
rank computes them on its own shard. Newton-Schulz needs the whole matrix. For a set of
sharded matrices (DTensors on one DeviceMesh, split over the same mesh dimensions) the
exchange

1. gives each matrix an *owner*: a position on the mesh dimensions that split it, chosen
   so that the owners' shares of elements are balanced (largest matrix first, to the
   least loaded position; the same choice on every rank, from the global shapes alone);
2. sends every shard of each matrix's Newton-Schulz input to its owner, which assembles
   the whole matrix;
3. lets the owner orthogonalise it (a callable: the math stays in ``kernels.muon_ref``);
4. sends every rank back its shard of the result.

Optionally a *side* matrix (a second matrix per exchanged one, sharded alike) travels with
the input, and the owner's work returns, beside the whole result, small *extra* results
whose rows are indexed by the matrix's rows or by its columns (``Extra``): every rank
receives the rows of each that its shard covers, bit for bit as the owner computed them.

What travels is the Newton-Schulz input ``U`` in bf16, and the result in bf16. That is
exact: Newton-Schulz starts by rounding ``U`` to bf16 (``muon_ref.newton_schulz``) and
returns bf16, so the owner orthogonalises the very matrix that one process holding the
whole parameter would, and every rank receives the very values it would have computed.
The quantized momentum is *not* what travels, though it is smaller (8-bit: about half of
bf16's bytes): ``U`` is made from the new momentum in fp32, before it is requantized, and
(Nesterov) from the gradient; the owner would need the old momentum's codes and the
gradient (more bytes than ``U`` in bf16) or would orthogonalise a requantized momentum
that no unsharded step sees.

With a side matrix and extras (Muon4bit's rank-k factor of its momentum: the side matrix
is the new momentum ``M`` in bf16, the extras ``P`` [rows, k] and ``R`` [cols, k]) the
owner receives ``U`` and ``M`` in bf16 and sends back the result in bf16 and, to each rank,
its rows of ``P`` and its columns' rows of ``R`` in their own dtype: for a matrix of ``N``
elements on ``n`` ranks of one mesh dimension the ranks send ``6 N (n - 1) / n`` bytes of
matrices (``4 N (n - 1) / n`` without) plus each non-owner's slices of the extras. ``M``
travels, rather than each rank reducing its part of ``M^T P`` with all-reduces, because an
all-reduce over row shards sums in an order that depends on the number of ranks: a run
resumed on a different number of GPUs would not continue bit-identically. The owner
computes from the whole bf16 ``M``, exactly as one process holding the whole matrix does.

Collectives: every step, per bucket of matrices, one ``all_to_all_single`` per mesh
dimension that splits them on the way to the owners and one on the way back (all the
bucket's matrices in one buffer, the side matrix and the extras too: a second
all_to_all for them would move the same bytes in twice the collectives), on that mesh
dimension's process group. Matrices split over two mesh dimensions (FSDP2 x TP) travel
in two hops: along the first dimension to the owner's position there, then along the
second (and back through both, the extras' slices with each shard's result); every rank's
shard is a rectangle of the matrix (``compute_local_shape_and_global_offset``, also for
FSDP2's strided shards of a TP-sharded dimension). Mesh dimensions that replicate the
matrices (HSDP's replicate dimension) carry nothing: each replica runs its own exchange
and computes the same result.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .tensors import local

# The dtype of what travels (see the module docstring: Newton-Schulz's own input dtype).
WIRE_DTYPE = torch.bfloat16
# LowBitMuon's default exchange_bucket_numel: elements (global) of the matrices exchanged
# at once: bounds a step's transient memory (about 16 bytes per element of the bucket's
# local shards) while leaving each bucket enough matrices to balance the owners.
EXCHANGE_BUCKET_NUMEL = 1 << 27

Coord = tuple[int, ...]  # a position on the mesh dimensions that split the matrices

# What an extra result's rows are indexed by: the matrix's rows or its columns.
ROWS, COLS = 0, 1


class Extra(NamedTuple):
    """One extra result of the owner's work on a matrix, declared to ``run``: a
    ``[matrix.shape[along], width]`` tensor of ``dtype`` whose rows are indexed by the
    matrix's rows (``along=ROWS``) or columns (``COLS``). Every rank receives the rows its
    shard covers: its rectangle's row range, or its column range. Declared up front
    because every rank sizes its receive buffers before the owner has computed it."""
    along: int
    width: int
    dtype: torch.dtype


class _Payload(NamedTuple):
    """What travels for each shard of each matrix in one ``run``: everything as 1-D
    tensors of ``unit`` (the smallest dtype involved, so each part travels as its own
    bits), toward the owner the input (and the side matrix), back the result and the
    extras' slices."""
    wire: torch.dtype
    side: bool
    extras: tuple[tuple[Extra, ...], ...]
    unit: torch.dtype

    @staticmethod
    def of(wire: torch.dtype, side: bool, extras: tuple[tuple[Extra, ...], ...]) -> _Payload:
        unit = min((wire, *(e.dtype for declared in extras for e in declared)), key=lambda d: d.itemsize)
        return _Payload(wire, side, extras, unit)

    def parts(self, j: int, rect: tuple[int, int, int, int], toward_owner: bool) -> list[int]:
        """The sizes, in units, of the parts that travel for the shard ``rect`` of matrix ``j``."""
        _, _, rows, cols = rect
        if toward_owner:
            return [self._units(rows * cols, self.wire)] * (2 if self.side else 1)
        return [self._units(rows * cols, self.wire)] + [self._units((rows, cols)[e.along] * e.width, e.dtype)
                                                         for e in self.extras[j]]

    def _units(self, numel: int, dtype: torch.dtype) -> int:
        return numel * dtype.itemsize // self.unit.itemsize


def _to_units(x: torch.Tensor, unit: torch.dtype) -> torch.Tensor:
    """``x`` flattened, its bits read as ``unit`` (no larger than its dtype)."""
    return x.reshape(-1).view(unit)


def _from_units(part: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of ``dtype`` and ``shape`` whose bits ``part`` carries: a view where the
    dtypes' sizes agree, else a copy (a larger dtype's view would need its alignment)."""
    if dtype.itemsize == part.dtype.itemsize:
        return part.view(dtype).view(shape)
    out = torch.empty(shape, dtype=dtype, device=part.device)
    out.view(-1).view(part.dtype).copy_(part)
    return out


def _parts(pieces: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    """A shard's parts: ``pieces`` as they were put in (not yet sent) or one received piece."""
    if [p.numel() for p in pieces] == sizes:
        return pieces
    (piece,) = pieces
    return list(piece.split(sizes))


def split_dims(p: torch.Tensor, name: str) -> tuple[int, ...]:
    """The mesh dimensions (of more than one rank) that shard matrix ``p``; () for a plain
    tensor or one whose every rank holds all of it. Each rank's shard must be one
    rectangle of the matrix: Shard, and FSDP2's strided shard of a dimension that tensor
    parallel shards on a later mesh dimension; other placements are refused, naming the
    parameter."""
    if not isinstance(p, DTensor):
        return ()
    from torch.distributed.tensor.placement_types import _StridedShard

    dims = []
    placements = p.placements
    for d, pl in enumerate(placements):
        if isinstance(pl, Replicate):
            continue
        rectangle = isinstance(pl, Shard) or (isinstance(pl, _StridedShard) and any(
            isinstance(later, Shard) and later.dim == pl.dim for later in placements[d + 1:]))
        if not rectangle:
            raise ValueError(f"param '{name}' is placed {pl} on mesh dimension {d} (placements {placements}); "
                             "LowBitMuon steps matrices that are sharded (Shard, or FSDP2's strided shard over "
                             "tensor parallel) or replicated on each mesh dimension, as FSDP2, HSDP and "
                             "tensor parallel place parameters")
        if p.device_mesh.size(d) > 1:
            dims.append(d)
    return tuple(dims)


def balanced_owners(numels: Sequence[int], load: list[int]) -> list[int]:
    """Owner position of each matrix: the largest first, each to the position that owns
    the fewest elements so far (the lowest such position on a tie). ``load``: the elements
    each position owns already (earlier buckets), updated here."""
    positions = len(load)
    owner = [0] * len(numels)
    for j in sorted(range(len(numels)), key=lambda j: (-numels[j], j)):
        owner[j] = min(range(positions), key=lambda k: (load[k], k))
        load[owner[j]] += numels[j]
    return owner


class OwnerExchange:
    """The exchange for one bucket of 2-D DTensor matrices that share a mesh and the mesh
    dimensions that split them. Building it is a collective on those dimensions' process
    groups (every rank learns every shard's rectangle); so is ``run``."""

    def __init__(self, params: Sequence[DTensor], dims: tuple[int, ...], wire_dtype: torch.dtype = WIRE_DTYPE,
                 load: Optional[list[int]] = None):
        """``wire_dtype``: what travels; anything but bf16 is for comparisons (a benchmark
        of an fp32 exchange), not the optimizer's exactness. ``load``: elements owned per
        position (flattened over ``dims``) by earlier buckets of the same mesh, which the
        owners of this one balance against; updated here."""
        mesh = params[0].device_mesh
        self.wire_dtype = wire_dtype
        self.dims = dims
        self.sizes = tuple(mesh.size(d) for d in dims)
        here = mesh.get_coordinate()
        self.coord: Coord = tuple(here[d] for d in dims)
        self.groups = [mesh.get_group(d) for d in dims]
        # peers[t][k]: the group rank (in groups[t]) of the rank at position k along dims[t]
        self.peers = []
        for t, d in enumerate(dims):
            where = list(here)
            ranks = []
            for k in range(self.sizes[t]):
                where[d] = k
                ranks.append(dist.get_group_rank(self.groups[t], int(mesh.mesh[tuple(where)])))
            self.peers.append(ranks)
        self.shapes = [tuple(p.shape) for p in params]
        self.local_shapes = [tuple(local(p).shape) for p in params]
        self.device = local(params[0]).device
        self.rects = self._gather_rects(params)
        self.coords: list[Coord] = list(itertools.product(*(range(s) for s in self.sizes)))
        load = [0] * len(self.coords) if load is None else load
        owners = balanced_owners([math.prod(s) for s in self.shapes], load)
        self.owner: list[Coord] = [self.coords[k] for k in owners]
        self._routes: dict[tuple[int, bool, _Payload], tuple] = {}

    def _gather_rects(self, params: Sequence[DTensor]) -> dict[Coord, list[tuple[int, int, int, int]]]:
        """position -> (row offset, col offset, rows, cols) of its shard of each matrix."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mine = []
        for p in params:
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            mine.append((offset[0], offset[1], shape[0], shape[1]))
        dev = torch.device("cpu") if dist.get_backend(self.groups[0]) == "gloo" else self.device
        table = torch.tensor(mine, dtype=torch.int64, device=dev)
        for t, group in enumerate(self.groups):  # table[k_t, ..., k_0] after hop t
            parts = [torch.empty_like(table) for _ in range(self.sizes[t])]
            dist.all_gather(parts, table, group=group)
            table = torch.stack([parts[self.peers[t][k]] for k in range(self.sizes[t])])
        table = table.cpu()
        return {c: [tuple(r) for r in table[tuple(reversed(c))].tolist()] for c in
                itertools.product(*(range(s) for s in self.sizes))}

    # ------------------------------------------------------------------------------------
    # which shards a rank holds between hops
    # ------------------------------------------------------------------------------------
    def _holds(self, c: Coord, j: int, hop: int) -> list[Coord]:
        """The shards of matrix ``j`` (by source position) that the rank at ``c`` holds
        after ``hop`` hops towards the owner (0: its own): those of the positions that
        differ from ``c`` on the first ``hop`` dimensions only, if ``c`` is the owner's
        position on those dimensions; else none."""
        if c[:hop] != self.owner[j][:hop]:
            return []
        return [s for s in self.coords if s[hop:] == c[hop:]]

    def _route(self, hop: int, toward_owner: bool, payload: _Payload) -> tuple:
        """(send list, send sizes, receive list, receive sizes, received pieces' sizes) of
        hop ``hop`` (along dims[hop]), in the payload's units, indexed by group rank; the
        lists hold (matrix, source) in the order of the buffer."""
        key = (hop, toward_owner, payload)
        if key in self._routes:
            return self._routes[key]
        n, size = len(self.shapes), self.sizes[hop]
        before = hop if toward_owner else hop + 1  # hops done when this one starts

        def dest(j: int, s: Coord) -> int:
            return self.owner[j][hop] if toward_owner else s[hop]

        def units(j: int, s: Coord) -> int:
            return sum(payload.parts(j, self.rects[s][j], toward_owner))

        send, recv = [[] for _ in range(size)], [[] for _ in range(size)]
        for j in range(n):
            for s in self._holds(self.coord, j, before):
                send[self.peers[hop][dest(j, s)]].append((j, s))
            for k in range(size):
                peer = self.coord[:hop] + (k,) + self.coord[hop + 1:]
                recv[self.peers[hop][k]].extend((j, s) for s in self._holds(peer, j, before)
                                                if dest(j, s) == self.coord[hop])
        recv_list = sum(recv, [])
        route = (sum(send, []), [sum(units(j, s) for j, s in x) for x in send],
                 recv_list, [sum(units(j, s) for j, s in x) for x in recv], [units(j, s) for j, s in recv_list])
        self._routes[key] = route
        return route

    def _hop(self, hop: int, toward_owner: bool, held: list[dict[Coord, list[torch.Tensor]]], payload: _Payload
             ) -> list[dict[Coord, list[torch.Tensor]]]:
        """One all_to_all along dims[hop]: every shard's parts (1-D, in the payload's
        units) that this rank holds and that go this way, in one buffer."""
        send_list, send_sizes, recv_list, recv_sizes, piece_sizes = self._route(hop, toward_owner, payload)
        out = torch.cat([part for j, s in send_list for part in held[j][s]]) if send_list else \
            torch.empty(0, dtype=payload.unit, device=self.device)
        got = torch.empty(sum(recv_sizes), dtype=payload.unit, device=self.device)
        dist.all_to_all_single(got, out, recv_sizes, send_sizes, group=self.groups[hop])
        new: list[dict[Coord, list[torch.Tensor]]] = [{} for _ in self.shapes]
        for (j, s), piece in zip(recv_list, got.split(piece_sizes)):
            new[j][s] = [piece]
        return new

    # ------------------------------------------------------------------------------------
    def run(self, inputs: Sequence[torch.Tensor], work: Callable, side: Optional[Sequence[torch.Tensor]] = None,
            extras: Optional[Sequence[Sequence[Extra]]] = None) -> tuple[list[torch.Tensor], list[tuple]]:
        """The owners' work on the whole matrices, each rank given its share of the results.

        ``inputs``: each matrix's local shard (rounded to ``wire_dtype`` here); ``side``:
        optionally a second local shard per matrix, of the same shape, that travels with
        its input to the owner (rounded alike); ``extras``: per matrix, the ``Extra``
        results that ``work`` returns beside the matrix (none if not given).
        ``work(j, whole input, whole side or None)`` runs on matrix ``j``'s owner and
        returns ``(result, extra results)``: a tensor of the matrix's shape (sent in
        ``wire_dtype``) and a tuple of tensors as ``extras[j]`` declares them (checked
        on the owner, which raises naming the matrix; the other ranks then wait in the
        next collective, as they do for any error on one rank).

        Returns each matrix's local shard of its result (``wire_dtype``) and each matrix's
        tuple of its extras' local slices: the rows of each that this rank's shard covers
        (its rectangle's rows, or its columns), in the extra's dtype, bit for bit as the
        owner computed them."""
        n = len(self.shapes)
        extras = tuple(() for _ in range(n)) if extras is None else tuple(tuple(e) for e in extras)
        self._check_run(inputs, side, extras)
        payload = _Payload.of(self.wire_dtype, side is not None, extras)
        held = [{self.coord: [_to_units(x.to(self.wire_dtype), payload.unit)]
                 + ([] if side is None else [_to_units(side[j].to(self.wire_dtype), payload.unit)])}
                for j, x in enumerate(inputs)]
        for hop in range(len(self.dims)):
            held = self._hop(hop, True, held, payload)
        for j, shape in enumerate(self.shapes):
            if self.owner[j] != self.coord:
                continue
            wholes = [torch.empty(shape, dtype=self.wire_dtype, device=self.device) for _ in range(1 + payload.side)]
            for s, pieces in held[j].items():
                r0, c0, nr, nc = rect = self.rects[s][j]
                for whole, part in zip(wholes, _parts(pieces, payload.parts(j, rect, True))):
                    whole[r0:r0 + nr, c0:c0 + nc] = _from_units(part, self.wire_dtype, (nr, nc))
            result, extra_results = work(j, wholes[0], wholes[1] if payload.side else None)
            self._check_work(j, result, extra_results, extras[j])
            result = result.to(self.wire_dtype)
            held[j] = {}
            for s in self.coords:
                r0, c0, nr, nc = self.rects[s][j]
                held[j][s] = [_to_units(result[r0:r0 + nr, c0:c0 + nc], payload.unit)]
                for x, e in zip(extra_results, extras[j]):
                    first, count = (r0, c0)[e.along], (nr, nc)[e.along]
                    held[j][s].append(_to_units(x[first:first + count], payload.unit))
        for hop in reversed(range(len(self.dims))):
            held = self._hop(hop, False, held, payload)
        outputs, extra_slices = [], []
        rects = self.rects[self.coord]
        for j, shape in enumerate(self.local_shapes):
            result, *mine = _parts(held[j][self.coord], payload.parts(j, rects[j], False))
            outputs.append(_from_units(result, self.wire_dtype, shape))
            extra_slices.append(tuple(_from_units(x, e.dtype, (shape[e.along], e.width))
                                      for x, e in zip(mine, extras[j])))
        return outputs, extra_slices

    def _check_run(self, inputs: Sequence[torch.Tensor], side: Optional[Sequence[torch.Tensor]],
                   extras: tuple[tuple[Extra, ...], ...]) -> None:
        n = len(self.shapes)
        if len(inputs) != n:
            raise ValueError(f"OwnerExchange.run: {len(inputs)} inputs for the exchange's {n} matrices")
        if side is not None:
            if len(side) != n:
                raise ValueError(f"OwnerExchange.run: side holds {len(side)} tensors for the exchange's {n} matrices")
            for j, (x, y) in enumerate(zip(inputs, side)):
                if tuple(x.shape) != tuple(y.shape):
                    raise ValueError(f"OwnerExchange.run: matrix {j}'s side shard is {tuple(y.shape)}, its input "
                                     f"shard {tuple(x.shape)}: give side shards shaped like the inputs'")
        if len(extras) != n:
            raise ValueError(f"OwnerExchange.run: extras declares {len(extras)} matrices' results for the "
                             f"exchange's {n} matrices")
        for j, declared in enumerate(extras):
            for e in declared:
                if not isinstance(e, Extra) or e.along not in (ROWS, COLS) or not isinstance(e.width, int) \
                        or e.width < 0 or not isinstance(e.dtype, torch.dtype):
                    raise ValueError(f"OwnerExchange.run: matrix {j}'s extra {e!r}: declare each as "
                                     "Extra(along=ROWS or COLS, width=an int >= 0, dtype=a torch.dtype)")

    def _check_work(self, j: int, result: torch.Tensor, extra_results: Sequence[torch.Tensor],
                    declared: tuple[Extra, ...]) -> None:
        """The owner's results must be what ``run`` was told to send: every rank sized its
        buffers from the declarations."""
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != self.shapes[j]:
            raise ValueError(f"OwnerExchange.run: the work on matrix {j} returned a result of shape "
                             f"{getattr(result, 'shape', type(result).__name__)}, not the matrix's {self.shapes[j]}")
        got = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
               for x in extra_results]
        want = [((self.shapes[j][e.along], e.width), e.dtype) for e in declared]
        if got != want:
            raise ValueError(f"OwnerExchange.run: the work on matrix {j} returned extras {got} (shape, dtype), "
                             f"declared {want}: return the extras as run's extras[{j}] declares them")

    def all_finite(self, ok: torch.Tensor) -> torch.Tensor:
        """Per matrix, whether its step is finite on every rank that holds a shard of it,
        given this rank's ``ok`` (bool, one per matrix): one small all-reduce per mesh
        dimension that splits the matrices."""
        dev = torch.device("cpu") if dist.get_backend(self.groups[0]) == "gloo" else self.device
        bad = (~ok).to(device=dev, dtype=torch.int32)
        for group in self.groups:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        return bad.to(ok.device) == 0

    def bytes_sent(self, side: bool = False, extras: Optional[Sequence[Sequence[Extra]]] = None) -> int:
        """Bytes this rank sends to other ranks per ``run`` (both directions, all hops),
        with a side matrix or not and the extras declared."""
        extras = tuple(() for _ in self.shapes) if extras is None else tuple(tuple(e) for e in extras)
        payload = _Payload.of(self.wire_dtype, side, extras)
        total = 0
        for hop in range(len(self.dims)):
            for toward in (True, False):
                sizes = self._route(hop, toward, payload)[1]
                total += sum(x for k, x in enumerate(sizes) if k != self.peers[hop][self.coord[hop]])
        return total * payload.unit.itemsize


def exchange_buckets(items: Sequence[tuple[DTensor, tuple[int, ...]]], bucket_numel: int
                     ) -> list[tuple[list[int], tuple[int, ...]]]:
    """Split the sharded matrices (with their ``split_dims``) into buckets of one mesh and
    the same split dimensions, in their order, each of at most ``bucket_numel`` elements
    (or one matrix): (positions in ``items``, split dimensions) per bucket."""
    kinds: dict[tuple, list[int]] = {}
    for i, (p, dims) in enumerate(items):
        kinds.setdefault((p.device_mesh, dims), []).append(i)
    buckets = []
    for (_, dims), idx in kinds.items():
        current: list[int] = []
        total = 0
        for i in idx:
            n = items[i][0].numel()
            if current and total + n > bucket_numel:
                buckets.append((current, dims))
                current, total = [], 0
            current.append(i)
            total += n
        buckets.append((current, dims))
    return buckets

