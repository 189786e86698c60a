"""RL losses against direct computations: PPO-clip, group advantages, and the feedback KL."""

import pytest
import torch

from etude.rl.advantages import broadcast_to_tokens, group_advantages
from etude.rl.losses import masked_mean, ppo_clip_loss, token_entropy, token_kl


def test_group_advantages_known_values():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    out = group_advantages(rewards)
    assert torch.equal(out.advantages_NG[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.equal(out.advantages_NG[1], torch.zeros(4))
    assert torch.allclose(out.advantages_NG[2], torch.tensor([-0.25, -0.25, -0.25, 0.75]))
    assert out.zero_variance_N.tolist() == [False, True, False]
    normed = group_advantages(rewards, normalize_std=True).advantages_NG
    assert torch.allclose(
        normed[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (rewards[0].std() + 1e-6)
    )
    assert torch.equal(normed[1], torch.zeros(4))
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_advantages(torch.zeros(4))
    assert broadcast_to_tokens(0.5, torch.tensor([0, 1, 1])).tolist() == [0.0, 0.5, 0.5]


def test_ungraded_rollouts_are_masked_from_group_statistics():
    """An infra outcome (reward None, stored as 0.0 with valid=False) moves no statistic."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    valid = torch.tensor([[True, True, False, False], [False, True, True, True]])
    out = group_advantages(rewards, valid_NG=valid)
    assert torch.allclose(out.advantages_NG[0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    third = 1.0 / 3.0
    assert torch.allclose(
        out.advantages_NG[1], torch.tensor([0.0, -2 * third, third, third]), atol=1e-6
    )
    alone = group_advantages(rewards[:1], valid_NG=torch.tensor([[True, False, False, False]]))
    assert alone.zero_variance_N.tolist() == [True] and torch.equal(
        alone.advantages_NG, torch.zeros(1, 4)
    )
    normed = group_advantages(rewards, normalize_std=True, valid_NG=valid).advantages_NG
    assert torch.allclose(
        normed[0, :2], torch.tensor([0.5, -0.5]) / (torch.tensor([1.0, 0.0]).std() + 1e-6)
    )
    assert normed[0, 2:].abs().sum() == 0


def test_ppo_clip_value_and_token_mean():
    logp = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    old = torch.log(torch.tensor([0.5, 0.25, 0.5]))
    adv = torch.tensor([1.0, 1.0, -1.0])
    mask = torch.tensor([1.0, 1.0, 0.0])
    loss, stats = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # token 0: ratio 1 -> -1; token 1: ratio 2 clipped to 1.28 -> -1.28; token 2 masked out
    assert loss.item() == pytest.approx((-1.0 - 1.28) / 2)
    assert stats["clip_frac"] == pytest.approx(0.5)
    loss_n, _ = ppo_clip_loss(logp, old, adv, mask, num_tokens=4)
    assert loss_n.item() == pytest.approx((-1.0 - 1.28) / 4)


def test_ppo_gradient_zero_outside_clip_range():
    old = torch.zeros(4)
    # ratios: e^0.5 > 1.28 (A>0: clipped), e^-0.5 < 0.8 (A<0: clipped), inside (A>0), e^-0.5 (A>0: not clipped)
    logp = torch.tensor([0.5, -0.5, 0.1, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    loss, _ = ppo_clip_loss(logp, old, adv, torch.ones(4))
    loss.backward()
    assert logp.grad[0] == 0 and logp.grad[1] == 0
    assert logp.grad[2] != 0 and logp.grad[3] != 0


def direct_kl(p, q):
    return (p * (p.log() - q.log())).sum(-1)


def test_kl_directions_against_direct_computation():
    torch.manual_seed(0)
    s, t = torch.randn(5, 11), torch.randn(5, 11)
    ps, pt = s.softmax(-1), t.softmax(-1)
    assert torch.allclose(token_kl(s, t, kind="reverse"), direct_kl(ps, pt), atol=1e-6)
    assert torch.allclose(token_kl(s, t, kind="forward"), direct_kl(pt, ps), atol=1e-6)
    m = 0.5 * (ps + pt)
    assert torch.allclose(
        token_kl(s, t, kind="jsd"), 0.5 * direct_kl(ps, m) + 0.5 * direct_kl(pt, m), atol=1e-6
    )
    assert not torch.allclose(token_kl(s, t, kind="reverse"), token_kl(s, t, kind="forward"))


def test_topk_with_tail_bucket():
    torch.manual_seed(1)
    s, t = torch.randn(3, 20), torch.randn(3, 20)
    full = token_kl(s, t, kind="reverse")
    # k = V - 1: the tail bucket is the single remaining token, so it is the full KL
    assert torch.allclose(token_kl(s, t, kind="reverse", topk=19), full, atol=1e-5)
    ps, pt = s.softmax(-1), t.softmax(-1)
    idx = pt.topk(4, -1).indices
    bins_s = torch.cat([ps.gather(-1, idx), 1 - ps.gather(-1, idx).sum(-1, keepdim=True)], -1)
    bins_t = torch.cat([pt.gather(-1, idx), 1 - pt.gather(-1, idx).sum(-1, keepdim=True)], -1)
    assert torch.allclose(
        token_kl(s, t, kind="reverse", topk=4), direct_kl(bins_s, bins_t), atol=1e-5
    )


def test_identical_teacher_gives_exact_zero_and_zero_gradient():
    torch.manual_seed(2)
    s = torch.randn(4, 9, requires_grad=True)
    for kind in ("reverse", "forward", "jsd"):
        for k in (0, 3):
            kl = token_kl(s, s.detach().clone(), kind=kind, topk=k)
            assert torch.equal(kl, torch.zeros(4))
            (grad,) = torch.autograd.grad(kl.sum(), s)
            assert torch.equal(grad, torch.zeros_like(grad))


def test_kl_gradient_only_into_student():
    s = torch.randn(2, 5, requires_grad=True)
    t = torch.randn(2, 5, requires_grad=True)
    token_kl(s, t).sum().backward()
    assert s.grad is not None and t.grad is None


def test_entropy_and_masked_mean():
    uniform = torch.zeros(2, 8)
    assert torch.allclose(
        token_entropy(uniform), torch.full((2,), torch.log(torch.tensor(8.0)).item())
    )
    assert masked_mean(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0])).item() == 2.0
    with pytest.raises(ValueError, match="kl_kind"):
        token_kl(torch.zeros(1, 2), torch.zeros(1, 2), kind="bogus")
