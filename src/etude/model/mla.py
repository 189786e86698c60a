"""Multi-head latent attention (MLA, DeepSeek-V2 arXiv:2405.04434 sec. 2.1; DeepSeek-V3, Kimi K2)
and its latent KV cache.

Shapes (names as in the DeepSeek-V3 checkpoints):

- queries: ``q_proj: [H*(Kn+Kr), D]``, or with ``q_lora_rank = Cq`` the low-rank pair
  ``q_a_proj: [Cq, D]`` -> RMSNorm -> ``q_b_proj: [H*(Kn+Kr), Cq]``; each head's query is a
  position-free part (Kn = ``qk_nope_head_dim``) and a rotary part (Kr = ``qk_rope_head_dim``);
- keys and values: ``kv_a_proj: [C+Kr, D]`` makes the compressed latent (C = ``kv_lora_rank``,
  RMSNorm'ed) and ONE rotary key of width Kr shared by all heads; ``kv_b_proj: [H*(Kn+Kv), C]``
  expands the latent into each head's position-free key and its value (Kv = ``v_head_dim``);
- ``o_proj: [D, H*Kv]``.

Attention of head h: softmax(scale * (qn_h . kn_h + qr_h . kr)) over keys, values v_h, with
``scale = (Kn+Kr)^-1/2``, times ``m(s, mscale_all_dim)^2`` under YaRN (see ``etude.model.rope``).
The two low-rank norms use eps 1e-6 whatever ``norm_eps`` is, as the published implementations do.

The KV cache (`LatentKVCache`) stores only what a token contributes before the expansion: the
normed latent [C] and the rotary key [Kr] (RoPE applied) per layer and token, ``C + Kr`` values,
against ``2 * G * K`` for GQA (Kimi K2: 512 + 64 = 576 values per token and layer; the same model
with GQA 8 x 128 would cache 2,048). Each step expands the cached latents through ``kv_b_proj``
(the naive form: it costs ``S * C * H * (Kn + Kv)`` MACs per layer and step; DeepSeek's
"absorbed" form folds ``kv_b_proj`` into the query and output projections instead and is not
implemented here). Slot = position, masks and ragged batches exactly as in
``etude.model.attention``.

Parameter metadata (Muon blocks): ``q_proj``/``q_b_proj`` and ``kv_b_proj`` are H row blocks
(heads along dim 0), ``o_proj`` H column blocks; the low-rank ``q_a_proj`` and ``kv_a_proj`` mix
all heads and are whole matrices.

Not here: the absorbed decode form, context parallelism of MLA, multi-token prediction.

Legend: B batch, T new tokens, S key slots, D model width, H heads, C kv_lora_rank, Q q_lora_rank,
N = Kn (no-position dims), R = Kr (rotary dims), V = Kv (value dims), L layers.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from etude.model.attention import KVCache, apply_rope
from etude.model.config import ModelConfig
from etude.model.meta import ParamMeta
from etude.model.norm import RMSNorm
from etude.model.rope import yarn_mscale

LOW_RANK_NORM_EPS = 1e-6
"""Epsilon of the q_a/kv_a RMSNorms (fixed in DeepSeek-V3's code, not ``rms_norm_eps``)."""


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """``(Kn + Kr)^-1/2``, times ``m(s, mscale_all_dim)^2`` under YaRN with mscale_all_dim."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.yarn_mscale_all_dim:
        scale *= yarn_mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim) ** 2
    return scale


class LatentKVCache(KVCache):
    """Preallocated MLA cache: ``latent`` [L, B, S_max, C] and ``k_rope`` [L, B, S_max, R].

    Same protocol as `KVCache` (``advance`` once per forward, ``row_range``, ``copy_row``,
    ``keep_rows``, ``num_filled``), so the generation engine drives it without knowing which
    attention the model has.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        max_seq_len: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if batch_size < 1 or max_seq_len < 1:
            raise ValueError(
                f"KV cache needs batch_size >= 1 and max_seq_len >= 1, got {batch_size} and "
                f"{max_seq_len}"
            )
        self.latent = torch.zeros(
            (num_layers, batch_size, max_seq_len, kv_lora_rank), dtype=dtype, device=device
        )
        self.k_rope = torch.zeros(
            (num_layers, batch_size, max_seq_len, rope_dim), dtype=dtype, device=device
        )
        self.num_filled = 0
        self.num_slots = 0

    @property
    def batch_size(self) -> int:
        return self.latent.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.latent.shape[2]

    def values_per_token(self) -> int:
        """Cached values per token and layer (C + R)."""
        return self.latent.shape[3] + self.k_rope.shape[3]

    def keep_rows(self, rows_B: Tensor) -> None:
        self.latent = self.latent[:, rows_B]
        self.k_rope = self.k_rope[:, rows_B]

    def row_range(self, start: int, stop: int) -> LatentKVCache:
        """A cache over rows [start, stop) sharing this cache's storage (written in place)."""
        assert 0 <= start < stop <= self.batch_size, (start, stop, self.batch_size)
        view = copy.copy(self)
        view.latent, view.k_rope = self.latent[:, start:stop], self.k_rope[:, start:stop]
        view.num_filled = view.num_slots = 0
        return view

    def copy_row(self, src: int, dst: int) -> None:
        """Copy every layer's latents and rotary keys of row ``src`` into row ``dst``."""
        self.latent[:, dst] = self.latent[:, src]
        self.k_rope[:, dst] = self.k_rope[:, src]

    def update(  # type: ignore[override]
        self, layer_idx: int, latent_BTC: Tensor, k_rope_BTR: Tensor, positions_BT: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Write a layer's latents and rotary keys at their positions; return the visible slots
        ``latent`` [B, S, C] and ``k_rope`` [B, S, R]."""
        assert self.num_slots > 0, "KVCache.advance must run before update"
        index_BTC = positions_BT[..., None].expand(-1, -1, latent_BTC.shape[-1])
        index_BTR = positions_BT[..., None].expand(-1, -1, k_rope_BTR.shape[-1])
        self.latent[layer_idx].scatter_(1, index_BTC, latent_BTC.to(self.latent.dtype))
        self.k_rope[layer_idx].scatter_(1, index_BTR, k_rope_BTR.to(self.k_rope.dtype))
        return self.latent[layer_idx, :, : self.num_slots], self.k_rope[
            layer_idx, :, : self.num_slots
        ]


class MLAttention(nn.Module):
    """Multi-head latent attention (see the module docstring for shapes and the cache)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        assert cfg.attention == "mla"
        self.layer_idx = layer_idx
        self.num_heads = H = cfg.num_heads
        self.nope_dim, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.kv_rank = cfg.v_head_dim, cfg.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LOW_RANK_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.dim, H * qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(cfg.dim, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank, LOW_RANK_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, cfg.dim, bias=False)
        self.scale = mla_softmax_scale(cfg)

    def param_meta(self) -> dict[str, ParamMeta]:
        heads0 = ParamMeta(kind="heads_dim0", num_blocks=self.num_heads)
        meta = {
            "kv_a_proj.weight": ParamMeta(kind="matrix"),
            "kv_b_proj.weight": heads0,
            "o_proj.weight": ParamMeta(kind="heads_dim1", num_blocks=self.num_heads),
        }
        if hasattr(self, "q_proj"):
            meta["q_proj.weight"] = heads0
        else:
            meta["q_a_proj.weight"] = ParamMeta(kind="matrix")
            meta["q_b_proj.weight"] = heads0
        return meta

    def _queries(self, x_BTD: Tensor) -> Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x_BTD)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BTD)))

    def forward(
        self,
        x_BTD: Tensor,
        cos_BTR: Tensor,
        sin_BTR: Tensor,
        *,
        mask_B1TS: Tensor | None = None,
        cache: KVCache | None = None,
        positions_BT: Tensor,
    ) -> Tensor:
        batch, seq, _ = x_BTD.shape
        H, N, R, V = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim
        q_BHTK = self._queries(x_BTD).view(batch, seq, H, N + R).transpose(1, 2)
        q_nope_BHTN, q_rope_BHTR = q_BHTK.split([N, R], dim=-1)
        q_rope_BHTR = apply_rope(q_rope_BHTR, cos_BTR, sin_BTR)
        latent_BTC, k_rope_BTR = self.kv_a_proj(x_BTD).split([self.kv_rank, R], dim=-1)
        latent_BTC = self.kv_a_norm(latent_BTC)
        k_rope_BTR = apply_rope(k_rope_BTR[:, None], cos_BTR, sin_BTR)[:, 0]
        if cache is not None:
            assert isinstance(cache, LatentKVCache) and mask_B1TS is not None, type(cache)
            latent_BTC, k_rope_BTR = cache.update(
                self.layer_idx, latent_BTC, k_rope_BTR, positions_BT
            )
            latent_BTC, k_rope_BTR = latent_BTC.to(x_BTD.dtype), k_rope_BTR.to(x_BTD.dtype)
        slots = latent_BTC.shape[1]  # S: T without a cache, the visible slots with one
        kv_BHSK = self.kv_b_proj(latent_BTC).view(batch, slots, H, N + V).transpose(1, 2)
        k_nope_BHSN, v_BHSV = kv_BHSK.split([N, V], dim=-1)
        k_rope_BHSR = k_rope_BTR[:, None].expand(-1, H, -1, -1)
        q_BHTK = torch.cat((q_nope_BHTN, q_rope_BHTR), dim=-1)
        k_BHSK = torch.cat((k_nope_BHSN, k_rope_BHSR), dim=-1)
        if mask_B1TS is None:
            out_BHTV = F.scaled_dot_product_attention(
                q_BHTK, k_BHSK, v_BHSV, is_causal=True, scale=self.scale
            )
        else:
            out_BHTV = F.scaled_dot_product_attention(
                q_BHTK, k_BHSK, v_BHSV, attn_mask=mask_B1TS, scale=self.scale
            )
        return self.o_proj(out_BHTV.transpose(1, 2).reshape(batch, seq, H * V))
