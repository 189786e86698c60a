"""Group-relative advantages (GRPO-style) over the G rollouts of one task.

Each task is rolled out G times with the same policy; a rollout's advantage is its reward minus
the group mean (Shao et al. 2024, "DeepSeekMath", GRPO), optionally divided by the group std.
Dividing by the std is optional because it over-weights near-uniform groups (Liu et al. 2025,
"Understanding R1-Zero-Like Training", Dr. GRPO). A group where every rollout got the same
reward has zero advantage everywhere and teaches nothing: such groups are reported so that the
trainer can drop them (dynamic filtering, Yu et al. 2025, "DAPO") and the curriculum can learn
that the task is too easy or too hard.

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
    rewards_NG: torch.Tensor, *, normalize_std: bool = False, eps: float = 1e-6
) -> GroupAdvantages:
    """Mean-centred (optionally std-normalized) advantages within each group of G rollouts."""
    if rewards_NG.dim() != 2:
        raise ValueError(
            f"rewards must be [num_groups, group_size], got shape {tuple(rewards_NG.shape)}"
        )
    r_NG = rewards_NG.float()
    centred_NG = r_NG - r_NG.mean(dim=1, keepdim=True)
    zero_var_N = (r_NG == r_NG[:, :1]).all(dim=1)
    if normalize_std and r_NG.shape[1] > 1:
        std_N1 = r_NG.std(dim=1, unbiased=True, keepdim=True)
        centred_NG = centred_NG / (std_N1 + eps)
    # exact zeros for uniform groups (mean subtraction can leave rounding noise)
    centred_NG = torch.where(zero_var_N[:, None], torch.zeros_like(centred_NG), centred_NG)
    return GroupAdvantages(advantages_NG=centred_NG, zero_variance_N=zero_var_N)


def broadcast_to_tokens(advantage: float, trainable_T: torch.Tensor) -> torch.Tensor:
    """A trajectory's advantage on each of its trainable (assistant) tokens, zero elsewhere."""
    return trainable_T.float() * advantage
