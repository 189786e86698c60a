"""The state-dict adapter between Hugging Face checkpoints and etude's modules.

This is the only place that knows Hugging Face tensor names. For each HF tensor, `to_etude`
says which etude parameter (or buffer) it fills, where (an expert slot along dim 0 of a stacked
expert weight, or the whole tensor), and how it changes on the way:

- names: ``model.layers.{i}.self_attn.*`` -> ``layers.{i}.attention.*``, ``mlp`` -> ``ffn``,
  ``gate_proj/up_proj/down_proj`` -> ``w1/w3/w2``, ``mlp.gate`` -> ``ffn.router.gate``,
  ``e_score_correction_bias`` -> ``ffn.router.expert_bias``, ``kv_a_proj_with_mqa`` ->
  ``kv_a_proj``, ``*_layernorm`` (MLA) -> ``*_norm``, embeddings, final norm and head;
- transposes: per-expert ``gate_proj``/``up_proj`` [F, D] become rows ``w1[e]``/``w3[e]`` [D, F]
  and ``down_proj`` [D, F] becomes ``w2[e]`` [F, D] (etude stacks experts as ``x @ w``);
- RoPE permutation: DeepSeek-V3/Kimi K2 checkpoints rotate interleaved pairs; the rotary rows of
  every query head (``q_proj``/``q_b_proj``) and the shared rotary key rows of
  ``kv_a_proj_with_mqa`` are permuted evens-then-odds so etude's rotate-half RoPE computes the
  same attention (``etude.model.rope``); export applies the inverse;
- FP8 block dequantization: a ``float8_e4m3fn`` weight with a ``weight_scale_inv`` tensor of
  [ceil(rows/b), ceil(cols/b)] per-block scales (DeepSeek-V3's format, b = 128 by default) is
  ``w = fp8 * scale`` per block (`dequantize_fp8_blocks`).

Tensors with no counterpart are skipped by rule and reported: multi-token-prediction layers
(index >= ``num_hidden_layers``) and ``rotary_emb.inv_freq`` buffers. Any other unknown name is a
``ValueError``.

Not here: reading files or placing tensors on ranks (``etude.parallel.checkpoint``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from etude.model.config import ModelConfig
from etude.model.rope import half_to_interleaved, interleaved_to_half

FP8_BLOCK = 128
"""Default block edge of DeepSeek-V3's FP8 weights (``weight_block_size = [128, 128]``)."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where one HF tensor goes: an etude name and an optional expert slot along dim 0."""

    name: str
    expert: int | None = None
    transpose: bool = False
    rope_rows: str = ""
    """``q``: permute each head's rotary rows; ``kv_a``: permute the shared key's rows."""


_ATTN_GQA = {
    "q_proj.weight": "q_proj.weight",
    "k_proj.weight": "k_proj.weight",
    "v_proj.weight": "v_proj.weight",
    "o_proj.weight": "o_proj.weight",
    "q_proj.bias": "q_proj.bias",
    "k_proj.bias": "k_proj.bias",
    "v_proj.bias": "v_proj.bias",
    "q_norm.weight": "q_norm.weight",
    "k_norm.weight": "k_norm.weight",
}
_ATTN_MLA = {
    "q_proj.weight": "q_proj.weight",
    "q_a_proj.weight": "q_a_proj.weight",
    "q_a_layernorm.weight": "q_a_norm.weight",
    "q_b_proj.weight": "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight": "kv_a_proj.weight",
    "kv_a_layernorm.weight": "kv_a_norm.weight",
    "kv_b_proj.weight": "kv_b_proj.weight",
    "o_proj.weight": "o_proj.weight",
}
_FFN = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "weight_scale_inv", "activation_scale")


