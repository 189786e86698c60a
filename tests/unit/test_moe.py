"""Mixture of experts: routing, permutation, grouped experts vs a per-token reference, balancing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from etude.model import ModelConfig
from etude.model.moe import (
    GroupedExperts,
    MoE,
    TopKRouter,
    permute_tokens,
    unpermute_tokens,
)
from etude.model.transformer import build_model


def moe_cfg(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=64,
        dim=16,
        num_layers=2,
        num_dense_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        dense_ffn_dim=24,
        num_experts=6,
        num_experts_per_tok=2,
        expert_ffn_dim=8,
        num_shared_experts=1,
        max_seq_len=32,
        init_std=0.2,
    )
    return ModelConfig.preset("tiny", **{**fields, **overrides})


def make_moe(**overrides) -> MoE:
    torch.manual_seed(0)
    moe = MoE(moe_cfg(**overrides))
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return moe


def swiglu(x, w1, w3, w2):
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def reference_moe(moe: MoE, x_ND: torch.Tensor) -> torch.Tensor:
    """Token by token: scores, top-k by score + bias, weights from scores, experts, shared."""
    router, experts = moe.router, moe.experts
    out = []
    for x in x_ND:
        logits = router.gate.weight @ x
        scores = logits.sigmoid() if router.score == "sigmoid" else logits.softmax(-1)
        chosen = (scores + router.expert_bias).topk(router.top_k).indices
        weights = scores[chosen] / scores[chosen].sum() * router.route_scale
        y = sum(
            w * swiglu(x, experts.w1[e], experts.w3[e], experts.w2[e])
            for w, e in zip(weights, chosen.tolist())
        )
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(x)
        out.append(y)
    return torch.stack(out)


# ---------------------------------------------------------------- router


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_router_weights_are_normalized_scores_of_the_chosen(score):
    torch.manual_seed(1)
    router = TopKRouter(16, 6, 3, score=score, route_scale=2.5)
    x = torch.randn(20, 16)
    weights, experts = router(x)
    assert weights.dtype == torch.float32 and experts.shape == (20, 3)
    torch.testing.assert_close(weights.sum(-1), torch.full((20,), 2.5))
    logits = x @ router.gate.weight.T
    scores = logits.sigmoid() if score == "sigmoid" else logits.softmax(-1)
    torch.testing.assert_close(experts.sort(-1).values, scores.topk(3).indices.sort(-1).values)
    chosen = scores.gather(1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * 2.5)
    if score == "softmax":  # normalized softmax over the top-k = softmax over their logits
        torch.testing.assert_close(weights / 2.5, logits.gather(1, experts).softmax(-1))


def test_expert_bias_steers_selection_not_weights():
    torch.manual_seed(2)
    router = TopKRouter(16, 6, 2)
    x = torch.randn(30, 16)
    _, unbiased = router(x)
    router.expert_bias[4] = 10.0  # larger than any sigmoid score gap
    weights, experts = router(x)
    assert (experts == 4).any(dim=-1).all()
    assert not (unbiased == 4).any(dim=-1).all()
    scores = (x @ router.gate.weight.T).sigmoid()
    chosen = scores.gather(1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))


# ---------------------------------------------------------------- permutation


def test_permute_groups_by_expert_and_unpermute_inverts():
    torch.manual_seed(3)
    x = torch.randn(7, 5)
    experts = torch.tensor([[2, 0], [2, 1], [0, 3], [3, 2], [1, 0], [2, 3], [0, 2]])
    grouped, order, counts = permute_tokens(x, experts, num_experts=5)
    assert counts.tolist() == [4, 2, 5, 3, 0]
    group_of_row = experts.reshape(-1)[order]
    assert group_of_row.tolist() == sorted(group_of_row.tolist())
    torch.testing.assert_close(grouped, x[order // 2])
    # inside a group tokens keep their order
    assert (order // 2)[:4].tolist() == [0, 2, 4, 6]
    weights = torch.rand(7, 2)
    out = unpermute_tokens(grouped * 3.0, order, weights)
    torch.testing.assert_close(out, 3.0 * x * weights.sum(-1, keepdim=True))


# ---------------------------------------------------------------- grouped experts


def grouped_reference(experts, x_MD, counts):
    rows, start = [], 0
    for e, n in enumerate(counts):
        for i in range(start, start + n):
            rows.append(swiglu(x_MD[i], experts.w1[e], experts.w3[e], experts.w2[e]))
        start += n
    rows += [torch.zeros(x_MD.shape[1])] * (x_MD.shape[0] - start)
    return torch.stack(rows)


@pytest.mark.parametrize("counts", [[3, 0, 4, 1], [0, 0, 8, 0], [2, 2, 2, 0]])
def test_grouped_experts_equals_per_token_loop(counts):
    torch.manual_seed(4)
    experts = GroupedExperts(4, 8, 12)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(8, 8, requires_grad=True)  # [2, 2, 2, 0] leaves two padding rows
    out = experts(x, torch.tensor(counts))
    want = grouped_reference(experts, x, counts)
    torch.testing.assert_close(out, want)
    grads = torch.autograd.grad(out.square().sum(), [x, experts.w1, experts.w2, experts.w3])
    want_grads = torch.autograd.grad(want.square().sum(), [x, experts.w1, experts.w2, experts.w3])
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref)
    for e, n in enumerate(counts):
        if n == 0:  # an expert without tokens gets a zero gradient, not garbage
            assert not grads[1][e].any() and not grads[2][e].any()


def test_grouped_mm_kernel_matches_loop():
    """The grouped_mm path (CUDA bf16 by default) forced on CPU bf16 against the slice loop."""
    torch.manual_seed(5)
    experts = GroupedExperts(4, 16, 32).to(torch.bfloat16)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.2)
    x = torch.randn(10, 16, dtype=torch.bfloat16)
    counts = torch.tensor([3, 0, 5, 1])  # one padding row
    experts.use_grouped_mm = False
    loop = experts(x, counts)
    experts.use_grouped_mm = True
    grouped = experts(x, counts)
    torch.testing.assert_close(grouped.float(), loop.float(), atol=2e-2, rtol=2e-2)
    assert not grouped[9].any()


# ---------------------------------------------------------------- MoE layer


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
@pytest.mark.parametrize("shared", [0, 2])
def test_moe_equals_per_token_reference(score, shared):
    moe = make_moe(router_score=score, num_shared_experts=shared, route_scale=1.7)
    moe.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.5, -0.4, 0.1]))
    x = torch.randn(3, 5, 16)
    out = moe(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out.reshape(15, 16), reference_moe(moe, x.reshape(15, 16)))


def test_load_counts_accumulate_in_training_only():
    moe = make_moe()
    x1, x2 = torch.randn(2, 4, 16), torch.randn(1, 6, 16)
    moe.train()
    moe(x1)
    load1 = moe.last_load.clone()
    _, chosen1 = moe.router(x1.reshape(-1, 16))
    assert load1.tolist() == torch.bincount(chosen1.reshape(-1), minlength=6).tolist()
    assert load1.sum().item() == 8 * 2
    moe(x2)
    torch.testing.assert_close(moe.tokens_per_expert, (load1 + moe.last_load).float())
    moe.eval()
    before = moe.tokens_per_expert.clone()
    moe(x1)
    torch.testing.assert_close(moe.tokens_per_expert, before)
    assert moe.last_load.tolist() == load1.tolist()
    assert "tokens_per_expert" not in moe.state_dict()
    assert "router.expert_bias" in moe.state_dict()


def test_expert_with_no_tokens():
    moe = make_moe()
    moe.router.expert_bias[1] = -100.0  # never selected
    x = torch.randn(2, 8, 16)
    out = moe(x)
    assert moe.last_load[1] == 0
    torch.testing.assert_close(out.reshape(16, 16), reference_moe(moe, x.reshape(16, 16)))
    out.sum().backward()
    assert not moe.experts.w1.grad[1].any() and moe.experts.w1.grad[0].abs().sum() > 0


def test_bias_update_direction():
    model = build_model(moe_cfg(num_layers=3, bias_update_rate=0.01))
    first, second = list(model.moe_layers())
    first.tokens_per_expert.copy_(torch.tensor([10.0, 0.0, 5.0, 5.0, 5.0, 5.0]))
    model.update_expert_bias()
    # mean load is 5: overloaded expert 0 goes down, starved expert 1 goes up, others stay
    torch.testing.assert_close(
        first.router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0, 0.0, 0.0])
    )
    assert not first.tokens_per_expert.any()
    assert not second.router.expert_bias.any()  # no counts, no change
    assert model.update_expert_bias() is None


def test_bias_updates_balance_a_skewed_router():
    moe = make_moe(num_shared_experts=0)
    with torch.no_grad():
        moe.router.gate.weight[0] += 1.0  # expert 0 wins almost every token
    x = torch.randn(256, 16) + 0.5
    moe.train()

    def imbalance() -> float:
        moe(x)
        load = moe.last_load.float()
        return (load.max() / load.mean()).item()

    start = imbalance()
    late = []
    for _ in range(40):
        late.append(imbalance())
        moe.update_expert_bias(0.05)
    # a fixed-step sign rule settles into a small cycle around balance, not a fixed point
    assert start > 2.5 and max(late[-10:]) < 1.3
