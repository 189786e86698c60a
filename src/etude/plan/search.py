"""Layout search: every dual-mesh layout of a GPU count, the infeasible ones ruled out with a
reason, the feasible ones ranked by estimated step time.

``etude plan --gpus N`` with no layout flag runs this. Candidates are every combination of
``cp`` (1, 2, 4, 8: dividing the GPUs and the sequence), ``dp_replicate`` (a divisor of
``N / cp``; ``dp_shard`` takes the rest), ``ep`` (a divisor of the experts per layer and of
``dp_shard * cp``) and ``expert_replicate`` (a divisor of ``dp_replicate``: the seed's wider
expert mesh). A candidate is ruled out when the layout or the model rejects it (the same
``ValueError`` as ``etude plan`` with flags would print), when FSDP2 cannot shard its experts,
or when its memory per GPU exceeds the GPU's.

Ranking, with the batch fixed for all candidates (``batch_tokens``, default one sequence per
GPU: ``N * seq_len * micro_batch`` tokens, so a faster step is a higher throughput):
``step = forward/backward compute + training communication (serial, as reported) + Muon step
(overlapped)``. The cheap pass estimates the Muon step from perfectly balanced Newton-Schulz
FLOPs; the best ``simulate`` candidates then get the full block-by-block Muon schedule of
``etude.plan.muon_schedule`` and are ranked again.

What this does not do: search the shared mesh, micro-batch sizes, activation checkpointing or
dtypes (they are settings), or tensor/pipeline parallelism.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

from etude.model.config import ModelConfig
from etude.plan.cluster import ClusterConfig
from etude.plan.comm import train_comm
from etude.plan.cost import estimate, train_flops_per_token
from etude.plan.layout import Layout
from etude.plan.memory import memory_per_gpu
from etude.plan.settings import PlanSettings
from etude.plan.sharding import model_inventory, shard_param


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfg: ModelConfig, num_gpus: int, seq_len: int) -> list[dict[str, Any]]:
    """Degrees of every candidate (see the module docstring), before any check."""
    out = []
    for cp in (1, 2, 4, 8):
        if num_gpus % cp:
            continue
        for dp_replicate in _divisors(num_gpus // cp):
            dp_shard = num_gpus // (cp * dp_replicate)
            eps = [1]
            if cfg.num_experts:
                eps = _divisors(math.gcd(cfg.num_experts, dp_shard * cp))
            for ep in eps:
                for expert_replicate in _divisors(dp_replicate):
                    out.append(
                        dict(
                            dp_replicate=dp_replicate,
                            dp_shard=dp_shard,
                            cp=cp,
                            ep=ep,
                            expert_replicate=expert_replicate,
                        )
                    )
    return out


def _cheap_step(est: dict[str, Any]) -> float:
    return est["train"]["compute_s"] + est["train"]["comm_s_serial"] + est["muon"]["step_s_overlap"]


def _ns_flops_split(records, settings) -> tuple[int, int]:
    """Newton-Schulz FLOPs of one replica: (dense and attention blocks, routed experts)."""
    from etude.optim.muon import ns_flops

    dense = expert = 0
    for r in records:
        if r.meta.optimizer == "muon":
            f = r.meta.num_blocks * ns_flops(*r.meta.block_shape(r.shape), settings.ns_steps)
            if r.is_expert:
                expert += f
            else:
                dense += f
    return dense, expert


def _cheap_estimate(cfg, cluster, layout, settings, records, ns_split, per_token):
    """Memory, training time and a balanced-FLOPs Muon step (no block schedule)."""
    shards = [shard_param(r, layout) for r in records]
    memory = memory_per_gpu(cfg, records, shards, layout, settings)
    batch_tokens = settings.resolved_batch_tokens(layout)
    num_micro = batch_tokens // (
        settings.micro_batch_size * settings.seq_len * layout.data_parallel
    )
    comm = train_comm(cfg, records, layout, cluster, settings, num_micro)
    dense, expert = ns_split
    ideal = dense / layout.dense_fsdp + expert / layout.expert_shard
    muon_s = ideal / (cluster.flops(settings.dtype) * cluster.matmul_efficiency)
    flops = batch_tokens / layout.num_gpus * per_token
    compute_s = flops / (cluster.flops(settings.dtype) * cluster.model_flops_utilization)
    return {
        "memory": memory,
        "train": {
            "compute_s": compute_s,
            "comm_s_serial": sum(a["seconds"] for a in comm.values()),
        },
        "muon": {"step_s_overlap": muon_s},
    }


def search_layouts(
    cfg: ModelConfig,
    cluster: ClusterConfig,
    settings: PlanSettings,
    *,
    top: int = 5,
    simulate: int = 5,
) -> dict[str, Any]:
    """Rank the feasible layouts of ``cluster.num_gpus`` GPUs (see the module docstring).

    Returns ``best`` (up to ``top`` full estimates, fastest first, each with ``step_s``),
    ``ruled_out`` (one ``{"layout", "reason", "kind"}`` per candidate that cannot run),
    ``reasons`` ({kind: count}), ``feasible`` (how many can run) and ``batch_tokens``.
    """
    num_gpus = cluster.num_gpus
    if settings.batch_tokens is None:
        tokens = num_gpus * settings.seq_len * settings.micro_batch_size
        settings = dataclasses.replace(settings, batch_tokens=tokens)
    records = model_inventory(cfg)
    ns_split = _ns_flops_split(records, settings)
    per_token = train_flops_per_token(cfg, records, settings)
    ruled_out: list[dict[str, Any]] = []
    feasible: list[tuple[float, Layout]] = []
    for degrees in candidate_layouts(cfg, num_gpus, settings.seq_len):
        shown = dict(degrees)
        if degrees["expert_replicate"] == degrees["dp_replicate"]:
            degrees = {**degrees, "expert_replicate": None}
        try:
            layout = Layout(**degrees)
            layout.check_model(num_experts=cfg.num_experts, seq_len=settings.seq_len)
            settings.resolved_batch_tokens(layout)
        except ValueError as e:
            ruled_out.append({"layout": shown, "reason": str(e), "kind": "layout"})
            continue
        try:
            est = _cheap_estimate(cfg, cluster, layout, settings, records, ns_split, per_token)
        except ValueError as e:
            ruled_out.append({"layout": shown, "reason": str(e), "kind": "expert sharding"})
            continue
        need, have = est["memory"]["total"], cluster.gpu_memory_bytes
        if need > have:
            reason = (
                f"needs {need / 2**30:,.1f} GiB per GPU, the GPU has {have / 2**30:,.1f} GiB "
                f"(parameters, master, gradients and optimizer state "
                f"{sum(est['memory'][k] for k in ('parameters', 'master', 'gradients', 'optimizer')) / 2**30:,.1f} GiB)"
            )
            ruled_out.append({"layout": shown, "reason": reason, "kind": "memory"})
            continue
        feasible.append((_cheap_step(est), layout))
    feasible.sort(key=lambda item: item[0])
    best = []
    for _, layout in feasible[: max(simulate, top)]:
        full = estimate(cfg, cluster, layout, settings, records)
        full["step_s"] = (
            full["train"]["compute_s"]
            + full["train"]["comm_s_serial"]
            + full["muon"]["step_s_overlap"]
        )
        best.append(full)
        if len(best) >= simulate:
            break
    best.sort(key=lambda e: e["step_s"])
    return {
        "best": best[:top],
        "feasible": len(feasible),
        "ruled_out": ruled_out,
        "reasons": dict(Counter(r["kind"] for r in ruled_out)),
        "batch_tokens": settings.batch_tokens,
        "settings": dataclasses.asdict(settings),
        "cluster": dataclasses.asdict(cluster),
    }


def _layout_text(layout: dict[str, Any]) -> str:
    text = "dp_replicate {dp_replicate} x dp_shard {dp_shard} x cp {cp}, ep {ep}".format(**layout)
    if layout.get("expert_replicate") not in (None, layout["dp_replicate"]):
        text += f", expert_replicate {layout['expert_replicate']}"
    return text


def format_search(
    result: dict[str, Any], *, model_name: str = "model", gpu: str | None = None
) -> str:
    """The plain-text report of `search_layouts` (``gpu``: the preset name, for the command
    line of the best layout)."""
    cluster, best = result["cluster"], result["best"]
    total = result["feasible"] + len(result["ruled_out"])
    lines = [
        f"etude plan: {model_name} on {cluster['num_gpus']:,} x {cluster['gpu_name']}, "
        f"no layout given: searched {total:,} dual-mesh layouts, "
        f"{result['feasible']:,} feasible; batch {result['batch_tokens']:,} tokens per step",
        "",
        f"{'#':>2}  {'layout':<70}{'memory':>10}{'compute':>10}{'comm':>10}{'Muon':>9}{'step':>9}",
    ]
    for i, est in enumerate(best, 1):
        lay = dict(est["layout"])
        lines.append(
            f"{i:>2}  {_layout_text(lay):<70}{est['memory']['total'] / 2**30:>8.1f} G"
            f"{est['train']['compute_s']:>9.2f}s{est['train']['comm_s_serial']:>9.2f}s"
            f"{est['muon']['step_s_overlap']:>8.3f}s{est['step_s']:>8.2f}s"
        )
    if not best:
        lines.append("    (no layout fits: see the reasons below)")
    lines += ["", "step = compute + training communication (serial) + Muon step (overlapped)", ""]
    slower = result["feasible"] - len(best)
    if slower > 0:
        lines.append(f"{slower:,} other feasible layouts are slower than those shown")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for item in result["ruled_out"]:
        by_kind.setdefault(item["kind"], []).append(item)
    for kind, items in by_kind.items():
        lines.append(f"{len(items):,} ruled out by {kind}, e.g.:")
        seen = set()
        for item in items:
            if item["reason"][:40] in seen:
                continue
            seen.add(item["reason"][:40])
            lines.append(f"  {_layout_text(item['layout'])}: {item['reason']}")
            if len(seen) == 3:
                break
    if best:
        cmd = best[0]["layout"]
        lines += [
            "",
            f"the best layout in full: etude plan --config {model_name} "
            + (f"--gpu {gpu} " if gpu else "")
            + "--gpus {n} --dp-replicate {dp_replicate} --cp {cp} --ep {ep} "
            "--expert-replicate {expert_replicate}".format(n=cluster["num_gpus"], **cmd),
        ]
    return "\n".join(lines)