def target_of(cfg: ModelConfig, hf_name: str) -> Target | None:
    """Where ``hf_name`` goes in etude; None for a tensor skipped by rule (see module doc)."""
    if hf_name.endswith(_SKIPPED_SUFFIXES):
        return None
    if hf_name == "model.embed_tokens.weight":
        return Target("tok_embeddings.weight")
    if hf_name == "model.norm.weight":
        return Target("norm.weight")
    if hf_name == "lm_head.weight":
        return None if cfg.tie_embeddings else Target("output.weight")
    match = _LAYER.fullmatch(hf_name)
    if match is None:
        raise ValueError(f"checkpoint tensor {hf_name!r} has no counterpart in etude's model")
    layer, rest = int(match.group(1)), match.group(2)
    if layer >= cfg.num_layers:
        return None  # multi-token prediction modules follow the decoder layers
    prefix = f"layers.{layer}."
    if rest == "input_layernorm.weight":
        return Target(prefix + "attention_norm.weight")
    if rest == "post_attention_layernorm.weight":
        return Target(prefix + "ffn_norm.weight")
    if rest.startswith("self_attn."):
        table = _ATTN_MLA if cfg.attention == "mla" else _ATTN_GQA
        key = rest[len("self_attn.") :]
        if key in table:
            rope = ""
            if cfg.attention == "mla" and key in ("q_proj.weight", "q_b_proj.weight"):
                rope = "q"
            elif cfg.attention == "mla" and key == "kv_a_proj_with_mqa.weight":
                rope = "kv_a"
            return Target(prefix + "attention." + table[key], rope_rows=rope)
    elif rest.startswith("mlp."):
        moe = cfg.is_moe_layer(layer)
        expert = _EXPERT.fullmatch(rest)
        if moe and expert is not None:
            index, kind = int(expert.group(1)), expert.group(2)
            if index < cfg.num_experts:
                return Target(prefix + f"ffn.experts.{_FFN[kind]}", expert=index, transpose=True)
        if moe and rest == "mlp.gate.weight":
            return Target(prefix + "ffn.router.gate.weight")
        if moe and rest == "mlp.gate.e_score_correction_bias":
            return Target(prefix + "ffn.router.expert_bias")
        shared = re.fullmatch(r"mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight", rest)
        if moe and shared is not None and cfg.num_shared_experts:
            return Target(prefix + f"ffn.shared_experts.{_FFN[shared.group(1)]}.weight")
        dense = re.fullmatch(r"mlp\.(gate_proj|up_proj|down_proj)\.weight", rest)
        if not moe and dense is not None:
            return Target(prefix + f"ffn.{_FFN[dense.group(1)]}.weight")
    raise ValueError(
        f"checkpoint tensor {hf_name!r} has no counterpart in etude's model for this config "
        f"(layer {layer} is {'MoE' if cfg.is_moe_layer(layer) else 'dense'})"
    )


def _rope_row_order(cfg: ModelConfig, rope_rows: str, num_rows: int, to_half: bool) -> Tensor:
    """Row index vector that permutes the rotary rows of a q or kv_a projection."""
    R = cfg.qk_rope_head_dim
    perm = interleaved_to_half(R) if to_half else half_to_interleaved(R)
    order = torch.arange(num_rows)
    if rope_rows == "kv_a":
        start = cfg.kv_lora_rank
        order[start : start + R] = start + torch.tensor(perm)
        return order
    per_head = cfg.qk_nope_head_dim + R
    assert num_rows == cfg.num_heads * per_head, (num_rows, cfg.num_heads, per_head)
    for h in range(cfg.num_heads):
        start = h * per_head + cfg.qk_nope_head_dim
        order[start : start + R] = start + torch.tensor(perm)
    return order


def to_etude(
    cfg: ModelConfig, target: Target, tensor: Tensor, *, rope_interleave: bool = True
) -> Tensor:
    """An HF tensor in etude's layout (transposed, RoPE rows permuted), same dtype."""
    if target.rope_rows and rope_interleave:
        tensor = tensor[_rope_row_order(cfg, target.rope_rows, tensor.shape[0], to_half=True)]
    if target.transpose:
        tensor = tensor.mT
    return tensor.contiguous()


