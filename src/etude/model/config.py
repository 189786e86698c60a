"""Model shapes: the `ModelConfig` dataclass and its named presets.

One config describes a decoder-only transformer of the Kimi K2 family: grouped-query attention
with RoPE, a few dense SwiGLU layers first, then mixture-of-experts layers (routed experts chosen
top-k by a sigmoid router with aux-loss-free balancing, plus shared experts).

Presets:
- ``tiny``: trains on 2 CPU cores in minutes (tests, the laptop demo);
- ``small``: a few times bigger, for CPU benchmarks and short GPU runs;
- ``kimi-k2``: the published Kimi K2 shapes, for planning and parameter counts on the meta device.
  Kimi K2 uses multi-head latent attention (MLA); this model has grouped-query attention (GQA)
  in its place, so the attention share of any count for this preset is an approximation
  (GQA with 8 KV heads holds ~132M parameters per layer where MLA holds ~101M).

What this module does not do: build modules (see ``etude.model.transformer``) or import torch;
configs are read and checked without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

PRESETS = ("tiny", "small", "kimi-k2")
"""Names accepted by ``ModelConfig.preset``."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shapes and hyperparameters of the MoE transformer."""

    vocab_size: int
    """Number of token ids (rows of the embedding, columns of the logits)."""
    dim: int
    """Model width D (residual stream)."""
    num_layers: int
    """Number of transformer blocks."""
    num_heads: int
    """Query heads H."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    head_dim: int
    """Width of one attention head Dh (even: RoPE rotates pairs)."""
    dense_ffn_dim: int
    """Hidden width of the dense SwiGLU FFN of the first ``num_dense_layers`` layers."""
    num_dense_layers: int
    """How many leading layers use a dense FFN instead of a mixture of experts."""
    num_experts: int
    """Routed experts per MoE layer; 0 makes every layer dense (MoE fields are then unused)."""
    num_experts_per_tok: int
    """Routed experts each token is sent to (top-k)."""
    expert_ffn_dim: int
    """Hidden width of one expert's SwiGLU FFN (also of each shared expert)."""
    num_shared_experts: int
    """Shared experts every token passes through (fused into one FFN); 0 for none."""
    router_score: Literal["sigmoid", "softmax"] = "sigmoid"
    """Router score function; top-k weights are normalized to sum 1 either way."""
    route_scale: float = 1.0
    """Factor on the normalized routing weights (Kimi K2: 2.827)."""
    bias_update_rate: float = 1e-3
    """Step of the aux-loss-free balancing update of each router's selection bias."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-6
    """Epsilon of RMSNorm."""
    max_seq_len: int = 512
    """Longest sequence the model is trained and used on (generation cache bound)."""
    init_std: float = 0.02
    """Standard deviation of the normal init of every weight matrix."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        positive += ("max_seq_len",)
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        for name in ("num_dense_layers", "num_experts", "num_experts_per_tok"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"model.{name} must be a non-negative integer, got {value!r}")
        for name in ("dense_ffn_dim", "expert_ffn_dim", "num_shared_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"model.{name} must be a non-negative integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads "
                f"({self.num_kv_heads}); set num_kv_heads to a divisor of num_heads"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"model.head_dim ({self.head_dim}) must be even (RoPE rotates pairs); "
                "set an even head_dim"
            )
        if self.num_dense_layers > self.num_layers:
            raise ValueError(
                f"model.num_dense_layers ({self.num_dense_layers}) must be <= model.num_layers "
                f"({self.num_layers}); lower num_dense_layers or add layers"
            )
        if self.num_moe_layers < self.num_layers and self.dense_ffn_dim < 1:
            raise ValueError(
                f"model.dense_ffn_dim must be >= 1 when the model has dense layers, got "
                f"{self.dense_ffn_dim}; set dense_ffn_dim (e.g. 3 * dim)"
            )
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"model.num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 "
                    f"and model.num_experts ({self.num_experts}); set a top-k in that range"
                )
            if self.expert_ffn_dim < 1:
                raise ValueError(
                    f"model.expert_ffn_dim must be >= 1 when num_experts > 0, got "
                    f"{self.expert_ffn_dim}; set the hidden width of one expert"
                )
        if self.router_score not in ("sigmoid", "softmax"):
            raise ValueError(
                f"model.router_score must be 'sigmoid' or 'softmax', got {self.router_score!r}"
            )
        for name in ("route_scale", "rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"model.{name} must be a positive number, got {value!r}")
        rate = self.bias_update_rate
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not rate >= 0:
            raise ValueError(
                f"model.bias_update_rate must be a number >= 0 (0 disables balancing), got {rate!r}"
            )

    @property
    def num_moe_layers(self) -> int:
        """Layers whose FFN is a mixture of experts."""
        return 0 if self.num_experts == 0 else self.num_layers - self.num_dense_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether block ``layer_idx`` has a MoE FFN (dense layers come first)."""
        return self.num_experts > 0 and layer_idx >= self.num_dense_layers

    @staticmethod
    def preset(name: str, **overrides: Any) -> ModelConfig:
        """A named preset (see ``PRESETS``) with fields replaced by ``overrides``."""
        if name not in _PRESET_FIELDS:
            raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(
                f"unknown ModelConfig field {unknown[0]!r} in preset overrides; valid fields: "
                f"{', '.join(sorted(fields))}"
            )
        return ModelConfig(**{**_PRESET_FIELDS[name], **overrides})


_PRESET_FIELDS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=2048,
        dim=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        dense_ffn_dim=384,
        num_dense_layers=1,
        num_experts=8,
        num_experts_per_tok=2,
        expert_ffn_dim=128,
        num_shared_experts=1,
        route_scale=1.0,
        bias_update_rate=1e-3,
        rope_theta=10000.0,
        norm_eps=1e-6,
        max_seq_len=512,
        init_std=0.02,
    ),
    "small": dict(
        vocab_size=8192,
        dim=256,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        dense_ffn_dim=768,
        num_dense_layers=1,
        num_experts=16,
        num_experts_per_tok=2,
        expert_ffn_dim=256,
        num_shared_experts=1,
        route_scale=1.0,
        bias_update_rate=1e-3,
        rope_theta=10000.0,
        norm_eps=1e-6,
        max_seq_len=1024,
        init_std=0.02,
    ),
    # Kimi K2 (moonshotai/Kimi-K2-Base config): 61 layers, first one dense, 384 routed experts
    # top-8 plus 1 shared, sigmoid router with routed_scaling_factor 2.827, RoPE base 50000 (its
    # YaRN context extension is not modelled). Attention is MLA there; here GQA with 64 query and
    # 8 KV heads of width 128 stands in.
    "kimi-k2": dict(
        vocab_size=163840,
        dim=7168,
        num_layers=61,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        dense_ffn_dim=18432,
        num_dense_layers=1,
        num_experts=384,
        num_experts_per_tok=8,
        expert_ffn_dim=2048,
        num_shared_experts=1,
        route_scale=2.827,
        bias_update_rate=1e-3,
        rope_theta=50000.0,
        norm_eps=1e-6,
        max_seq_len=131072,
        init_std=0.006,
    ),
}
assert tuple(_PRESET_FIELDS) == PRESETS
