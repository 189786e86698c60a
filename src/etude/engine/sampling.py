"""Sampling settings, the per-sequence generation record, and the sampling math.

The math is pure functions over one decode step's logits [B, V]:

- ``sampling_logprobs``: the log-probabilities of the distribution actually sampled: logits
  divided by the temperature, top-k then top-p truncation, renormalized over the kept tokens
  (``-inf`` outside them). The RL trainer applies this same transform to the logits of its full
  forward (``etude.rl.trainer``), so importance ratios compare like with like.
- ``token_logprobs``: that distribution's logprob at the sampled token, which the engine reports
  as the behaviour logprob (temperature 1 when greedy, no truncation).
- ``truncate_probs``: top-k then top-p (nucleus, Holtzman et al. 2019, arXiv:1904.09751)
  filtering; the kept probabilities are not renormalized (sampling below does not need it).
- ``sample_tokens``: the exponential race ``argmax_v p_v / e_v`` with ``e_v ~ Exp(1)``, which
  draws v with probability proportional to p_v (as ``torch.multinomial`` would) from one
  vectorized, seeded random draw.

Not here: repetition/frequency penalties, beam search, logit processors, constrained decoding.

Legend: B sequences, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How the engine samples; one setting for every sequence of a ``generate`` call."""

    max_new_tokens: int
    """Most tokens generated per sequence (fewer if the engine's max_seq_len is reached)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens whose mass reaches top_p; 1 = off."""
    top_k: int = 0
    """Keep only the top_k most likely tokens; 0 = off."""
    stop_token_ids: tuple[int, ...] = ()
    """A sequence finishes after sampling one of these (the stop token is kept in the output)."""
    stop_strings: tuple[str, ...] = ()
    """A sequence finishes once its decoded text contains one of these (needs a decode_fn)."""
    seed: int | None = None
    """Seed of the sampling generator: same seed, model and batch -> same output; None = random."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"sampling.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}"
            )
        if not isinstance(self.temperature, int | float) or not self.temperature >= 0:
            raise ValueError(
                f"sampling.temperature must be >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"sampling.top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"
            )
        self.stop_token_ids = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"sampling.stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}"
            )
        if isinstance(self.stop_strings, str):
            raise ValueError(
                f"sampling.stop_strings must be a list of strings, got the string "
                f"{self.stop_strings!r}; write [{self.stop_strings!r}]"
            )
        self.stop_strings = tuple(self.stop_strings)
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(
                f"sampling.stop_strings must be non-empty strings, got {self.stop_strings!r}"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"sampling.seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(kw_only=True, slots=True)
class Generation:
    """What the engine generated for one prompt."""

    token_ids: list[int]
    """Generated token ids (prompt excluded; a stop token, if any, included)."""
    logprobs: list[float]
    """Per generated token: its logprob under the distribution sampled (``sampling_logprobs``:
    after temperature and top-k/top-p truncation, renormalized)."""
    finish_reason: Literal["stop", "length"]
    """"stop": a stop token or stop string ended it; "length": the token budget did."""
    stop: int | str | None = None
    """The stop token id or stop string that ended the sequence (None for "length")."""
    policy_version: int = 0
    """Version of the weights that sampled the first token (a reload mid-request is applied
    between decode steps, so later tokens may come from a newer version)."""


def sampling_logprobs(
    logits_NV: Tensor, temperature: float, *, top_k: int = 0, top_p: float = 1.0
) -> Tensor:
    """fp32 log-probabilities [N, V] of the distribution sampled from ``logits_NV``.

    ``log_softmax(logits / temperature)`` (temperature 0 counts as 1), then the tokens outside
    the top-k / top-p nucleus (``truncate_probs``' rule) get ``-inf`` and the kept ones are
    renormalized. Differentiable in the kept logits; the kept set itself is a discrete choice.
    """
    scale = temperature if temperature > 0 else 1.0
    logp_NV = torch.log_softmax(logits_NV.float() / scale, dim=-1)
    if top_k <= 0 and top_p >= 1.0:
        return logp_NV
    with torch.no_grad():
        keep_NV = truncate_probs(logp_NV.exp(), top_k=top_k, top_p=top_p) > 0
        # the most likely token is always kept, even if its probability underflows to 0
        keep_NV.scatter_(1, logp_NV.argmax(dim=-1, keepdim=True), True)
    kept_NV = logp_NV.masked_fill(~keep_NV, float("-inf"))
    return kept_NV - torch.logsumexp(kept_NV, dim=-1, keepdim=True)


def token_logprobs(
    logits_BV: Tensor,
    tokens_B: Tensor,
    temperature: float,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Tensor:
    """fp32 logprob [B] of ``tokens_B`` under the sampled distribution (``sampling_logprobs``)."""
    logprobs_BV = sampling_logprobs(logits_BV, temperature, top_k=top_k, top_p=top_p)
    return logprobs_BV.gather(1, tokens_B[:, None])[:, 0]


def truncate_probs(probs_BV: Tensor, *, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Zero every probability outside the top-k and outside the top-p nucleus (no renormalizing).

    Nucleus rule: sorted descending, a token is kept if the mass strictly before it is < top_p,
    so the most likely token is always kept. Ties at the top-k boundary keep sort order.
    """
    if top_k <= 0 and top_p >= 1.0:
        return probs_BV
    sorted_BV, order_BV = torch.sort(probs_BV, dim=-1, descending=True)
    keep_BV = torch.ones_like(sorted_BV, dtype=torch.bool)
    if top_k > 0:
        keep_BV[:, top_k:] = False
    if top_p < 1.0:
        mass_before_BV = torch.cumsum(sorted_BV, dim=-1) - sorted_BV
        keep_BV &= mass_before_BV < top_p
    kept_BV = torch.where(keep_BV, sorted_BV, torch.zeros((), dtype=sorted_BV.dtype))
    return torch.zeros_like(probs_BV).scatter(1, order_BV, kept_BV)


def sample_tokens(
    logits_BV: Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """One token per row and its logprob (see ``token_logprobs``); both [B]."""
    if params.greedy:
        tokens_B = logits_BV.argmax(dim=-1)
        return tokens_B, token_logprobs(logits_BV, tokens_B, 0.0)
    logp_BV = sampling_logprobs(
        logits_BV, params.temperature, top_k=params.top_k, top_p=params.top_p
    )
    probs_BV = logp_BV.exp()  # zero outside the top-k / top-p set
    # exponential race: argmax p/e with e ~ Exp(1) samples v with probability p_v / sum(p)
    race_BV = torch.empty_like(probs_BV).exponential_(generator=generator)
    # a draw of exactly 0 would turn a truncated token's 0/0 into NaN, which argmax picks
    race_BV.clamp_(min=torch.finfo(race_BV.dtype).tiny)
    tokens_B = (probs_BV / race_BV).argmax(dim=-1)
    return tokens_B, logp_BV.gather(1, tokens_B[:, None])[:, 0]
