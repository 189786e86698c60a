"""The analytic cost model of ``etude plan``: memory, communication and the Muon step of a layout.

Given a model config (built on the meta device, so every parameter count and block shape is the
model's own), a cluster (``etude.plan.cluster``), a layout (``etude.plan.layout``) and the step
settings (``etude.plan.settings``), ``estimate`` gives per GPU, for one mesh kind:

1. Memory (``etude.plan.memory``: sharded state in the precisions real runs use, FSDP buffers,
   activations).
2. Bytes per training step on each mesh axis and their time at the axis' bandwidth
   (``etude.plan.comm``), and the forward/backward compute time (``train_flops_per_token``).
3. The Muon optimizer step under ``etude.optim.ShardedMuon``'s schedule (replayed by
   ``etude.plan.muon_schedule``): Newton-Schulz FLOPs per rank, all-to-all bytes per rank,
   collectives, and the step time ``max(compute, comm)`` (communication overlapped, as the
   pipelined schedule does) or ``compute + comm`` (serial), plus the memory-bound elementwise
   work (momentum, weight decay, AdamW).

``plan`` runs ``estimate`` for the dual mesh and for a single shared mesh with the same degrees.
Where each parameter lies is ``etude.plan.sharding``'s docstring; each formula is in the
docstring of the module that computes it.

What this module does not model: pipeline parallelism, tensor parallelism, routing imbalance,
the optimizer's bucket workspace (a few buckets of ``bucket_mb``), memory fragmentation,
and overlap of training communication with compute (times per axis are reported as if
serial). CP of an MLA model is costed as an all-gather of the compressed latent and rotary key
(``C + Kr`` values per token); ``etude.parallel`` runs CP for GQA only.

Legend: W ranks of one exchange group, G global ranks of the job (arrays ``x_W``, ``x_G``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from etude.model.config import ModelConfig
from etude.plan.cluster import ClusterConfig
from etude.plan.comm import all_to_all_seconds, axis_link, train_comm
from etude.plan.layout import Layout, min_gpus
from etude.plan.memory import memory_per_gpu
from etude.plan.muon_schedule import MuonSchedule, simulate_muon
from etude.plan.settings import DTYPE_BYTES, PlanSettings
from etude.plan.sharding import ParamRecord, ParamShard, model_inventory, shard_param


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
    memory = memory_per_gpu(cfg, records, shards, layout, settings)
    memory["capacity"] = cluster.gpu_memory_bytes
    comm = train_comm(cfg, records, layout, cluster, settings, num_micro)
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
