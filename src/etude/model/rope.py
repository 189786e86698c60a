"""Rotary position embeddings (RoPE) as published checkpoints use them: plain or YaRN-scaled.

``rope_frequencies(cfg)`` returns the inverse frequencies of the ``cfg.rope_dim`` rotated dims
and the factor that scales cos and sin; ``rope_angles`` turns positions into cos/sin tables.

RoPE (Su et al. 2021, arXiv:2104.09864): dims are rotated in pairs by ``pos * theta^(-2r/d)``.
etude pairs dim r with dim r + d/2 (the "rotate-half" layout of GPT-NeoX, Llama, Qwen and GLM
checkpoints). DeepSeek-V3 and Kimi K2 checkpoints pair neighbours (2r, 2r+1) instead
("interleaved"); since q.k is unchanged when the same permutation is applied to the rows of both,
the checkpoint adapter permutes those projection rows once at load (evens first, then odds) and
back at export, and the model runs rotate-half everywhere.

YaRN (Peng et al. 2023, arXiv:2309.00071), with the conventions of DeepSeek-V3's reference code
and of ``transformers``: for context extension factor s over ``L0`` pretrained positions, each
frequency blends its interpolated value ``f/s`` and its original ``f`` by a linear ramp between the
dims whose wavelength makes ``beta_fast`` and ``beta_slow`` turns over L0 (bounds rounded out and
clamped to [0, d-1]); cos and sin are multiplied by ``m(s, mscale) / m(s, mscale_all_dim)`` where
``m(s, k) = 0.1 k ln s + 1`` (``m(s, 1)`` alone when ``mscale_all_dim`` is 0). MLA additionally
multiplies its softmax scale by ``m(s, mscale_all_dim)^2`` (see ``etude.model.mla``).

Not here: NTK-aware/dynamic scaling, Llama-3 and LongRoPE scaling (the checkpoint importer
rejects them by name).

Legend: B batch, T tokens, R = d/2 rotary frequencies.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from etude.model.config import ModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(scale) + 1`` for scale > 1, else 1 (YaRN's attention temperature)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """The factor on cos and sin (1 without YaRN)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    s = cfg.yarn_factor
    if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
        return yarn_mscale(s, cfg.yarn_mscale) / yarn_mscale(s, cfg.yarn_mscale_all_dim)
    return yarn_mscale(s)


def rope_frequencies(cfg: ModelConfig, device: torch.device | str | None = None) -> Tensor:
    """Inverse frequencies [R] (fp32) of the ``cfg.rope_dim`` rotated dims."""
    dim, base = cfg.rope_dim, cfg.rope_theta
    exponent_R = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
    inv_freq_R = 1.0 / (base**exponent_R)
    if cfg.rope_scaling != "yarn":
        return inv_freq_R
    s, original = cfg.yarn_factor, cfg.yarn_original_max_seq_len

    def correction_dim(rotations: float) -> float:
        # the dim whose wavelength 2 pi base^(2r/d) makes `rotations` turns over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp_R = torch.arange(dim // 2, device=device, dtype=torch.float32)
    ramp_R = ((ramp_R - low) / (high - low)).clamp(0, 1)
    keep_R = 1.0 - ramp_R  # 1: original frequency (high frequencies), 0: interpolated
    return (inv_freq_R / s) * (1.0 - keep_R) + inv_freq_R * keep_R


def rope_angles(
    positions_BT: Tensor, inv_freq_R: Tensor, attention_factor: float = 1.0
) -> tuple[Tensor, Tensor]:
    """cos and sin of ``pos * inv_freq``, each [B, T, R] in fp32, times ``attention_factor``.

    Computed from positions on every forward (cheap: B*T*R values) rather than read from a table,
    so any position works (per-sequence, CP shards).
    """
    angles_BTR = positions_BT.to(torch.float32)[..., None] * inv_freq_R.to(positions_BT.device)
    cos_BTR, sin_BTR = angles_BTR.cos(), angles_BTR.sin()
    if attention_factor != 1.0:
        cos_BTR, sin_BTR = cos_BTR * attention_factor, sin_BTR * attention_factor
    return cos_BTR, sin_BTR


def interleaved_to_half(dim: int) -> list[int]:
    """Row order that turns interleaved rotary pairs (2r, 2r+1) into rotate-half (r, r + d/2)."""
    return [*range(0, dim, 2), *range(1, dim, 2)]


def half_to_interleaved(dim: int) -> list[int]:
    """Inverse of `interleaved_to_half`."""
    order = interleaved_to_half(dim)
    inverse = [0] * dim
    for new, old in enumerate(order):
        inverse[old] = new
    return inverse
