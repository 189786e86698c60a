"""Continuous batching generation with a slot-based KV cache, returning token ids and logprobs.

Requests join and leave the running batch at every decode step. The cache has one row (slot)
per running sequence; the running sequences always hold rows 0..n-1, so each decode step is
one forward over the view ``cache.row_range(0, n)`` (one token per sequence, each at its own
next position). A step:

1. **schedule**: waiting requests are admitted by priority (higher first), then arrival, into
   free rows. A waiting request of higher priority than a running one takes that row when the
   batch is full (the running one is *preempted*: its row is released, its tokens so far are
   kept and it waits again; on readmission its prompt + generated tokens are prefilled anew, so
   its logprobs still equal a full forward). With ``latency_batch_size`` set, the batch is
   capped at that size while any request of priority > 0 waits or runs (small decode batches
   for the latency tier).
2. **prefill** the admitted requests in chunks of at most ``max_prefill_tokens`` (rows x longest
   context), right-padded into their own rows; each samples its first token. Prefix sharing: a
   request whose context starts with at least ``min_shared_prefix`` tokens that a running row
   (or another request admitted in the same step) already holds copies that row
   (``cache.copy_row``) and prefills only the rest. The G samples of one task share their whole
   prompt, and every episode shares the tool declarations of the system prompt.
3. **decode** every running sequence one token.
4. **leave**: a finished sequence releases its row; the last row is copied into the hole so the
   running rows stay contiguous (``cache.copy_row``).

Masking follows ``etude.model.attention``: cache slot = position, and a query at position p
sees slots <= p of its own row; whatever a previous occupant or padding left beyond p is never
read before this sequence overwrites it.

A sequence stops at a stop token (kept in its output), when its decoded text contains a stop
string (checked on a window of its last tokens), or when its budget is spent:
``min(max_new_tokens, max_seq_len - prompt length)``.

Determinism: every request has its own seeded generator, so its tokens do not depend on which
other requests share the batch (up to float rounding of batched matmuls). ``generate`` with one
``SamplingParams`` for several prompts derives prompt i's seed from (seed, i). The model runs in
eval mode under ``torch.inference_mode`` and gets its previous mode back after every step.

Two ways to drive it: ``generate(prompts, params)`` submits a batch and steps until it is done
(the cache is freed when the engine is idle again); or ``submit`` / ``step`` / ``abort`` from
one thread that owns the engine (``etude serve`` runs this loop).

Not here: paged caches or a prefix cache that outlives its row (a multi-turn episode's next turn
reuses K/V only if a row with the same prefix is running),
chunked prefill mixed into decode steps, speculative decoding, CUDA graphs, tensor parallelism.

Legend: B sequences in a forward, L longest context of a prefill chunk, V vocabulary.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from etude.engine.sampling import Generation, SamplingParams, sample_tokens
from etude.model.transformer import Transformer


@dataclass(kw_only=True, slots=True, eq=False)
class _Sequence:
    """One request's state inside the engine."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: int
    budget: int
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: tuple[str, int | str | None] | None = None
    row: int = -1
    """Cache row while running; -1 while waiting."""
    policy_version: int = 0
    preemptions: int = 0

    @property
    def sort_key(self) -> tuple[int, int]:
        return (-self.priority, self.arrival)


