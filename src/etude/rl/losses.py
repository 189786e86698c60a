"""RL losses as pure functions: token-level PPO-clip and the text-feedback distillation KL.

Policy loss (docs/architecture.md "RL loss"): token-level PPO-clip (Schulman et al. 2017) with
separate low/high clip ranges ("clip-higher", Yu et al. 2025, DAPO), the importance ratio taken
against the behavior logprobs the engine recorded while sampling, and a token-mean over every
trainable token of the batch (so long and short trajectories weigh per token, DAPO's token-level
loss). Two guards keep one stale or off-support token from wrecking a step: the log-ratio is
clamped to ``[-max_log_ratio, max_log_ratio]`` before the exponential (so ``0 * inf`` can not
make the loss NaN), and a negative advantage's loss is bounded by ``dual_clip * |A|`` (dual-clip
PPO, Ye et al. 2020, arXiv:1912.09729), where plain PPO-clip leaves ``-A * ratio`` unbounded.

Text-feedback KL: on a hinted turn, the same model with the hint spliced into its context is the
teacher; the KL between the student's next-token distribution (original context) and the
teacher's (hinted context) at that turn's positions is added with weight ``beta``. Computed in
float32 over the full vocabulary:

- ``reverse``: KL(student || teacher) = sum_v p_s (log p_s - log p_t)   (mode seeking; default,
  as in on-policy distillation, Agarwal et al. 2024 "GKD", Thinking Machines 2025);
- ``forward``: KL(teacher || student) = sum_v p_t (log p_t - log p_s);
- ``jsd``: 0.5 KL(s || m) + 0.5 KL(t || m), m = (p_s + p_t) / 2;
- ``topk`` > 0: the sum runs over the k tokens most likely under the teacher plus one tail bucket
  holding the remaining mass of each distribution (so the teacher's logits can be kept as k
  values per position instead of V).

Where the teacher's distribution equals the student's bit for bit (an empty hint splices in
nothing), the KL is exactly zero and so is its gradient: those rows are selected out, not left
to rounding.

Legend: N = tokens (flattened), V = vocabulary, K = top-k kept.
"""

from __future__ import annotations

from typing import Literal

import torch

KLKind = Literal["reverse", "forward", "jsd"]


