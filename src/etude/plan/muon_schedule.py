"""Replay of the sharded Muon step's schedule for ``etude plan``: owners, FLOPs, bytes, calls.

Muon schedule (``etude.optim.sharded``): blocks are grouped by (exchange group, block shape) in
the optimizer's parameter order and cut into buckets of ``bucket_mb`` MiB; a block that lies
whole on one rank is owned by it, every other block goes to the rank with the fewest blocks of
the bucket, then the least Newton-Schulz FLOPs so far in its group, then the largest piece of
the block, then the lowest rank. ``etude.optim`` keeps that rule inside its bucket builder (no
pure function to call at this scale), so ``OwnerBalancer`` replicates it; a unit test checks it
owner for owner against the optimizer's own builder. Pieces held away from the owner travel to
it and back (two ``all_to_all_single`` per bucket that needs any); the 1-element pads the
optimizer adds against empty splits are left out of the byte counts.

Newton-Schulz FLOPs of an m x n block: ``steps * (4 s^2 l + 2 s^3)``, ``s = min(m, n)``,
``l = max(m, n)`` (``etude.optim.muon.ns_flops``). With HSDP every replica repeats its shard
group's work, so per-rank figures do not shrink with ``dp_replicate``.

What this module does not do: turn the schedule into seconds (``etude.plan.cost`` does, with the
links of ``etude.plan.comm``), or count the optimizer's bucket workspace or its elementwise work.
``simulate_muon`` depends on the layout's degrees only, not on how ranks map to nodes.

Legend: W ranks of one exchange group (arrays ``x_W``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from etude.optim.muon import ns_flops
from etude.plan.layout import Layout
from etude.plan.settings import DTYPE_BYTES, PlanSettings
from etude.plan.sharding import ParamRecord, block_span, muon_order, shard_param


@dataclass(frozen=True, slots=True)
class Pieces:
    """The pieces of one block over the ranks of an exchange group."""

    ranks: np.ndarray
    """Group ranks holding a non-empty piece, most elements first, ties by rank."""
    volumes: np.ndarray
    """Elements each of those ranks holds, in the same order."""
    total: int
    """Elements of the block."""

    @property
    def single(self) -> bool:
        return len(self.ranks) == 1


def block_pieces(lo: int, hi: int, width: int, size: int, W: int) -> Pieces:
    """Pieces of a block spanning ``[lo, hi)`` of a tensor dim of ``size`` cut over ``W`` ranks
    in ``torch.chunk`` chunks (``ceil(size / W)`` each, the last ones short or empty)."""
    chunk = -(-size // W)
    ranks = np.arange(lo // chunk, (hi - 1) // chunk + 1, dtype=np.int64)
    starts = np.maximum(lo, ranks * chunk)
    stops = np.minimum(np.minimum(hi, (ranks + 1) * chunk), size)
    volumes = (stops - starts) * width
    keep = volumes > 0
    ranks, volumes = ranks[keep], volumes[keep]
    order = np.lexsort((ranks, -volumes))
    assert int(volumes.sum()) == (hi - lo) * width
    return Pieces(ranks=ranks[order], volumes=volumes[order], total=(hi - lo) * width)


class OwnerBalancer:
    """Owners of blocks, bucket after bucket, for one exchange group of ``size`` ranks.

    The rule of ``ShardedMuon`` (``etude.optim.exchange.make_bucket``): per bucket, a block held
    whole by one rank stays there; each other block goes to ``min(range(W), key=(count in this
    bucket, load, -held, rank))``. ``load`` (Newton-Schulz FLOPs) carries over buckets. Here the minimum is
    found with a heap of (load, rank) instead of a scan over the W ranks: ranks are taken in
    rounds of equal count (all count-0 ranks before any count-1 rank), within a round by least
    load; among the ranks tied at that load, the block's largest holder wins, else the lowest
    rank (the heap's top).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.load_W = np.zeros(size, dtype=np.int64)
        self._returned_W = np.zeros(size, dtype=np.int64)
        self._cut: dict[int, tuple[Pieces, int]] = {}
        self._count_W = np.zeros(size, dtype=np.int64)
        self._heap = [(0, r) for r in range(size)]
        self.buckets = 0
        self.exchanges = 0

    @property
    def bytes_W(self) -> np.ndarray:
        """Elements each rank has sent so far, both all-to-alls (no padding)."""
        sent_W = self._returned_W.copy()
        for pieces, num_blocks in self._cut.values():
            sent_W[pieces.ranks] += pieces.volumes * num_blocks  # ranks of one block are distinct
        return sent_W

    def assign(self, bucket: Sequence[Pieces], flops: int) -> list[int]:
        """Owners (group ranks) of the blocks of one bucket, each costing ``flops``."""
        load_W, count_W = self.load_W, self._count_W
        count_W[:] = 0
        owners = [-1] * len(bucket)
        touched = set()
        for k, pieces in enumerate(bucket):
            if pieces.single:
                owner = int(pieces.ranks[0])
                owners[k] = owner
                count_W[owner] += 1
                load_W[owner] += flops
                touched.add(owner)
        heap, level, in_global = self._heap, 0, True
        for k, pieces in enumerate(bucket):
            if owners[k] >= 0:
                continue
            while True:
                # drop entries whose load moved on (stale) or whose rank is past this round
                while heap and (load_W[heap[0][1]] != heap[0][0] or count_W[heap[0][1]] != level):
                    heapq.heappop(heap)
                if heap:
                    break
                level += 1
                heap = [(int(load_W[r]), int(r)) for r in np.flatnonzero(count_W == level)]
                heapq.heapify(heap)
                in_global = False
            least, first = heap[0]
            tier = (count_W[pieces.ranks] == level) & (load_W[pieces.ranks] == least)
            i = int(np.argmax(tier))
            owner = int(pieces.ranks[i]) if tier[i] else first
            held = int(pieces.volumes[i]) if tier[i] else 0
            owners[k] = owner
            count_W[owner] += 1
            load_W[owner] += flops
            touched.add(owner)
            # holders send their pieces to the owner (summed per piece layout in bytes_W); the
            # owner returns what it did not hold, and sends nothing of its own piece
            self._returned_W[owner] += pieces.total - 2 * held
            seen = self._cut.get(id(pieces))
            self._cut[id(pieces)] = (pieces, 1 if seen is None else seen[1] + 1)
        if in_global:
            for r in touched:
                heapq.heappush(self._heap, (int(load_W[r]), r))
        else:
            self._heap = [(int(load), r) for r, load in enumerate(load_W)]
            heapq.heapify(self._heap)
        self.buckets += 1
        if any(not p.single for p in bucket):
            self.exchanges += 1
        return owners


@dataclass(slots=True)
class GroupSchedule:
    """The sharded Muon work of one exchange axis, per rank of a group."""

    axis: str
    size: int
    ns_flops_W: np.ndarray
    bytes_W: np.ndarray
    """Bytes each rank sends in the NS dtype (both all-to-alls, no padding)."""
    blocks: int
    buckets: int
    collectives: int
    """all_to_all_single calls each rank of the group joins per step."""


@dataclass(slots=True)
class MuonSchedule:
    """The Muon step of one layout, independent of how ranks map to nodes."""

    ns_flops_total: int
    """Newton-Schulz FLOPs of all blocks of the model (one replica)."""
    expert_flops_total: int
    """The part of ``ns_flops_total`` spent on routed experts."""
    num_blocks: int
    whole_flops: int
    """FLOPs every rank spends on blocks it holds whole without any exchange."""
    groups: dict[str, GroupSchedule] = field(default_factory=dict)


def simulate_muon(
    records: Sequence[ParamRecord], layout: Layout, settings: PlanSettings
) -> MuonSchedule:
    """Owners, FLOPs, bytes and collectives of one sharded Muon step under ``layout``."""
    steps, nbytes = settings.ns_steps, DTYPE_BYTES[settings.dtype]
    ordered = muon_order(records)
    flops = [r.meta.num_blocks * ns_flops(*r.meta.block_shape(r.shape), steps) for r in ordered]
    schedule = MuonSchedule(
        ns_flops_total=sum(flops),
        expert_flops_total=sum(f for f, r in zip(flops, ordered) if r.is_expert),
        num_blocks=sum(r.meta.num_blocks for r in ordered),
        whole_flops=0,
    )
    keyed: dict[tuple[str, int, int], list[Pieces]] = {}
    cache: dict[tuple[int, ...], Pieces] = {}
    sizes: dict[str, int] = {}
    for rec in ordered:
        shard = shard_param(rec, layout)
        m, n = rec.meta.block_shape(rec.shape)
        if shard.axis is None:
            schedule.whole_flops += shard.whole_blocks * ns_flops(m, n, steps)
            continue
        sizes[shard.axis] = shard.group_size
        extent = rec.shape[shard.dim]
        blocks = keyed.setdefault((shard.axis, m, n), [])
        for b in range(shard.blocks):
            lo, hi, width = block_span(rec, b, shard.dim)
            key = (lo, hi, width, extent, shard.group_size)
            if key not in cache:
                cache[key] = block_pieces(lo, hi, width, extent, shard.group_size)
            blocks.append(cache[key])
    balancers = {axis: OwnerBalancer(size) for axis, size in sizes.items()}
    counts = dict.fromkeys(sizes, 0)
    for (axis, m, n), blocks in keyed.items():
        per_bucket = max(1, int(settings.bucket_mb * 2**20) // (m * n * nbytes))
        flops = ns_flops(m, n, steps)
        counts[axis] += len(blocks)
        for start in range(0, len(blocks), per_bucket):
            balancers[axis].assign(blocks[start : start + per_bucket], flops)
    for axis, bal in balancers.items():
        schedule.groups[axis] = GroupSchedule(
            axis=axis,
            size=bal.size,
            ns_flops_W=bal.load_W.copy(),
            bytes_W=bal.bytes_W * nbytes,
            blocks=counts[axis],
            buckets=bal.buckets,
            collectives=2 * bal.exchanges,
        )
    return schedule
