"""Feed-forward layers: the dense SwiGLU FFN and the mixture of experts built around it.

A MoE layer (DeepSeek-V3 / Kimi K2 style) is four steps, each a separate piece so that expert
parallelism can later replace the middle of the pipeline without touching the rest:

1. `TopKRouter`: scores each token against every expert (sigmoid by default), picks the top-k
   experts by score + ``expert_bias`` and weights them by the score alone, normalized to sum 1
   (``norm_topk_prob``) and multiplied by ``route_scale``. Group-limited routing (DeepSeek-V3
   ``n_group``/``topk_group``): experts form equal groups, each group is scored by the sum of its
   two best biased scores, and only experts of the ``topk_groups`` best groups can be chosen (the
   others are masked with -inf, so a negative bias can never let a masked expert win). The bias is the aux-loss-free balancing knob of DeepSeek-V3
   (arXiv:2412.19437, sec. 2.1.2): it steers selection, never the output, and is updated outside
   autograd by ``MoE.update_expert_bias`` (overloaded experts go down).
2. `permute_tokens` (pure): copies each token once per chosen expert and groups the copies by
   expert; an expert-parallel layer sends these groups to the experts' ranks.
3. `GroupedExperts`: one SwiGLU FFN per expert, weights stacked ``w1, w3: [E, D, F]`` and
   ``w2: [E, F, D]`` (one tensor per kind, so the optimizer sees experts as blocks along dim 0),
   applied to rows already grouped by expert.
4. `unpermute_tokens` (pure): puts expert outputs back in token order and sums each token's
   outputs weighted by its routing weights. Shared experts (one fused FFN) are added on top.

No token dropping and no capacity factor: every token reaches its k experts. Not here: auxiliary
balance losses, expert parallelism (``etude.parallel`` wraps `GroupedExperts`' dispatch).

Legend: N tokens (batch and time flattened), D model width, F hidden width, E experts,
A experts per token (top-k), M = N*A routed rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from etude.model.config import ModelConfig
from etude.model.meta import ParamMeta


class FeedForward(nn.Module):
    """SwiGLU FFN ``w2(silu(w1 x) * w3 x)`` (Shazeer 2020, arXiv:2002.05202); no biases."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def param_meta(self) -> dict[str, ParamMeta]:
        return {f"{name}.weight": ParamMeta(kind="matrix") for name in ("w1", "w2", "w3")}

    def forward(self, x_ND: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x_ND)) * self.w3(x_ND))


