"""The exchange plan of sharded Muon: where each block of a sharded parameter lies, who owns it.

``ShardedMuon`` (``etude.optim.sharded``) orthogonalizes whole blocks (one head, one expert, one
matrix) of parameters that FSDP2 leaves in slices over the ranks. This module is the geometry and
bookkeeping it runs on, pure functions of shapes and placements that every rank computes alike
without talking:
- boxes: the global hyper-rectangle a rank's shard holds (``shard_box``, ``torch.chunk`` layout:
  uneven and empty shards included), the box of one block (``block_box``), and where a piece of
  a block lies inside the block and inside a rank's local tensor;
- the exchange layout of a parameter (``exchange_layout``): the one mesh axis whose ranks swap
  pieces of its blocks, or none when every shard holds whole blocks; ``_StridedShard`` and
  ``Partial`` placements and blocks cut by two mesh axes at once are a ValueError here;
- buckets (``make_bucket``): one all-to-all round of same-shaped blocks, with each block's owner
  (a block whole on one rank stays there; the others are balanced by count, NS FLOPs and bytes)
  and this rank's precomputed sends, receives and local runs, every split padded to at least one
  element (an all-to-all where some rank sends or receives nothing is a known hang,
  https://github.com/pytorch/pytorch/issues/146468).

What is not here: the optimizer, the collectives and their overlap, Newton-Schulz, and cutting the
blocks of all parameters into buckets of ``bucket_mb`` (all in ``etude.optim.sharded``); the
paper replay of the same owner rule at 1T scale is ``etude.plan.muon_schedule``.

Legend: W ranks of an exchange group (one mesh axis), M and K rows and columns of one block.
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
from etude.optim.muon import ns_flops, split_blocks

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


def intersect_boxes(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def box_volume(box: Box) -> int:
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
class Block:
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


def make_bucket(
    blocks: Sequence[Block],
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
        held = {j: box_volume(box) for j, box in blk.pieces}
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


def whole_blocks(x: Tensor, run: _Run, m: int, n: int) -> Tensor:
    """``[count, M, K]`` view of a run of whole blocks inside a rank-local tensor."""
    if run.dim is None:
        return x.unsqueeze(0)
    extent = {"heads_dim0": m, "heads_dim1": n, "experts": 1}[run.kind]
    slab = x.narrow(run.dim, run.start, run.count * extent)
    return split_blocks(slab, ParamMeta(kind=run.kind, num_blocks=run.count))