def from_etude(cfg: ModelConfig, target: Target, tensor: Tensor) -> Tensor:
    """Inverse of `to_etude` (export writes interleaved RoPE rows for MLA checkpoints)."""
    if target.transpose:
        tensor = tensor.mT
    if target.rope_rows:
        tensor = tensor[_rope_row_order(cfg, target.rope_rows, tensor.shape[0], to_half=False)]
    return tensor.contiguous()


def hf_names(cfg: ModelConfig) -> Iterator[tuple[str, Target]]:
    """Every HF tensor name of a model with config ``cfg`` and its etude target, in order."""
    yield "model.embed_tokens.weight", Target("tok_embeddings.weight")
    for layer in range(cfg.num_layers):
        hf, et = f"model.layers.{layer}.", f"layers.{layer}."
        yield hf + "input_layernorm.weight", Target(et + "attention_norm.weight")
        if cfg.attention == "mla":
            keys = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight"]
            keys += ["o_proj.weight"]
            if cfg.q_lora_rank:
                keys = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", *keys]
            else:
                keys = ["q_proj.weight", *keys]
        else:
            keys = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
            if cfg.attention_bias:
                keys += ["q_proj.bias", "k_proj.bias", "v_proj.bias"]
            if cfg.qk_norm:
                keys += ["q_norm.weight", "k_norm.weight"]
        for key in keys:
            name = hf + "self_attn." + key
            target = target_of(cfg, name)
            assert target is not None
            yield name, target
        yield hf + "post_attention_layernorm.weight", Target(et + "ffn_norm.weight")
        if not cfg.is_moe_layer(layer):
            for kind, ours in _FFN.items():
                yield hf + f"mlp.{kind}.weight", Target(et + f"ffn.{ours}.weight")
            continue
        yield hf + "mlp.gate.weight", Target(et + "ffn.router.gate.weight")
        if cfg.router_score == "sigmoid":
            yield hf + "mlp.gate.e_score_correction_bias", Target(et + "ffn.router.expert_bias")
        for e in range(cfg.num_experts):
            for kind, ours in _FFN.items():
                yield (
                    hf + f"mlp.experts.{e}.{kind}.weight",
                    Target(et + f"ffn.experts.{ours}", expert=e, transpose=True),
                )
        if cfg.num_shared_experts:
            for kind, ours in _FFN.items():
                yield (
                    hf + f"mlp.shared_experts.{kind}.weight",
                    Target(et + f"ffn.shared_experts.{ours}.weight"),
                )
    yield "model.norm.weight", Target("norm.weight")
    if not cfg.tie_embeddings:
        yield "lm_head.weight", Target("output.weight")


def dequantize_fp8_blocks(
    weight: Tensor, scale_inv: Tensor, dtype: torch.dtype, block: tuple[int, int] = (128, 128)
) -> Tensor:
    """``weight * scale_inv`` per block: an fp8 [M, N] weight with [ceil(M/b0), ceil(N/b1)]
    scales (``block`` = the config's ``weight_block_size``; the last blocks may be partial)."""
    rows, cols = weight.shape
    block_r, block_c = block
    if scale_inv.shape != (-(-rows // block_r), -(-cols // block_c)):
        raise ValueError(
            f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not tile a weight of "
            f"shape {tuple(weight.shape)} into {block_r} x {block_c} blocks "
            "(quantization_config.weight_block_size)"
        )
    scale = scale_inv.float().repeat_interleave(block_r, 0)[:rows]
    scale = scale.repeat_interleave(block_c, 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def quantize_fp8_blocks(weight: Tensor, block: int = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """(fp8 e4m3 weight, fp32 ``weight_scale_inv``): per block ``scale = amax / 448``, as
    DeepSeek-V3's FP8 checkpoints store it (what the tests write FP8 checkpoints with)."""
    rows, cols = weight.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = weight.float().new_zeros(nr * block, nc * block)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(nr, block, nc, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    quant = (blocks / scale_inv[:, None, :, None]).view(nr * block, nc * block)[:rows, :cols]
    return quant.to(torch.float8_e4m3fn), scale_inv
