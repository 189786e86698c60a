"""Parameter counts of a model config, from a meta-device build (nothing is allocated).

``count_params(cfg)`` builds the real modules on the meta device and reads their shapes and
metadata, so the counts are the model's own, not a formula that could drift from it; the Kimi K2
shapes (1T parameters) take about a second. ``format_model_info(cfg)`` renders the counts as the
plain-text table printed by ``etude model info``.

Active parameters per token = everything except routed experts, plus top-k of E routed experts,
with the embedding table and the output head counted whole. Publishers differ on two points, so
the counts come in both ways (``counts_by_definition``):

- the input embedding: DeepSeek-V3's README_WEIGHTS.md counts 36.6B activated "including 0.9B
  for the output Head", i.e. without the input embedding (a row lookup, no multiply);
- a multi-token-prediction (MTP) module: DeepSeek-V3's 671B excludes its one MTP module (one more
  MoE layer plus a 2d -> d projection and three norms, sharing embedding and head; 685B on
  Hugging Face with it). ``mtp_module`` counts such a module for any config, shaped like the
  model's last layer.

With DeepSeek's definition (main model total; activated without the input embedding) the
``deepseek-v3`` preset gives 671.03B and 36.63B against the published 671B and 36.6B. The same
definition gives Kimi K2 1.026T (-1.3% from the technical report's 1.04T) and 31.69B activated
(-1.0% from the model card's 32B, -2.8% from the report's 32.6B); Kimi K2's total reaches 1.04T
only if an MTP module is counted, and its release has none (docs/checkpoints.md has the
arithmetic and what each definition meets). ``PUBLISHED`` holds the
figures and where they come from; ``format_model_info`` prints each definition against them.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Published:
    """A model's parameter counts as its publisher states them, with the sources."""

    name: str
    """Model name as published."""
    total: float
    """Total parameters of the main model as published."""
    actives: tuple[tuple[str, float], ...]
    """Activated parameters per token, (where stated, value), most precise first."""
    released_mtp_modules: int
    """Multi-token-prediction modules in the released checkpoint (``num_nextn_predict_layers``)."""
    checkpoint_total: float | None = None
    """Parameters of the released files where stated (MTP modules with their own copies of the
    embedding and head included)."""
    source: str
    """Where the figures come from, and what each one includes."""


