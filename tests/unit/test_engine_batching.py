"""Continuous batching: requests join and leave every step, preemption, priorities, aborts."""

from __future__ import annotations

import random

import pytest
import torch

from etude.engine import Engine, SamplingParams
from etude.model import ModelConfig
from etude.model.transformer import Transformer, build_model

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 100, 8], [1], [30, 31, 32, 33, 34], [70, 71]]


@pytest.fixture(scope="module")
def model() -> Transformer:
    cfg = ModelConfig.preset(
        "tiny",
        vocab_size=128,
        dim=64,
        num_layers=2,
        num_dense_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dense_ffn_dim=96,
        num_experts=4,
        num_experts_per_tok=2,
        expert_ffn_dim=32,
        num_shared_experts=1,
        max_seq_len=64,
        init_std=0.15,
    )
    return build_model(cfg, seed=5)


def full_forward_logprobs(model, prompt, generated, temperature):
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1]
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / scale, dim=-1).gather(1, torch.tensor(generated)[:, None])[
        :, 0
    ]


def run_to_end(engine: Engine) -> dict[int, object]:
    done = {}
    while not engine.idle:
        for out in engine.step():
            if out.generation is not None:
                done[out.request_id] = out.generation
    return done


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_requests_join_as_rows_free_and_match_running_alone(model, temperature):
    """Two rows for five prompts of different budgets: requests join as others leave."""
    params = [
        SamplingParams(max_new_tokens=n, temperature=temperature, seed=40 + i)
        for i, n in enumerate([3, 9, 5, 12, 2])
    ]
    engine = Engine(model, max_batch_size=2)
    batched = engine.generate(PROMPTS, params)
    for prompt, p, gen in zip(PROMPTS, params, batched):
        alone = Engine(model).generate([prompt], [p])[0]
        assert alone.token_ids == gen.token_ids and len(gen.token_ids) == p.max_new_tokens
        want = full_forward_logprobs(model, prompt, gen.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(gen.logprobs), want, atol=1e-5, rtol=0)


def test_a_request_submitted_mid_flight_joins_the_running_batch(model):
    engine = Engine(model, max_batch_size=4)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    first = engine.submit(PROMPTS[1], params)
    engine.step()
    engine.step()
    assert engine.num_running == 1
    second = engine.submit(PROMPTS[3], params)
    outs = engine.step()
    assert engine.num_running == 2 and {o.request_id for o in outs} == {first, second}
    done = run_to_end(engine)
    for rid, prompt in ((first, PROMPTS[1]), (second, PROMPTS[3])):
        gen = done[rid]
        want = full_forward_logprobs(model, prompt, gen.token_ids, 0.0)
        torch.testing.assert_close(torch.tensor(gen.logprobs), want, atol=1e-5, rtol=0)


def test_priority_preempts_and_the_preempted_request_is_unchanged(model):
    """A fast request takes a full batch's row; the standard one resumes by re-prefill and its
    sampled tokens and logprobs are what it would have produced without the interruption."""
    standard = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=s) for s in (1, 2)]
    fast = SamplingParams(max_new_tokens=4, temperature=0)
    engine = Engine(model, max_batch_size=2)
    ids = [engine.submit(PROMPTS[i], standard[i]) for i in range(2)]
    for _ in range(3):
        engine.step()
    urgent = engine.submit(PROMPTS[2], fast, priority=1)
    order = []
    while not engine.idle:
        order += [o.request_id for o in engine.step() if o.generation is not None]
    assert engine.num_preemptions >= 1
    assert order[0] == urgent  # the fast request finished before either standard one
    done_ids = set(order)
    assert done_ids == {*ids, urgent}


def test_preempted_output_equals_uninterrupted(model):
    standard = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=s) for s in (1, 2)]
    reference = Engine(model, max_batch_size=2).generate(PROMPTS[:2], standard)
    engine = Engine(model, max_batch_size=2)
    ids = [engine.submit(PROMPTS[i], standard[i]) for i in range(2)]
    done = {}
    for _ in range(3):
        engine.step()
    engine.submit(PROMPTS[2], SamplingParams(max_new_tokens=4, temperature=0), priority=1)
    done = run_to_end(engine)
    assert engine.num_preemptions >= 1
    for rid, prompt, ref in zip(ids, PROMPTS[:2], reference):
        gen = done[rid]
        assert gen.token_ids == ref.token_ids
        want = full_forward_logprobs(model, prompt, gen.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(gen.logprobs), want, atol=1e-5, rtol=0)


def test_latency_batch_size_caps_the_batch_while_a_fast_request_is_present(model):
    engine = Engine(model, max_batch_size=4, latency_batch_size=2)
    params = SamplingParams(max_new_tokens=20, temperature=0)
    for prompt in PROMPTS[:4]:
        engine.submit(prompt, params)
    engine.step()
    assert engine.num_running == 4
    engine.submit(PROMPTS[4], SamplingParams(max_new_tokens=3, temperature=0), priority=1)
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 3
    run_to_end(engine)
    assert engine.idle


