"""Memory per GPU for ``etude plan``: sharded state, FSDP buffers and activations.

Memory in the precisions real runs use, each a setting of ``PlanSettings``: sharded parameters
(``param_dtype``, bf16 by default) and gradients (``grad_dtype``, bf16), the optimizer's master
weights (``master_dtype``, fp32; ``none`` when the parameters are the master copy), optimizer
state (Muon: one momentum buffer; AdamW: two moments; ``optim_dtype``, fp32), FSDP buffers (the
unit in use and the one prefetched, plus one unit's unsharded gradients) and activations.

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

What this module does not model: routing imbalance, the optimizer's bucket workspace (a few
buckets of ``bucket_mb``), memory fragmentation, or the CUDA context and allocator reserve.
"""

from __future__ import annotations

from collections.abc import Sequence

from etude.model.config import ModelConfig
from etude.plan.layout import Layout
from etude.plan.settings import DTYPE_BYTES, PlanSettings
from etude.plan.sharding import ParamRecord, ParamShard


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


def memory_per_gpu(
    cfg: ModelConfig,
    records: Sequence[ParamRecord],
    shards: Sequence[ParamShard],
    layout: Layout,
    settings: PlanSettings,
) -> dict[str, int]:
    """Bytes per GPU of each part (parameters, master, gradients, optimizer, FSDP buffers,
    activations) and their total, on the fullest rank."""
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
