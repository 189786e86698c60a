"""Batched generation with a preallocated KV cache: one prefill, then decode steps until every
sequence has stopped. Returns token ids and the logprobs the RL trainer needs.

Ragged batches: prompts are right-padded and prefilled together at positions 0..L-1, with logits
taken at each prompt's own last token; each sequence then decodes at its own next position
(cache slot = position, see ``etude.model.attention``), so padding never reaches a real token.
When at most half of the rows are still running, finished rows are dropped from the batch and
the cache, so a long tail does not pay for the whole batch (total copying stays under twice the
cache size).

A sequence stops at a stop token (kept in its output), when its decoded text contains a stop
string (checked on a window of its last tokens), or when its budget is spent:
``min(max_new_tokens, max_seq_len - prompt length)``.

Determinism: one seeded generator drives every random draw, so the same model, prompts and
params (seed included) give the same output. The model runs in eval mode under
``torch.inference_mode`` and gets its previous mode back afterwards.

Not here: continuous batching (adding prompts mid-flight), paged or shared-prefix caches,
speculative decoding, CUDA graphs, tensor parallelism.

Legend: B sequences in the running batch, L longest prompt, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from etude.engine.sampling import Generation, SamplingParams, sample_tokens
from etude.model.transformer import Transformer


class Engine:
    """Generates continuations of token-id prompts with a `Transformer`.

    ``decode_fn(ids) -> str`` turns token ids into text; it is needed only for stop strings.
    ``max_seq_len`` (default: the model's) bounds prompt + generation per sequence.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        max_seq_len: int | None = None,
        decode_fn: Callable[[list[int]], str] | None = None,
    ) -> None:
        limit = model.cfg.max_seq_len
        if max_seq_len is None:
            max_seq_len = limit
        if not isinstance(max_seq_len, int) or not 2 <= max_seq_len <= limit:
            raise ValueError(
                f"engine max_seq_len must be an integer in [2, {limit}] (model.max_seq_len), got "
                f"{max_seq_len!r}; lower it or raise the model's max_seq_len"
            )
        self.model = model
        self.max_seq_len = max_seq_len
        self.decode_fn = decode_fn

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One `Generation` per prompt, in prompt order."""
        self._check_prompts(prompts)
        if params.stop_strings and self.decode_fn is None:
            raise ValueError(
                "sampling.stop_strings needs text: pass Engine(model, decode_fn=tokenizer.decode)"
            )
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                return self._generate(prompts, params)
        finally:
            self.model.train(was_training)

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        if not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        vocab = self.model.cfg.vocab_size
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if len(prompt) >= self.max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens, leaving no room under the engine's "
                    f"max_seq_len ({self.max_seq_len}); shorten it or raise max_seq_len"
                )
            bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"prompt {i} has token id {bad[0]!r} outside [0, {vocab}) (model.vocab_size)"
                )

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        model = self.model
        device = model.tok_embeddings.weight.device
        num_seqs = len(prompts)
        prompt_lens = [len(p) for p in prompts]
        budgets = [min(params.max_new_tokens, self.max_seq_len - n) for n in prompt_lens]
        cache = model.make_cache(num_seqs, max(n + b for n, b in zip(prompt_lens, budgets)))
        generator = torch.Generator(device=device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)

        prompt_BL = torch.zeros(num_seqs, max(prompt_lens), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            prompt_BL[b, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        last_B1 = torch.tensor(prompt_lens, device=device)[:, None] - 1
        logits_BV = model(prompt_BL.to(device), cache=cache, logits_index_BN=last_B1)[:, 0]

        token_ids: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finish: list[tuple[str, int | str | None] | None] = [None] * num_seqs
        stop_ids = frozenset(params.stop_token_ids)
        # a stop string of n UTF-8 bytes spans at most n + 1 byte-level tokens; the slack covers
        # tokens that decode to nothing (special tokens)
        window = 2 * max((len(s.encode()) for s in params.stop_strings), default=0) + 16
        rows = list(range(num_seqs))  # sequence index of each batch row
        while True:
            tokens_B, logprobs_B = sample_tokens(logits_BV, params, generator)
            for seq, token, logprob in zip(rows, tokens_B.tolist(), logprobs_B.tolist()):
                if finish[seq] is not None:
                    continue
                token_ids[seq].append(token)
                logprobs[seq].append(logprob)
                finish[seq] = self._finish(token_ids[seq], token, stop_ids, params, window)
                if finish[seq] is None and len(token_ids[seq]) >= budgets[seq]:
                    finish[seq] = ("length", None)
            running = [row for row, seq in enumerate(rows) if finish[seq] is None]
            if not running:
                break
            if len(running) <= len(rows) // 2:
                keep_B = torch.tensor(running, device=device)
                cache.keep_rows(keep_B)
                tokens_B = tokens_B[keep_B]
                rows = [rows[row] for row in running]
            # the token just sampled goes at its sequence's next slot; finished rows still in the
            # batch rewrite slot 0 of their own (dead) cache row, which nothing reads
            positions = [
                prompt_lens[seq] + len(token_ids[seq]) - 1 if finish[seq] is None else 0
                for seq in rows
            ]
            positions_B1 = torch.tensor(positions, device=device)[:, None]
            logits_BV = model(tokens_B[:, None], positions_BT=positions_B1, cache=cache)[:, 0]

        out = []
        for seq in range(num_seqs):
            reason, stop = finish[seq]
            out.append(
                Generation(
                    token_ids=token_ids[seq],
                    logprobs=logprobs[seq],
                    finish_reason=reason,
                    stop=stop,
                )
            )
        return out

    def _finish(
        self,
        ids: list[int],
        token: int,
        stop_ids: frozenset[int],
        params: SamplingParams,
        window: int,
    ) -> tuple[str, int | str | None] | None:
        """("stop", what) if the newest token ends the sequence by a stop rule, else None."""
        if token in stop_ids:
            return ("stop", token)
        if params.stop_strings:
            assert self.decode_fn is not None
            text = self.decode_fn(ids[-window:])
            for stop in params.stop_strings:
                if stop in text:
                    return ("stop", stop)
        return None
