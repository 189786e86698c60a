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

What is not here: the geometry of blocks and shards, exchange layouts and the owner rule of one
bucket (``etude.optim.exchange``); Newton-Schulz itself and single-process ``Muon``
(``etude.optim.muon``).

Legend: W ranks of an exchange group (one mesh axis), N blocks a rank owns in one bucket, M and K
rows and columns of one block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from etude.optim.exchange import (
    Block,
    Bucket,
    block_box,
    box_volume,
    exchange_layout,
    intersect_boxes,
    make_bucket,
    whole_blocks,
)
from etude.optim.muon import (
    Muon,
    local_tensor,
    ns_flops,
    resolve_ns_dtype,
    update_scale,
    zeropower_via_newtonschulz,
)


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
        keyed: dict[tuple[Any, ...], list[Block]] = {}
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
                    if (piece := intersect_boxes(box, member)) is not None
                )
                if not pieces:
                    continue  # a block of another exchange group (another expert-parallel rank)
                if sum(box_volume(piece) for _, piece in pieces) != m * n:
                    raise ValueError(
                        f"block {blk} of a {meta.kind} parameter of shape {shape} is not held "
                        f"whole by its exchange group ({p.placements}); shard it on one mesh "
                        "axis, or keep the other shard axes on block boundaries"
                    )
                keyed.setdefault(key, []).append(Block(i, blk, box, pieces))
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
                buckets.append(make_bucket(chunk, metas, layouts, setting, device, load))
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
                whole_blocks(updates[run.entry], run, b.m, b.n)
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
            whole_blocks(shards[run.entry], run, b.m, b.n).add_(
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