@dataclass(kw_only=True, slots=True)
class StepOutput:
    """What one engine step produced for one request."""

    request_id: int
    new_token_ids: list[int]
    new_logprobs: list[float]
    generation: Generation | None = None
    """Set when the request finished in this step."""


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (binary search over C-speed slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def derive_seed(seed: int, index: int) -> int:
    """A 62-bit seed for the index-th request of a batch that shares ``seed``."""
    return (seed * 1_000_003 + index * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % (1 << 62)


class Engine:
    """Generates continuations of token-id prompts with a `Transformer`.

    ``decode_fn(ids) -> str`` turns token ids into text; it is needed only for stop strings.
    ``max_seq_len`` (default: the model's) bounds prompt + generation per sequence.
    ``max_batch_size`` bounds the running batch (cache rows); ``max_prefill_tokens`` the size
    (rows x longest context) of one prefill forward; ``latency_batch_size`` (0 = off) caps the
    batch while a request of priority > 0 is present; ``min_shared_prefix`` (0 = off) is the
    shortest prefix worth copying from another row.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        max_seq_len: int | None = None,
        decode_fn: Callable[[list[int]], str] | None = None,
        max_batch_size: int = 32,
        max_prefill_tokens: int = 4096,
        latency_batch_size: int = 0,
        min_shared_prefix: int = 32,
    ) -> None:
        limit = model.cfg.max_seq_len
        if max_seq_len is None:
            max_seq_len = limit
        if not isinstance(max_seq_len, int) or not 2 <= max_seq_len <= limit:
            raise ValueError(
                f"engine max_seq_len must be an integer in [2, {limit}] (model.max_seq_len), got "
                f"{max_seq_len!r}; lower it or raise the model's max_seq_len"
            )
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(
                f"engine max_batch_size must be an integer >= 1, got {max_batch_size!r}"
            )
        if not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1:
            raise ValueError(
                f"engine max_prefill_tokens must be an integer >= 1, got {max_prefill_tokens!r}"
            )
        if not isinstance(latency_batch_size, int) or not 0 <= latency_batch_size:
            raise ValueError(
                f"engine latency_batch_size must be an integer >= 0 (0 = off), got "
                f"{latency_batch_size!r}"
            )
        self.model = model
        self.max_seq_len = max_seq_len
        self.decode_fn = decode_fn
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.latency_batch_size = latency_batch_size
        if not isinstance(min_shared_prefix, int) or min_shared_prefix < 0:
            raise ValueError(
                f"engine min_shared_prefix must be an integer >= 0 (0 = no sharing), got "
                f"{min_shared_prefix!r}"
            )
        self.min_shared_prefix = min_shared_prefix
        self.num_shared_prefix_tokens = 0
        """Prompt tokens whose K/V were copied from another row instead of prefilled."""
        self.policy_version = 0
        """Recorded on every generation; the inference backend bumps it on a weight update."""
        self.num_preemptions = 0
        self._waiting: list[_Sequence] = []  # sorted by (-priority, arrival)
        self._running: list[_Sequence] = []  # running[r].row == r
        self._by_id: dict[int, _Sequence] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._cache = None
        self._cache_shape: tuple[int, int] | None = None  # (rows, slots) of the next cache

    # ------------------------------------------------------------------ batch API

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """One `Generation` per prompt, in prompt order: submit all, step until all are done.

        ``params`` is one setting for every prompt (prompt i seeded from (seed, i)) or one per
        prompt (each seeded by its own seed).
        """
        if not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        if isinstance(params, SamplingParams):
            per_prompt = [
                params
                if params.seed is None
                else dataclasses.replace(params, seed=derive_seed(params.seed, i))
                for i in range(len(prompts))
            ]
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(
                    f"got {len(per_prompt)} sampling params for {len(prompts)} prompts; pass one "
                    "SamplingParams or one per prompt"
                )
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            self._check(prompt, p, f"prompt {i}")
        if self.idle:
            rows = min(self.max_batch_size, len(prompts))
            slots = max(len(p) + self._budget(p, q) for p, q in zip(prompts, per_prompt))
            self._cache, self._cache_shape = None, (rows, slots)
        ids = [self.submit(p, q) for p, q in zip(prompts, per_prompt)]
        wanted = set(ids)
        done: dict[int, Generation] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.generation is not None and out.request_id in wanted:
                    done[out.request_id] = out.generation
        if self.idle:
            self._cache, self._cache_shape = None, None
        return [done[i] for i in ids]

    # ------------------------------------------------------------------ incremental API

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, priority: int = 0) -> int:
        """Queue one request; returns its id. Higher ``priority`` is scheduled first."""
        self._check(prompt_ids, params, "prompt")
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.model.tok_embeddings.weight.device)
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed)
        seq = _Sequence(
            request_id=next(self._ids),
            prompt_ids=list(prompt_ids),
            params=params,
            priority=int(priority),
            arrival=next(self._arrivals),
            budget=self._budget(prompt_ids, params),
            generator=generator,
        )
        self._by_id[seq.request_id] = seq
        self._enqueue(seq)
        return seq.request_id

    def abort(self, request_id: int) -> bool:
        """Drop a waiting or running request (its row is freed at once); False if unknown."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        if seq.row >= 0:
            with torch.inference_mode():  # the cache holds inference tensors
                self._release(seq)
        else:
            self._waiting.remove(seq)
        return True

    def step(self) -> list[StepOutput]:
        """Admit, prefill, decode one token per running sequence, release finished rows."""
        if self.idle:
            return []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                return self._step()
        finally:
            self.model.train(was_training)

    # ------------------------------------------------------------------ internals

    def _budget(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        return min(params.max_new_tokens, self.max_seq_len - len(prompt_ids))

    def _check(self, prompt: Sequence[int], params: SamplingParams, name: str) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{name}: sampling params must be a SamplingParams, got {params!r}")
        if params.stop_strings and self.decode_fn is None:
            raise ValueError(
                "sampling.stop_strings needs text: pass Engine(model, decode_fn=tokenizer.decode)"
            )
        if not isinstance(prompt, list | tuple) or len(prompt) == 0:
            raise ValueError(f"{name} is empty; every prompt needs at least one token")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(
                f"{name} has {len(prompt)} tokens, leaving no room under the engine's "
                f"max_seq_len ({self.max_seq_len}); shorten it or raise max_seq_len"
            )
        vocab = self.model.cfg.vocab_size
        bad = [
            t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(
                f"{name} has token id {bad[0]!r} outside [0, {vocab}) (model.vocab_size)"
            )

    def _enqueue(self, seq: _Sequence) -> None:
        keys = [s.sort_key for s in self._waiting]
        self._waiting.insert(bisect.bisect_right(keys, seq.sort_key), seq)

    def _ensure_cache(self) -> None:
        if self._cache is None:
            rows, slots = self._cache_shape or (self.max_batch_size, self.max_seq_len)
            self._cache = self.model.make_cache(rows, slots)
            self._cache_shape = (rows, slots)

    def _batch_cap(self) -> int:
        cap = self._cache_shape[0] if self._cache_shape else self.max_batch_size
        if self.latency_batch_size and any(
            s.priority > 0 for s in itertools.chain(self._waiting, self._running)
        ):
            cap = min(cap, self.latency_batch_size)
        return cap

    def _release(self, seq: _Sequence) -> None:
        """Free ``seq``'s row; the last running row moves into it (rows stay 0..n-1)."""
        row, last = seq.row, len(self._running) - 1
        assert self._running[row] is seq
        if row != last:
            moved = self._running[last]
            self._cache.copy_row(last, row)
            self._running[row], moved.row = moved, row
        self._running.pop()
        seq.row = -1

    def _schedule(self) -> list[_Sequence]:
        cap = self._batch_cap()
        top = max((s.priority for s in itertools.chain(self._waiting, self._running)), default=0)
        while self._running:
            victim = min(self._running, key=lambda s: (s.priority, -s.arrival))
            over_cap = len(self._running) > cap and victim.priority < top
            displaced = (
                bool(self._waiting)
                and len(self._running) >= cap
                and self._waiting[0].priority > victim.priority
            )
            if not (over_cap or displaced):
                break
            self._release(victim)
            victim.preemptions += 1
            self.num_preemptions += 1
            self._enqueue(victim)
        admitted = []
        while self._waiting and len(self._running) < cap:
            seq = self._waiting.pop(0)
            seq.row = len(self._running)
            self._running.append(seq)
            admitted.append(seq)
        return admitted

    def _step(self) -> list[StepOutput]:
        self._ensure_cache()
        outputs: dict[int, StepOutput] = {}
        admitted = self._schedule()
        first = len(self._running) - len(admitted)
        plan = self._plan_prefix_sharing(admitted, self._running[:first])
        # admitted rows hold nothing yet: renumber them in execution order (by level, then by
        # suffix length), so that every prefill forward covers consecutive rows
        plan.sort(
            key=lambda item: (item[3], len(item[0].prompt_ids) + len(item[0].token_ids) - item[2])
        )
        for row, (seq, _, _, _) in enumerate(plan, start=first):
            seq.row = row
            self._running[row] = seq
        for level in sorted({item[3] for item in plan}):
            items = [item for item in plan if item[3] == level]
            for seq, source, shared, _ in items:
                if source is not None:
                    self._cache.copy_row(source.row, seq.row)
                    self.num_shared_prefix_tokens += shared
            # one forward per chunk under the token budget; only prefills from position 0 are
            # padded together: a shared prefix's suffix starts late, so padding it could run
            # past the cache, and sharers go in runs of equal suffix length
            start = 0
            while start < len(items):
                stop, longest = start, 0
                while stop < len(items):
                    seq, _, shared, _ = items[stop]
                    n = len(seq.prompt_ids) + len(seq.token_ids) - shared
                    needs_equal = shared > 0 or items[start][2] > 0
                    if stop > start and (
                        (stop - start + 1) * max(longest, n) > self.max_prefill_tokens
                        or (needs_equal and n != longest)
                    ):
                        break
                    longest = max(longest, n)
                    stop += 1
                chunk = items[start:stop]
                self._prefill([c[0] for c in chunk], [c[2] for c in chunk], outputs)
                start = stop
        self._release_finished()
        device = self.model.tok_embeddings.weight.device
        if self._running:
            running = list(self._running)
            tokens_B1 = torch.tensor([[s.token_ids[-1]] for s in running], device=device)
            positions_B1 = torch.tensor(
                [[len(s.prompt_ids) + len(s.token_ids) - 1] for s in running], device=device
            )
            cache = self._cache.row_range(0, len(running))
            logits_BV = self.model(tokens_B1, positions_BT=positions_B1, cache=cache)[:, 0]
            self._sample(running, logits_BV, outputs)
            self._release_finished()
        for out in outputs.values():
            seq = self._by_id.get(out.request_id)
            if seq is not None and seq.finish is not None:
                del self._by_id[out.request_id]
                reason, stop = seq.finish
                out.generation = Generation(
                    token_ids=seq.token_ids,
                    logprobs=seq.logprobs,
                    finish_reason=reason,
                    stop=stop,
                    policy_version=seq.policy_version,
                )
        return list(outputs.values())

    def _plan_prefix_sharing(
        self, admitted: list[_Sequence], running: list[_Sequence]
    ) -> list[tuple[_Sequence, _Sequence | None, int, int]]:
        """Per admitted sequence: (seq, source row's sequence or None, shared tokens, level).

        A sequence shares when its context starts with at least ``min_shared_prefix`` tokens
        that a running row or an earlier admitted sequence holds; level 0 prefills from scratch,
        level k + 1 copies from a level-k (or running, level -1) source after that one's prefill.
        """
        plan: list[tuple[_Sequence, _Sequence | None, int, int]] = []
        # a running row holds K/V for its context minus the pending last token
        sources = [(s, s.prompt_ids + s.token_ids[:-1], -1) for s in running]
        for seq in admitted:
            context = seq.prompt_ids + seq.token_ids
            best, best_len, best_level = None, 0, -1
            if self.min_shared_prefix:
                for source, held, level in sources:
                    n = _common_prefix(context, held)
                    if n > best_len:
                        best, best_len, best_level = source, n, level
            # at least the last context token is prefilled: its logits sample the next token
            best_len = min(best_len, len(context) - 1)
            if best is not None and best_len >= self.min_shared_prefix:
                plan.append((seq, best, best_len, best_level + 1))
                sources.append((seq, context, best_level + 1))
            else:
                plan.append((seq, None, 0, 0))
                sources.append((seq, context, 0))
        return plan

    def _prefill(
        self, seqs: list[_Sequence], starts: list[int], outputs: dict[int, StepOutput]
    ) -> None:
        """One forward over ``seqs``'s contexts from ``starts`` (right-padded), each into its own
        row; samples every sequence's next token."""
        device = self.model.tok_embeddings.weight.device
        contexts = [s.prompt_ids + s.token_ids for s in seqs]
        lengths = [len(ids) - start for ids, start in zip(contexts, starts)]
        longest = max(lengths)
        tokens_BL = torch.zeros(len(seqs), longest, dtype=torch.long)
        for b, (ids, start) in enumerate(zip(contexts, starts)):
            tokens_BL[b, : lengths[b]] = torch.tensor(ids[start:], dtype=torch.long)
        # padding continues each row's positions; a row's slots beyond its context are written
        # but never read before the sequence overwrites them (cache slots >= every position)
        positions_BL = torch.tensor(starts, device=device)[:, None] + torch.arange(
            longest, device=device
        )
        last_B1 = torch.tensor([n - 1 for n in lengths], device=device)[:, None]
        rows = [s.row for s in seqs]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            cache = self._cache.row_range(rows[0], rows[-1] + 1)
            logits_BV = self.model(
                tokens_BL.to(device),
                positions_BT=positions_BL,
                cache=cache,
                logits_index_BN=last_B1,
            )[:, 0]
            self._sample(seqs, logits_BV, outputs)
        else:
            for seq, start in zip(seqs, starts):
                self._prefill([seq], [start], outputs)

    def _release_finished(self) -> None:
        for seq in [s for s in self._running if s.finish is not None]:
            self._release(seq)

    def _sample(
        self, seqs: list[_Sequence], logits_BV: torch.Tensor, outputs: dict[int, StepOutput]
    ) -> None:
        """Sample one token per sequence (row b of logits is seqs[b]) and record it."""
        tokens: list[int] = [0] * len(seqs)
        logprobs: list[float] = [0.0] * len(seqs)
        # greedy rows with the same settings draw nothing: one batched call per setting
        greedy: dict[tuple, list[int]] = {}
        for b, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                greedy.setdefault((p.temperature, p.top_p, p.top_k), []).append(b)
            else:
                token_1, logprob_1 = sample_tokens(logits_BV[b : b + 1], p, seq.generator)
                tokens[b], logprobs[b] = int(token_1), float(logprob_1)
        for rows in greedy.values():
            rows_B = torch.tensor(rows, device=logits_BV.device)
            tokens_B, logprobs_B = sample_tokens(logits_BV[rows_B], seqs[rows[0]].params, None)
            for b, token, logprob in zip(rows, tokens_B.tolist(), logprobs_B.tolist()):
                tokens[b], logprobs[b] = token, logprob
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            if not seq.token_ids and not seq.preemptions:
                seq.policy_version = self.policy_version
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            seq.finish = self._finish(seq, token)
            if seq.finish is None and len(seq.token_ids) >= seq.budget:
                seq.finish = ("length", None)
            out = outputs.get(seq.request_id)
            if out is None:
                out = outputs[seq.request_id] = StepOutput(
                    request_id=seq.request_id, new_token_ids=[], new_logprobs=[]
                )
            out.new_token_ids.append(token)
            out.new_logprobs.append(logprob)

    def _finish(self, seq: _Sequence, token: int) -> tuple[str, int | str | None] | None:
        """("stop", what) if the newest token ends the sequence by a stop rule, else None."""
        params = seq.params
        if token in params.stop_token_ids:
            return ("stop", token)
        if params.stop_strings:
            assert self.decode_fn is not None
            # a stop string of n UTF-8 bytes spans at most n + 1 byte-level tokens; the slack
            # covers tokens that decode to nothing (special tokens)
            window = 2 * max(len(s.encode()) for s in params.stop_strings) + 16
            text = self.decode_fn(seq.token_ids[-window:])
            for stop in params.stop_strings:
                if stop in text:
                    return ("stop", stop)
        return None
