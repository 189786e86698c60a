"""The decoder-only MoE transformer, built on the meta device and materialized on demand.

``Transformer(cfg)`` only creates modules, so ``with torch.device("meta")`` builds even the
Kimi K2 shapes instantly; ``init_weights(seed)`` then fills every parameter and buffer on
whatever device they live, and ``build_model`` does meta build + ``to_empty`` + init in one call.
Between the two steps ``etude.parallel`` may shard the modules (FSDP2, EP, CP); this file knows
nothing of that.

Block: pre-norm RMSNorm -> attention with RoPE (grouped-query, ``etude.model.attention``, or
multi-head latent, ``etude.model.mla``) -> residual -> RMSNorm -> FFN -> residual. The FFN is a dense SwiGLU for the first ``num_dense_layers`` blocks and a mixture of
experts after (all dense when ``num_experts == 0``). Logits come out in fp32.

Init: weight matrices (embedding, projections, experts, router gate, head) draw from
N(0, init_std) with a generator seeded per parameter from (seed, parameter name), so a value does
not depend on module order or on which other parameters exist; norms are ones, biases and every
buffer (router bias, load counts) zeros. Same seed and device type -> identical parameters.

Not here: multi-token prediction, dropout, any parallelism or mixed-precision policy.

Legend: B batch, T tokens, N selected tokens per sequence, D model width, V vocabulary,
R rotary frequencies, S key slots.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from etude.model.attention import Attention, KVCache
from etude.model.config import ModelConfig
from etude.model.meta import ParamMeta, collect_param_meta
from etude.model.mla import LatentKVCache, MLAttention
from etude.model.moe import FeedForward, MoE
from etude.model.norm import RMSNorm
from etude.model.rope import rope_angles, rope_frequencies, yarn_attention_factor

__all__ = ["RMSNorm", "Transformer", "TransformerBlock", "build_model"]


class TransformerBlock(nn.Module):
    """Pre-norm attention and FFN sublayers, each with a residual connection."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention: Attention | MLAttention = (
            MLAttention(cfg, layer_idx) if cfg.attention == "mla" else Attention(cfg, layer_idx)
        )
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn: FeedForward | MoE = (
            MoE(cfg) if cfg.is_moe_layer(layer_idx) else FeedForward(cfg.dim, cfg.dense_ffn_dim)
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
        h_BTD = x_BTD + self.attention(
            self.attention_norm(x_BTD),
            cos_BTR,
            sin_BTR,
            mask_B1TS=mask_B1TS,
            cache=cache,
            positions_BT=positions_BT,
        )
        return h_BTD + self.ffn(self.ffn_norm(h_BTD))


class Transformer(nn.Module):
    """Token ids [B, T] -> fp32 logits [B, T, V]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make the head share the embedding (if ``tie_embeddings``); ``to_empty`` unties them."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def param_meta(self) -> dict[str, ParamMeta]:
        meta = {"tok_embeddings.weight": ParamMeta(kind="embedding")}
        if not self.cfg.tie_embeddings:
            meta["output.weight"] = ParamMeta(kind="head")
        return meta

    def forward(
        self,
        tokens_BT: Tensor,
        *,
        positions_BT: Tensor | None = None,
        cache: KVCache | None = None,
        logits_index_BN: Tensor | None = None,
    ) -> Tensor:
        """Logits [B, T, V] in fp32 (or [B, N, V] at ``logits_index_BN``, indices along T).

        Without ``cache``: attention is causal by index and ``positions_BT`` (default 0..T-1)
        only sets RoPE. With ``cache``: the new tokens' K/V are written at slots
        ``positions_BT`` (default: continuing after ``cache.num_filled``) and each token attends
        every slot of its sequence up to its own position (see ``etude.model.attention``).
        ``logits_index_BN`` spares the [B, T, V] logits of a long prefill when only a few
        positions are needed.
        """
        batch, seq = tokens_BT.shape
        if positions_BT is not None and positions_BT.shape != tokens_BT.shape:
            raise ValueError(
                f"positions_BT has shape {tuple(positions_BT.shape)} but tokens_BT has "
                f"{tuple(tokens_BT.shape)}; pass one position per token"
            )
        mask_B1TS = None
        if cache is None:
            if seq > self.cfg.max_seq_len:
                raise ValueError(
                    f"sequence of {seq} tokens exceeds model.max_seq_len ({self.cfg.max_seq_len}); "
                    "shorten the input or raise max_seq_len"
                )
            if positions_BT is None:
                positions_BT = torch.arange(seq, device=tokens_BT.device).expand(batch, seq)
        else:
            if positions_BT is None:
                start = cache.num_filled
                positions_BT = torch.arange(start, start + seq, device=tokens_BT.device)
                positions_BT = positions_BT.expand(batch, seq)
            mask_B1TS = cache.advance(positions_BT)
        inv_freq_R = rope_frequencies(self.cfg, device=tokens_BT.device)
        cos_BTR, sin_BTR = rope_angles(positions_BT, inv_freq_R, yarn_attention_factor(self.cfg))
        h_BTD = self.tok_embeddings(tokens_BT)
        for layer in self.layers:
            h_BTD = layer(
                h_BTD,
                cos_BTR,
                sin_BTR,
                mask_B1TS=mask_B1TS,
                cache=cache,
                positions_BT=positions_BT,
            )
        h_BTD = self.norm(h_BTD)
        if logits_index_BN is not None:
            index_BND = logits_index_BN[..., None].expand(-1, -1, h_BTD.shape[-1])
            h_BTD = h_BTD.gather(1, index_BND)
        return self.output(h_BTD).float()

    def make_cache(
        self,
        batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A zeroed KV cache for ``batch_size`` sequences of up to ``max_seq_len`` tokens.

        dtype and device default to those of the model's parameters.
        """
        weight = self.tok_embeddings.weight
        if self.cfg.attention == "mla":
            return LatentKVCache(
                num_layers=self.cfg.num_layers,
                batch_size=batch_size,
                max_seq_len=max_seq_len,
                kv_lora_rank=self.cfg.kv_lora_rank,
                rope_dim=self.cfg.qk_rope_head_dim,
                dtype=dtype if dtype is not None else weight.dtype,
                device=device if device is not None else weight.device,
            )
        return KVCache(
            num_layers=self.cfg.num_layers,
            batch_size=batch_size,
            num_kv_heads=self.cfg.num_kv_heads,
            max_seq_len=max_seq_len,
            head_dim=self.cfg.head_dim,
            dtype=dtype if dtype is not None else weight.dtype,
            device=device if device is not None else weight.device,
        )

    def moe_layers(self) -> Iterator[MoE]:
        """The MoE FFNs in layer order."""
        for layer in self.layers:
            if isinstance(layer.ffn, MoE):
                yield layer.ffn

    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing step on every MoE layer (see `MoE.update_expert_bias`)."""
        for moe in self.moe_layers():
            moe.update_expert_bias(self.cfg.bias_update_rate)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fill every parameter and buffer deterministically (see the module docstring)."""
        self.tie_weights()
        meta = collect_param_meta(self)
        for name, param in self.named_parameters():
            if param.is_meta:
                raise ValueError(
                    f"parameter {name!r} is on the meta device; materialize the model first "
                    "(model.to_empty(device=...)) or use build_model"
                )
            kind = meta[name].kind
            if kind == "norm":
                param.fill_(1.0)
            elif kind == "bias":
                param.zero_()
            else:
                generator = torch.Generator(device=param.device)
                generator.manual_seed(_param_seed(seed, name))
                param.normal_(0.0, self.cfg.init_std, generator=generator)
        for buffer in self.buffers():
            buffer.zero_()


def _param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and a parameter name (crc32 of the name: stable)."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)


def build_model(
    cfg: ModelConfig, *, device: torch.device | str = "cpu", seed: int = 0
) -> Transformer:
    """Meta build, then ``to_empty(device)`` (re-tying the head if tied), then ``init_weights``."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model
