"""The analytic cost model of ``etude plan``: memory, communication and the Muon step of a layout.

Given a model config (built on the meta device, so every parameter count and block shape is the
model's own), a cluster (``etude.plan.cluster``) and a layout (``etude.plan.layout``), estimate
per GPU, for the dual mesh and for a single shared mesh:

1. Memory in the precisions real runs use, each a setting: sharded parameters
   (``param_dtype``, bf16 by default) and gradients (``grad_dtype``, bf16), the optimizer's
   master weights (``master_dtype``, fp32; ``none`` when the parameters are the master copy),
   optimizer state (Muon: one momentum buffer; AdamW: two moments; ``optim_dtype``, fp32), FSDP
   buffers and activations.
2. Bytes per training step on each mesh axis (FSDP all-gather and reduce-scatter on the dense
   and expert meshes, HSDP all-reduce across replicas, EP all-to-all of routed tokens, CP K/V
   all-gather) and their time at the axis' bandwidth (NVLink inside a node, the NIC across).
3. The Muon optimizer step under ``etude.optim.ShardedMuon``'s schedule: Newton-Schulz FLOPs
   per rank, all-to-all bytes per rank, collectives, and the step time ``max(compute, comm)``
   (communication overlapped, as the pipelined schedule does) or ``compute + comm`` (serial),
   plus the memory-bound elementwise work (momentum, weight decay, AdamW).

Sharding assumed (what ``etude.parallel`` does, docs/architecture.md "Dual mesh"): FSDP2 shards every
dense weight on dim 0 over ``dp_shard x cp`` (``torch.chunk`` sizes: ceil, trailing shards
short or empty). Expert weights ``[E, M, K]`` are split over ``ep`` on dim 0, then over
``efsdp`` on dim 0 when it divides the local experts (whole experts per rank), else on dim 1
(every expert cut into row slices; FSDP2 needs ``M`` to divide by ``efsdp`` there, else
``ValueError``). The shared mesh shards the same way over the same degrees;
it differs in which ranks form the ep and efsdp groups (and so in their bandwidth) and in the
GPUs it needs.

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

Activation estimate (bytes per GPU, compute dtype of b bytes, ``t = micro_batch_size *
seq_len / cp`` tokens per micro-batch on a GPU, flash attention so no T x T scores, uniform
routing, tokens sent once per (token, expert) pair):

- attention, per token: ``b (D + (H + 2 Hkv) Dh + 2 Hkv Dh cp + H Dh + D) + 4 H``
  (norm output, q/k/v, K/V all-gathered over cp, attention output, projection; fp32 logsumexp);
  MLA: ``b (D + Cq + H Kqk + (C + Kr) cp + H (Kn + Kv) + H Kqk + H Kv + D) + 4 H`` (norm output,
  q_a output, queries, the compressed latent and rotary key (what CP would gather), the
  kv_b expansion, the keys with the shared rotary part, attention output, projection);
- dense FFN: ``b (2 D + 3 F)``; MoE: ``b (3 D + 2 k D + 3 k F_e + 3 F_s) + 4 E + 12 k``
  (dispatched and returned copies, SwiGLU hidden of the k experts and the shared expert, fp32
  router scores, top-k weights and ids); plus the residual ``b D``;
- logits: ``V (b + 8)`` per token (output, fp32 logits and their gradient);
- full activation checkpointing per layer: ``t (L b D + 2 a_max + logits)``: every layer's
  input is kept, one layer (the largest, ``a_max``) is recomputed and holds its activations and
  their gradients at once; none: ``t (sum_l a_l + a_max + logits)``.

What this module does not model: pipeline parallelism, tensor parallelism, routing imbalance,
the optimizer's bucket workspace (a few buckets of ``bucket_mb``), memory fragmentation,
and overlap of training communication with compute (times per axis are reported as if
serial). CP of an MLA model is costed as an all-gather of the compressed latent and rotary key
(``C + Kr`` values per token); ``etude.parallel`` runs CP for GQA only.

Legend: W ranks of one exchange group, G global ranks of the job (arrays ``x_W``, ``x_G``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from etude.model.config import ModelConfig
from etude.model.meta import ParamMeta
from etude.optim.muon import ns_flops
from etude.plan.cluster import ClusterConfig
from etude.plan.layout import Layout, min_gpus

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
"""Bytes per element of the dtypes a plan can name."""


@dataclass(kw_only=True, slots=True)
class PlanSettings:
    """What one training step does: tokens, dtypes, checkpointing, Newton-Schulz steps."""

    seq_len: int = 4096
    """Tokens per sequence."""
    batch_tokens: int | None = None
    """Tokens per optimizer step over the whole job; None: one micro-batch per data-parallel
    rank."""
    micro_batch_size: int = 1
    """Sequences per data-parallel rank in one forward/backward (gradient accumulation covers
    the rest of the batch)."""
    ns_steps: int = 5
    """Newton-Schulz iterations per Muon step."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype: gathered weights, activations, EP/CP payloads, Newton-Schulz and its
    all-to-all."""
    param_dtype: Literal["bf16", "fp32"] = "bf16"
    """Dtype of the sharded parameters FSDP holds and gathers (mixed precision: bf16)."""
    grad_dtype: Literal["bf16", "fp32"] = "bf16"
    """Dtype of the sharded gradients (FSDP reduce-scatters and HSDP all-reduces in it)."""
    master_dtype: Literal["fp32", "bf16", "none"] = "fp32"
    """Dtype of the optimizer's master copy of the sharded parameters; ``none``: the
    parameters themselves are the master copy (no extra memory)."""
    optim_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the optimizer state (Muon momentum, AdamW moments)."""
    activation_checkpointing: Literal["full", "none"] = "full"
    """``full``: every transformer block recomputes its forward in backward; ``none``: keep all."""
    bucket_mb: float = 32.0
    """MiB of whole blocks per all-to-all bucket of the sharded Muon step."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch_size", "ns_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"plan.{name} must be a positive integer, got {value!r}")
        if self.batch_tokens is not None and (
            not isinstance(self.batch_tokens, int) or self.batch_tokens < 1
        ):
            raise ValueError(
                f"plan.batch_tokens must be a positive integer or None, got {self.batch_tokens!r}"
            )
        if self.master_dtype not in (*DTYPE_BYTES, "none"):
            raise ValueError(
                f"plan.master_dtype must be one of {', '.join(DTYPE_BYTES)}, none; got "
                f"{self.master_dtype!r}"
            )
        for name in ("dtype", "param_dtype", "grad_dtype", "optim_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(
                    f"plan.{name} must be one of {', '.join(DTYPE_BYTES)}, got "
                    f"{getattr(self, name)!r}"
                )
        if self.activation_checkpointing not in ("full", "none"):
            raise ValueError(
                "plan.activation_checkpointing must be 'full' or 'none', got "
                f"{self.activation_checkpointing!r}"
            )
        if not self.bucket_mb > 0:
            raise ValueError(f"plan.bucket_mb must be > 0 MiB, got {self.bucket_mb!r}")

    def resolved_batch_tokens(self, layout: Layout) -> int:
        """Tokens per step; a multiple of one micro-batch over every data-parallel rank."""
        per_round = self.micro_batch_size * self.seq_len * layout.data_parallel
        if self.batch_tokens is None:
            return per_round
        if self.batch_tokens % per_round:
            raise ValueError(
                f"plan.batch_tokens={self.batch_tokens} must be a multiple of micro_batch_size "
                f"* seq_len * data-parallel ranks = {self.micro_batch_size} * {self.seq_len} * "
                f"{layout.data_parallel} = {per_round}; e.g. batch_tokens="
                f"{max(1, round(self.batch_tokens / per_round)) * per_round}"
            )
        return self.batch_tokens


# ---------------------------------------------------------------------------------------------
# The model, read from a meta-device build


@dataclass(frozen=True, slots=True)
class ParamRecord:
    """One parameter of the model: name, full shape and its metadata."""

    name: str
    shape: tuple[int, ...]
    meta: ParamMeta

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_expert(self) -> bool:
        """Held by the expert mesh (stacked routed experts); everything else is dense."""
        return self.meta.kind == "experts"

    @property
    def layer(self) -> int | None:
        """Transformer block index, or None for the embedding, final norm and output head."""
        parts = self.name.split(".")
        return int(parts[1]) if parts[0] == "layers" else None


def model_inventory(cfg: ModelConfig) -> list[ParamRecord]:
    """Every parameter of ``Transformer(cfg)`` built on the meta device (nothing allocated)."""
    import torch

    from etude.model.meta import collect_param_meta
    from etude.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    metas = collect_param_meta(model)
    return [ParamRecord(n, tuple(p.shape), metas[n]) for n, p in model.named_parameters()]


def muon_order(records: Sequence[ParamRecord]) -> list[ParamRecord]:
    """Muon parameters in the order ``ShardedMuon`` sees them: ``build_optimizer`` makes one
    group per (kind, num_blocks) in order of first appearance, each in model order."""
    groups: dict[tuple[str, int], list[ParamRecord]] = {}
    for rec in records:
        if rec.meta.optimizer == "muon":
            groups.setdefault((rec.meta.kind, rec.meta.num_blocks), []).append(rec)
    return [rec for recs in groups.values() for rec in recs]


# ---------------------------------------------------------------------------------------------
# Where each parameter lies


@dataclass(frozen=True, slots=True)
class ParamShard:
    """How one parameter lies on a rank under a layout."""

    local_numel: int
    """Elements on the fullest rank (rank 0 of its groups: ceil-sized chunks)."""
    axis: str | None
    """Axis whose ranks exchange pieces of its Muon blocks (``dense_fsdp``/``efsdp``), or None
    when every rank holds whole blocks."""
    group_size: int = 1
    """Ranks of the exchange axis."""
    dim: int = 0
    """Tensor dim the exchange axis cuts."""
    blocks: int = 0
    """Muon blocks an exchange group sees (local experts of one ep rank, or all blocks)."""
    whole_blocks: int = 0
    """Without exchange: Muon blocks held whole by every rank."""


def shard_param(rec: ParamRecord, layout: Layout) -> ParamShard:
    """Where ``rec`` lies (same rule on both meshes; see the module docstring)."""
    shape, meta = rec.shape, rec.meta
    muon = meta.optimizer == "muon"
    if not rec.is_expert:
        W = layout.dense_fsdp
        local = -(-shape[0] // W) * math.prod(shape[1:])
        if not muon:
            return ParamShard(local_numel=local, axis=None)
        if W == 1:
            return ParamShard(local_numel=local, axis=None, whole_blocks=meta.num_blocks)
        return ParamShard(
            local_numel=local, axis="dense_fsdp", group_size=W, dim=0, blocks=meta.num_blocks
        )
    num_local, (_, m, k) = shape[0] // layout.ep, shape
    W = layout.efsdp
    if W == 1:
        return ParamShard(local_numel=num_local * m * k, axis=None, whole_blocks=num_local)
    if num_local % W == 0:
        per_rank = num_local // W
        return ParamShard(local_numel=per_rank * m * k, axis=None, whole_blocks=per_rank)
    if m % W:
        # FSDP2 shards dims > 0 only evenly ("FSDP does not support uneven sharding on dim 1")
        raise ValueError(
            f"efsdp={W} (from ep={layout.ep}) cannot shard {rec.name} {list(shape)}: its "
            f"{num_local} local experts do not split evenly over {W} ranks, and dim 1 ({m}) "
            f"does not either (FSDP2 shards dims > 0 only evenly); choose ep (or "
            f"expert_replicate) so that efsdp divides {num_local} or {m}"
        )
    return ParamShard(
        local_numel=num_local * (m // W) * k, axis="efsdp", group_size=W, dim=1, blocks=num_local
    )


def block_span(rec: ParamRecord, block: int, dim: int) -> tuple[int, int, int]:
    """(lo, hi, width) of a Muon block: its extent along tensor ``dim`` and the elements per
    index of that extent (the rest of the block)."""
    m, n = rec.meta.block_shape(rec.shape)
    if dim == rec.meta.block_dim and rec.meta.kind != "experts":
        assert dim == 0 and rec.meta.kind == "heads_dim0", rec
        return block * m, (block + 1) * m, n
    extent = rec.shape[dim]
    return 0, extent, m * n // extent


# ---------------------------------------------------------------------------------------------
# The owner rule of the sharded Muon step


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

    The rule of ``ShardedMuon`` (``etude.optim.sharded``): per bucket, a block held whole by one
    rank stays there; each other block goes to ``min(range(W), key=(count in this bucket, load,
    -held, rank))``. ``load`` (Newton-Schulz FLOPs) carries over buckets. Here the minimum is
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


# ---------------------------------------------------------------------------------------------
# Bandwidth of an axis


@dataclass(frozen=True, slots=True)
class AxisLink:
    """Where the ranks of one axis group sit: all in one node, or spread over nodes."""

    size: int
    in_node: int
    """Members (rank 0 included) in rank 0's node."""

    @property
    def intra(self) -> bool:
        return self.in_node == self.size


