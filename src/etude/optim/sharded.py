"""Sharded Muon: Newton-Schulz on whole blocks of FSDP2-sharded (DTensor) parameters.

FSDP2 leaves each rank a slice of every parameter (``Shard(0)`` by default, any dim with a
``shard_placement_fn``). Newton-Schulz needs a whole block (one head, one expert, one matrix), so
each block gets one *owner* rank: the ranks send their pieces of the block to its owner with
``all_to_all_single``, the owner orthogonalizes all of its blocks of one shape in one batched
iteration, and a second ``all_to_all_single`` returns every piece of the result to the rank that
holds it. The result equals single-process ``Muon`` on the same logical blocks. The communication
schedule is written out in ``ShardedMuon``'s docstring.

What is covered:
- plain tensors (one process, or replicated), DTensors on 1-D meshes, and 2-D HSDP meshes
  ``(replicate, shard)``: only the shard axis exchanges, every replica repeats the same work;
- any shard dim and uneven or empty shards (``torch.chunk`` layout: 18 rows over 8 ranks leave
  ranks 6 and 7 empty); pieces travel with exact split sizes, and every split is padded to at
  least one element, because an all-to-all where some rank sends or receives nothing is a known
  hang (https://github.com/pytorch/pytorch/issues/146468);
- a local fast path: a block that lies whole on one rank (experts on dim 0, heads on dim 0 when
  shard boundaries fall between heads) is orthogonalized by that rank, and a bucket whose blocks
  all lie whole sends nothing;
- several shard axes when all but one keep blocks whole (experts split over an expert-parallel
  axis on dim 0 and FSDP-sharded on dim 1): the exchange runs over the one axis that cuts blocks.

What is not covered: ``_StridedShard`` and ``Partial`` placements (ValueError), blocks cut by two
mesh axes at once (ValueError), and meshes whose layout differs from rank to rank.

Legend: W ranks of an exchange group (one mesh axis), N blocks a rank owns in one bucket, M and K
rows and columns of one block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from etude.model.meta import ParamMeta
from etude.optim.muon import (
    Muon,
    local_tensor,
    ns_flops,
    resolve_ns_dtype,
    split_blocks,
    update_scale,
    zeropower_via_newtonschulz,
)

Box = tuple[tuple[int, int], ...]
"""A hyper-rectangle of a parameter in global coordinates: (start, stop) per tensor dim."""


def shard_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
) -> Box:
    """The global box held by the rank at ``coordinate`` of a mesh (DTensor ``Shard`` semantics:
    mesh axes apply in order, each cuts the current extent into ceil-sized chunks, trailing
    chunks may be short or empty)."""
    starts = [0] * len(global_shape)
    sizes = list(global_shape)
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard):
            d = placement.dim % len(global_shape)
            chunk = -(-sizes[d] // mesh_shape[axis])
            lo = min(coordinate[axis] * chunk, sizes[d])
            hi = min(lo + chunk, sizes[d])
            starts[d] += lo
            sizes[d] = hi - lo
    return tuple((s, s + z) for s, z in zip(starts, sizes))


def block_box(meta: ParamMeta, shape: Sequence[int], block: int) -> Box:
    """The global box of block ``block`` of a parameter of full ``shape``."""
    m, n = meta.block_shape(tuple(shape))
    if meta.kind == "heads_dim0":
        return ((block * m, (block + 1) * m), (0, shape[1]))
    if meta.kind == "heads_dim1":
        return ((0, shape[0]), (block * n, (block + 1) * n))
    if meta.kind == "experts":
        return ((block, block + 1), (0, shape[1]), (0, shape[2]))
    return tuple((0, s) for s in shape)


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _volume(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def _matrix_dims(meta: ParamMeta) -> tuple[int, int]:
    """Tensor dims that are the rows and columns of a block (experts: dim 0 picks the expert)."""
    return (1, 2) if meta.kind == "experts" else (0, 1)


def _in_block(meta: ParamMeta, block: Box, piece: Box) -> tuple[slice, slice]:
    """Where ``piece`` lies inside its block, as (row, column) slices of the [M, K] block."""
    r, c = _matrix_dims(meta)
    return (
        slice(piece[r][0] - block[r][0], piece[r][1] - block[r][0]),
        slice(piece[c][0] - block[c][0], piece[c][1] - block[c][0]),
    )


def _in_shard(meta: ParamMeta, piece: Box, shard: Box) -> tuple[Any, ...]:
    """Index into a rank's local tensor (whose global box is ``shard``) giving ``piece`` as 2-D."""
    local = [slice(lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(piece, shard)]
    if meta.kind == "experts":
        return (piece[0][0] - shard[0][0], local[1], local[2])
    return tuple(local)


def _piece_shape(meta: ParamMeta, piece: Box) -> tuple[int, int]:
    r, c = _matrix_dims(meta)
    return (piece[r][1] - piece[r][0], piece[c][1] - piece[c][0])


@dataclass(frozen=True, slots=True)
class ExchangeLayout:
    """How one parameter lies over the ranks that exchange its blocks (one mesh axis).

    ``group`` is None when no exchange is needed (plain tensor, replicated, or every shard holds
    whole blocks); ``boxes`` lists each member's global box in group-rank order.
    """

    group: Any
    size: int
    index: int
    boxes: tuple[Box, ...]


def exchange_layout(p: Tensor, meta: ParamMeta) -> ExchangeLayout:
    """Find the exchange group of parameter ``p`` and where its members' shards lie."""
    shape = tuple(p.shape)
    if not isinstance(p, DTensor):
        return ExchangeLayout(None, 1, 0, (tuple((0, s) for s in shape),))
    mesh, placements = p.device_mesh, tuple(p.placements)
    for placement in placements:
        if type(placement) is not Shard and not isinstance(placement, Replicate):
            raise ValueError(
                f"sharded Muon supports Shard and Replicate placements, got {placement} on a "
                f"parameter of shape {shape}; shard it with fully_shard (Shard(dim)) instead"
            )
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not part of the parameter's mesh"
    mesh_shape = tuple(mesh.shape)
    mine = shard_box(shape, mesh_shape, coordinate, placements)
    assert tuple(hi - lo for lo, hi in mine) == tuple(p.to_local().shape), (
        mine,
        p.to_local().shape,
    )

    def box_at(axis: int, index: int) -> Box:
        c = list(coordinate)
        c[axis] = index
        return shard_box(shape, mesh_shape, c, placements)

    shard_axes = [
        a for a, pl in enumerate(placements) if isinstance(pl, Shard) and mesh_shape[a] > 1
    ]
    if len(shard_axes) > 1:
        # an axis that shards along the block dim at block boundaries only picks whole blocks
        m, n = meta.block_shape(shape)
        extent = {"heads_dim0": m, "heads_dim1": n, "experts": 1}.get(meta.kind)

        def keeps_blocks_whole(axis: int) -> bool:
            d = placements[axis].dim % len(shape)
            if d != meta.block_dim:
                return False
            boxes = [box_at(axis, j) for j in range(mesh_shape[axis])]
            return all(lo % extent == 0 and hi % extent == 0 for lo, hi in (b[d] for b in boxes))

        shard_axes = [a for a in shard_axes if not keeps_blocks_whole(a)]
        if len(shard_axes) > 1:
            raise ValueError(
                f"a {meta.kind} parameter of shape {shape} has its blocks cut by mesh axes "
                f"{shard_axes} ({placements}); sharded Muon exchanges over one axis: keep all "
                "but one shard axis on block boundaries"
            )
    if not shard_axes:
        return ExchangeLayout(None, 1, 0, (mine,))
    axis = shard_axes[0]
    group = mesh.get_group(axis)
    boxes: list[Box | None] = [None] * mesh_shape[axis]
    for j in range(mesh_shape[axis]):
        c = list(coordinate)
        c[axis] = j
        boxes[dist.get_group_rank(group, int(mesh.mesh[tuple(c)]))] = box_at(axis, j)
    index = dist.get_group_rank(group, dist.get_rank())
    assert boxes[index] == mine
    return ExchangeLayout(group, mesh_shape[axis], index, tuple(boxes))  # type: ignore[arg-type]


class _Run(NamedTuple):
    """Consecutive whole blocks of one parameter that this rank both holds and owns."""

    entry: int
    dim: int | None
    """Tensor dim the blocks are stacked along (None: the parameter is one block)."""
    start: int
    """Where the first block starts along ``dim`` in the rank-local tensor."""
    slot: int
    """Index of the first block in this rank's [N, M, K] batch."""
    count: int
    kind: str


@dataclass(frozen=True, slots=True)
class _Block:
    entry: int
    block: int
    box: Box
    pieces: tuple[tuple[int, Box], ...]
    """(member, global box) of every non-empty piece, in group-rank order."""


@dataclass(slots=True)
class Bucket:
    """One all-to-all round: blocks of one shape and NS setting, and this rank's part in it."""

    group: Any
    size: int
    index: int
    m: int
    n: int
    dtype: torch.dtype
    device: torch.device
    steps: int
    coefficients: str
    needs_comm: bool
    """Some block has a piece on a rank other than its owner (the same on every member)."""
    owners: list[int]
    """Owner (group rank) of each block of the bucket."""
    num_owned: int = 0
    runs: list[_Run] = field(default_factory=list)
    """Whole blocks this rank owns and holds, batched by parameter."""
    own_pieces: list[tuple[int, tuple[slice, slice], int, tuple[Any, ...]]] = field(
        default_factory=list
    )
    """Partial pieces this rank holds of blocks it owns: (slot, in-block, entry, local index)."""
    send: list[list[tuple[int, tuple[Any, ...], tuple[int, int]]]] = field(default_factory=list)
    """Per member: this rank's pieces of the member's blocks (entry, local index, shape)."""
    recv: list[list[tuple[int, tuple[slice, slice], tuple[int, int]]]] = field(default_factory=list)
    """Per member: the member's pieces of this rank's blocks (slot, in-block, shape)."""
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)


