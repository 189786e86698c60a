"""Infrastructure failures are masked from group statistics, never scored 0."""

from __future__ import annotations

import torch

from etude.rl.advantages import group_advantages


def test_masked_rollouts_leave_the_group_statistics() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    valid = torch.tensor([[True, True, False, False], [True, True, True, True]])
    out = group_advantages(rewards, valid_NG=valid)
    # group 0: mean over the two valid rollouts (0.5), not over four (0.25)
    assert torch.allclose(out.advantages_NG[0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    # a group without failures is unchanged
    assert torch.equal(out.advantages_NG[1], group_advantages(rewards[1:]).advantages_NG[0])
    assert out.zero_variance_N.tolist() == [False, False]
    # scoring the failures as 0 instead would have moved the valid rollouts' advantages
    naive = group_advantages(rewards).advantages_NG[0]
    assert not torch.allclose(naive[:2], out.advantages_NG[0, :2])


def test_std_and_zero_variance_over_valid_rollouts_only() -> None:
    rewards = torch.tensor([[1.0, 0.0, 7.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    valid = torch.tensor([[True, True, False], [True, True, False], [True, False, False]])
    out = group_advantages(rewards, valid_NG=valid, normalize_std=True)
    reference = group_advantages(torch.tensor([[1.0, 0.0]]), normalize_std=True).advantages_NG
    assert torch.allclose(out.advantages_NG[0, :2], reference[0])
    # equal valid rewards (the failed 0 does not count), and a lone valid rollout
    assert out.zero_variance_N.tolist() == [False, True, True]
    assert torch.equal(out.advantages_NG[1:], torch.zeros(2, 3))