def axis_link(layout: Layout, cluster: ClusterConfig, axis: str) -> AxisLink:
    ranks = layout.axis_ranks(axis)
    node = cluster.node_of(0)
    return AxisLink(size=len(ranks), in_node=sum(cluster.node_of(r) == node for r in ranks))


def ring_seconds(num_bytes: float, link: AxisLink, cluster: ClusterConfig, calls: int) -> float:
    """All-gather / reduce-scatter / all-reduce: bytes sent per GPU at the slowest link (the NIC
    once the ring leaves the node), plus a fixed latency per call."""
    if link.size == 1:
        return 0.0
    bw = cluster.intra_node_bw if link.intra else cluster.inter_node_bw
    latency = cluster.intra_node_latency_s if link.intra else cluster.inter_node_latency_s
    return num_bytes / (bw * cluster.comm_efficiency) + calls * latency


def all_to_all_seconds(
    num_bytes: float, link: AxisLink, cluster: ClusterConfig, calls: int
) -> float:
    """All-to-all: the bytes to peers inside the node go over NVLink, the rest over the NIC, at
    the same time (peers taken as equally loaded)."""
    if link.size == 1:
        return 0.0
    inside = num_bytes * (link.in_node - 1) / (link.size - 1)
    outside = num_bytes - inside
    seconds = max(inside / cluster.intra_node_bw, outside / cluster.inter_node_bw)
    latency = cluster.intra_node_latency_s if link.intra else cluster.inter_node_latency_s
    return seconds / cluster.comm_efficiency + calls * latency


