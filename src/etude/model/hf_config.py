"""Hugging Face ``config.json`` <-> `ModelConfig`, per architecture.

Architectures (the ``architectures[0]`` name that ``transformers`` and vLLM dispatch on):

| family        | architecture            | attention                 | FFN                               |
| ------------- | ----------------------- | ------------------------- | --------------------------------- |
| ``deepseek_v3`` | DeepseekV3ForCausalLM (also Kimi K2) | MLA, YaRN, interleaved RoPE | sigmoid + bias, groups, shared |
| ``glm4_moe``  | Glm4MoeForCausalLM      | GQA, q/k/v bias, partial rotary, optional q/k norm | as DeepSeek-V3 |
| ``qwen3_moe`` | Qwen3MoeForCausalLM     | GQA + q/k norm            | softmax top-k, no shared experts  |
| ``qwen3``     | Qwen3ForCausalLM        | GQA + q/k norm            | dense SwiGLU                      |
| ``llama``     | LlamaForCausalLM        | GQA                       | dense SwiGLU                      |

etude's own models (GQA + sigmoid router + shared experts) export as ``glm4_moe`` with full
rotary and no biases; `family_of` picks the family a `ModelConfig` exports as.

Every key of an imported ``config.json`` is either mapped, checked to have the one value etude
supports (``hidden_act = "silu"``, no sliding window, ...), or on a short list of keys that do
not change the network (token ids, dtype, init range, dropout at 0, ...). Anything else raises
``ValueError`` naming the key: a field etude does not know could change the model, and a
silently wrong import is worse than none. RoPE settings are read from ``rope_parameters``
(transformers >= 5) or ``rope_theta`` + ``rope_scaling`` (older checkpoints, e.g. the published
DeepSeek-V3 and Kimi K2).

Not here: tensors (``etude.model.hf_adapter``), tokenizers (``etude.model.hf_tokenizer``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from etude.model.config import ModelConfig

FAMILIES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}
"""Supported families and the architecture name each one is written with."""

_MODEL_TYPES = {"deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3"}

_HARMLESS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "_name_or_path",
    "auto_map", "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux",
    "ep_size", "num_nextn_predict_layers", "head_dim", "qk_head_dim", "max_window_layers",
    "sliding_window", "tokenizer_class", "output_attentions", "output_hidden_states",
    "return_dict", "id2label", "label2id", "quantization_config", "rope_theta", "rope_scaling",
    "rope_parameters", "partial_rotary_factor", "num_local_experts",
}  # fmt: skip
"""Keys that carry no network shape (or are read separately below)."""


def _fail(key: str, value: Any, want: str) -> ValueError:
    return ValueError(
        f"config.json: {key}={value!r} is not supported by etude ({want}); only checkpoints "
        "whose networks etude computes exactly are imported"
    )


def family_from_hf(config: dict[str, Any]) -> str:
    """The family of a ``config.json`` (by ``model_type``, checked against ``architectures``)."""
    model_type = config.get("model_type")
    family = _MODEL_TYPES.get(model_type, model_type)
    if family not in FAMILIES:
        raise ValueError(
            f"config.json: model_type={model_type!r} is not supported; etude imports "
            f"{', '.join(sorted(FAMILIES))} (and kimi_k2)"
        )
    arch = (config.get("architectures") or [FAMILIES[family]])[0]
    if arch != FAMILIES[family]:
        raise ValueError(
            f"config.json: architectures[0]={arch!r} does not match model_type {model_type!r} "
            f"(expected {FAMILIES[family]})"
        )
    return family


def _rope(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ModelConfig RoPE fields, the rope dict) from either config layout."""
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    if legacy:
        params = {**legacy, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = config.get("rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(params["rope_theta"])}
    known = {"rope_theta", "rope_type", "type", "partial_rotary_factor"}
    if kind == "yarn":
        known |= {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}
        known |= {"mscale", "mscale_all_dim", "truncate"}
        if params.get("attention_factor") is not None:
            raise _fail("rope_parameters.attention_factor", params["attention_factor"], "derived")
        if params.get("truncate", True) is not True:
            raise _fail("rope_parameters.truncate", params["truncate"], "only truncate=true")
        out.update(
            rope_scaling="yarn",
            yarn_factor=float(params["factor"]),
            yarn_original_max_seq_len=int(params["original_max_position_embeddings"]),
            yarn_beta_fast=float(params.get("beta_fast") or 32.0),
            yarn_beta_slow=float(params.get("beta_slow") or 1.0),
            yarn_mscale=float(params.get("mscale") or 0.0),
            yarn_mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        )
    elif kind != "default":
        raise _fail("rope_parameters.rope_type", kind, "default or yarn")
    extra = sorted(set(params) - known)
    if extra:
        raise _fail(f"rope_parameters.{extra[0]}", params[extra[0]], "unknown RoPE setting")
    return out, params


def model_config_from_hf(config: dict[str, Any], **overrides: Any) -> tuple[ModelConfig, str]:
    """(`ModelConfig`, family) of a Hugging Face ``config.json`` dict; ``ValueError`` on any key
    etude does not support. ``overrides`` replace fields (e.g. ``max_seq_len``)."""
    family = family_from_hf(config)
    used: set[str] = set()

    def get(key: str, default: Any = dataclasses.MISSING) -> Any:
        used.add(key)
        if key in config:
            return config[key]
        if default is dataclasses.MISSING:
            raise ValueError(f"config.json has no {key!r}, which {FAMILIES[family]} needs")
        return default

    def require(key: str, allowed: tuple[Any, ...], default: Any) -> None:
        value = get(key, default)
        if value not in allowed:
            raise _fail(key, value, f"must be {' or '.join(repr(a) for a in allowed)}")

    require("hidden_act", ("silu",), "silu")
    require("attention_dropout", (0, 0.0), 0.0)
    require("pretraining_tp", (1,), 1)
    require("use_sliding_window", (False,), False)
    require("mlp_bias", (False,), False)
    layer_types = get("layer_types", None)
    if layer_types is not None and set(layer_types) - {"full_attention"}:
        raise _fail("layer_types", sorted(set(layer_types)), "full_attention only")
    rope, rope_params = _rope(config)
    num_heads = get("num_attention_heads")
    dim = get("hidden_size")
    fields: dict[str, Any] = dict(
        vocab_size=get("vocab_size"),
        dim=dim,
        num_layers=get("num_hidden_layers"),
        num_heads=num_heads,
        max_seq_len=get("max_position_embeddings"),
        norm_eps=float(get("rms_norm_eps")),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        **rope,
    )
    if family == "deepseek_v3":
        require("attention_bias", (False,), False)
        require("scoring_func", ("sigmoid",), "sigmoid")
        require("topk_method", ("noaux_tc",), "noaux_tc")
        require("moe_layer_freq", (1,), 1)
        require("rope_interleave", (True, False), True)
        num_kv = get("num_key_value_heads", num_heads)
        if num_kv not in (None, num_heads):
            raise _fail("num_key_value_heads", num_kv, f"MLA has one key per head ({num_heads})")
        nope, rope_dim = get("qk_nope_head_dim"), get("qk_rope_head_dim")
        fields.update(
            attention="mla",
            num_kv_heads=num_heads,
            head_dim=nope + rope_dim,
            q_lora_rank=get("q_lora_rank", None) or 0,
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=get("v_head_dim"),
        )
    else:
        head_dim = get("head_dim", None) or dim // num_heads
        fields.update(num_kv_heads=get("num_key_value_heads", num_heads), head_dim=head_dim)
        if family == "llama":
            require("attention_bias", (False,), False)
        elif family in ("qwen3", "qwen3_moe"):
            require("attention_bias", (False,), False)
            fields["qk_norm"] = True
        else:  # glm4_moe: q/k/v biases, partial rotary, optional q/k norm
            fields["attention_bias"] = bool(get("attention_bias", False))
            fields["qk_norm"] = bool(get("use_qk_norm", False))
            partial = rope_params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
            partial = 0.5 if partial is None else float(partial)
            rotary = int(head_dim * partial)
            fields["rotary_dim"] = 0 if rotary == head_dim else rotary
    if family in ("deepseek_v3", "glm4_moe"):
        fields.update(
            dense_ffn_dim=get("intermediate_size"),
            num_dense_layers=get("first_k_dense_replace", 0),
            num_experts=get("n_routed_experts"),
            num_experts_per_tok=get("num_experts_per_tok"),
            expert_ffn_dim=get("moe_intermediate_size"),
            num_shared_experts=get("n_shared_experts", 0) or 0,
            router_score="sigmoid",
            route_scale=float(get("routed_scaling_factor", 1.0)),
            router_num_groups=get("n_group", None) or 1,
            router_topk_groups=get("topk_group", None) or 1,
            norm_topk_prob=bool(get("norm_topk_prob", True)),
        )
    elif family == "qwen3_moe":
        require("decoder_sparse_step", (1,), 1)
        num_layers = fields["num_layers"]
        dense = sorted(get("mlp_only_layers", []) or [])
        if dense != list(range(len(dense))):
            raise _fail("mlp_only_layers", dense, "dense layers must come first: [0, 1, ..., k-1]")
        num_experts = config.get("num_experts", config.get("num_local_experts"))
        used.add("num_experts")
        if num_experts is None:
            raise ValueError("config.json has no 'num_experts', which Qwen3MoeForCausalLM needs")
        fields.update(
            dense_ffn_dim=get("intermediate_size"),
            num_dense_layers=min(len(dense), num_layers),
            num_experts=num_experts,
            num_experts_per_tok=get("num_experts_per_tok"),
            expert_ffn_dim=get("moe_intermediate_size"),
            num_shared_experts=0,
            router_score="softmax",
            norm_topk_prob=bool(get("norm_topk_prob", False)),
        )
    else:
        fields.update(
            dense_ffn_dim=get("intermediate_size"),
            num_dense_layers=fields["num_layers"],
            num_experts=0,
            num_experts_per_tok=0,
            expert_ffn_dim=0,
            num_shared_experts=0,
        )
    unknown = sorted(set(config) - used - _HARMLESS)
    if unknown:
        raise ValueError(
            f"config.json: unknown or unsupported key {unknown[0]!r} (value "
            f"{config[unknown[0]]!r}) for {FAMILIES[family]}; etude cannot tell whether it "
            "changes the network, so the import stops here"
        )
    return ModelConfig(**{**fields, **overrides}), family


def family_of(cfg: ModelConfig) -> str:
    """The family a `ModelConfig` exports as (``ValueError`` if none computes it exactly)."""
    if cfg.attention == "mla":
        if cfg.num_experts == 0 or cfg.router_score != "sigmoid":
            raise ValueError(
                "an MLA model exports as DeepseekV3ForCausalLM, which needs a sigmoid-routed "
                "MoE (model.num_experts > 0, model.router_score = 'sigmoid')"
            )
        return "deepseek_v3"
    if cfg.num_experts == 0:
        if cfg.attention_bias or cfg.rotary_dim:
            raise ValueError(
                "a dense model with model.attention_bias or model.rotary_dim has no Hugging "
                "Face family in etude; unset them"
            )
        return "qwen3" if cfg.qk_norm else "llama"
    if cfg.router_score == "softmax":
        if cfg.num_shared_experts or cfg.attention_bias or cfg.rotary_dim or not cfg.qk_norm:
            raise ValueError(
                "a softmax-routed MoE exports as Qwen3MoeForCausalLM, which has q/k norms and no "
                "shared experts, biases or partial rotary; set model.qk_norm = true, "
                "num_shared_experts = 0, attention_bias = false, rotary_dim = 0"
            )
        return "qwen3_moe"
    return "glm4_moe"


def _rope_parameters(cfg: ModelConfig, family: str) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling == "yarn":
        params.update(
            rope_type="yarn",
            factor=cfg.yarn_factor,
            original_max_position_embeddings=cfg.yarn_original_max_seq_len,
            beta_fast=cfg.yarn_beta_fast,
            beta_slow=cfg.yarn_beta_slow,
            mscale=cfg.yarn_mscale,
            mscale_all_dim=cfg.yarn_mscale_all_dim,
        )
    if family == "glm4_moe":
        params["partial_rotary_factor"] = cfg.rope_dim / cfg.head_dim
    return params


def hf_config_from_model(cfg: ModelConfig, family: str | None = None) -> dict[str, Any]:
    """The ``config.json`` dict of a `ModelConfig` (family: `family_of` unless given)."""
    family = family or family_of(cfg)
    out: dict[str, Any] = {
        "architectures": [FAMILIES[family]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "intermediate_size": cfg.dense_ffn_dim,
        "rope_parameters": _rope_parameters(cfg, family),
        "torch_dtype": "float32",
    }
    if family == "deepseek_v3":
        out.update(
            num_key_value_heads=cfg.num_heads,
            q_lora_rank=cfg.q_lora_rank or None,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            attention_bias=False,
            rope_interleave=True,
            num_nextn_predict_layers=0,
        )
    else:
        out.update(num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        out["attention_bias"] = cfg.attention_bias
    if family == "glm4_moe":
        out["use_qk_norm"] = cfg.qk_norm
        out["num_nextn_predict_layers"] = 0
    if family in ("deepseek_v3", "glm4_moe"):
        out.update(
            first_k_dense_replace=cfg.num_dense_layers,
            n_routed_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.expert_ffn_dim,
            n_shared_experts=cfg.num_shared_experts,
            routed_scaling_factor=cfg.route_scale,
            n_group=cfg.router_num_groups,
            topk_group=cfg.router_topk_groups,
            norm_topk_prob=cfg.norm_topk_prob,
        )
    elif family == "qwen3_moe":
        out.update(
            decoder_sparse_step=1,
            mlp_only_layers=list(range(cfg.num_dense_layers)),
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.expert_ffn_dim,
            norm_topk_prob=cfg.norm_topk_prob,
        )
    return out
