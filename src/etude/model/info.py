"""Parameter counts of a model config, from a meta-device build (nothing is allocated).

``count_params(cfg)`` builds the real modules on the meta device and reads their shapes and
metadata, so the counts are the model's own, not a formula that could drift from it; the Kimi K2
shapes (1T parameters) take about a second. ``format_model_info(cfg)`` renders the counts as the
plain-text table printed by ``etude model info``.

Active parameters per token = everything except routed experts, plus top-k of E routed experts
(embedding rows and the output head are counted whole, as published MoE counts do).

The ``kimi-k2`` and ``deepseek-v3`` presets build the published architecture (MLA included), so
their counts are the checkpoints' own: DeepSeek-V3 comes to 671.0B (published 671B without its
multi-token-prediction module), Kimi K2 to 1.026T total and 32.9B active (published "1.04T" and
"32B"/"32.6B"; the released checkpoint holds the same 61 layers).
"""

from __future__ import annotations

from typing import Any

import torch

from etude.model.config import ModelConfig
from etude.model.meta import collect_param_meta
from etude.model.transformer import Transformer

PARTS = (
    "embedding",
    "attention",
    "dense_ffn",
    "shared_experts",
    "routed_experts",
    "router",
    "norm",
    "head",
)
"""Parts a parameter count is broken into, in table order."""

KIMI_K2_PUBLISHED = {"total": 1.04e12, "active": 32e9}
"""Kimi K2 as published (Kimi K2 technical report): ~1.04T total, ~32B activated parameters."""


_SHAPE_FIELDS = (
    "vocab_size",
    "dim",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "dense_ffn_dim",
    "num_dense_layers",
    "num_experts",
    "num_experts_per_tok",
    "expert_ffn_dim",
    "num_shared_experts",
    "tie_embeddings",
    "attention",
    "q_lora_rank",
    "kv_lora_rank",
)


def _part_of(name: str, kind: str) -> str:
    if kind in ("heads_dim0", "heads_dim1") or (kind == "matrix" and ".attention." in name):
        return "attention"
    if kind == "experts":
        return "routed_experts"
    if kind == "matrix":
        return "shared_experts" if ".shared_experts." in name else "dense_ffn"
    return {"embedding": "embedding", "head": "head", "norm": "norm", "router": "router"}[kind]


def count_params(cfg: ModelConfig) -> dict[str, Any]:
    """Counts of a model with config ``cfg``, built on the meta device.

    Returns a dict with ``total`` and ``active`` (ints), ``by_part`` and ``active_by_part``
    ({part: count} over ``PARTS``), ``by_kind`` ({metadata kind: count}) and ``muon_blocks``
    ({(m, n): number of Newton-Schulz blocks of that shape}).
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    meta = collect_param_meta(model)
    by_part = dict.fromkeys(PARTS, 0)
    by_kind: dict[str, int] = {}
    muon_blocks: dict[tuple[int, int], int] = {}
    for name, param in model.named_parameters():
        info = meta[name]
        by_part[_part_of(name, info.kind)] += param.numel()
        by_kind[info.kind] = by_kind.get(info.kind, 0) + param.numel()
        if info.optimizer == "muon":
            shape = info.block_shape(tuple(param.shape))
            muon_blocks[shape] = muon_blocks.get(shape, 0) + info.num_blocks
    active_by_part = dict(by_part)
    if cfg.num_experts > 0:
        # every routed-expert tensor is E equal blocks; a token uses k of them
        assert by_part["routed_experts"] % cfg.num_experts == 0
        per_expert = by_part["routed_experts"] // cfg.num_experts
        active_by_part["routed_experts"] = per_expert * cfg.num_experts_per_tok
    return {
        "total": sum(by_part.values()),
        "active": sum(active_by_part.values()),
        "by_part": by_part,
        "active_by_part": active_by_part,
        "by_kind": by_kind,
        "muon_blocks": dict(sorted(muon_blocks.items())),
    }


def _human(count: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return str(int(count))


def _human_bytes(num_bytes: int) -> str:
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:,.1f} GiB"
    return f"{num_bytes / 2**20:,.1f} MiB"


def _is_kimi_k2_shape(cfg: ModelConfig) -> bool:
    reference = ModelConfig.preset("kimi-k2")
    return all(getattr(cfg, f) == getattr(reference, f) for f in _SHAPE_FIELDS)


def format_model_info(cfg: ModelConfig) -> str:
    """Plain-text table of parameter counts (total, active, per part, Muon blocks)."""
    counts = count_params(cfg)
    if cfg.attention == "mla":
        q = f"q rank {cfg.q_lora_rank}" if cfg.q_lora_rank else "full-rank q"
        attention = (
            f"attention MLA {cfg.num_heads} heads ({q}, kv rank {cfg.kv_lora_rank}, qk "
            f"{cfg.qk_nope_head_dim}+{cfg.qk_rope_head_dim}, v {cfg.v_head_dim})"
        )
    else:
        attention = (
            f"attention GQA {cfg.num_heads} q / {cfg.num_kv_heads} kv heads x {cfg.head_dim}"
        )
    lines = [
        f"dim {cfg.dim}, {cfg.num_layers} layers ({cfg.num_layers - cfg.num_moe_layers} dense, "
        f"{cfg.num_moe_layers} MoE), {attention}, vocab {cfg.vocab_size}",
    ]
    if cfg.num_experts > 0:
        lines.append(
            f"experts per MoE layer: {cfg.num_experts} routed (top-{cfg.num_experts_per_tok}, "
            f"ffn {cfg.expert_ffn_dim}) + {cfg.num_shared_experts} shared, "
            f"{cfg.router_score} router"
        )
    lines.append("")
    header = f"{'part':<16}{'total':>20}{'active/token':>20}"
    lines += [header, "-" * len(header)]
    for part in PARTS:
        total, active = counts["by_part"][part], counts["active_by_part"][part]
        if total:
            lines.append(f"{part.replace('_', ' '):<16}{total:>20,}{active:>20,}")
    lines.append("-" * len(header))
    lines.append(f"{'total':<16}{counts['total']:>20,}{counts['active']:>20,}")
    lines.append(
        f"{'':<16}{_human(counts['total']):>20}{_human(counts['active']):>20}"
        f"   (bf16 weights {_human_bytes(counts['total'] * 2)})"
    )
    lines += ["", "Muon blocks (m x n: count)"]
    for (m, n), num in counts["muon_blocks"].items():
        lines.append(f"  {m:>6} x {n:<6} {num:>10,}")
    if _is_kimi_k2_shape(cfg):
        published = KIMI_K2_PUBLISHED
        lines += [
            "",
            f"Kimi K2 as published: ~{_human(published['total'])} total, "
            f"~{_human(published['active'])} active; ours: {_human(counts['total'])} total, "
            f"{_human(counts['active'])} active "
            f"({counts['total'] / published['total'] - 1:+.1%} / "
            f"{counts['active'] / published['active'] - 1:+.1%}).",
        ]
    return "\n".join(lines)