# ---------------------------------------------------------------------------------------------
# The estimate


def activation_bytes_per_token(cfg: ModelConfig, layout: Layout, settings: PlanSettings) -> dict:
    """Per-token activation bytes of the formula in the module docstring."""
    b = DTYPE_BYTES[settings.dtype]
    D, H, Hkv, Dh = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if cfg.attention == "mla":
        qk, Kn, Kv = (
            cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
            cfg.qk_nope_head_dim,
            cfg.v_head_dim,
        )
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        attention = b * (
            2 * D + cfg.q_lora_rank + 2 * H * qk + latent * layout.cp + H * (Kn + Kv) + H * Kv
        )
        attention += 4 * H
    else:
        attention = b * (2 * D + (H + 2 * Hkv) * Dh + 2 * Hkv * Dh * layout.cp + H * Dh) + 4 * H
    dense = b * (2 * D + 3 * cfg.dense_ffn_dim)
    k, Fe = cfg.num_experts_per_tok, cfg.expert_ffn_dim
    Fs = Fe * cfg.num_shared_experts
    moe = b * (3 * D + 2 * k * D + 3 * k * Fe + 3 * Fs) + 4 * cfg.num_experts + 12 * k
    residual = b * D
    num_moe = cfg.num_moe_layers
    num_dense = cfg.num_layers - num_moe
    dense_layer = attention + dense + residual
    moe_layer = attention + moe + residual
    largest = max(dense_layer if num_dense else 0, moe_layer if num_moe else 0)
    return {
        "dense_layer": dense_layer,
        "moe_layer": moe_layer,
        "largest_layer": largest,
        "all_layers": num_dense * dense_layer + num_moe * moe_layer,
        "checkpoints": cfg.num_layers * b * D,
        "logits": cfg.vocab_size * (b + 8),
    }