class TopKRouter(nn.Module):
    """Top-k expert choice per token; returns fp32 weights [N, A] and expert ids [N, A]."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score: str = "sigmoid",
        route_scale: float = 1.0,
        num_groups: int = 1,
        topk_groups: int = 1,
        norm_topk_prob: bool = True,
    ) -> None:
        super().__init__()
        assert 1 <= top_k <= num_experts and score in ("sigmoid", "softmax")
        assert num_experts % num_groups == 0 and 1 <= topk_groups <= num_groups
        self.num_experts = num_experts
        self.top_k = top_k
        self.score = score
        self.route_scale = route_scale
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=False)
        # learned by the balancing rule, not by gradients; persistent so checkpoints keep it
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))

    def param_meta(self) -> dict[str, ParamMeta]:
        return {"gate.weight": ParamMeta(kind="router")}

    def forward(self, x_ND: Tensor) -> tuple[Tensor, Tensor]:
        # routing in fp32: near-ties between experts must not flip with the activation dtype
        logits_NE = F.linear(x_ND.float(), self.gate.weight.float())
        if self.score == "sigmoid":
            scores_NE = torch.sigmoid(logits_NE)
        else:
            scores_NE = torch.softmax(logits_NE, dim=-1)
        # the bias changes which experts are chosen, never how much they count
        choice_NE = scores_NE + self.expert_bias
        if self.num_groups > 1:
            choice_NGX = choice_NE.view(choice_NE.shape[0], self.num_groups, -1)
            group_score_NG = choice_NGX.topk(2, dim=-1).values.sum(dim=-1)
            groups_NK = group_score_NG.topk(self.topk_groups, dim=-1).indices
            keep_NG = torch.zeros_like(group_score_NG, dtype=torch.bool)
            keep_NG.scatter_(1, groups_NK, True)
            keep_NE = keep_NG[..., None].expand_as(choice_NGX).reshape_as(choice_NE)
            choice_NE = choice_NE.masked_fill(~keep_NE, float("-inf"))
        experts_NA = torch.topk(choice_NE, self.top_k, dim=-1).indices
        weights_NA = scores_NE.gather(1, experts_NA)
        if self.norm_topk_prob:
            weights_NA = weights_NA / (weights_NA.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_NA * self.route_scale, experts_NA


def permute_tokens(
    x_ND: Tensor, experts_NA: Tensor, num_experts: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Group token copies by expert.

    Returns ``x_MD`` (row m is token ``order_M[m] // A``, rows of expert 0 first, then expert 1,
    ...; token order kept inside a group), ``order_M`` (the flat routed slot ``n*A + a`` of each
    grouped row) and ``num_tokens_per_expert_E`` (int64 group sizes).
    """
    top_k = experts_NA.shape[1]
    flat_M = experts_NA.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)
    num_tokens_per_expert_E = torch.bincount(flat_M, minlength=num_experts)
    return x_ND[order_M // top_k], order_M, num_tokens_per_expert_E


def unpermute_tokens(y_MD: Tensor, order_M: Tensor, weights_NA: Tensor) -> Tensor:
    """Inverse of `permute_tokens`: ``out[n] = sum_a weights[n, a] * y[row of (n, a)]`` [N, D].

    A gather by the inverse permutation then a sum over A (no scatter-add: deterministic on GPU).
    """
    num_tokens, top_k = weights_NA.shape
    assert y_MD.shape[0] == num_tokens * top_k == order_M.shape[0], (y_MD.shape, weights_NA.shape)
    inverse_M = torch.empty_like(order_M)
    inverse_M[order_M] = torch.arange(order_M.shape[0], device=order_M.device)
    y_NAD = y_MD[inverse_M].view(num_tokens, top_k, -1)
    out_ND = (y_NAD.float() * weights_NA[..., None].float()).sum(dim=1)
    return out_ND.to(y_MD.dtype)


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights, applied to rows grouped by expert.

    ``forward(x_MD, num_tokens_per_expert_E)``: the first ``counts[0]`` rows go to expert 0, the
    next ``counts[1]`` to expert 1, ...; rows past ``sum(counts)`` (padding an EP dispatch may
    add) come out as zeros. Experts with no rows are skipped. Two equivalent kernels:
    ``torch.nn.functional.grouped_mm`` (one launch, no host sync; CUDA bf16 with 16-byte aligned
    rows) and a loop over experts on slices (everywhere else). ``use_grouped_mm``: None picks
    automatically, True/False forces one.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.use_grouped_mm: bool | None = None

    def param_meta(self) -> dict[str, ParamMeta]:
        meta = ParamMeta(kind="experts", num_blocks=self.num_experts)
        return {"w1": meta, "w2": meta, "w3": meta}

    def _grouped_mm_ok(self, x_MD: Tensor) -> bool:
        if self.use_grouped_mm is not None:
            return self.use_grouped_mm
        _, dim, hidden = self.w1.shape
        aligned = (dim * x_MD.element_size()) % 16 == 0 and (hidden * x_MD.element_size()) % 16 == 0
        return x_MD.is_cuda and x_MD.dtype == torch.bfloat16 and aligned

    def forward(self, x_MD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
        assert num_tokens_per_expert_E.shape == (self.w1.shape[0],), (
            num_tokens_per_expert_E.shape,
            self.w1.shape,
        )
        if self._grouped_mm_ok(x_MD):
            return self._forward_grouped_mm(x_MD, num_tokens_per_expert_E)
        return self._forward_loop(x_MD, num_tokens_per_expert_E)

    def _forward_loop(self, x_MD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
        counts = num_tokens_per_expert_E.tolist()
        assert sum(counts) <= x_MD.shape[0], (counts, x_MD.shape)
        # unbind, not w[e] per expert: its backward stacks the E gradients once, where E
        # separate selects would each materialize a full-size [E, ...] zero gradient
        w1s, w3s, w2s = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)
        outs, start = [], 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            xe_CD = x_MD[start : start + count]
            he_CF = F.silu(xe_CD @ w1s[expert]) * (xe_CD @ w3s[expert])
            outs.append(he_CF @ w2s[expert])
            start += count
        if start < x_MD.shape[0] or not outs:
            outs.append(x_MD.new_zeros(x_MD.shape[0] - start, self.w2.shape[2]))
        return torch.cat(outs)

    def _forward_grouped_mm(self, x_MD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0).to(torch.int32)
        h1_MF = F.grouped_mm(x_MD, self.w1, offs=offsets_E)
        h3_MF = F.grouped_mm(x_MD, self.w3, offs=offsets_E)
        out_MD = F.grouped_mm(F.silu(h1_MF) * h3_MF, self.w2, offs=offsets_E)
        # the kernel leaves rows past the last offset unspecified: zero them
        used_M = torch.arange(x_MD.shape[0], device=x_MD.device) < offsets_E[-1]
        return torch.where(used_M[:, None], out_MD, torch.zeros((), dtype=out_MD.dtype))


class MoE(nn.Module):
    """Router + permutation + grouped experts + unpermutation + shared experts.

    Load statistics: ``last_load`` [E] (int64) is the number of token copies each expert got in
    the latest forward; in training mode the same counts also accumulate into the non-persistent
    buffer ``tokens_per_expert`` [E] (fp32) that ``update_expert_bias`` consumes and resets.
    Inference traffic (eval mode, e.g. the generation engine) does not move the balance.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.num_experts > 0
        self.num_experts = cfg.num_experts
        self.router = TopKRouter(
            cfg.dim,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            score=cfg.router_score,
            route_scale=cfg.route_scale,
            num_groups=cfg.router_num_groups,
            topk_groups=cfg.router_topk_groups,
            norm_topk_prob=cfg.norm_topk_prob,
        )
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.expert_ffn_dim)
        self.shared_experts = (
            FeedForward(cfg.dim, cfg.num_shared_experts * cfg.expert_ffn_dim)
            if cfg.num_shared_experts > 0
            else None
        )
        self.register_buffer(
            "tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.float32), persistent=False
        )
        self.last_load: Tensor | None = None

    def forward(self, x_BTD: Tensor) -> Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        weights_NA, experts_NA = self.router(x_ND)
        x_MD, order_M, num_tokens_per_expert_E = permute_tokens(x_ND, experts_NA, self.num_experts)
        self.last_load = num_tokens_per_expert_E.detach()
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert += num_tokens_per_expert_E.to(self.tokens_per_expert.dtype)
        y_MD = self.experts(x_MD, num_tokens_per_expert_E)
        out_ND = unpermute_tokens(y_MD, order_M, weights_NA)
        if self.shared_experts is not None:
            out_ND = out_ND + self.shared_experts(x_ND)
        return out_ND.view_as(x_BTD)

    @torch.no_grad()
    def update_expert_bias(self, rate: float) -> None:
        """Aux-loss-free balancing: ``bias += rate * sign(mean_load - load)``, then reset counts.

        Overloaded experts (load above the mean) become less likely to be selected. With data
        parallelism the caller sums ``tokens_per_expert`` over ranks first.
        """
        load_E = self.tokens_per_expert
        self.router.expert_bias += rate * torch.sign(load_E.mean() - load_E)
        load_E.zero_()
