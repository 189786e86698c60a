"""Generation engine: logprobs vs a full forward, ragged batches, stops, seeding, sampling math."""

from __future__ import annotations

import re

import pytest
import torch

from etude.engine import Engine, Generation, SamplingParams
from etude.engine.sampling import sample_tokens, truncate_probs
from etude.model import ModelConfig
from etude.model.transformer import Transformer, build_model

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 100, 8], [1], [30, 31, 32, 33, 34]]


def engine_model(**overrides) -> Transformer:
    fields = dict(
        vocab_size=128,
        dim=64,
        num_layers=3,
        num_dense_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dense_ffn_dim=96,
        num_experts=4,
        num_experts_per_tok=2,
        expert_ffn_dim=32,
        num_shared_experts=1,
        max_seq_len=48,
        init_std=0.15,
    )
    return build_model(ModelConfig.preset("tiny", **{**fields, **overrides}), seed=11)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return engine_model()


def full_forward_logprobs(model, prompt, generated, temperature, top_k=0, top_p=1.0):
    """What the RL trainer computes: one teacher-forced forward over prompt + generation, under
    the distribution sampled (temperature, then top-k / top-p, renormalized)."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1]
    scale = temperature if temperature > 0 else 1.0
    logprobs = torch.log_softmax(logits / scale, dim=-1)
    if temperature > 0 and (top_k > 0 or top_p < 1.0):
        sorted_p, order = logprobs.exp().sort(dim=-1, descending=True)
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if top_k > 0:
            keep[:, top_k:] = False
        keep &= (sorted_p.cumsum(-1) - sorted_p) < top_p
        mask = torch.zeros_like(keep).scatter(1, order, keep)
        kept = logprobs.masked_fill(~mask, float("-inf"))
        logprobs = kept - torch.logsumexp(kept, dim=-1, keepdim=True)
    return logprobs.gather(1, torch.tensor(generated)[:, None])[:, 0]


# ---------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(max_new_tokens=0), "sampling.max_new_tokens must be an integer >= 1, got 0"),
        (dict(temperature=-0.5), "sampling.temperature must be >= 0 (0 = greedy), got -0.5"),
        (dict(top_p=0.0), "sampling.top_p must be in (0, 1] (1 = off), got 0.0"),
        (dict(top_k=-1), "sampling.top_k must be an integer >= 0 (0 = off), got -1"),
        (dict(stop_token_ids=(3, -1)), "sampling.stop_token_ids must be non-negative token ids"),
        (dict(stop_strings="END"), "write ['END']"),
        (dict(stop_strings=("",)), "sampling.stop_strings must be non-empty strings"),
        (dict(seed=1.5), "sampling.seed must be an integer or None, got 1.5"),
    ],
)
def test_sampling_params_validation(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**{"max_new_tokens": 4, **fields})


def test_sampling_params_accept_lists():
    params = SamplingParams(max_new_tokens=2, stop_token_ids=[1, 2], stop_strings=["a"])
    assert params.stop_token_ids == (1, 2) and params.stop_strings == ("a",)


def test_engine_input_errors(model):
    engine = Engine(model)
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="prompts must be a non-empty list"):
        engine.generate([], params)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], params)
    with pytest.raises(ValueError, match=r"prompt 0 has token id 128 outside \[0, 128\)"):
        engine.generate([[1, 128]], params)
    with pytest.raises(ValueError, match="prompt 0 has 48 tokens, leaving no room"):
        engine.generate([[1] * 48], params)
    with pytest.raises(ValueError, match="stop_strings needs text: pass Engine"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2, stop_strings=("x",)))
    with pytest.raises(ValueError, match=r"engine max_seq_len must be an integer in \[2, 48\]"):
        Engine(model, max_seq_len=49)


# ---------------------------------------------------------------- logprobs and batching


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=12, temperature=0.0),
        SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=20, seed=3),
        SamplingParams(max_new_tokens=12, temperature=1.3, seed=4),
    ],
    ids=["greedy", "t0.7-topp-topk", "t1.3"],
)
def test_engine_logprobs_equal_full_forward_on_ragged_batch(model, params):
    generations = Engine(model).generate(PROMPTS, params)
    assert len(generations) == len(PROMPTS)
    for prompt, gen in zip(PROMPTS, generations):
        assert isinstance(gen, Generation)
        assert len(gen.token_ids) == len(gen.logprobs) == 12 and gen.finish_reason == "length"
        want = full_forward_logprobs(
            model, prompt, gen.token_ids, params.temperature, params.top_k, params.top_p
        )
        torch.testing.assert_close(torch.tensor(gen.logprobs), want, atol=1e-5, rtol=0)


def test_greedy_tokens_are_the_argmax_of_a_full_forward(model):
    gen = Engine(model).generate([PROMPTS[1]], SamplingParams(max_new_tokens=8, temperature=0))[0]
    ids = torch.tensor([PROMPTS[1] + gen.token_ids])
    with torch.no_grad():
        argmax = model(ids)[0, len(PROMPTS[1]) - 1 : -1].argmax(-1)
    assert argmax.tolist() == gen.token_ids


def test_ragged_batch_equals_per_sequence_generation(model):
    params = SamplingParams(max_new_tokens=10, temperature=0)
    engine = Engine(model)
    batched = engine.generate(PROMPTS, params)
    for prompt, gen in zip(PROMPTS, batched):
        alone = engine.generate([prompt], params)[0]
        assert alone.token_ids == gen.token_ids
        torch.testing.assert_close(
            torch.tensor(alone.logprobs), torch.tensor(gen.logprobs), atol=1e-5, rtol=0
        )


def test_early_stops_shrink_the_batch_without_changing_results(model):
    """Two of four rows stop at once, so the engine drops them from the batch and the cache."""
    engine = Engine(model)
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    first = [g.token_ids[0] for g in engine.generate(PROMPTS[:2], greedy)]
    params = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=first)
    batched = engine.generate(PROMPTS, params)
    assert batched[0].token_ids == [first[0]] and batched[0].finish_reason == "stop"
    assert batched[0].stop == first[0]
    assert batched[1].token_ids == [first[1]] and batched[1].finish_reason == "stop"
    assert len(batched[3].token_ids) > 1  # so the batch did shrink while rows still ran
    for prompt, gen in zip(PROMPTS, batched):
        alone = engine.generate([prompt], params)[0]
        assert (alone.token_ids, alone.finish_reason) == (gen.token_ids, gen.finish_reason)
        want = full_forward_logprobs(model, prompt, gen.token_ids, 0.0)
        torch.testing.assert_close(torch.tensor(gen.logprobs), want, atol=1e-5, rtol=0)


def test_seeded_sampling_is_reproducible(model):
    engine = Engine(model)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=123)
    a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    other = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=1.0, seed=124))
    assert [g.token_ids for g in a] != [g.token_ids for g in other]


# ---------------------------------------------------------------- stopping


def test_stop_token_is_included_and_ends_the_sequence(model):
    engine = Engine(model)
    greedy = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=10, temperature=0))[0]
    stop = greedy.token_ids[3]
    cut = greedy.token_ids.index(stop) + 1
    params = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=(stop,))
    gen = engine.generate([PROMPTS[1]], params)[0]
    assert gen.token_ids == greedy.token_ids[:cut] and gen.token_ids[-1] == stop
    assert gen.finish_reason == "stop" and gen.stop == stop
    assert gen.logprobs == pytest.approx(greedy.logprobs[:cut], abs=1e-6)


def test_stop_string_ends_the_sequence(model):
    def decode(ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    engine = Engine(model, decode_fn=decode)
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, temperature=0))[0]
    stop = decode(greedy.token_ids[2:4])  # spans two tokens
    params = SamplingParams(max_new_tokens=10, temperature=0, stop_strings=("never", stop))
    gen = engine.generate([PROMPTS[0]], params)[0]
    cut = next(n for n in range(1, 11) if stop in decode(greedy.token_ids[:n]))
    assert gen.token_ids == greedy.token_ids[:cut]
    assert gen.finish_reason == "stop" and gen.stop == stop


def test_budget_is_capped_by_max_seq_len(model):
    engine = Engine(model, max_seq_len=10)
    gens = engine.generate([[1] * 7, [2, 3]], SamplingParams(max_new_tokens=20, temperature=0))
    assert [len(g.token_ids) for g in gens] == [3, 8]
    assert all(g.finish_reason == "length" for g in gens)


def test_model_mode_is_restored(model):
    engine = Engine(model)
    model.train()
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert model.training
    model.eval()
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert not model.training
    model.train()


# ---------------------------------------------------------------- sampling math


def test_truncate_probs_top_k_and_top_p():
    probs = torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15], [0.2, 0.2, 0.2, 0.2, 0.2]])
    top2 = truncate_probs(probs, top_k=2)
    torch.testing.assert_close(top2[0], torch.tensor([0.0, 0.4, 0.0, 0.3, 0.0]))
    assert (top2[1] > 0).sum() == 2
    # nucleus 0.75: 0.4 (before 0) + 0.3 (before 0.4) + 0.15 (before 0.7 < 0.75) kept
    nucleus = truncate_probs(probs, top_p=0.75)
    torch.testing.assert_close(nucleus[0], torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15]))
    assert (nucleus[1] > 0).sum() == 4
    tiny = truncate_probs(probs, top_p=0.01)  # the most likely token always survives
    assert (tiny > 0).sum(-1).tolist() == [1, 1] and tiny[0, 1] == 0.4
    assert truncate_probs(probs) is probs


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(40000, 4)
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_tokens(logits, SamplingParams(max_new_tokens=1), generator)
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)
    torch.testing.assert_close(logprobs, probs.log()[tokens])


def test_truncated_sampling_stays_in_the_kept_set_with_truncated_logprobs():
    # the behaviour logprob is that of the distribution sampled: renormalized over the top 3
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    params = SamplingParams(max_new_tokens=1, temperature=0.5, top_k=3, seed=0)
    tokens, logprobs = sample_tokens(logits, params, torch.Generator().manual_seed(1))
    top3 = logits.topk(3).indices
    assert (top3 == tokens[:, None]).any(-1).all()
    full = torch.log_softmax(logits / 0.5, dim=-1)
    want = full.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(full.gather(1, top3), -1)
    torch.testing.assert_close(logprobs, want)