def _memory(
    cfg: ModelConfig,
    records: Sequence[ParamRecord],
    shards: Sequence[ParamShard],
    layout: Layout,
    settings: PlanSettings,
) -> dict[str, int]:
    b_c, b_p, b_g = (
        DTYPE_BYTES[x] for x in (settings.dtype, settings.param_dtype, settings.grad_dtype)
    )
    b_m, b_o = DTYPE_BYTES.get(settings.master_dtype, 0), DTYPE_BYTES[settings.optim_dtype]
    local = sum(s.local_numel for s in shards)
    muon_local = sum(s.local_numel for r, s in zip(records, shards) if r.meta.optimizer == "muon")
    # FSDP units: each block's dense part and its (local, gathered over efsdp) experts, the
    # embedding, and the final norm with the output head
    units: dict[int | str, int] = {}
    for rec in records:
        numel = rec.numel // layout.ep if rec.is_expert else rec.numel
        key: int | str = rec.layer if rec.layer is not None else "outer"
        if rec.name.startswith("tok_embeddings."):
            key = "embedding"
        units[key] = units.get(key, 0) + numel
    largest_unit = max(units.values())
    per_token = activation_bytes_per_token(cfg, layout, settings)
    tokens = settings.micro_batch_size * settings.seq_len // layout.cp
    if settings.activation_checkpointing == "full":
        act = per_token["checkpoints"] + 2 * per_token["largest_layer"]
    else:
        act = per_token["all_layers"] + per_token["largest_layer"]
    out = {
        "parameters": local * b_p,
        "master": local * b_m,
        "gradients": local * b_g,
        "optimizer": muon_local * b_o + (local - muon_local) * 2 * b_o,
        # the unit in use and the one prefetched (compute dtype), and one unit's unsharded
        # gradients before their reduce-scatter
        "fsdp_buffers": largest_unit * (2 * b_c + b_g),
        "activations": tokens * (act + per_token["logits"]),
    }
    out["total"] = sum(out.values())
    return out


