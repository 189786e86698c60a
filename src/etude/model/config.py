"""Model shapes: the `ModelConfig` dataclass and its named presets.

One config describes a decoder-only transformer of the Kimi K2 / DeepSeek-V3 family and its
relatives: attention is grouped-query (GQA, with optional per-head q/k RMSNorm, q/k/v biases and
partial rotary as Qwen3 and GLM-4 MoE use them) or multi-head latent attention (MLA, DeepSeek-V2/V3
and Kimi K2); RoPE is plain or YaRN-scaled; a few dense SwiGLU layers come first, then
mixture-of-experts layers (routed experts chosen top-k by a sigmoid or softmax router, optionally
group-limited, with aux-loss-free balancing, plus shared experts). ``num_experts = 0`` gives a
dense model (Llama, Qwen3).

Presets:
- ``tiny``: trains on 2 CPU cores in minutes (tests, the laptop demo);
- ``small``: a few times bigger, for CPU benchmarks and short GPU runs;
- ``kimi-k2``: the published Kimi K2 shapes (MLA, YaRN, 384 experts), for planning and parameter
  counts on the meta device;
- ``deepseek-v3``: the published DeepSeek-V3 shapes (MLA, YaRN, 256 experts in 8 groups).

What this module does not do: build modules (see ``etude.model.transformer``) or import torch;
configs are read and checked without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

PRESETS = ("micro", "tiny", "small", "kimi-k2", "deepseek-v3")
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
    """Key/value heads (grouped-query attention); must divide ``num_heads``; unused by MLA."""
    head_dim: int
    """Width of one attention head Dh (even: RoPE rotates pairs); unused by MLA."""
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
    attention: Literal["gqa", "mla"] = "gqa"
    """``gqa``: grouped-query attention; ``mla``: multi-head latent attention (DeepSeek-V2/V3)."""
    qk_norm: bool = False
    """GQA: RMSNorm over each query and key head before RoPE (Qwen3, GLM-4 MoE option)."""
    attention_bias: bool = False
    """GQA: biases on the q/k/v projections (GLM-4 MoE); the output projection has none."""
    rotary_dim: int = 0
    """GQA: RoPE on the first ``rotary_dim`` dims of each head only (partial rotary, GLM-4
    MoE); 0 rotates the whole head."""
    q_lora_rank: int = 0
    """MLA: rank of the query down-projection (q_a -> norm -> q_b); 0 projects queries directly."""
    kv_lora_rank: int = 0
    """MLA: width of the compressed key/value latent (what the KV cache stores)."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without positions."""
    qk_rope_head_dim: int = 0
    """MLA: width of the rotary query part per head and of the one rotary key shared by heads."""
    v_head_dim: int = 0
    """MLA: per-head value width."""
    rope_scaling: Literal["none", "yarn"] = "none"
    """``yarn``: YaRN context extension (Peng et al. 2023, arXiv:2309.00071) of the RoPE."""
    yarn_factor: float = 1.0
    """YaRN: context extension factor s."""
    yarn_original_max_seq_len: int = 4096
    """YaRN: context length the model was pretrained at."""
    yarn_beta_fast: float = 32.0
    """YaRN: rotations above which a frequency is kept (extrapolated)."""
    yarn_beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is fully interpolated."""
    yarn_mscale: float = 1.0
    """YaRN: ``mscale`` of the cos/sin scale ``m(s, mscale) / m(s, mscale_all_dim)``."""
    yarn_mscale_all_dim: float = 0.0
    """YaRN: ``mscale_all_dim``; MLA also multiplies its softmax scale by ``m(s, this)^2``
    (DeepSeek-V3); 0 leaves the softmax scale alone and makes the cos/sin scale ``m(s, 1)``."""
    router_num_groups: int = 1
    """Expert groups of group-limited routing (DeepSeek-V3 ``n_group``); 1: no groups."""
    router_topk_groups: int = 1
    """Groups a token may route into (``topk_group``), chosen by the sum of each group's top-2
    biased scores."""
    norm_topk_prob: bool = True
    """Normalize the top-k routing weights to sum 1 (before ``route_scale``)."""

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
        if self.attention == "gqa" and self.head_dim % 2:
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
        self._check_attention()
        self._check_rope_and_routing()
        rate = self.bias_update_rate
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not rate >= 0:
            raise ValueError(
                f"model.bias_update_rate must be a number >= 0 (0 disables balancing), got {rate!r}"
            )

    def _check_attention(self) -> None:
        for name in ("rotary_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"model.{name} must be a non-negative integer, got {value!r}")
        for name in ("qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"model.{name} must be a non-negative integer, got {value!r}")
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"model.attention must be 'gqa' or 'mla', got {self.attention!r}")
        if self.attention == "gqa":
            if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
                raise ValueError(
                    f"model.rotary_dim ({self.rotary_dim}) must be even and <= head_dim "
                    f"({self.head_dim}); 0 rotates the whole head"
                )
            return
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"model.{name} must be >= 1 with model.attention='mla', got "
                    f"{getattr(self, name)}; set the MLA shapes (see configs/kimi-k2.toml)"
                )
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"model.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even (RoPE rotates "
                "pairs)"
            )
        if self.qk_norm or self.attention_bias or self.rotary_dim:
            raise ValueError(
                "model.qk_norm, model.attention_bias and model.rotary_dim are GQA options; "
                "unset them with model.attention='mla'"
            )

    def _check_rope_and_routing(self) -> None:
        if self.rope_scaling not in ("none", "yarn"):
            raise ValueError(
                f"model.rope_scaling must be 'none' or 'yarn', got {self.rope_scaling!r}"
            )
        for name in ("yarn_factor", "yarn_beta_fast", "yarn_beta_slow"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"model.{name} must be a positive number, got {value!r}")
        for name in ("yarn_mscale", "yarn_mscale_all_dim"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"model.{name} must be a number >= 0, got {value!r}")
        if self.yarn_original_max_seq_len < 1:
            raise ValueError(
                f"model.yarn_original_max_seq_len must be >= 1, got "
                f"{self.yarn_original_max_seq_len}"
            )
        groups, topk_groups = self.router_num_groups, self.router_topk_groups
        for name, value in (("router_num_groups", groups), ("router_topk_groups", topk_groups)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.num_experts > 0 and groups > 1:
            if self.num_experts % groups:
                raise ValueError(
                    f"model.router_num_groups ({groups}) must divide model.num_experts "
                    f"({self.num_experts})"
                )
            if topk_groups > groups:
                raise ValueError(
                    f"model.router_topk_groups ({topk_groups}) must be <= router_num_groups "
                    f"({groups})"
                )
            if self.num_experts_per_tok > topk_groups * (self.num_experts // groups):
                raise ValueError(
                    f"model.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts "
                    f"of {topk_groups} groups; raise router_topk_groups"
                )
            if self.num_experts // groups < 2:
                raise ValueError(
                    "group-limited routing scores a group by its top-2 experts: each of the "
                    f"{groups} groups needs >= 2 experts; lower model.router_num_groups"
                )

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates per head: MLA's rotary part, the partial width or the whole head."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return self.rotary_dim or self.head_dim

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


_TINY: dict[str, Any] = dict(
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
)

_PRESET_FIELDS: dict[str, dict[str, Any]] = {
    # the smallest model with every part (a dense layer, routed experts, grouped-query attention):
    # for tests and smoke runs of the machinery, not for learning anything; "tiny" scaled down
    "micro": {
        **_TINY,
        "vocab_size": 512,
        "dim": 32,
        "num_layers": 2,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 16,
        "dense_ffn_dim": 64,
        "num_experts": 4,
        "expert_ffn_dim": 32,
    },
    "tiny": _TINY,
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
    # Kimi K2 (moonshotai/Kimi-K2-Base config.json): 61 layers, first one dense, MLA with 64
    # heads (q rank 1536, kv rank 512, 128 + 64 query/key dims, 128 value dims), YaRN x32 over
    # 4096 pretrained positions, 384 routed experts top-8 in one group plus 1 shared, sigmoid
    # router with routed_scaling_factor 2.827, RoPE base 50000.
    "kimi-k2": dict(
        vocab_size=163840,
        dim=7168,
        num_layers=61,
        num_heads=64,
        num_kv_heads=64,
        head_dim=192,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_scaling="yarn",
        yarn_factor=32.0,
        yarn_original_max_seq_len=4096,
        yarn_beta_fast=1.0,
        yarn_beta_slow=1.0,
        yarn_mscale=1.0,
        yarn_mscale_all_dim=1.0,
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
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): 61 layers, first three dense, MLA with
    # 128 heads, YaRN x40 over 4096 positions, 256 routed experts top-8 in 8 groups (top-4
    # groups) plus 1 shared, routed_scaling_factor 2.5, RoPE base 10000.
    "deepseek-v3": dict(
        vocab_size=129280,
        dim=7168,
        num_layers=61,
        num_heads=128,
        num_kv_heads=128,
        head_dim=192,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_scaling="yarn",
        yarn_factor=40.0,
        yarn_original_max_seq_len=4096,
        yarn_beta_fast=32.0,
        yarn_beta_slow=1.0,
        yarn_mscale=1.0,
        yarn_mscale_all_dim=1.0,
        dense_ffn_dim=18432,
        num_dense_layers=3,
        num_experts=256,
        num_experts_per_tok=8,
        expert_ffn_dim=2048,
        num_shared_experts=1,
        router_num_groups=8,
        router_topk_groups=4,
        route_scale=2.5,
        bias_update_rate=1e-3,
        rope_theta=10000.0,
        norm_eps=1e-6,
        max_seq_len=163840,
        init_std=0.006,
    ),
}
assert tuple(_PRESET_FIELDS) == PRESETS