def test_abort_frees_the_row_and_leaves_the_others_correct(model):
    engine = Engine(model, max_batch_size=3)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    ids = [engine.submit(p, params) for p in PROMPTS[:3]]
    engine.step()
    assert engine.abort(ids[0]) and not engine.abort(ids[0])
    assert engine.num_running == 2
    waiting = engine.submit(PROMPTS[4], params)
    assert engine.abort(waiting) and engine.num_waiting == 0
    done = run_to_end(engine)
    assert set(done) == set(ids[1:])
    for rid, prompt in zip(ids[1:], PROMPTS[1:3]):
        want = full_forward_logprobs(model, prompt, done[rid].token_ids, 0.0)
        torch.testing.assert_close(torch.tensor(done[rid].logprobs), want, atol=1e-5, rtol=0)


def test_prefill_is_chunked_under_the_token_budget(model):
    params = SamplingParams(max_new_tokens=4, temperature=0)
    small = Engine(model, max_prefill_tokens=8).generate(PROMPTS, params)
    large = Engine(model).generate(PROMPTS, params)
    assert [g.token_ids for g in small] == [g.token_ids for g in large]


def test_engine_setting_errors(model):
    with pytest.raises(ValueError, match="engine max_batch_size must be an integer >= 1"):
        Engine(model, max_batch_size=0)
    with pytest.raises(ValueError, match="engine latency_batch_size must be an integer >= 0"):
        Engine(model, latency_batch_size=-1)
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        Engine(model).generate([[1], [2]], [SamplingParams(max_new_tokens=1)])


def test_shared_prefixes_are_copied_not_recomputed_and_change_nothing(model):
    """Four samples of one prompt and one prompt that shares only its first 36 tokens."""
    base = [(7 * i + 3) % 128 for i in range(40)]
    prompts = [base] * 4 + [base[:36] + [1, 2, 3, 4, 5]]
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s) for s in range(5)]
    sharing = Engine(model, min_shared_prefix=16)
    shared = sharing.generate(prompts, params)
    assert sharing.num_shared_prefix_tokens == 3 * 39 + 36
    plain = Engine(model, min_shared_prefix=0).generate(prompts, params)
    for prompt, a, b in zip(prompts, shared, plain):
        assert a.token_ids == b.token_ids
        want = full_forward_logprobs(model, prompt, a.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(a.logprobs), want, atol=1e-5, rtol=0)


def test_a_sharer_and_a_long_leader_admitted_together(model):
    """A request that shares a running row's 50-token prefix (2-token suffix) and a fresh
    30-token prompt join in one step: their prefills must not be padded together (the sharer's
    padded positions would run past the cache)."""
    engine = Engine(model, max_batch_size=4, min_shared_prefix=16)
    long_prompt = [(5 * i + 1) % 128 for i in range(50)]
    params = SamplingParams(max_new_tokens=6, temperature=0)
    first = engine.submit(long_prompt, params)
    engine.step()
    follow = long_prompt + [7, 9]
    fresh = [(3 * i + 2) % 128 for i in range(30)]
    ids = [engine.submit(follow, params), engine.submit(fresh, params)]
    done = run_to_end(engine)
    assert engine.num_shared_prefix_tokens >= 50 and set(done) == {first, *ids}
    for rid, prompt in zip(ids, (follow, fresh)):
        want = full_forward_logprobs(model, prompt, done[rid].token_ids, 0.0)
        torch.testing.assert_close(torch.tensor(done[rid].logprobs), want, atol=1e-5, rtol=0)


def test_random_arrivals_priorities_aborts_and_shared_prefixes(model):
    """A seeded random schedule: requests arrive between steps with shared prefixes and two
    priorities, some are aborted; every finished one equals its run alone and a full forward."""
    rng = random.Random(0)
    bases = [[rng.randrange(128) for _ in range(rng.randint(20, 40))] for _ in range(3)]
    engine = Engine(model, max_batch_size=3, min_shared_prefix=8, latency_batch_size=2)
    submitted: dict[int, tuple[list[int], SamplingParams]] = {}
    aborted: set[int] = set()
    done: dict[int, object] = {}
    for step in range(60):
        if step < 30 and rng.random() < 0.5:
            base = rng.choice(bases)
            prompt = base[: rng.randint(10, len(base))] + [rng.randrange(128)] * rng.randint(0, 4)
            params = SamplingParams(
                max_new_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 1.0]), seed=step
            )
            rid = engine.submit(prompt, params, priority=rng.choice([0, 0, 1]))
            submitted[rid] = (prompt, params)
        if submitted and rng.random() < 0.08:
            victim = rng.choice(sorted(submitted))
            if victim not in done and engine.abort(victim):
                aborted.add(victim)
        for out in engine.step():
            if out.generation is not None:
                done[out.request_id] = out.generation
    done.update(run_to_end(engine))
    assert set(done) == set(submitted) - aborted and engine.idle
    assert engine.num_preemptions > 0 and engine.num_shared_prefix_tokens > 0 and aborted
    for rid, gen in done.items():
        prompt, params = submitted[rid]
        alone = Engine(model, min_shared_prefix=0).generate([prompt], [params])[0]
        assert alone.token_ids == gen.token_ids
        want = full_forward_logprobs(model, prompt, gen.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(gen.logprobs), want, atol=1e-5, rtol=0)