def _train_comm(
    cfg: ModelConfig,
    records: Sequence[ParamRecord],
    layout: Layout,
    cluster: ClusterConfig,
    settings: PlanSettings,
    num_micro: int,
) -> dict[str, dict[str, Any]]:
    b_c, b_r = DTYPE_BYTES[settings.dtype], DTYPE_BYTES[settings.grad_dtype]
    dense = sum(r.numel for r in records if not r.is_expert)
    expert = sum(r.numel for r in records if r.is_expert)
    num_units = cfg.num_layers + 2
    tokens = settings.micro_batch_size * settings.seq_len // layout.cp
    full_ac = settings.activation_checkpointing == "full"
    out: dict[str, dict[str, Any]] = {}

    def add(axis: str, what: str, num_bytes: float, calls: int, kind: str) -> None:
        link = axis_link(layout, cluster, axis)
        if link.size == 1:
            num_bytes, calls = 0.0, 0
        timing = ring_seconds if kind == "ring" else all_to_all_seconds
        out[axis] = {
            "what": what,
            "size": link.size,
            "in_node": link.intra,
            "bytes": num_bytes,
            "collectives": calls,
            "seconds": timing(num_bytes, link, cluster, calls),
        }

    def sharded(full: float, n: int) -> float:
        # per micro-batch: all-gather in forward and again in backward, reduce-scatter of grads
        return num_micro * (n - 1) / n * full * (2 * b_c + b_r)

    n = layout.dense_fsdp
    add(
        "dense_fsdp",
        "FSDP all-gather x2 + reduce-scatter",
        sharded(dense, n),
        3 * num_micro * num_units,
        "ring",
    )
    n = layout.efsdp
    add(
        "efsdp",
        "FSDP all-gather x2 + reduce-scatter",
        sharded(expert / layout.ep, n),
        3 * num_micro * cfg.num_moe_layers,
        "ring",
    )
    n = layout.dp_replicate
    add(
        "dp_replicate",
        "HSDP all-reduce of dense grads",
        2 * (n - 1) / n * dense / layout.dense_fsdp * b_r,
        num_units,
        "ring",
    )
    n = layout.expert_replicate_degree
    add(
        "expert_replicate",
        "HSDP all-reduce of expert grads",
        2 * (n - 1) / n * expert / layout.expert_shard * b_r,
        cfg.num_moe_layers,
        "ring",
    )
    n = layout.ep
    # dispatch + combine in forward, again in the recompute, and their gradients in backward
    passes = 6 if full_ac else 4
    per_call = tokens * cfg.num_experts_per_tok * cfg.dim * b_c * (n - 1) / n
    calls = num_micro * cfg.num_moe_layers * passes
    add("ep", "EP all-to-all of routed tokens", calls * per_call, calls, "all_to_all")
    n = layout.cp
    # K/V all-gather in forward (and recompute), reduce-scatter of dK/dV in backward
    passes = 3 if full_ac else 2
    if cfg.attention == "mla":  # the compressed latent and the shared rotary key
        chunk = tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * b_c
    else:
        chunk = tokens * 2 * cfg.num_kv_heads * cfg.head_dim * b_c
    calls = num_micro * cfg.num_layers * passes
    add("cp", "CP K/V all-gather + reduce-scatter", calls * (n - 1) * chunk, calls, "ring")
    return out


