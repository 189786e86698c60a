"""Expert-parallel dispatch as pure functions, with the all-to-all simulated in one process.

The rank-local pieces of ``etude.parallel.expert`` (send splits, one-row padding of empty
splits, regrouping received rows by local expert, the inverse) are checked on hand-made
examples, then composed with a simulated all-to-all over W "ranks" (lists of tensors): the
result must equal every rank running the whole MoE expert step on its own rows, including
ranks whose experts receive nothing and ranks that send nothing to some rank.

Legend: E experts, W ranks, L local experts, N tokens, A experts per token, M rows, D width.
"""

from __future__ import annotations

import pytest
import torch

from etude.model.moe import GroupedExperts, permute_tokens, unpermute_tokens
from etude.parallel.expert import (
    drop_split_padding,
    group_by_local_expert,
    inverse_permutation,
    pad_empty_splits,
    send_splits,
)


def test_send_splits_sum_counts_of_each_ranks_experts():
    counts_E = torch.tensor([3, 0, 1, 4, 0, 0])
    assert send_splits(counts_E, 3) == [3, 5, 0]
    assert send_splits(counts_E, 1) == [8]


def test_padding_of_empty_splits_round_trips():
    x_MD = torch.arange(10.0).view(5, 2)
    padded, splits = pad_empty_splits(x_MD, [2, 0, 3, 0])
    assert splits == [2, 1, 3, 1]
    assert padded.shape == (7, 2)
    assert torch.equal(padded[2], torch.zeros(2)) and torch.equal(padded[6], torch.zeros(2))
    assert torch.equal(drop_split_padding(padded, [2, 0, 3, 0]), x_MD)
    # nothing to send at all: one pad row per rank, and back to nothing
    empty = x_MD[:0]
    padded, splits = pad_empty_splits(empty, [0, 0])
    assert splits == [1, 1] and padded.shape == (2, 2)
    assert drop_split_padding(padded, [0, 0]).shape == (0, 2)
    # no empty split: untouched
    same, splits = pad_empty_splits(x_MD, [4, 1])
    assert same is x_MD and splits == [4, 1]


def test_group_by_local_expert_hand_example():
    # W=3 sources, L=2 local experts; source 1 sends nothing (one pad row)
    recv_counts_WL = torch.tensor([[2, 1], [0, 0], [1, 2]])
    # received buffer rows: s0e0 s0e0 s0e1 | pad | s2e0 s2e1 s2e1 -> indices 0..6
    order_R, counts_L = group_by_local_expert(recv_counts_WL)
    assert counts_L.tolist() == [3, 3]
    assert order_R.tolist() == [0, 1, 4, 2, 5, 6, 3]
    inverse = inverse_permutation(order_R)
    x_R = torch.arange(7) * 10
    assert torch.equal(x_R[order_R][inverse], x_R)


def test_group_by_local_expert_without_padding_is_a_permutation():
    gen = torch.Generator().manual_seed(0)
    recv_counts_WL = torch.randint(1, 5, (4, 3), generator=gen)
    order_R, counts_L = group_by_local_expert(recv_counts_WL)
    total = int(recv_counts_WL.sum())
    assert sorted(order_R.tolist()) == list(range(total))
    assert counts_L.tolist() == recv_counts_WL.sum(0).tolist()


def simulate_all_to_all(sends: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
    """``sends[v]`` split by ``splits[v]`` goes to ranks 0..W-1; rank w receives by source."""
    W = len(sends)
    pieces = [list(x.split(s)) for x, s in zip(sends, splits)]
    return [torch.cat([pieces[v][w] for v in range(W)]) for w in range(W)]


def expert_parallel_step(
    rows: list[torch.Tensor], counts: list[torch.Tensor], experts: GroupedExperts, W: int
) -> list[torch.Tensor]:
    """Dispatch -> local experts -> combine on W simulated ranks, with the module's pieces."""
    E = experts.num_experts
    L = E // W
    # counts all-to-all (equal splits of L)
    recv_counts = simulate_all_to_all(counts, [[L] * W] * W)
    send = [send_splits(c, W) for c in counts]
    padded = [pad_empty_splits(x, s) for x, s in zip(rows, send)]
    recv_splits = [[max(1, int(n)) for n in rc.view(W, L).sum(1)] for rc in recv_counts]
    received = simulate_all_to_all([p[0] for p in padded], [p[1] for p in padded])
    outputs = []
    for w in range(W):
        order_R, counts_L = group_by_local_expert(recv_counts[w].view(W, L))
        assert received[w].shape[0] == sum(recv_splits[w]) == order_R.numel()
        local = GroupedExperts(L, experts.w1.shape[1], experts.w1.shape[2])
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                getattr(local, name).copy_(getattr(experts, name)[w * L : (w + 1) * L])
        y_grouped = local(received[w][order_R], counts_L)
        outputs.append(y_grouped[inverse_permutation(order_R)])
    # combine: the reverse all-to-all, splits swapped
    back_splits = [[recv_splits[v][w] for w in range(W)] for v in range(W)]
    back = simulate_all_to_all(outputs, back_splits)
    for w in range(W):
        assert back[w].shape[0] == sum(padded[w][1]), (w, back[w].shape, padded[w][1])
    return [drop_split_padding(y, s) for y, s in zip(back, send)]


@pytest.mark.parametrize(("W", "E", "skewed"), [(2, 4, False), (4, 8, False), (4, 8, True)])
def test_simulated_dispatch_equals_local_moe(W, E, skewed):
    D, F, A = 6, 5, 2
    gen = torch.Generator().manual_seed(W * 100 + E)
    experts = GroupedExperts(E, D, F)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    rows, counts, orders, weights, inputs = [], [], [], [], []
    for rank in range(W):
        N = 3 + rank  # ranks hold different token counts
        x_ND = torch.randn(N, D, generator=gen)
        if skewed:
            # every token picks experts 0 and 1 (both on rank 0): the other ranks' experts get
            # nothing and every rank sends nothing to ranks 1..W-1
            experts_NA = torch.tensor([[0, 1]] * N)
        else:
            experts_NA = torch.stack([torch.randperm(E, generator=gen)[:A] for _ in range(N)])
        weights_NA = torch.rand(N, A, generator=gen)
        x_MD, order_M, counts_E = permute_tokens(x_ND, experts_NA, E)
        rows.append(x_MD)
        counts.append(counts_E)
        orders.append(order_M)
        weights.append(weights_NA)
        inputs.append(x_ND)
    got = expert_parallel_step(rows, counts, experts, W)
    for rank in range(W):
        expect_MD = experts(rows[rank], counts[rank])
        torch.testing.assert_close(got[rank], expect_MD, rtol=1e-6, atol=1e-6)
        # and through the unpermutation: the MoE output of the rank's tokens
        torch.testing.assert_close(
            unpermute_tokens(got[rank], orders[rank], weights[rank]),
            unpermute_tokens(expect_MD, orders[rank], weights[rank]),
            rtol=1e-6,
            atol=1e-6,
        )
