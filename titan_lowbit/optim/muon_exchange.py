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

What travels is the Newton-Schulz input ``U`` in bf16, and the result in bf16. That is
exact: Newton-Schulz starts by rounding ``U`` to bf16 (``muon_ref.newton_schulz``) and
returns bf16, so the owner orthogonalises the very matrix that one process holding the
whole parameter would, and every rank receives the very values it would have computed.
The quantized momentum is *not* what travels, though it is smaller (8-bit: about half of
bf16's bytes): ``U`` is made from the new momentum in fp32, before it is requantized, and
(Nesterov) from the gradient; the owner would need the old momentum's codes and the
gradient (more bytes than ``U`` in bf16) or would orthogonalise a requantized momentum
that no unsharded step sees.

Collectives: every step, per bucket of matrices, one ``all_to_all_single`` per mesh
dimension that splits them on the way to the owners and one on the way back (all the
bucket's matrices in one buffer), on that mesh dimension's process group. Matrices split
over two mesh dimensions (FSDP2 x TP) travel in two hops: along the first dimension to
the owner's position there, then along the second; every rank's shard is a rectangle of
the matrix (``compute_local_shape_and_global_offset``, also for FSDP2's strided shards
of a TP-sharded dimension). Mesh dimensions that replicate the matrices (HSDP's
replicate dimension) carry nothing: each replica runs its own exchange and computes the
same result.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Optional, Sequence

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
        self._routes: dict[tuple[int, bool], tuple] = {}

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

    def _route(self, hop: int, toward_owner: bool) -> tuple:
        """(send list, send sizes, receive list, receive sizes) of hop ``hop`` (along
        dims[hop]), in elements, indexed by group rank; the lists hold (matrix, source)
        in the order of the buffer."""
        key = (hop, toward_owner)
        if key in self._routes:
            return self._routes[key]
        n, size = len(self.shapes), self.sizes[hop]
        before = hop if toward_owner else hop + 1  # hops done when this one starts

        def dest(j: int, s: Coord) -> int:
            return self.owner[j][hop] if toward_owner else s[hop]

        def numel(j: int, s: Coord) -> int:
            return self.rects[s][j][2] * self.rects[s][j][3]

        send, recv = [[] for _ in range(size)], [[] for _ in range(size)]
        for j in range(n):
            for s in self._holds(self.coord, j, before):
                send[self.peers[hop][dest(j, s)]].append((j, s))
            for k in range(size):
                peer = self.coord[:hop] + (k,) + self.coord[hop + 1:]
                recv[self.peers[hop][k]].extend((j, s) for s in self._holds(peer, j, before)
                                                if dest(j, s) == self.coord[hop])
        route = (sum(send, []), [sum(numel(j, s) for j, s in x) for x in send],
                 sum(recv, []), [sum(numel(j, s) for j, s in x) for x in recv])
        self._routes[key] = route
        return route

    def _hop(self, hop: int, toward_owner: bool, held: list[dict[Coord, torch.Tensor]]
             ) -> list[dict[Coord, torch.Tensor]]:
        send_list, send_sizes, recv_list, recv_sizes = self._route(hop, toward_owner)
        out = torch.cat([held[j][s] for j, s in send_list]) if send_list else \
            torch.empty(0, dtype=self.wire_dtype, device=self.device)
        got = torch.empty(sum(recv_sizes), dtype=self.wire_dtype, device=self.device)
        dist.all_to_all_single(got, out, recv_sizes, send_sizes, group=self.groups[hop])
        sizes = [self.rects[s][j][2] * self.rects[s][j][3] for j, s in recv_list]
        new: list[dict[Coord, torch.Tensor]] = [{} for _ in self.shapes]
        for (j, s), piece in zip(recv_list, got.split(sizes)):
            new[j][s] = piece
        return new

    # ------------------------------------------------------------------------------------
    def run(self, inputs: Sequence[torch.Tensor],
            orthogonalise: Callable[[int, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """Each matrix's local shard of ``orthogonalise(j, whole input of matrix j)``
        (``wire_dtype``), given each matrix's local shard of the input (rounded to it here)."""
        held = [{self.coord: x.to(self.wire_dtype).reshape(-1)} for x in inputs]
        for hop in range(len(self.dims)):
            held = self._hop(hop, True, held)
        for j, shape in enumerate(self.shapes):
            if self.owner[j] != self.coord:
                continue
            whole = torch.empty(shape, dtype=self.wire_dtype, device=self.device)
            for s, piece in held[j].items():
                r0, c0, nr, nc = self.rects[s][j]
                whole[r0:r0 + nr, c0:c0 + nc] = piece.view(nr, nc)
            result = orthogonalise(j, whole).to(self.wire_dtype)
            held[j] = {}
            for s in self.coords:
                r0, c0, nr, nc = self.rects[s][j]
                held[j][s] = result[r0:r0 + nr, c0:c0 + nc].reshape(-1)
        for hop in reversed(range(len(self.dims))):
            held = self._hop(hop, False, held)
        return [held[j][self.coord].view(shape) for j, shape in enumerate(self.local_shapes)]

    def all_finite(self, ok: torch.Tensor) -> torch.Tensor:
        """Per matrix, whether its step is finite on every rank that holds a shard of it,
        given this rank's ``ok`` (bool, one per matrix): one small all-reduce per mesh
        dimension that splits the matrices."""
        dev = torch.device("cpu") if dist.get_backend(self.groups[0]) == "gloo" else self.device
        bad = (~ok).to(device=dev, dtype=torch.int32)
        for group in self.groups:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        return bad.to(ok.device) == 0

    def bytes_sent(self) -> int:
        """Bytes this rank sends to other ranks per ``run`` (both directions, all hops)."""
        total = 0
        for hop in range(len(self.dims)):
            for toward in (True, False):
                sizes = self._route(hop, toward)[1]
                total += sum(x for k, x in enumerate(sizes) if k != self.peers[hop][self.coord[hop]])
        return total * self.wire_dtype.itemsize


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

