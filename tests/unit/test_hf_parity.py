"""Logits parity with ``transformers`` on tiny random checkpoints that transformers wrote.

For each family: transformers builds a random model from a tiny config and ``save_pretrained``s
it; etude imports the directory (config.json -> ModelConfig, safetensors -> a meta-device
model); both run the same 64-token sequence in fp32. Checked: max |logit difference| <= 1e-4 at
every position and the same expert ids in every MoE layer. Then the round trip: etude exports
(``export_hf``), transformers loads that with ``from_pretrained``, logits agree to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from etude.model.hf_config import family_of, model_config_from_hf  # noqa: E402
from etude.model.transformer import Transformer  # noqa: E402
from etude.parallel.checkpoint import export_hf, load_hf_checkpoint, read_hf_config  # noqa: E402

SEQ = 64
VOCAB = 320
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=32,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=0.8,
    mscale_all_dim=0.6,
)


def deepseek_config(q_lora_rank):
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=16,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=128,
        rope_parameters=YARN,
        initializer_range=0.1,
        num_nextn_predict_layers=0,
    )


CONFIGS = {
    "deepseek_v3_q_lora": lambda: deepseek_config(24),
    "deepseek_v3_no_q_lora": lambda: deepseek_config(None),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        use_qk_norm=True,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
        initializer_range=0.1,
        num_nextn_predict_layers=0,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        initializer_range=0.1,
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        initializer_range=0.1,
    ),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0),
    ),
}


def hf_model(name: str):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:  # random, partly negative: selection must follow it exactly
                bias.copy_(torch.randn(bias.shape) * 0.1)
    return model.eval()


def hf_routes(model, tokens):
    """Logits and per-MoE-layer sorted expert ids of a transformers model."""
    routes = []

    def hook(module, args, out):
        routes.append(torch.sort(out[2], dim=-1).values)

    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    handles = [g.register_forward_hook(hook) for g in gates]
    with torch.no_grad():
        logits = model(tokens).logits
    for h in handles:
        h.remove()
    return logits, routes


def etude_routes(model, tokens):
    routes = []

    def hook(module, args, out):
        routes.append(torch.sort(out[1], dim=-1).values)

    handles = [moe.router.register_forward_hook(hook) for moe in model.moe_layers()]
    with torch.no_grad():
        logits = model(tokens)
    for h in handles:
        h.remove()
    return logits, routes


def import_etude(path):
    cfg, _ = model_config_from_hf(read_hf_config(path))
    with torch.device("meta"):
        model = Transformer(cfg)
    load_hf_checkpoint(model, path)
    return model.eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_routes_match_transformers(name, tmp_path):
    ref = hf_model(name)
    ref.save_pretrained(tmp_path / "hf")
    model = import_etude(tmp_path / "hf")
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    want, want_routes = hf_routes(ref, tokens)
    got, got_routes = etude_routes(model, tokens)
    assert (got - want).abs().max().item() <= 1e-4, (got - want).abs().max().item()
    assert want.abs().max() > 0.1  # the test would be vacuous on near-zero logits
    assert len(got_routes) == len(want_routes) == model.cfg.num_moe_layers
    for got_e, want_e in zip(got_routes, want_routes):
        assert torch.equal(got_e, want_e.view_as(got_e))
    # round trip: etude -> Hugging Face directory -> transformers
    assert family_of(model.cfg) == ("deepseek_v3" if name.startswith("deepseek") else name)
    export_hf(model, tmp_path / "out", max_shard_bytes=200_000)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        again = back.eval()(tokens).logits
    assert (again - got).abs().max().item() <= 1e-5
