"""MLA with its latent KV cache: engine generation equals recomputation, logprobs equal a full
forward, ragged batches and shrinking batches; RoPE/YaRN and group routing invariants."""

from __future__ import annotations

import pytest
import torch

from etude.engine import Engine, SamplingParams
from etude.model import ModelConfig
from etude.model.meta import collect_param_meta
from etude.model.mla import LatentKVCache, MLAttention
from etude.model.moe import TopKRouter
from etude.model.rope import half_to_interleaved, interleaved_to_half, rope_frequencies
from etude.model.transformer import Transformer, build_model

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 100, 8], [1], [30, 31, 32, 33, 34]]


def mla_cfg(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=128,
        dim=64,
        num_layers=3,
        num_dense_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=24,
        attention="mla",
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_scaling="yarn",
        yarn_factor=4.0,
        yarn_original_max_seq_len=16,
        yarn_mscale_all_dim=1.0,
        dense_ffn_dim=96,
        num_experts=8,
        num_experts_per_tok=2,
        expert_ffn_dim=32,
        num_shared_experts=1,
        router_num_groups=2,
        router_topk_groups=1,
        max_seq_len=48,
        init_std=0.15,
    )
    return ModelConfig.preset("tiny", **{**fields, **overrides})


@pytest.fixture(scope="module")
def model() -> Transformer:
    return build_model(mla_cfg(), seed=3)


def full_forward_logprobs(model, prompt, generated, temperature):
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return logprobs.gather(1, torch.tensor(generated)[:, None])[:, 0]


def test_cache_holds_latent_and_rope_key_only(model):
    cache = model.make_cache(2, 20)
    assert isinstance(cache, LatentKVCache)
    assert cache.latent.shape == (3, 2, 20, 16) and cache.k_rope.shape == (3, 2, 20, 8)
    assert cache.values_per_token() == 24  # vs 2 * 4 heads * 24 for the expanded K/V


def test_greedy_generation_equals_recomputation(model):
    prompt, steps = PROMPTS[1], 10
    gen = Engine(model).generate([prompt], SamplingParams(max_new_tokens=steps, temperature=0))[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):  # no cache: the whole sequence again at every step
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert gen.token_ids == ids[len(prompt) :]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_equal_full_forward_on_ragged_batch(model, temperature):
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=5)
    generations = Engine(model).generate(PROMPTS, params)
    for prompt, gen in zip(PROMPTS, generations):
        want = full_forward_logprobs(model, prompt, gen.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(gen.logprobs), want, atol=1e-5, rtol=0)


def test_shrinking_batch_keeps_results(model):
    engine = Engine(model)
    params = SamplingParams(max_new_tokens=9, temperature=0)
    alone = [engine.generate([p], params)[0].token_ids for p in PROMPTS]
    first = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2, temperature=0))[0]
    stop = SamplingParams(max_new_tokens=9, temperature=0, stop_token_ids=(first.token_ids[0],))
    batched = engine.generate(PROMPTS, stop)
    for want, gen in zip(alone, batched):
        n = len(gen.token_ids)
        assert gen.token_ids == want[:n]


def test_mla_metadata_blocks():
    with torch.device("meta"):
        model = Transformer(mla_cfg())
    meta = collect_param_meta(model)
    attn = "layers.0.attention."
    assert (meta[attn + "q_b_proj.weight"].kind, meta[attn + "q_b_proj.weight"].num_blocks) == (
        "heads_dim0",
        4,
    )
    assert meta[attn + "kv_b_proj.weight"].num_blocks == 4
    assert meta[attn + "o_proj.weight"].kind == "heads_dim1"
    assert meta[attn + "q_a_proj.weight"].kind == meta[attn + "kv_a_proj.weight"].kind == "matrix"
    assert isinstance(model.layers[0].attention, MLAttention)
    without_q_rank = Transformer(mla_cfg(q_lora_rank=0))
    assert collect_param_meta(without_q_rank)[attn + "q_proj.weight"].num_blocks == 4


def test_yarn_keeps_high_frequencies_and_interpolates_low_ones():
    plain = rope_frequencies(mla_cfg(rope_scaling="none"))
    yarn = rope_frequencies(mla_cfg())
    assert torch.equal(yarn[0], plain[0])  # fastest rotation: extrapolated, unchanged
    torch.testing.assert_close(yarn[-1], plain[-1] / 4.0)  # slowest: divided by the factor
    assert bool((yarn <= plain).all())


def test_rope_permutations_are_inverse():
    order, inverse = interleaved_to_half(8), half_to_interleaved(8)
    assert order == [0, 2, 4, 6, 1, 3, 5, 7]
    assert [order[i] for i in inverse] == list(range(8))


def test_group_limited_routing_masks_other_groups_even_with_negative_bias():
    router = TopKRouter(4, 8, 2, num_groups=2, topk_groups=1)
    with torch.no_grad():
        router.gate.weight.zero_()
        router.gate.weight[:4, 0] = 5.0  # group 0 scores high
        router.expert_bias.copy_(torch.tensor([-0.4, -0.3, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0]))
    x = torch.zeros(3, 4)
    x[:, 0] = 1.0
    weights, experts = router(x)
    # group 0 (sum of its top-2 biased scores ~2.0) beats group 1 (~1.9 with the +0.9 bias),
    # so expert 4 is out however large its bias; inside group 0 the bias demotes 0 and 1
    assert sorted(experts[0].tolist()) == [2, 3]
    torch.testing.assert_close(weights.sum(-1), torch.ones(3))


def test_mla_options_are_checked():
    with pytest.raises(ValueError, match="kv_lora_rank must be >= 1"):
        mla_cfg(kv_lora_rank=0)
    with pytest.raises(ValueError, match="GQA options"):
        mla_cfg(qk_norm=True)
    with pytest.raises(ValueError, match="router_num_groups"):
        mla_cfg(router_num_groups=3)
