"""Communication of a training step for ``etude plan``: bytes per mesh axis and their time.

``axis_link`` says where the ranks of one axis group sit (all in rank 0's node, or spread over
nodes); ``ring_seconds`` (all-gather, reduce-scatter, all-reduce) and ``all_to_all_seconds`` turn
bytes per GPU into seconds at that link's bandwidth, plus a fixed latency per call.
``train_comm`` counts, per GPU and step, the bytes on each axis: per micro-batch FSDP all-gathers
in forward and backward and a reduce-scatter of gradients (dense and expert meshes), the EP
all-to-all of every (token, expert) pair in dispatch and combine (forward, recompute, backward),
the CP all-gather of K/V (MLA: the compressed latent and rotary key, ``C + Kr`` values per token)
and reduce-scatter of their gradients; per step the HSDP all-reduce across replicas.

What this module does not model: overlap of training communication with compute or between
axes (times per axis are reported as if serial), routing imbalance, contention with other jobs,
or the Muon step's all-to-all (``etude.plan.muon_schedule`` counts it). ``etude.parallel`` runs
CP for GQA only; CP of an MLA model is costed all the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from etude.model.config import ModelConfig
from etude.plan.cluster import ClusterConfig
from etude.plan.layout import Layout
from etude.plan.settings import DTYPE_BYTES, PlanSettings
from etude.plan.sharding import ParamRecord


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


def train_comm(
    cfg: ModelConfig,
    records: Sequence[ParamRecord],
    layout: Layout,
    cluster: ClusterConfig,
    settings: PlanSettings,
    num_micro: int,
) -> dict[str, dict[str, Any]]:
    """Per mesh axis: what it sends, its group size and link, bytes per GPU, calls and seconds
    of one training step of ``num_micro`` micro-batches (see the module docstring)."""
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