def _muon_step(
    schedule: MuonSchedule,
    records: Sequence[ParamRecord],
    shards: Sequence[ParamShard],
    layout: Layout,
    cluster: ClusterConfig,
    settings: PlanSettings,
) -> dict[str, Any]:
    ranks_G = np.arange(layout.num_gpus, dtype=np.int64)
    flops_G = np.full(layout.num_gpus, schedule.whole_flops, dtype=np.int64)
    comm_G = np.zeros(layout.num_gpus)
    bytes_G = np.zeros(layout.num_gpus)
    collectives = 0
    for axis, group in schedule.groups.items():
        index_G = layout.group_index(axis, ranks_G)
        flops_G += group.ns_flops_W[index_G]
        bytes_G += group.bytes_W[index_G]
        link = axis_link(layout, cluster, axis)
        comm_G += np.array(
            [all_to_all_seconds(float(x), link, cluster, group.collectives) for x in group.bytes_W]
        )[index_G]
        collectives += group.collectives
    compute_G = flops_G / (cluster.flops(settings.dtype) * cluster.matmul_efficiency)
    # memory-bound elementwise work per element: Muon reads the gradient twice, reads and
    # writes the momentum and reads it again (Nesterov), writes the update and reads the
    # orthogonal result back (NS dtype), reads and writes the parameter; AdamW reads the
    # gradient, reads and writes both moments and the parameter
    # with a master copy the update is applied to it and the parameters are rewritten from it
    b_c, b_g = DTYPE_BYTES[settings.dtype], DTYPE_BYTES[settings.grad_dtype]
    b_p, b_o = DTYPE_BYTES[settings.param_dtype], DTYPE_BYTES[settings.optim_dtype]
    b_m = DTYPE_BYTES.get(settings.master_dtype, 0)
    update = 2 * b_m + b_p if b_m else 2 * b_p
    muon_local = sum(s.local_numel for r, s in zip(records, shards) if r.meta.optimizer == "muon")
    adamw_local = sum(s.local_numel for s in shards) - muon_local
    stream = muon_local * (2 * b_g + 3 * b_o + 2 * b_c + update)
    stream += adamw_local * (b_g + 4 * b_o + update)
    elementwise = stream / (cluster.hbm_bw * cluster.hbm_efficiency)
    compute, comm = float(compute_G.max()), float(comm_G.max())
    # perfect balance: dense work spread over its FSDP group, expert work over efsdp x ep
    dense_flops = schedule.ns_flops_total - schedule.expert_flops_total
    ideal = dense_flops / layout.dense_fsdp + schedule.expert_flops_total / layout.expert_shard
    return {
        "ns_flops_total": schedule.ns_flops_total,
        # every replica repeats its shard group's work
        "ns_flops_cluster": dense_flops * layout.dp_replicate
        + schedule.expert_flops_total * layout.expert_replicate_degree,
        "num_blocks": schedule.num_blocks,
        "ns_flops_per_rank_max": int(flops_G.max()),
        "ns_flops_per_rank_mean": float(flops_G.mean()),
        "ns_flops_per_rank_min": int(flops_G.min()),
        "ns_flops_ideal": ideal,
        "alltoall_bytes_per_rank_max": float(bytes_G.max()),
        "alltoall_bytes_per_rank_mean": float(bytes_G.mean()),
        "collectives": collectives,
        "buckets": {a: g.buckets for a, g in schedule.groups.items()},
        "exchange_groups": {
            a: {"size": g.size, "blocks": g.blocks, "in_node": axis_link(layout, cluster, a).intra}
            for a, g in schedule.groups.items()
        },
        "compute_s": compute,
        "comm_s": comm,
        "elementwise_s": elementwise,
        "step_s_overlap": elementwise + max(compute, comm),
        "step_s_serial": elementwise + compute + comm,
    }