PUBLISHED = {
    # README.md and README_WEIGHTS.md of deepseek-ai/DeepSeek-V3 (and the technical report,
    # arXiv 2412.19437): "Main Model Weights ... Total parameters: 671B; Activation
    # parameters: 36.6B (including 0.9B for the output Head)"; the MTP module "11.5B unique
    # parameters (excluding the shared 0.9B Embedding and 0.9B output Head)"; 685B on Hugging
    # Face = 671B + 14B of MTP weights; headline 671B total / 37B activated. (Another
    # revision of README_WEIGHTS.md says 36.7B "including 0.9B for Embedding and 0.9B for the
    # output Head"; the arithmetic gives 37.55B with the embedding, 36.63B without it.)
    "deepseek-v3": Published(
        name="DeepSeek-V3",
        total=671e9,
        actives=(("README_WEIGHTS.md", 36.6e9), ("headline", 37e9)),
        released_mtp_modules=1,
        checkpoint_total=685e9,
        source="DeepSeek-V3 README_WEIGHTS.md: main model 671B, activated 36.6B incl. the "
        "output head (not the input embedding); + 1 MTP module, 685B on Hugging Face",
    ),
    # Kimi K2 technical report (arXiv 2507.20534), Table 2 and section 2: 1.04T total, 32.6B
    # activated; model card of moonshotai/Kimi-K2-Instruct / Kimi-K2-Base: "1T total
    # parameters", "32B activated". The released config.json has num_nextn_predict_layers 0.
    "kimi-k2": Published(
        name="Kimi K2",
        total=1.04e12,
        actives=(("technical report", 32.6e9), ("model card", 32e9)),
        released_mtp_modules=0,
        source="Kimi K2 technical report (arXiv 2507.20534): 1.04T total, 32.6B activated; "
        "model card: 1T / 32B; the release has no MTP module",
    ),
}
"""Published counts of the presets that build a published architecture."""


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

    Returns a dict with ``total`` and ``active`` (ints; the embedding counted as active),
    ``active_without_embedding`` (DeepSeek's definition of activated), ``mtp_module``
    ({"total", "active"} of one DeepSeek-style multi-token-prediction module, not part of
    ``total``), ``by_part`` and ``active_by_part`` ({part: count} over ``PARTS``), ``by_kind``
    ({metadata kind: count}) and ``muon_blocks`` ({(m, n): number of Newton-Schulz blocks of
    that shape}).
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    meta = collect_param_meta(model)
    prefix = f"layers.{cfg.num_layers - 1}."

    def meta_kind(name: str) -> str:
        return meta[prefix + name].kind

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
    # One DeepSeek-style MTP module (DeepSeek-V3 README_WEIGHTS.md, technical report sec. 2.2):
    # enorm, hnorm, eh_proj [d, 2d], one transformer layer shaped like the last one, and the
    # shared head's norm; its embedding and output head are the main model's (not counted).
    last = model.layers[-1]
    layer_total = sum(p.numel() for p in last.parameters())
    layer_routed = sum(p.numel() for n, p in last.named_parameters() if meta_kind(n) == "experts")
    extra = 2 * cfg.dim * cfg.dim + 3 * cfg.dim
    layer_active = layer_total - layer_routed
    if layer_routed:
        layer_active += layer_routed // cfg.num_experts * cfg.num_experts_per_tok
    # the input embedding is a row lookup: with tied weights the table is the head, still used
    lookup_only = 0 if cfg.tie_embeddings else by_part["embedding"]
    return {
        "total": sum(by_part.values()),
        "active": sum(active_by_part.values()),
        "active_without_embedding": sum(active_by_part.values()) - lookup_only,
        "mtp_module": {"total": layer_total + extra, "active": layer_active + extra},
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


def published_of(cfg: ModelConfig) -> Published | None:
    """The published counts of the preset whose shapes ``cfg`` has, if any."""
    for name, published in PUBLISHED.items():
        reference = ModelConfig.preset(name)
        if all(getattr(cfg, f) == getattr(reference, f) for f in _SHAPE_FIELDS):
            return published
    return None


def counts_by_definition(counts: dict[str, Any]) -> dict[str, int]:
    """Totals and activated counts the ways publishers count them (see the module docstring)."""
    return {
        "total, main model": counts["total"],
        "total + 1 MTP module": counts["total"] + counts["mtp_module"]["total"],
        "activated, with input embedding": counts["active"],
        "activated, without it (DeepSeek)": counts["active_without_embedding"],
    }


def _published_lines(counts: dict[str, Any], published: Published) -> list[str]:
    """Each definition against the published figures; '*' marks a deviation within 1%."""

    def vs(ours: int, theirs: float) -> str:
        deviation = ours / theirs - 1
        return f"{deviation:+.1%}{'*' if abs(deviation) <= 0.01 else ' '} vs {_human(theirs)}"

    by_definition = counts_by_definition(counts)
    if published.checkpoint_total is not None:
        # the released files store the MTP modules' own copies of the embedding and head
        copies = counts["by_part"]["embedding"] + counts["by_part"]["head"]
        with_mtp = counts["mtp_module"]["total"] + copies
        by_definition["checkpoint files"] = (
            counts["total"] + published.released_mtp_modules * with_mtp
        )
    lines = ["", f"{published.name} as published; * = within 1%", f"  ({published.source})"]
    for label, ours in by_definition.items():
        if label == "checkpoint files":
            compared = [vs(ours, published.checkpoint_total)]
        elif label.startswith("total"):
            compared = [vs(ours, published.total)]
        else:
            compared = [f"{vs(ours, value)} ({where})" for where, value in published.actives]
        lines.append(f"  {label:<34}{_human(ours):>8}   " + ", ".join(compared))
    mtp = "module" if published.released_mtp_modules == 1 else "modules"
    lines.append(
        f"  the released checkpoint has {published.released_mtp_modules} MTP {mtp}; DeepSeek's "
        "definition is the main-model total and activated without the input embedding"
    )
    return lines


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
    lines += ["", "Counts by definition (docs/checkpoints.md)"]
    for label, value in counts_by_definition(counts).items():
        lines.append(f"  {label:<34}{value:>22,}{_human(value):>8}")
    mtp = counts["mtp_module"]
    lines.append(
        f"  (1 MTP module: one more layer like the last, eh_proj and norms: {mtp['total']:,} "
        f"total, {mtp['active']:,} activated)"
    )
    published = published_of(cfg)
    if published is not None:
        lines += _published_lines(counts, published)
    return "\n".join(lines)
