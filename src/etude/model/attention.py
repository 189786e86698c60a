"""Grouped-query self-attention with rotary positions, and the KV cache used for generation.

`Attention` has separate ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` linears (no bias), so
each head is a clean row block of q/k/v and a clean column block of o: the optimizer
orthogonalizes per head (see ``etude.model.meta``). The work is split in two small methods so a
context-parallel wrapper can step in between them: ``project_qkv`` (local queries, keys, values,
RoPE applied) and ``attend`` (the SDPA call). ``forward`` always receives the tokens' positions, so
an all-gather CP wrapper can gather K/V and positions across its ranks and call ``attend`` with
``causal_mask(local positions, gathered positions)``.

Masking rule. Without a cache, attention is causal by index (``is_causal``) and positions only
set RoPE angles. With a `KVCache`, the cache slot of a token IS its position: a forward writes the
new K/V at slots ``positions_BT`` (per sequence) and a query at position p attends every slot
s <= p of its own sequence. Ragged batches follow from this: prefill right-padded prompts at
positions 0..L-1, then decode each sequence at its own next position; the K/V that padding wrote
past a prompt's end is overwritten by that sequence's own tokens before any query can see it.

Options of the checkpoint families: ``qk_norm`` (RMSNorm over each query and key head before
RoPE, Qwen3), ``attention_bias`` (q/k/v biases, GLM-4 MoE) and ``rotary_dim`` (RoPE on the first
dims of each head only, GLM-4 MoE); cos/sin come from ``etude.model.rope`` (plain or YaRN).

Not here: multi-head latent attention (``etude.model.mla``), sliding windows, attention sinks,
paged caches, any parallelism.

Legend: B batch, T query tokens, S key slots, D model width, H query heads, G key/value heads,
K head width, R = K/2 rotary frequencies, L layers.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from etude.model.config import ModelConfig
from etude.model.meta import ParamMeta
from etude.model.norm import RMSNorm


def rope_angles(positions_BT: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the plain RoPE angles ``pos * theta^(-2r/K)``, each [B, T, R] in fp32."""
    exponent_R = torch.arange(0, head_dim, 2, device=positions_BT.device, dtype=torch.float32)
    inv_freq_R = 1.0 / theta ** (exponent_R / head_dim)
    angles_BTR = positions_BT.to(torch.float32)[..., None] * inv_freq_R
    return angles_BTR.cos(), angles_BTR.sin()


def apply_rope(x_BNTK: Tensor, cos_BTR: Tensor, sin_BTR: Tensor) -> Tensor:
    """Rotate pairs (x[r], x[r + K/2]) of every head by the position's angles (in fp32).

    The half-split pairing (GPT-NeoX / Llama layout) rather than interleaved pairs: both are
    RoPE (Su et al. 2021, arXiv:2104.09864); this one needs no complex view.
    """
    x1_BNTR, x2_BNTR = x_BNTK.float().chunk(2, dim=-1)
    cos_B1TR, sin_B1TR = cos_BTR[:, None], sin_BTR[:, None]
    out_BNTK = torch.cat(
        (x1_BNTR * cos_B1TR - x2_BNTR * sin_B1TR, x2_BNTR * cos_B1TR + x1_BNTR * sin_B1TR), dim=-1
    )
    return out_BNTK.to(x_BNTK.dtype)


def causal_mask(q_positions_BT: Tensor, k_positions_BS: Tensor) -> Tensor:
    """Boolean attention mask [B, 1, T, S]: a query sees every key at a position <= its own.

    The rule behind both the KV cache (keys = cache slots) and all-gather context parallelism
    (keys = K/V gathered from every CP rank, with their global positions).
    """
    return (k_positions_BS[:, None, :] <= q_positions_BT[:, :, None])[:, None]