def train_flops_per_token(
    cfg: ModelConfig, records: Sequence[ParamRecord], settings: PlanSettings
) -> float:
    """Forward + backward FLOPs per token (recompute included under full checkpointing)."""
    total = sum(r.numel for r in records)
    expert = sum(r.numel for r in records if r.is_expert)
    embedding = sum(r.numel for r in records if r.meta.kind == "embedding")
    active = total - expert
    if cfg.num_experts:
        active += expert // cfg.num_experts * cfg.num_experts_per_tok
    full_ac = settings.activation_checkpointing == "full"
    # 6 N per token for forward + backward (2 more with recompute), attention H (Kqk + Kv) T
    # per token and layer forward (causal: half of the 2 H (Kqk + Kv) T of QK^T and AV; GQA
    # has Kqk = Kv = Dh), times 3 or 4
    per_token = (8 if full_ac else 6) * (active - embedding)
    if cfg.attention == "mla":
        qk_plus_v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    else:
        qk_plus_v = 2 * cfg.head_dim
    heads_and_tokens = cfg.num_heads * qk_plus_v * settings.seq_len * cfg.num_layers
    return per_token + (4 if full_ac else 3) * heads_and_tokens


def estimate(
    cfg: ModelConfig,
    cluster: ClusterConfig,
    layout: Layout,
    settings: PlanSettings,
    records: Sequence[ParamRecord] | None = None,
    schedule: MuonSchedule | None = None,
) -> dict[str, Any]:
    """Memory, training communication and Muon step of ``layout`` (one mesh kind).

    ``records`` (``model_inventory(cfg)``) and ``schedule`` (``simulate_muon``) may be passed in
    to share them between layouts with the same degrees.
    """
    if layout.num_gpus != cluster.num_gpus:
        raise ValueError(
            f"the layout covers {layout.num_gpus} GPUs ({layout.describe()}) but the cluster "
            f"has {cluster.num_gpus}; make dp_replicate*dp_shard*cp equal the GPU count"
        )
    layout.check_model(num_experts=cfg.num_experts, seq_len=settings.seq_len)
    batch_tokens = settings.resolved_batch_tokens(layout)
    num_micro = batch_tokens // (
        settings.micro_batch_size * settings.seq_len * layout.data_parallel
    )
    records = model_inventory(cfg) if records is None else records
    shards = [shard_param(r, layout) for r in records]
    if schedule is None:
        schedule = simulate_muon(records, layout, settings)
    memory = _memory(cfg, records, shards, layout, settings)
    memory["capacity"] = cluster.gpu_memory_bytes
    comm = _train_comm(cfg, records, layout, cluster, settings, num_micro)
    total = sum(r.numel for r in records)
    expert = sum(r.numel for r in records if r.is_expert)
    active = total - expert
    if cfg.num_experts:
        active += expert // cfg.num_experts * cfg.num_experts_per_tok
    tokens_per_gpu = batch_tokens / layout.num_gpus
    per_token = train_flops_per_token(cfg, records, settings)
    train_flops = tokens_per_gpu * per_token
    return {
        "mesh": layout.mesh,
        "feasible": True,
        "layout": {
            "dp_replicate": layout.dp_replicate,
            "dp_shard": layout.dp_shard,
            "cp": layout.cp,
            "ep": layout.ep,
            "efsdp": layout.efsdp,
            "expert_replicate": layout.expert_replicate_degree,
            "dense_fsdp": layout.dense_fsdp,
            "expert_shard": layout.expert_shard,
            "min_gpus_for_cp_ep": min_gpus(layout.cp, layout.ep, layout.mesh),
        },
        "batch": {
            "batch_tokens": batch_tokens,
            "micro_batches": num_micro,
            "tokens_per_micro_batch_per_gpu": settings.micro_batch_size
            * settings.seq_len
            // layout.cp,
        },
        "memory": memory,
        "comm": comm,
        "train": {
            "flops_per_gpu": train_flops,
            "compute_s": train_flops
            / (cluster.flops(settings.dtype) * cluster.model_flops_utilization),
            "comm_s_serial": sum(a["seconds"] for a in comm.values()),
        },
        "muon": _muon_step(schedule, records, shards, layout, cluster, settings),
        "params": {"total": total, "active": active, "expert": expert, "dense": total - expert},
    }