def _make_bucket(
    blocks: Sequence[_Block],
    metas: Sequence[ParamMeta],
    layouts: Sequence[ExchangeLayout],
    setting: tuple[int, int, torch.dtype, int, str],
    device: torch.device,
    load: list[int],
) -> Bucket:
    """Assign owners (balanced by NS FLOPs) and precompute this rank's sends and receives."""
    m, n, dtype, steps, coefficients = setting
    layout = layouts[blocks[0].entry]  # all blocks of a bucket share the exchange group
    W, me = layout.size, layout.index
    flops = ns_flops(m, n, steps)
    count = [0] * W
    owners = [-1] * len(blocks)
    for k, blk in enumerate(blocks):  # a block that lies whole on one rank stays there
        if len(blk.pieces) == 1:
            owners[k] = blk.pieces[0][0]
            count[owners[k]] += 1
            load[owners[k]] += flops
    for k, blk in enumerate(blocks):
        if owners[k] >= 0:
            continue
        held = {j: _volume(box) for j, box in blk.pieces}
        # fewest blocks in this bucket (spread each bucket's compute), then least total load,
        # then the rank holding most of the block (fewest bytes to move)
        owners[k] = min(range(W), key=lambda r: (count[r], load[r], -held.get(r, 0), r))
        count[owners[k]] += 1
        load[owners[k]] += flops
    needs_comm = any(j != owners[k] for k, blk in enumerate(blocks) for j, _ in blk.pieces)
    b = Bucket(
        group=layout.group,
        size=W,
        index=me,
        m=m,
        n=n,
        dtype=dtype,
        device=device,
        steps=steps,
        coefficients=coefficients,
        needs_comm=needs_comm,
        owners=owners,
        send=[[] for _ in range(W)],
        recv=[[] for _ in range(W)],
    )
    for k, blk in enumerate(blocks):
        meta, mine = metas[blk.entry], layouts[blk.entry].boxes[me]
        if owners[k] != me:
            for j, piece in blk.pieces:
                if j == me:
                    b.send[owners[k]].append(
                        (blk.entry, _in_shard(meta, piece, mine), _piece_shape(meta, piece))
                    )
            continue
        slot = b.num_owned
        b.num_owned += 1
        for j, piece in blk.pieces:
            if j != me:
                b.recv[j].append((slot, _in_block(meta, blk.box, piece), _piece_shape(meta, piece)))
            elif piece == blk.box:
                d = meta.block_dim
                start = 0 if d is None else piece[d][0] - mine[d][0]
                last = b.runs[-1] if b.runs else None
                if (
                    last is not None
                    and d is not None
                    and last.entry == blk.entry
                    and last.slot + last.count == slot
                    and last.start + last.count * (blk.box[d][1] - blk.box[d][0]) == start
                ):
                    b.runs[-1] = last._replace(count=last.count + 1)
                else:
                    b.runs.append(_Run(blk.entry, d, start, slot, 1, meta.kind))
            else:
                b.own_pieces.append(
                    (slot, _in_block(meta, blk.box, piece), blk.entry, _in_shard(meta, piece, mine))
                )
    # every split carries at least one element: no rank enters the all-to-all with nothing to
    # send or receive (the self split is a 1-element pad; own pieces are copied locally)
    b.send_splits = [
        1 if j == me else max(1, sum(h * w for _, _, (h, w) in b.send[j])) for j in range(W)
    ]
    b.recv_splits = [
        1 if j == me else max(1, sum(h * w for _, _, (h, w) in b.recv[j])) for j in range(W)
    ]
    return b


