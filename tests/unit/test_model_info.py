"""Parameter counts from a meta build: exact arithmetic, real-model agreement, Kimi K2 scale."""

from __future__ import annotations

from etude.model import ModelConfig
from etude.model.info import PARTS, count_params, format_model_info
from etude.model.transformer import build_model


def hand_cfg(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=100,
        dim=16,
        num_layers=3,
        num_dense_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        dense_ffn_dim=40,
        num_experts=5,
        num_experts_per_tok=2,
        expert_ffn_dim=12,
        num_shared_experts=2,
    )
    return ModelConfig.preset("tiny", **{**fields, **overrides})


def test_counts_match_hand_arithmetic():
    counts = count_params(hand_cfg())
    # V*D each; per layer q,o: 4*8*16, k,v: 2*8*16; dense 3*16*40; per MoE layer routed 3*5*16*12,
    # shared 3*16*24, router 5*16; norms 2 per layer + final, 16 each
    want = {
        "embedding": 1600,
        "attention": 3 * (512 + 256 + 256 + 512),
        "dense_ffn": 1920,
        "shared_experts": 2 * 1152,
        "routed_experts": 2 * 2880,
        "router": 2 * 80,
        "norm": 7 * 16,
        "head": 1600,
    }
    assert counts["by_part"] == want
    assert counts["total"] == 18064
    assert counts["active_by_part"]["routed_experts"] == 2 * 2880 * 2 // 5
    assert counts["active"] == 18064 - 5760 + 2304
    assert counts["active_without_embedding"] == counts["active"] - 1600
    # an MTP module: one more MoE layer (attention 1536, routed 2880, shared 1152, router 80,
    # 2 norms 32) + eh_proj 16 x 32 + enorm, hnorm, head norm 3 x 16
    assert counts["mtp_module"] == {
        "total": 1536 + 2880 + 1152 + 80 + 32 + 512 + 48,
        "active": 1536 + 2880 * 2 // 5 + 1152 + 80 + 32 + 512 + 48,
    }
    assert counts["by_kind"] == {
        "embedding": 1600,
        "heads_dim0": 3 * 1024,
        "heads_dim1": 3 * 512,
        "matrix": 1920 + 2304,
        "router": 160,
        "experts": 5760,
        "norm": 112,
        "head": 1600,
    }
    assert counts["muon_blocks"] == {
        (8, 16): 3 * (4 + 2 + 2),  # q, k, v heads
        (16, 8): 3 * 4,  # o heads
        (40, 16): 2,  # dense w1, w3
        (16, 40): 1,  # dense w2
        (16, 12): 2 * 2 * 5,  # expert w1, w3
        (12, 16): 2 * 5,  # expert w2
        (24, 16): 2 * 2,  # shared w1, w3
        (16, 24): 2,  # shared w2
    }


def test_counts_tied_and_dense_variants():
    tied = count_params(hand_cfg(tie_embeddings=True))
    assert tied["by_part"]["head"] == 0 and tied["total"] == 18064 - 1600
    # tied: the table is also the head, so it stays activated
    assert tied["active_without_embedding"] == tied["active"]
    dense = count_params(hand_cfg(num_experts=0))
    assert dense["by_part"]["routed_experts"] == dense["by_part"]["router"] == 0
    assert dense["by_part"]["dense_ffn"] == 3 * 1920
    assert dense["total"] == dense["active"]


