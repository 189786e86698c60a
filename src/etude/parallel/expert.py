"""Expert parallelism (EP): the routed experts of a MoE layer split over the ``ep`` ranks.

Each of the W = ``ep`` ranks of a group holds L = E / W consecutive experts (rank w: experts
``w*L .. w*L+L-1``) and every token copy travels to the rank of its expert and back. The MoE
layer itself is unchanged (router, `permute_tokens`, `unpermute_tokens`, shared experts run on
the rank's own tokens); only the grouped-expert call in the middle becomes distributed:

1. counts: ``num_tokens_per_expert_E`` of this rank's rows (already grouped by expert, so the
   rows for rank w are one contiguous run) goes out with an equal-split all-to-all: rank w gets
   ``[W, L]`` counts, row v = what rank v sends for each of w's experts. One host sync follows:
   the token all-to-all needs its split sizes on the host.
2. tokens: ``all_to_all_single`` of the rows with those splits (autograd: its backward is the
   reverse all-to-all). A split that would be empty carries one zero row instead: no rank ever
   enters the collective with an empty send or receive (https://github.com/pytorch/pytorch/
   issues/146468 saw a hang with empty buffers).
3. local permutation (pure): received rows come ordered (source rank, local expert); a gather
   regroups them by local expert (source order kept), padding rows last. The model's own
   `GroupedExperts` kernel runs on the rank's local expert weights (rows past the counts come
   out as zeros).
4. combine: the inverse gather, the reverse all-to-all, padding rows dropped; the MoE layer then
   unpermutes and weights the outputs as without EP.

So the result equals the non-EP MoE exactly (same rows through the same expert weights). Every
rank always runs both all-to-alls and their backward, also when its experts got no token: a
rank that skipped one would hang the others.

The expert weights are DTensors on the expert mesh ``(dp_replicate, efsdp, ep)``, ``Shard(0)``
over ``ep`` (FSDP adds its own shard over ``efsdp``); the forward uses their local tensors.

Not here: capacity factors or token dropping, overlapping the all-to-all with compute (DeepEP
style), hierarchical (intra-node first) dispatch.

Legend: E experts, W ranks of the ep group, L = E / W local experts, M rows (token copies) of
this rank, R received rows (padding included), D model width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from etude.model.moe import GroupedExperts


def send_splits(num_tokens_per_expert_E: Tensor, ep: int) -> list[int]:
    """Rows this rank sends to each ep rank: the sum of its counts for that rank's experts."""
    assert num_tokens_per_expert_E.numel() % ep == 0, (num_tokens_per_expert_E.shape, ep)
    return num_tokens_per_expert_E.view(ep, -1).sum(dim=1).tolist()


def pad_empty_splits(x_MD: Tensor, splits: Sequence[int]) -> tuple[Tensor, list[int]]:
    """Insert one zero row where a split is empty; returns the rows and the padded splits."""
    if all(s > 0 for s in splits):
        return x_MD, list(splits)
    parts, start = [], 0
    for s in splits:
        parts.append(x_MD[start : start + s] if s > 0 else x_MD.new_zeros(1, x_MD.shape[1]))
        start += s
    assert start == x_MD.shape[0], (start, x_MD.shape)
    return torch.cat(parts), [max(1, s) for s in splits]


def drop_split_padding(y_MD: Tensor, splits: Sequence[int]) -> Tensor:
    """Inverse of `pad_empty_splits`: remove the one-row padding of the empty splits."""
    if all(s > 0 for s in splits):
        return y_MD
    keep, start = [], 0
    for s in splits:
        if s > 0:
            keep.append(y_MD[start : start + s])
        start += max(1, s)
    assert start == y_MD.shape[0], (start, y_MD.shape)
    return torch.cat(keep) if keep else y_MD[:0]


def group_by_local_expert(recv_counts_WL: Tensor) -> tuple[Tensor, Tensor]:
    """Order that regroups received rows by local expert, and the rows per local expert.

    Received rows arrive by source rank v, inside it by local expert l (``recv_counts_WL[v, l]``
    rows each), a source that sends nothing contributes one padding row. Returns ``order_R``
    with ``x_grouped = x_recv[order_R]``: expert 0's rows (source 0, 1, ... in turn), then
    expert 1's, ...; padding rows last. And ``num_tokens_per_expert_L`` (int64).
    """
    W, L = recv_counts_WL.shape
    counts_WL = recv_counts_WL.to(torch.int64).cpu()
    rows_W = counts_WL.sum(dim=1)
    padded_W = rows_W.clamp(min=1)
    source_start_W = torch.cumsum(padded_W, 0) - padded_W
    # start of block (v, l) in the received buffer
    start_WL = source_start_W[:, None] + torch.cumsum(counts_WL, 1) - counts_WL
    # blocks in (l, v) order: the grouped layout
    starts_LW, counts_LW = start_WL.mT.reshape(-1), counts_WL.mT.reshape(-1)
    total = int(counts_LW.sum())
    block_of_row = torch.repeat_interleave(torch.arange(W * L), counts_LW)
    first_row_of_block = torch.cumsum(counts_LW, 0) - counts_LW
    order_M = starts_LW[block_of_row] + torch.arange(total) - first_row_of_block[block_of_row]
    pad_sources = (rows_W == 0).nonzero().flatten()
    order_R = torch.cat((order_M, source_start_W[pad_sources]))
    return order_R.to(recv_counts_WL.device), counts_WL.sum(dim=0).to(recv_counts_WL.device)