def _whole_blocks(x: Tensor, run: _Run, m: int, n: int) -> Tensor:
    """``[count, M, K]`` view of a run of whole blocks inside a rank-local tensor."""
    if run.dim is None:
        return x.unsqueeze(0)
    extent = {"heads_dim0": m, "heads_dim1": n, "experts": 1}[run.kind]
    slab = x.narrow(run.dim, run.start, run.count * extent)
    return split_blocks(slab, ParamMeta(kind=run.kind, num_blocks=run.count))


class ShardedMuon(Muon):
    """``Muon`` whose Newton-Schulz runs on whole blocks of sharded (DTensor) parameters.

    Also the single-process optimizer: plain tensors are one rank holding every block, so no
    collective runs (one code path from 1 rank to N). Momentum buffers are DTensors sharded like
    their parameters; momentum, weight decay and the final add are elementwise on local shards.

    Plan (built on the first step, cached): blocks of all Muon parameters are grouped by
    (exchange group, block shape, NS dtype, steps, coefficients) and cut into buckets of at most
    ``bucket_mb`` MiB of whole blocks. In each bucket a block that lies whole on one rank is owned
    by it; every other block gets the rank with the fewest blocks of this bucket, then the least
    NS FLOPs so far, then the largest piece of it. The plan depends only on shapes and placements,
    so every rank computes the same one without talking.

    Schedule of one step. Buckets whose blocks all lie whole on their owners need no transfer;
    the others, X0..X(B-1), each take two ``all_to_all_single`` over their exchange group, both
    ``async_op=True``: Gk gathers the pieces of bucket k's blocks at their owners, Sk scatters
    the orthogonalized pieces back to their holders::

        issue G0
        NS on every local bucket         (overlaps G0)
        for k in 0..B-1:
            issue G(k+1)                 pack and send the next bucket before waiting
            wait Gk                      pieces of my blocks of bucket k arrive
            NS on my blocks of k         batched [N, M, K]; add the pieces I hold to my shards
            issue Sk                     every other piece of the result to its holder
            wait S(k-1), apply           the previous bucket's results land in my shards
        wait S(B-1), apply

    So bucket k+1's transfer overlaps bucket k's Newton-Schulz and bucket k's return overlaps
    bucket k+1's; every rank issues the same collectives in the same order (the plan is the
    same everywhere). With ``async_comm=False`` each collective is waited on at once, bucket by
    bucket (debugging, benchmarks).

    ``stats`` after a step: ``ns_flops`` (this rank), ``bytes_sent`` (this rank, both
    all-to-alls, padding included, nothing to itself), ``collectives``, ``buckets``.
    """

    def __init__(
        self,
        params: Any,
        *,
        bucket_mb: float = 32.0,
        async_comm: bool = True,
        **muon_kwargs: Any,
    ) -> None:
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be > 0 (MiB of whole blocks per bucket)")
        self.bucket_mb = bucket_mb
        self.async_comm = async_comm
        self.stats: dict[str, int] = {}
        self._plans: dict[tuple[Any, ...], list[Bucket]] = {}
        super().__init__(params, **muon_kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._plans.clear()

    def _reduce_gradient_flags(self, flags_P2: Tensor) -> Tensor:
        """Sum the flags over the mesh of the DTensor parameters, so that every rank raises on a
        non-finite gradient anywhere, and a gradient present on some ranks only is caught before
        it could leave ranks waiting in different collectives."""
        mesh = next(
            (
                p.device_mesh
                for g in self.param_groups
                for p in g["params"]
                if isinstance(p, DTensor)
            ),
            None,
        )
        if mesh is None or mesh.size() == 1:
            return flags_P2
        device = next(local_tensor(p).device for g in self.param_groups for p in g["params"])
        total = flags_P2.to(device)
        for axis in range(mesh.ndim):
            if mesh.size(axis) > 1:
                dist.all_reduce(total, group=mesh.get_group(axis))
        total = total.cpu()
        partial = [
            self._param_name(gi, pi)
            for gi, pi, row in self._flat_index()
            if 0 < total[row, 0] < mesh.size()
        ]
        if partial:
            raise RuntimeError(
                f"gradient is None on some ranks only for {', '.join(partial[:5])}; every rank "
                "must run backward through the same parameters"
            )
        return total

    def _flat_index(self) -> list[tuple[int, int, int]]:
        out, row = [], 0
        for gi, group in enumerate(self.param_groups):
            for pi in range(len(group["params"])):
                out.append((gi, pi, row))
                row += 1
        return out

    def plan(self, entries: Sequence[tuple[dict[str, Any], Tensor]]) -> list[Bucket]:
        """The buckets for Muon parameters ``entries`` ((group, param) with a gradient), cached."""
        key = tuple(
            (id(p), g["kind"], g["num_blocks"], g["ns_dtype"], g["ns_steps"], g["ns_coefficients"])
            for g, p in entries
        )
        if key not in self._plans:
            self._plans[key] = self._build_plan(entries)
        return self._plans[key]

    def _build_plan(self, entries: Sequence[tuple[dict[str, Any], Tensor]]) -> list[Bucket]:
        metas = [self.group_meta(g) for g, _ in entries]
        layouts = [exchange_layout(p, meta) for (_, p), meta in zip(entries, metas)]
        keyed: dict[tuple[Any, ...], list[_Block]] = {}
        settings: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        for i, ((group, p), meta, layout) in enumerate(zip(entries, metas, layouts)):
            shape = tuple(p.shape)
            m, n = meta.block_shape(shape)
            device = local_tensor(p).device
            setting = (
                m,
                n,
                resolve_ns_dtype(group["ns_dtype"], device),
                group["ns_steps"],
                group["ns_coefficients"],
            )
            key = (id(layout.group), *setting)
            settings[key] = (setting, layout, device)
            for blk in range(meta.num_blocks):
                box = block_box(meta, shape, blk)
                pieces = tuple(
                    (j, piece)
                    for j, member in enumerate(layout.boxes)
                    if (piece := _intersect(box, member)) is not None
                )
                if not pieces:
                    continue  # a block of another exchange group (another expert-parallel rank)
                if sum(_volume(piece) for _, piece in pieces) != m * n:
                    raise ValueError(
                        f"block {blk} of a {meta.kind} parameter of shape {shape} is not held "
                        f"whole by its exchange group ({p.placements}); shard it on one mesh "
                        "axis, or keep the other shard axes on block boundaries"
                    )
                keyed.setdefault(key, []).append(_Block(i, blk, box, pieces))
        buckets = []
        loads: dict[int, list[int]] = {}
        for key, blocks in keyed.items():
            setting, layout, device = settings[key]
            m, n, dtype = setting[0], setting[1], setting[2]
            block_bytes = m * n * torch.finfo(dtype).bits // 8
            per_bucket = max(1, int(self.bucket_mb * 2**20) // block_bytes)
            load = loads.setdefault(id(layout.group), [0] * layout.size)
            for start in range(0, len(blocks), per_bucket):
                chunk = blocks[start : start + per_bucket]
                buckets.append(_make_bucket(chunk, metas, layouts, setting, device, load))
        return buckets

    def _muon_step(self, groups: Sequence[dict[str, Any]]) -> None:
        entries = [(g, p) for g in groups for p in g["params"] if p.grad is not None]
        self.stats = {"ns_flops": 0, "bytes_sent": 0, "collectives": 0, "buckets": 0}
        if not entries:
            return
        buckets = self.plan(entries)
        updates, shards, alphas = [], [], []
        for group, p in entries:
            updates.append(self._momentum_update(p, group))
            x = local_tensor(p)
            x.mul_(1.0 - group["lr"] * group["weight_decay"])
            shards.append(x)
            m, n = self.group_meta(group).block_shape(tuple(p.shape))
            alphas.append(-group["lr"] * update_scale(m, n, group["adjust_lr"]))
        self.stats["buckets"] = len(buckets)
        if not self.async_comm:
            for b in buckets:
                O_NMK = self._orthogonalize(b, updates, self._start_gather(b, updates))
                self._apply_own(b, O_NMK, shards, alphas)
                self._finish_return(b, self._start_return(b, O_NMK), shards, alphas)
            return
        exchanged = [b for b in buckets if b.needs_comm]
        inflight = self._start_gather(exchanged[0], updates) if exchanged else None
        for b in buckets:  # blocks that lie whole on their owner: NS while G0 is in flight
            if not b.needs_comm:
                self._apply_own(b, self._orthogonalize(b, updates, None), shards, alphas)
        pending: tuple[Bucket, Any] | None = None
        for k, b in enumerate(exchanged):
            upcoming = (
                self._start_gather(exchanged[k + 1], updates) if k + 1 < len(exchanged) else None
            )
            O_NMK = self._orthogonalize(b, updates, inflight)
            self._apply_own(b, O_NMK, shards, alphas)
            returning = self._start_return(b, O_NMK)
            if pending is not None:
                self._finish_return(*pending, shards, alphas)
            pending, inflight = (b, returning), upcoming
        if pending is not None:
            self._finish_return(*pending, shards, alphas)

    def _all_to_all(
        self, b: Bucket, send: Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> tuple[Any, Tensor, Tensor]:
        recv = torch.empty(sum(recv_splits), dtype=b.dtype, device=b.device)
        work = dist.all_to_all_single(
            recv, send, recv_splits, send_splits, group=b.group, async_op=self.async_comm
        )
        self.stats["bytes_sent"] += (send.numel() - send_splits[b.index]) * send.element_size()
        self.stats["collectives"] += 1
        return work, recv, send  # the send buffer must outlive the transfer

    @staticmethod
    def _wait(flight: tuple[Any, Tensor, Tensor]) -> Tensor:
        work, recv, _ = flight
        if work is not None:
            work.wait()
        return recv

    def _start_gather(
        self, b: Bucket, updates: Sequence[Tensor]
    ) -> tuple[Any, Tensor, Tensor] | None:
        """Pack this rank's pieces of other ranks' blocks and start sending them to the owners."""
        if not b.needs_comm:
            return None
        send = torch.empty(sum(b.send_splits), dtype=b.dtype, device=b.device)
        offset = 0
        for j in range(b.size):
            at = offset
            for i, index, (h, w) in b.send[j]:
                send[at : at + h * w].view(h, w).copy_(updates[i][index])
                at += h * w
            offset += b.send_splits[j]
        return self._all_to_all(b, send, b.send_splits, b.recv_splits)

    def _orthogonalize(
        self, b: Bucket, updates: Sequence[Tensor], flight: tuple[Any, Tensor, Tensor] | None
    ) -> Tensor:
        """Assemble this rank's whole blocks of the bucket and run Newton-Schulz on them."""
        X_NMK = torch.empty(b.num_owned, b.m, b.n, dtype=b.dtype, device=b.device)
        for run in b.runs:
            X_NMK[run.slot : run.slot + run.count].copy_(
                _whole_blocks(updates[run.entry], run, b.m, b.n)
            )
        for slot, inside, i, index in b.own_pieces:
            X_NMK[slot][inside].copy_(updates[i][index])
        if flight is not None:
            recv = self._wait(flight)
            offset = 0
            for j in range(b.size):
                at = offset
                for slot, inside, (h, w) in b.recv[j]:
                    X_NMK[slot][inside].copy_(recv[at : at + h * w].view(h, w))
                    at += h * w
                offset += b.recv_splits[j]
        if b.num_owned == 0:
            return X_NMK
        self.stats["ns_flops"] += b.num_owned * ns_flops(b.m, b.n, b.steps)
        return zeropower_via_newtonschulz(X_NMK, b.steps, b.coefficients, b.dtype)

    @staticmethod
    def _apply_own(
        b: Bucket, O_NMK: Tensor, shards: Sequence[Tensor], alphas: Sequence[float]
    ) -> None:
        """Add the result pieces this rank holds itself into its shards."""
        for run in b.runs:
            _whole_blocks(shards[run.entry], run, b.m, b.n).add_(
                O_NMK[run.slot : run.slot + run.count], alpha=alphas[run.entry]
            )
        for slot, inside, i, index in b.own_pieces:
            shards[i][index].add_(O_NMK[slot][inside], alpha=alphas[i])

    def _start_return(self, b: Bucket, O_NMK: Tensor) -> tuple[Any, Tensor, Tensor] | None:
        """Start sending every piece of this rank's results to the rank that holds it."""
        if not b.needs_comm:
            return None
        send = torch.empty(sum(b.recv_splits), dtype=b.dtype, device=b.device)
        offset = 0
        for j in range(b.size):
            at = offset
            for slot, inside, (h, w) in b.recv[j]:
                send[at : at + h * w].view(h, w).copy_(O_NMK[slot][inside])
                at += h * w
            offset += b.recv_splits[j]
        return self._all_to_all(b, send, b.recv_splits, b.send_splits)

    def _finish_return(
        self,
        b: Bucket,
        flight: tuple[Any, Tensor, Tensor] | None,
        shards: Sequence[Tensor],
        alphas: Sequence[float],
    ) -> None:
        """Wait for the results of other ranks' blocks and add them into this rank's shards."""
        if flight is None:
            return
        recv = self._wait(flight)
        offset = 0
        for j in range(b.size):
            at = offset
            for i, index, (h, w) in b.send[j]:
                shards[i][index].add_(recv[at : at + h * w].view(h, w), alpha=alphas[i])
                at += h * w
            offset += b.send_splits[j]
