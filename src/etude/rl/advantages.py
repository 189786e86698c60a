"""Group-relative advantages (GRPO-style) over the G rollouts of one task.

Each task is rolled out G times with the same policy; a rollout's advantage is its reward minus
the group mean (Shao et al. 2024, "DeepSeekMath", GRPO), optionally divided by the group std.
Dividing by the std is optional because it over-weights near-uniform groups (Liu et al. 2025,
"Understanding R1-Zero-Like Training", Dr. GRPO). A group where every rollout got the same
reward has zero advantage everywhere and teaches nothing: such groups are reported so that the
trainer can drop them (dynamic filtering, Yu et al. 2025, "DAPO") and the curriculum can learn
that the task is too easy or too hard.

Infrastructure failures (a dead worker, a crashed sandbox: an episode with no reward) are left
out of their group's statistics through ``valid_NG``: the mean (and std) run over the valid
rollouts only, an invalid rollout gets advantage 0, and a group with fewer than two valid
rollouts counts as zero-variance. They are never scored as reward 0.

Legend: G = rollouts per group, N = groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class GroupAdvantages:
    advantages_NG: torch.Tensor
    """Per-rollout advantage, float32 [N, G]."""
    zero_variance_N: torch.Tensor
    """True for groups whose rewards were all equal, bool [N]."""


def group_advantages(
    rewards_NG: torch.Tensor,
    *,
    normalize_std: bool = False,
    eps: float = 1e-6,
    valid_NG: torch.Tensor | None = None,
) -> GroupAdvantages:
    """Mean-centred (optionally std-normalized) advantages within each group of G rollouts.

    ``valid_NG`` (bool, default all True) marks the rollouts that count; the others are left
    out of the statistics and get advantage 0.
    """
    if rewards_NG.dim() != 2:
        raise ValueError(
            f"rewards must be [num_groups, group_size], got shape {tuple(rewards_NG.shape)}"
        )
    if valid_NG is None:
        valid_NG = torch.ones_like(rewards_NG, dtype=torch.bool)
    assert valid_NG.shape == rewards_NG.shape and valid_NG.dtype == torch.bool
    r_NG = torch.where(valid_NG, rewards_NG.float(), torch.zeros(()))
    count_N1 = valid_NG.sum(dim=1, keepdim=True).clamp(min=1)
    mean_N1 = r_NG.sum(dim=1, keepdim=True) / count_N1
    centred_NG = torch.where(valid_NG, r_NG - mean_N1, torch.zeros(()))
    # zero variance: every valid reward equals the group's first valid one (or < 2 valid)
    first_N1 = r_NG.gather(1, valid_NG.int().argmax(dim=1, keepdim=True))
    zero_var_N = ((r_NG == first_N1) | ~valid_NG).all(dim=1) | (count_N1[:, 0] < 2)
    if normalize_std and r_NG.shape[1] > 1:
        var_N1 = (centred_NG**2).sum(dim=1, keepdim=True) / (count_N1 - 1).clamp(min=1)
        centred_NG = centred_NG / (var_N1.sqrt() + eps)
    # exact zeros for uniform groups (mean subtraction can leave rounding noise)
    centred_NG = torch.where(zero_var_N[:, None], torch.zeros_like(centred_NG), centred_NG)
    return GroupAdvantages(advantages_NG=centred_NG, zero_variance_N=zero_var_N)


def broadcast_to_tokens(advantage: float, trainable_T: torch.Tensor) -> torch.Tensor:
    """A trajectory's advantage on each of its trainable (assistant) tokens, zero elsewhere."""
    return trainable_T.float() * advantage