def plan(
    cfg: ModelConfig, cluster: ClusterConfig, layout: Layout, settings: PlanSettings
) -> dict[str, Any]:
    """Estimates for the dual mesh and for a single shared mesh with the same degrees.

    A shared mesh that cannot hold the degrees (``ep`` must divide ``dp_shard``) is reported as
    infeasible with the reason and the GPUs it would need.
    """
    records = model_inventory(cfg)
    dual = dataclasses.replace(layout, mesh="dual")
    result: dict[str, Any] = {
        "model": {
            "total": sum(r.numel for r in records),
            "expert": sum(r.numel for r in records if r.is_expert),
        },
        "cluster": dataclasses.asdict(cluster),
        "settings": dataclasses.asdict(settings),
    }
    schedule = simulate_muon(records, dual, settings)
    result["dual"] = estimate(cfg, cluster, dual, settings, records, schedule)
    try:
        shared = dataclasses.replace(layout, mesh="shared", expert_replicate=None)
    except ValueError as e:
        result["shared"] = {
            "mesh": "shared",
            "feasible": False,
            "reason": str(e),
            "layout": {"min_gpus_for_cp_ep": min_gpus(layout.cp, layout.ep, "shared")},
        }
        return result
    same = shared.efsdp == dual.efsdp
    result["shared"] = estimate(cfg, cluster, shared, settings, records, schedule if same else None)
    return result
