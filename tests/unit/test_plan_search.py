"""Layout search of ``etude plan --gpus N``: every candidate ranked or ruled out with a reason,
the best ones are real estimates, in order; MLA and the precisions as settings."""

from __future__ import annotations

import pytest

from etude.model import ModelConfig
from etude.plan.cluster import ClusterConfig
from etude.plan.cost import estimate
from etude.plan.layout import Layout
from etude.plan.report import main
from etude.plan.search import candidate_layouts, search_layouts
from etude.plan.settings import PlanSettings


def small_moe() -> ModelConfig:
    return ModelConfig.preset(
        "tiny",
        vocab_size=512,
        dim=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dense_ffn_dim=128,
        num_experts=8,
        num_experts_per_tok=2,
        expert_ffn_dim=32,
    )


def test_search_ranks_feasible_layouts_and_explains_the_rest():
    cfg = small_moe()
    # a capacity that only the more sharded layouts fit
    tight = ClusterConfig.preset("h100", 16, gpu_memory_bytes=2_000_000)
    settings = PlanSettings(seq_len=64)
    result = search_layouts(cfg, tight, settings, top=3, simulate=3)
    candidates = candidate_layouts(cfg, 16, 64)
    assert result["feasible"] + len(result["ruled_out"]) == len(candidates)
    assert result["reasons"].get("memory", 0) > 0 and result["feasible"] > 0
    for item in result["ruled_out"]:
        assert item["reason"] and item["kind"] in ("layout", "expert sharding", "memory")
    steps = [e["step_s"] for e in result["best"]]
    assert steps == sorted(steps) and len(steps) == 3
    for est in result["best"]:
        assert est["memory"]["total"] <= tight.gpu_memory_bytes
        lay = est["layout"]
        expert_replicate = lay["expert_replicate"]
        layout = Layout(
            dp_replicate=lay["dp_replicate"],
            dp_shard=lay["dp_shard"],
            cp=lay["cp"],
            ep=lay["ep"],
            expert_replicate=None if expert_replicate == lay["dp_replicate"] else expert_replicate,
        )
        settings_used = PlanSettings(seq_len=64, batch_tokens=result["batch_tokens"])
        again = estimate(cfg, tight, layout, settings_used)
        assert again["memory"]["total"] == est["memory"]["total"]
    memory = [r for r in result["ruled_out"] if r["kind"] == "memory"]
    assert "GiB per GPU, the GPU has" in memory[0]["reason"]


def test_cli_searches_when_no_layout_flag_is_given(capsys):
    assert main(["--config", "tiny", "--gpus", "8", "--seq-len", "64", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "no layout given: searched" in out and "the best layout in full: etude plan" in out
    assert "step = compute" in out


def test_mla_shapes_and_precisions_in_the_plan():
    cfg = ModelConfig.preset(
        "tiny",
        attention="mla",
        num_kv_heads=4,
        head_dim=48,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
    )
    cluster = ClusterConfig.preset("h100", 4)
    layout = Layout.for_gpus(4, cp=2)
    base = estimate(cfg, cluster, layout, PlanSettings(seq_len=64))
    # CP of MLA sends the compressed latent and the rotary key: (32 + 16) values per token
    tokens = 64 // 2
    assert base["comm"]["cp"]["bytes"] == pytest.approx(
        3 * cfg.num_layers * (2 - 1) * tokens * (32 + 16) * 2
    )
    fp32 = estimate(
        cfg,
        cluster,
        layout,
        PlanSettings(seq_len=64, param_dtype="fp32", grad_dtype="fp32", master_dtype="none"),
    )
    assert fp32["memory"]["parameters"] == 2 * base["memory"]["parameters"]
    assert fp32["memory"]["gradients"] == 2 * base["memory"]["gradients"]
    assert fp32["memory"]["master"] == 0 and base["memory"]["master"] > 0
    with pytest.raises(ValueError, match="plan.master_dtype must be one of"):
        PlanSettings(master_dtype="fp8")


@pytest.mark.slow
def test_kimi_k2_on_2048_gpus_with_only_gpus(capsys):
    assert main(["--config", "kimi-k2", "--gpus", "2048", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "feasible" in out and "ruled out by memory" in out