def ppo_clip_loss(
    logprobs_N: torch.Tensor,
    behavior_logprobs_N: torch.Tensor,
    advantages_N: torch.Tensor,
    mask_N: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    num_tokens: int | None = None,
    max_log_ratio: float = 10.0,
    dual_clip: float = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip loss, token-mean over ``mask``; returns (loss, stats).

    ``num_tokens`` overrides the normalizer (the trainer passes the token count of the whole
    batch when it accumulates minibatches, so that the sum over minibatches is the batch mean).
    ``max_log_ratio`` clamps the log importance ratio; ``dual_clip`` (> 1; 0 = off) bounds the
    loss of a negative-advantage token at ``dual_clip * |A|``.
    """
    keep_N = mask_N.bool()
    mask_N = keep_N.float()
    diff_N = logprobs_N.float() - behavior_logprobs_N.float()
    # where, not multiply: an infinite difference outside the mask must not become 0 * inf
    log_ratio_N = torch.where(keep_N, diff_N, torch.zeros_like(diff_N))
    log_ratio_N = log_ratio_N.clamp(-max_log_ratio, max_log_ratio)
    ratio_N = torch.exp(log_ratio_N)
    advantages_N = advantages_N.float()
    unclipped_N = -advantages_N * ratio_N
    clipped_N = -advantages_N * torch.clamp(ratio_N, 1.0 - clip_low, 1.0 + clip_high)
    loss_N = torch.maximum(unclipped_N, clipped_N)
    if dual_clip > 0:
        bound_N = -advantages_N * dual_clip  # = dual_clip * |A| where A < 0
        loss_N = torch.where(advantages_N < 0, torch.minimum(loss_N, bound_N), loss_N)
    denom = float(max(num_tokens, 1)) if num_tokens is not None else mask_N.sum().clamp(min=1.0)
    loss = torch.where(keep_N, loss_N, torch.zeros_like(loss_N)).sum() / denom
    with torch.no_grad():
        n = mask_N.sum().clamp(min=1.0)
        stats = {
            "clip_frac": float(((clipped_N > unclipped_N).float() * mask_N).sum() / n),
            "ratio_mean": float((ratio_N * mask_N).sum() / n),
            "approx_kl_behavior": float((((ratio_N - 1) - log_ratio_N) * mask_N).sum() / n),
        }
    return loss, stats


def token_entropy(logits_NV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of each row's ``softmax(logits / temperature)``, float32 [N]."""
    logp_NV = torch.log_softmax(logits_NV.float() / temperature, dim=-1)
    return -(logp_NV.exp() * logp_NV).sum(-1)


def logprob_entropy(logp_NV: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of log-probabilities that may hold ``-inf`` (truncated), fp32 [N]."""
    p_NV = logp_NV.exp()
    return -torch.where(p_NV > 0, p_NV * logp_NV, torch.zeros_like(p_NV)).sum(-1)


def _topk_with_tail(logp_NV: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
    """Log-probs of the K chosen tokens plus a tail bucket for the rest: [N, K+1]."""
    top_NK = logp_NV.gather(-1, idx_NK)
    # log(1 - sum p_top), computed stably; clamp keeps log finite when the top-k hold all mass
    tail_N1 = torch.log1p(-top_NK.exp().sum(-1, keepdim=True).clamp(max=1.0 - 1e-7))
    return torch.cat([top_NK, tail_N1], dim=-1)


def token_kl(
    student_logits_NV: torch.Tensor,
    teacher_logits_NV: torch.Tensor,
    *,
    kind: KLKind = "reverse",
    topk: int = 0,
) -> torch.Tensor:
    """Per-position divergence between student and teacher next-token distributions, fp32 [N].

    Gradients flow into the student only (the teacher is detached).
    """
    if student_logits_NV.shape != teacher_logits_NV.shape:
        raise ValueError(
            f"student logits {tuple(student_logits_NV.shape)} != teacher {tuple(teacher_logits_NV.shape)}"
        )
    if kind not in ("reverse", "forward", "jsd"):
        raise ValueError(f"rl.kl_kind={kind!r}: use reverse, forward or jsd")
    logp_s_NV = torch.log_softmax(student_logits_NV.float(), dim=-1)
    logp_t_NV = torch.log_softmax(teacher_logits_NV.detach().float(), dim=-1)
    same_N = (logp_s_NV.detach() == logp_t_NV).all(dim=-1)
    if topk > 0:
        k = min(topk, logp_s_NV.shape[-1] - 1)
        idx_NK = logp_t_NV.topk(k, dim=-1).indices
        logp_s_NV = _topk_with_tail(logp_s_NV, idx_NK)
        logp_t_NV = _topk_with_tail(logp_t_NV, idx_NK)
    if kind == "reverse":
        kl_N = (logp_s_NV.exp() * (logp_s_NV - logp_t_NV)).sum(-1)
    elif kind == "forward":
        kl_N = (logp_t_NV.exp() * (logp_t_NV - logp_s_NV)).sum(-1)
    else:
        p_m_NV = 0.5 * (logp_s_NV.exp() + logp_t_NV.exp())
        logp_m_NV = torch.log(p_m_NV.clamp(min=1e-30))
        kl_N = 0.5 * (logp_s_NV.exp() * (logp_s_NV - logp_m_NV)).sum(-1) + 0.5 * (
            logp_t_NV.exp() * (logp_t_NV - logp_m_NV)
        ).sum(-1)
    return torch.where(same_N, torch.zeros_like(kl_N), kl_N)


def masked_mean(
    values_N: torch.Tensor, mask_N: torch.Tensor, num_tokens: int | None = None
) -> torch.Tensor:
    """Sum of ``values`` over ``mask`` divided by the mask's count (or ``num_tokens``)."""
    mask_N = mask_N.float()
    denom = float(max(num_tokens, 1)) if num_tokens is not None else mask_N.sum().clamp(min=1.0)
    return (values_N * mask_N).sum() / denom
