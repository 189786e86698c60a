"""The transformer: config checks, meta build and init, metadata contract, causality, KV cache."""

from __future__ import annotations

import re

import pytest
import torch

from etude.model import PRESETS, ModelConfig
from etude.model.attention import Attention, apply_rope, causal_mask, rope_angles
from etude.model.meta import collect_param_meta
from etude.model.moe import FeedForward, GroupedExperts, MoE
from etude.model.transformer import Transformer, build_model


def small_cfg(**overrides) -> ModelConfig:
    """A few-layer model that runs in milliseconds; init_std large enough for peaked logits."""
    fields = dict(
        vocab_size=256,
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
        max_seq_len=64,
        init_std=0.1,
    )
    return ModelConfig.preset("tiny", **{**fields, **overrides})


# ---------------------------------------------------------------- config


def test_presets_build_and_unknown_preset_lists_names():
    assert PRESETS == ("micro", "tiny", "small", "kimi-k2", "deepseek-v3")
    tiny = ModelConfig.preset("tiny")
    assert (tiny.vocab_size, tiny.dim, tiny.num_layers, tiny.num_experts) == (2048, 128, 4, 8)
    k2 = ModelConfig.preset("kimi-k2")
    assert (k2.dim, k2.num_layers, k2.num_experts, k2.num_experts_per_tok) == (7168, 61, 384, 8)
    assert ModelConfig.preset("tiny", dim=64).dim == 64
    with pytest.raises(
        ValueError, match="unknown model preset 'huge'; valid presets: micro, tiny, small, kimi-k2"
    ):
        ModelConfig.preset("huge")
    with pytest.raises(ValueError, match="unknown ModelConfig field 'dimm'"):
        ModelConfig.preset("tiny", dimm=3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(num_kv_heads=3),
            "model.num_heads (4) must be divisible by model.num_kv_heads (3); "
            "set num_kv_heads to a divisor of num_heads",
        ),
        (
            dict(num_experts_per_tok=9),
            "model.num_experts_per_tok (9) must be between 1 and model.num_experts (8); "
            "set a top-k in that range",
        ),
        (
            dict(num_dense_layers=5),
            "model.num_dense_layers (5) must be <= model.num_layers (4); "
            "lower num_dense_layers or add layers",
        ),
        (
            dict(head_dim=31),
            "model.head_dim (31) must be even (RoPE rotates pairs); set an even head_dim",
        ),
        (dict(dim=0), "model.dim must be a positive integer, got 0"),
        (
            dict(router_score="relu"),
            "model.router_score must be 'sigmoid' or 'softmax', got 'relu'",
        ),
        (dict(route_scale=0.0), "model.route_scale must be a positive number, got 0.0"),
        (
            dict(bias_update_rate=-1.0),
            "model.bias_update_rate must be a number >= 0 (0 disables balancing), got -1.0",
        ),
        (
            dict(num_experts=0, dense_ffn_dim=0),
            "model.dense_ffn_dim must be >= 1 when the model has dense layers, got 0; "
            "set dense_ffn_dim (e.g. 3 * dim)",
        ),
    ],
)
def test_bad_config_messages(overrides, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ModelConfig.preset("tiny", **overrides)


def test_config_round_trips_through_the_config_machinery():
    from etude.config import from_dict, to_dict

    cfg = ModelConfig.preset("small", router_score="softmax", tie_embeddings=True)
    assert from_dict(ModelConfig, to_dict(cfg)) == cfg


def test_config_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, etude.model.config, etude.model; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- build, init, metadata


def test_meta_build_allocates_nothing():
    with torch.device("meta"):
        model = Transformer(ModelConfig.preset("small"))
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    with pytest.raises(ValueError, match="is on the meta device; materialize the model first"):
        model.init_weights(0)


def test_init_is_deterministic_and_follows_the_rules():
    cfg = small_cfg()
    a, b, c = build_model(cfg, seed=3), build_model(cfg, seed=3), build_model(cfg, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["output.weight"], sc["output.weight"])
    meta = collect_param_meta(a)
    for name, param in a.named_parameters():
        if meta[name].kind == "norm":
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert param.std().item() == pytest.approx(cfg.init_std, rel=0.25), name
    for name, buffer in a.named_buffers():
        assert not buffer.any(), name
    # per-parameter seeding: a value does not depend on which other parameters exist
    deeper = build_model(small_cfg(num_layers=5), seed=3)
    assert torch.equal(deeper.tok_embeddings.weight, a.tok_embeddings.weight)
    assert torch.equal(deeper.layers[1].ffn.experts.w1, a.layers[1].ffn.experts.w1)


def test_module_structure_dense_then_moe():
    model = build_model(small_cfg(num_layers=4, num_dense_layers=2))
    kinds = [type(layer.ffn) for layer in model.layers]
    assert kinds == [FeedForward, FeedForward, MoE, MoE]
    assert len(list(model.moe_layers())) == 2
    for layer in model.layers:
        assert isinstance(layer.attention, Attention)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert getattr(layer.attention, name).bias is None
    dense = build_model(small_cfg(num_experts=0))
    assert all(isinstance(layer.ffn, FeedForward) for layer in dense.layers)
    assert dense(torch.randint(0, 256, (1, 5))).shape == (1, 5, 256)


def check_metadata(model: Transformer) -> None:
    cfg = model.cfg
    meta = collect_param_meta(model)
    assert set(meta) == {name for name, _ in model.named_parameters()}
    params = dict(model.named_parameters())
    expected_blocks = {
        "attention.q_proj.weight": ("heads_dim0", cfg.num_heads),
        "attention.k_proj.weight": ("heads_dim0", cfg.num_kv_heads),
        "attention.v_proj.weight": ("heads_dim0", cfg.num_kv_heads),
        "attention.o_proj.weight": ("heads_dim1", cfg.num_heads),
        # MLA: per-head q (or q_b) and kv_b rows, whole low-rank q_a / kv_a matrices
        "attention.q_b_proj.weight": ("heads_dim0", cfg.num_heads),
        "attention.kv_b_proj.weight": ("heads_dim0", cfg.num_heads),
        "attention.q_a_proj.weight": ("matrix", 1),
        "attention.kv_a_proj.weight": ("matrix", 1),
        "ffn.experts.w1": ("experts", cfg.num_experts),
        "ffn.experts.w2": ("experts", cfg.num_experts),
        "ffn.experts.w3": ("experts", cfg.num_experts),
    }
    for name, info in meta.items():
        shape = tuple(params[name].shape)
        if name.startswith("layers."):
            rel = name.split(".", 2)[2]
            if rel in expected_blocks:
                assert (info.kind, info.num_blocks) == expected_blocks[rel], name
            elif rel.endswith("norm.weight"):
                assert info.kind == "norm", name
            elif rel == "ffn.router.gate.weight":
                assert info.kind == "router" and shape == (cfg.num_experts, cfg.dim)
            else:
                assert rel.startswith(("ffn.w", "ffn.shared_experts.w")), name
                assert info.kind == "matrix", name
        else:
            want = {"tok_embeddings.weight": "embedding", "output.weight": "head"}
            assert info.kind == want.get(name, "norm"), name
        if info.optimizer == "muon":
            m, n = info.block_shape(shape)
            assert m * n * info.num_blocks == params[name].numel()
    if cfg.attention == "mla":
        return
    q = meta["layers.0.attention.q_proj.weight"]
    assert q.block_shape(tuple(params["layers.0.attention.q_proj.weight"].shape)) == (
        cfg.head_dim,
        cfg.dim,
    )
    last = f"layers.{cfg.num_layers - 1}.ffn.experts.w2"
    assert meta[last].block_shape(tuple(params[last].shape)) == (cfg.expert_ffn_dim, cfg.dim)


@pytest.mark.parametrize(
    ("preset", "device"),
    [("tiny", "cpu"), ("tiny", "meta"), ("small", "cpu"), ("small", "meta"), ("kimi-k2", "meta")],
)
def test_metadata_covers_every_parameter_of_every_preset(preset, device):
    cfg = ModelConfig.preset(preset)
    if device == "meta":
        with torch.device("meta"):
            model = Transformer(cfg)
    else:
        model = build_model(cfg)
    check_metadata(model)


def test_tied_embeddings_share_one_parameter():
    model = build_model(small_cfg(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    meta = collect_param_meta(model)
    assert "output.weight" not in meta and meta["tok_embeddings.weight"].kind == "embedding"
    assert model(torch.randint(0, 256, (2, 4))).shape == (2, 4, 256)


# ---------------------------------------------------------------- forward


def test_causal_masking():
    torch.manual_seed(0)
    model = build_model(small_cfg())
    tokens = torch.randint(0, 256, (2, 12))
    base = model(tokens)
    assert base.dtype == torch.float32 and base.shape == (2, 12, 256)
    for t in (0, 5, 11):
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % 256
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-6, rtol=0)
        assert (out[:, t:] - base[:, t:]).abs().amax() > 1e-4


def test_logits_are_fp32_for_bf16_weights():
    model = build_model(small_cfg(num_layers=2)).to(torch.bfloat16)
    out = model(torch.randint(0, 256, (1, 6)))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_rope_relative_positions():
    """RoPE makes attention depend on position differences: shifting all positions is a no-op."""
    model = build_model(small_cfg())
    tokens = torch.randint(0, 256, (2, 10))
    shifted = torch.arange(7, 17).expand(2, 10)
    torch.testing.assert_close(
        model(tokens, positions_BT=shifted), model(tokens), atol=2e-5, rtol=0
    )


def test_apply_rope_is_a_rotation():
    x = torch.randn(2, 3, 5, 8)
    cos, sin = rope_angles(torch.arange(5).expand(2, 5), 8, 10000.0)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0: angle 0
    # pair (0, 4) at position 1 turns by exactly 1 radian (frequency theta^0 = 1)
    angle = torch.tensor(1.0)
    want0 = x[:, :, 1, 0] * angle.cos() - x[:, :, 1, 4] * angle.sin()
    torch.testing.assert_close(y[:, :, 1, 0], want0)


def test_attention_seams_support_all_gather_context_parallel():
    """Split a sequence over two simulated CP ranks (load-balanced chunks), gather K/V with their
    positions, attend with causal_mask: each rank's output equals the full attention's rows."""
    model = build_model(small_cfg())
    attention = model.layers[0].attention
    x = torch.randn(2, 10, 64)
    positions = torch.arange(10).expand(2, 10)
    cos, sin = rope_angles(positions, 16, 10000.0)
    full = attention(x, cos, sin, positions_BT=positions)
    chunks = [torch.tensor([0, 1, 2, 7, 8, 9]), torch.tensor([3, 4, 5, 6])]
    local = [attention.project_qkv(x[:, c], cos[:, c], sin[:, c]) for c in chunks]
    k_all = torch.cat([k for _, k, _ in local], dim=2)
    v_all = torch.cat([v for _, _, v in local], dim=2)
    k_positions = torch.cat(chunks).expand(2, -1)
    for chunk, (q, _, _) in zip(chunks, local):
        out = attention.attend(q, k_all, v_all, causal_mask(positions[:, chunk], k_positions))
        out = attention.o_proj(out.transpose(1, 2).reshape(2, len(chunk), -1))
        torch.testing.assert_close(out, full[:, chunk], atol=1e-6, rtol=1e-5)


def test_backward_reaches_every_parameter():
    model = build_model(small_cfg())
    tokens = torch.randint(0, 256, (4, 16))
    loss = torch.nn.functional.cross_entropy(
        model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
    )
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
    for moe in model.moe_layers():
        assert moe.router.expert_bias.grad is None


def test_sequence_longer_than_max_seq_len_is_refused():
    model = build_model(small_cfg(max_seq_len=8))
    with pytest.raises(ValueError, match=r"exceeds model.max_seq_len \(8\)"):
        model(torch.zeros(1, 9, dtype=torch.long))


# ---------------------------------------------------------------- KV cache


def test_kv_cache_step_by_step_equals_full_forward():
    model = build_model(small_cfg())
    tokens = torch.randint(0, 256, (2, 14))
    full = model(tokens)
    cache = model.make_cache(2, 20)
    parts = [model(tokens[:, :5], cache=cache)]
    for t in range(5, 14):
        parts.append(model(tokens[:, t : t + 1], cache=cache))
    assert cache.num_filled == 14
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


def test_kv_cache_ragged_positions_equal_per_sequence_forward():
    """Right-padded prefill, then each row decodes at its own position (slot = position)."""
    model = build_model(small_cfg())
    lens = [3, 7, 5]
    seqs = [torch.randint(1, 256, (n + 2,)) for n in lens]  # prompt + two decoded tokens
    cache = model.make_cache(3, 16)
    padded = torch.zeros(3, 7, dtype=torch.long)
    for b, n in enumerate(lens):
        padded[b, :n] = seqs[b][:n]
    prefill = model(padded, cache=cache)
    steps = []
    for k in range(2):
        positions = torch.tensor(lens)[:, None] + k
        step_tokens = torch.stack([seqs[b][lens[b] + k] for b in range(3)])[:, None]
        steps.append(model(step_tokens, positions_BT=positions, cache=cache)[:, 0])
    for b, n in enumerate(lens):
        want = model(seqs[b][None])[0]
        torch.testing.assert_close(prefill[b, :n], want[:n], atol=1e-5, rtol=0)
        for k in range(2):
            torch.testing.assert_close(steps[k][b], want[n + k], atol=1e-5, rtol=0)


def test_kv_cache_bad_use_is_refused():
    model = build_model(small_cfg())
    cache = model.make_cache(2, 4)
    with pytest.raises(ValueError, match="positions must lie in \\[0, 4\\) of the KV cache"):
        model(torch.zeros(2, 5, dtype=torch.long), cache=cache)
    with pytest.raises(
        ValueError, match="tokens have batch size 3 but the KV cache was made for 2"
    ):
        model(torch.zeros(3, 2, dtype=torch.long), cache=model.make_cache(2, 4))
    with pytest.raises(ValueError, match="pass one position per token"):
        model(torch.zeros(2, 2, dtype=torch.long), positions_BT=torch.zeros(2, 3, dtype=torch.long))


def test_logits_index_selects_positions():
    model = build_model(small_cfg())
    tokens = torch.randint(0, 256, (2, 9))
    index = torch.tensor([[8, 2], [0, 5]])
    picked = model(tokens, logits_index_BN=index)
    full = model(tokens)
    torch.testing.assert_close(picked, torch.stack([full[0, [8, 2]], full[1, [0, 5]]]))


def test_grouped_experts_is_a_stacked_parameter():
    model = build_model(small_cfg())
    experts = model.layers[1].ffn.experts
    assert isinstance(experts, GroupedExperts)
    assert experts.w1.shape == (4, 64, 32) and experts.w3.shape == (4, 64, 32)
    assert experts.w2.shape == (4, 32, 64)