def inverse_permutation(order_R: Tensor) -> Tensor:
    """``inv`` with ``x[order][inv] == x``."""
    inverse_R = torch.empty_like(order_R)
    inverse_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    return inverse_R


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class ExpertParallelExperts(GroupedExperts):
    """`GroupedExperts` whose forward dispatches rows to the experts' ep ranks and back.

    Made from a built `GroupedExperts` by `etude.parallel.fsdp.parallelize` (class swap, as
    ``fully_shard`` does): parameter names and metadata stay, only the weights become DTensors
    sharded over ``ep``. ``forward(x_MD, num_tokens_per_expert_E)`` has the signature and result
    of `GroupedExperts.forward` on all E experts.
    """

    ep_group: Any
    ep_size: int
    local_kernel: GroupedExperts
    """A meta-device `GroupedExperts` of L experts, run with this rank's local weights through
    ``torch.func.functional_call``: the model's kernels, not a copy of them."""

    def forward(self, x_MD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        W = self.ep_size
        E = num_tokens_per_expert_E.numel()
        assert E == self.num_experts and E % W == 0, (E, self.num_experts, W)
        # 1. counts (equal splits of L per rank), then the one host sync of the layer
        counts_E = num_tokens_per_expert_E.to(torch.int64)
        recv_counts_E = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts_E, counts_E, group=self.ep_group)
        counts_2E = torch.stack((counts_E, recv_counts_E)).cpu()
        send = send_splits(counts_2E[0], W)
        recv_counts_WL = counts_2E[1].view(W, E // W)
        recv = recv_counts_WL.sum(dim=1).tolist()
        # 2. tokens
        x_pad_MD, send_padded = pad_empty_splits(x_MD, send)
        recv_padded = [max(1, r) for r in recv]
        x_recv_RD = all_to_all_single_autograd(
            x_pad_MD.contiguous(), recv_padded, send_padded, self.ep_group
        )
        # 3. local experts on rows grouped by expert
        order_R, counts_L = group_by_local_expert(recv_counts_WL)
        order_R, counts_L = order_R.to(x_MD.device), counts_L.to(x_MD.device)
        x_grouped_RD = x_recv_RD[order_R]
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        self.local_kernel.use_grouped_mm = self.use_grouped_mm
        y_grouped_RD = torch.func.functional_call(
            self.local_kernel, {"w1": w1, "w2": w2, "w3": w3}, (x_grouped_RD, counts_L)
        )
        if sum(recv) == 0:
            # no row for any local expert: keep the weights and the received rows in the graph
            # so this rank's backward still runs both all-to-alls and yields (zero) gradients
            touch = w1.sum() + w2.sum() + w3.sum()
            y_grouped_RD = y_grouped_RD + 0.0 * (x_grouped_RD + touch)
        # 4. combine
        y_recv_RD = y_grouped_RD[inverse_permutation(order_R)]
        y_pad_MD = all_to_all_single_autograd(
            y_recv_RD.contiguous(), send_padded, recv_padded, self.ep_group
        )
        return drop_split_padding(y_pad_MD, send)


def make_expert_parallel(experts: GroupedExperts, expert_mesh: Any) -> None:
    """Turn ``experts`` (built, possibly on meta) into `ExpertParallelExperts` on ``expert_mesh``.

    Each weight ``[E, ...]`` becomes a DTensor on the whole expert mesh ``(dp_replicate, efsdp,
    ep)`` with placements ``(Replicate, Replicate, Shard(0))``: the local tensor holds this ep
    rank's L experts (a slice of the existing data, or a meta tensor). FSDP then shards the
    ``efsdp`` axis (see ``etude.parallel.fsdp``).
    """
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, Shard

    assert type(experts) is GroupedExperts, type(experts)
    ep_mesh = expert_mesh["ep"]
    W, e = ep_mesh.size(), ep_mesh.get_local_rank()
    E = experts.num_experts
    assert E % W == 0, (E, W)
    L = E // W
    placements = (Replicate(), Replicate(), Shard(0))
    for name in ("w1", "w2", "w3"):
        full = getattr(experts, name)
        local = full.detach()[e * L : (e + 1) * L].clone()
        dtensor = DTensor.from_local(
            local, expert_mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
        )
        setattr(experts, name, nn.Parameter(dtensor, requires_grad=full.requires_grad))
    _, dim, hidden = experts.w1.shape
    with torch.device("meta"):
        kernel = GroupedExperts(L, dim, hidden)
    experts.__class__ = ExpertParallelExperts
    experts.ep_group = ep_mesh.get_group()
    experts.ep_size = W
    # a plain attribute, not a submodule: the kernel has no state of its own
    object.__setattr__(experts, "local_kernel", kernel)