def test_counts_agree_with_a_real_model():
    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg)
    counts = count_params(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert sum(counts["by_part"].values()) == counts["total"]
    assert set(counts["by_part"]) == set(PARTS)


def test_kimi_k2_counts_on_meta():
    # fp32 weights would be ~4 TB: finishing at all shows nothing was allocated
    counts = count_params(ModelConfig.preset("kimi-k2"))
    # published: ~1.04T total, ~32B active (32.6B in the technical report's table)
    assert abs(counts["total"] / 1.04e12 - 1) < 0.015
    assert abs(counts["active"] / 32.6e9 - 1) < 0.01
    parts = counts["by_part"]
    assert parts["routed_experts"] == 60 * 384 * 3 * 7168 * 2048
    assert parts["embedding"] == parts["head"] == 163840 * 7168
    assert parts["dense_ffn"] == 3 * 7168 * 18432
    assert counts["active_by_part"]["routed_experts"] == 60 * 8 * 3 * 7168 * 2048
    assert counts["muon_blocks"][(7168, 2048)] == 60 * 384 * 2 + 60  # expert w1/w3 + shared w2
    # MLA per layer: q_b 64 heads of [192, 1536], kv_b 64 of [256, 512], o 64 of [7168, 128]
    assert counts["muon_blocks"][(192, 1536)] == 61 * 64
    assert counts["muon_blocks"][(256, 512)] == 61 * 64
    assert counts["muon_blocks"][(7168, 128)] == 61 * 64
    assert counts["muon_blocks"][(1536, 7168)] == 61  # q_a, whole
    assert counts["muon_blocks"][(576, 7168)] == 61  # kv_a (512 latent + 64 rope key), whole
    assert parts["attention"] == 61 * (
        1536 * 7168 + 64 * 192 * 1536 + 576 * 7168 + 64 * 256 * 512 + 7168 * 64 * 128
    )


def test_deepseek_v3_counts_match_published():
    # DeepSeek-V3 README_WEIGHTS.md: main model 671B, activated 36.6B including the output head
    # (not the input embedding); 685B on Hugging Face with the MTP module and its own copies of
    # the embedding and head
    counts = count_params(ModelConfig.preset("deepseek-v3"))
    assert counts["total"] == 671_026_404_352
    assert abs(counts["total"] / 671e9 - 1) < 0.001
    assert counts["active_without_embedding"] == 36_625_603_584
    assert abs(counts["active_without_embedding"] / 36.6e9 - 1) < 0.001
    assert abs(counts["active"] / 37e9 - 1) < 0.02  # headline 37B; 37.55B with the embedding
    copies = counts["by_part"]["embedding"] + counts["by_part"]["head"]
    checkpoint = counts["total"] + counts["mtp_module"]["total"] + copies
    assert abs(checkpoint / 685e9 - 1) < 0.001


def test_kimi_k2_counts_by_definition():
    # exact figures of the released architecture (docs/checkpoints.md has the arithmetic)
    counts = count_params(ModelConfig.preset("kimi-k2"))
    assert counts["total"] == 1_026_408_209_408
    assert counts["active"] == 32_861_477_888
    assert counts["active_without_embedding"] == 31_687_072_768
    assert counts["mtp_module"]["total"] == 17_162_146_816
    # DeepSeek's definition: activated within 1% of the model card's 32B, but the main-model
    # total is 1.3% short of 1.04T; only a (hypothetical, unreleased) MTP module reaches it
    assert abs(counts["active_without_embedding"] / 32e9 - 1) <= 0.01
    assert abs(counts["total"] / 1.04e12 - 1) > 0.01
    assert abs((counts["total"] + counts["mtp_module"]["total"]) / 1.04e12 - 1) <= 0.01
    assert abs(counts["active"] / 32.6e9 - 1) <= 0.01  # the technical report's 32.6B


def test_format_model_info():
    text = format_model_info(ModelConfig.preset("kimi-k2"))
    total = count_params(ModelConfig.preset("kimi-k2"))["total"]
    assert f"{total:,}" in text and "1.03T" in text
    assert "Kimi K2 as published; * = within 1%" in text
    assert "total, main model                    1.03T   -1.3%  vs 1.04T" in text
    assert "total + 1 MTP module                 1.04T   +0.3%* vs 1.04T" in text
    assert "31,687,072,768" in text and "-1.0%* vs 32B (model card)" in text
    assert "+0.8%* vs 32.6B (technical report)" in text
    deepseek = format_model_info(ModelConfig.preset("deepseek-v3"))
    assert "DeepSeek-V3 as published" in deepseek and "+0.1%* vs 36.6B" in deepseek
    assert "-0.1%* vs 685B" in deepseek
    assert "attention MLA 64 heads (q rank 1536, kv rank 512, qk 128+64, v 128)" in text
    assert "7168 x 2048" in text
    tiny = format_model_info(ModelConfig.preset("tiny"))
    assert "as published" not in tiny
    assert "MLA" not in tiny and f"{count_params(ModelConfig.preset('tiny'))['total']:,}" in tiny
    assert text.isascii() and tiny.isascii()