class KVCache:
    """Preallocated keys and values of every layer, ``k``/``v``: [L, B, G, S_max, K].

    Slot = position (see the module docstring). ``advance`` is called once per forward by the
    model: it checks capacity, records how many slots the forward may see and returns the mask.
    ``num_filled`` is one past the highest slot written so far: a forward without explicit
    positions continues every sequence from there (a uniform batch). The engine's continuous
    batching uses three row operations: ``row_range`` (a view over some rows), ``copy_row`` and
    ``keep_rows``; another cache layout (a latent cache) provides the same three.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if batch_size < 1 or max_seq_len < 1:
            raise ValueError(
                f"KV cache needs batch_size >= 1 and max_seq_len >= 1, got {batch_size} and "
                f"{max_seq_len}"
            )
        shape = (num_layers, batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_filled = 0
        self.num_slots = 0
        """Slots visible to the forward in progress (max position + 1)."""

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    def keep_rows(self, rows_B: Tensor) -> None:
        """Keep only batch rows ``rows_B`` (in that order), e.g. to drop finished sequences."""
        self.k = self.k[:, rows_B]
        self.v = self.v[:, rows_B]

    def row_range(self, start: int, stop: int) -> KVCache:
        """A cache over rows [start, stop) that shares this cache's storage: a forward through
        it writes these rows in place (continuous batching runs a subset of the slots)."""
        assert 0 <= start < stop <= self.batch_size, (start, stop, self.batch_size)
        view = copy.copy(self)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.num_filled = view.num_slots = 0
        return view

    def copy_row(self, src: int, dst: int) -> None:
        """Copy every layer's keys and values of row ``src`` into row ``dst``."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def advance(self, positions_BT: Tensor) -> Tensor:
        """Start a forward writing at ``positions_BT``; returns the boolean mask [B, 1, T, S].

        mask[b, 0, t, s] = s <= positions[b, t]: causal within the new tokens and open to every
        earlier slot of the same sequence.
        """
        batch, _ = positions_BT.shape
        if batch != self.batch_size:
            raise ValueError(
                f"tokens have batch size {batch} but the KV cache was made for {self.batch_size}; "
                "make the cache with make_cache(batch_size=...) matching the batch"
            )
        # one host sync per forward: the number of slots SDPA reads is a shape
        first, last = torch.stack(torch.aminmax(positions_BT)).tolist()
        if first < 0 or last >= self.max_seq_len:
            raise ValueError(
                f"positions must lie in [0, {self.max_seq_len}) of the KV cache, got up to {last}; "
                "make a longer cache with make_cache(max_seq_len=...)"
            )
        self.num_slots = last + 1
        self.num_filled = max(self.num_filled, self.num_slots)
        slots_BS = torch.arange(self.num_slots, device=positions_BT.device).expand(batch, -1)
        return causal_mask(positions_BT, slots_BS)

    def update(
        self, layer_idx: int, k_BGTK: Tensor, v_BGTK: Tensor, positions_BT: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Write a layer's new K/V at their positions; return the visible slots [B, G, S, K]."""
        assert self.num_slots > 0, "KVCache.advance must run before update"
        _, num_kv, _, head_dim = k_BGTK.shape
        index_BGTK = positions_BT[:, None, :, None].expand(-1, num_kv, -1, head_dim)
        self.k[layer_idx].scatter_(2, index_BGTK, k_BGTK.to(self.k.dtype))
        self.v[layer_idx].scatter_(2, index_BGTK, v_BGTK.to(self.v.dtype))
        return self.k[layer_idx, :, :, : self.num_slots], self.v[layer_idx, :, :, : self.num_slots]


class Attention(nn.Module):
    """Grouped-query attention: H query heads share G key/value heads (H % G == 0)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.rope_dim = cfg.rope_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def param_meta(self) -> dict[str, ParamMeta]:
        meta = {
            "q_proj.weight": ParamMeta(kind="heads_dim0", num_blocks=self.num_heads),
            "k_proj.weight": ParamMeta(kind="heads_dim0", num_blocks=self.num_kv_heads),
            "v_proj.weight": ParamMeta(kind="heads_dim0", num_blocks=self.num_kv_heads),
            "o_proj.weight": ParamMeta(kind="heads_dim1", num_blocks=self.num_heads),
        }
        if self.q_proj.bias is not None:
            meta.update({f"{n}_proj.bias": ParamMeta(kind="bias") for n in ("q", "k", "v")})
        return meta

    def _rope(self, x_BNTK: Tensor, cos_BTR: Tensor, sin_BTR: Tensor) -> Tensor:
        if self.rope_dim == self.head_dim:
            return apply_rope(x_BNTK, cos_BTR, sin_BTR)
        rot_BNTK, keep_BNTK = x_BNTK.split([self.rope_dim, self.head_dim - self.rope_dim], -1)
        return torch.cat((apply_rope(rot_BNTK, cos_BTR, sin_BTR), keep_BNTK), dim=-1)

    def project_qkv(
        self, x_BTD: Tensor, cos_BTR: Tensor, sin_BTR: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries [B, H, T, K] and keys [B, G, T, K] with RoPE applied, values [B, G, T, K]."""
        batch, seq, _ = x_BTD.shape
        q_BTHK = self.q_proj(x_BTD).view(batch, seq, self.num_heads, self.head_dim)
        k_BTGK = self.k_proj(x_BTD).view(batch, seq, self.num_kv_heads, self.head_dim)
        v_BGTK = self.v_proj(x_BTD).view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        q_BHTK, k_BGTK, v_BGTK = (
            q_BTHK.transpose(1, 2),
            k_BTGK.transpose(1, 2),
            v_BGTK.transpose(1, 2),
        )
        return self._rope(q_BHTK, cos_BTR, sin_BTR), self._rope(k_BGTK, cos_BTR, sin_BTR), v_BGTK

    def attend(
        self, q_BHTK: Tensor, k_BGSK: Tensor, v_BGSK: Tensor, mask_B1TS: Tensor | None
    ) -> Tensor:
        """Scaled dot-product attention [B, H, T, K]; ``mask_B1TS`` None means causal by index."""
        gqa = self.num_kv_heads != self.num_heads
        if mask_B1TS is None:
            return F.scaled_dot_product_attention(
                q_BHTK, k_BGSK, v_BGSK, is_causal=True, enable_gqa=gqa
            )
        return F.scaled_dot_product_attention(
            q_BHTK, k_BGSK, v_BGSK, attn_mask=mask_B1TS, enable_gqa=gqa
        )

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
        """``positions_BT``: the tokens' positions (RoPE is already in cos/sin; the cache writes
        at them; a CP wrapper reads them)."""
        batch, seq, _ = x_BTD.shape
        q_BHTK, k_BGSK, v_BGSK = self.project_qkv(x_BTD, cos_BTR, sin_BTR)
        if cache is not None:
            assert mask_B1TS is not None
            k_BGSK, v_BGSK = cache.update(self.layer_idx, k_BGSK, v_BGSK, positions_BT)
            k_BGSK, v_BGSK = k_BGSK.to(q_BHTK.dtype), v_BGSK.to(q_BHTK.dtype)
        out_BHTK = self.attend(q_BHTK, k_BGSK, v_BGSK, mask_B1TS)
        out_BTD = out_BHTK.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj(out_BTD)
