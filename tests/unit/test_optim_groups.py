"""build_optimizer routes parameters by model metadata; OptimConfig checks its settings.

The routing tests give parameters names that lie about what they are: the metadata, not the
name, must decide. The tiny MoE model checks the contract end to end: every attention
projection by heads, every stacked expert weight by experts, embeddings, head, norms and router
on AdamW.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from etude.config import from_dict
from etude.model.meta import ParamMeta, collect_param_meta
from etude.optim import OptimConfig, ShardedMuon, build_optimizer


class MisleadingNames(nn.Module):
    """Names that a name-based router would get wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Parameter(torch.randn(6 * 4, 10))  # really 6 query heads
        self.norm_out = nn.Parameter(torch.randn(10, 6 * 4))  # really an output projection
        self.w1 = nn.Parameter(torch.randn(3, 10, 7))  # really 3 experts
        self.q_proj = nn.Parameter(torch.randn(30, 10))  # really an embedding table
        self.frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)

    def param_meta(self) -> dict[str, ParamMeta]:
        return {
            "embedding": ParamMeta(kind="heads_dim0", num_blocks=6),
            "norm_out": ParamMeta(kind="heads_dim1", num_blocks=6),
            "w1": ParamMeta(kind="experts", num_blocks=3),
            "q_proj": ParamMeta(kind="embedding"),
            "frozen": ParamMeta(kind="matrix"),
        }


def names_by_group(opt: torch.optim.Optimizer) -> list[tuple]:
    return [
        (g.get("algorithm"), g.get("kind"), g.get("num_blocks"), sorted(g["param_names"]))
        for g in opt.param_groups
    ]


def test_routes_by_metadata_not_names():
    opt = build_optimizer(MisleadingNames(), OptimConfig())
    assert isinstance(opt, ShardedMuon)
    assert names_by_group(opt) == [
        ("muon", "heads_dim0", 6, ["embedding"]),
        ("muon", "heads_dim1", 6, ["norm_out"]),
        ("muon", "experts", 3, ["w1"]),
        ("adamw", None, None, ["q_proj"]),
    ]


def test_settings_reach_the_groups():
    cfg = OptimConfig(lr=0.01, weight_decay=0.2, adamw_lr=1e-3, adamw_weight_decay=0.01)
    opt = build_optimizer(MisleadingNames(), cfg)
    muon, adamw = opt.param_groups[0], opt.param_groups[-1]
    assert (muon["lr"], muon["weight_decay"], muon["momentum"], muon["ns_steps"]) == (
        0.01,
        0.2,
        0.95,
        5,
    )
    assert (adamw["lr"], adamw["weight_decay"], adamw["betas"]) == (1e-3, 0.01, (0.9, 0.95))
    assert OptimConfig(lr=0.01).resolved_adamw_lr == 0.01


def test_adamw_baseline_keeps_the_same_split_of_learning_rates():
    cfg = OptimConfig(name="adamw", lr=0.01, weight_decay=0.2, adamw_lr=1e-3)
    opt = build_optimizer(MisleadingNames(), cfg)
    assert type(opt) is torch.optim.AdamW
    hidden, rest = opt.param_groups
    assert sorted(hidden["param_names"]) == ["embedding", "norm_out", "w1"]
    assert (hidden["lr"], hidden["weight_decay"]) == (0.01, 0.2)
    assert rest["param_names"] == ["q_proj"] and rest["lr"] == 1e-3


def test_parameter_without_metadata_is_an_error():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"parameters without metadata: \['0.weight', '0.bias'\]"):
        build_optimizer(model, OptimConfig())


def test_tiny_moe_model_is_routed_as_declared():
    from etude.model import ModelConfig, build_model

    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, device="cpu", seed=0)
    opt = build_optimizer(model, OptimConfig())
    routed = {}
    for g in opt.param_groups:
        for name in g["param_names"]:
            routed[name] = (g["algorithm"], g.get("kind"), g.get("num_blocks"))
    assert routed.keys() == dict(model.named_parameters()).keys()
    for name, meta in collect_param_meta(model).items():
        if meta.optimizer == "muon":
            assert routed[name] == ("muon", meta.kind, meta.num_blocks), name
        else:
            assert routed[name] == ("adamw", None, None), name
    kinds = {v[1] for v in routed.values()}
    assert kinds == {"heads_dim0", "heads_dim1", "experts", "matrix", None}
    assert routed["layers.1.attention.q_proj.weight"] == ("muon", "heads_dim0", cfg.num_heads)
    assert routed["layers.1.attention.k_proj.weight"] == ("muon", "heads_dim0", cfg.num_kv_heads)
    assert routed["layers.1.attention.o_proj.weight"] == ("muon", "heads_dim1", cfg.num_heads)
    assert routed["layers.1.ffn.experts.w2"] == ("muon", "experts", cfg.num_experts)
    for name in (
        "tok_embeddings.weight",
        "output.weight",
        "norm.weight",
        "layers.1.ffn.router.gate.weight",
    ):
        assert routed[name][0] == "adamw", name

    tokens_BT = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits_BTV = model(tokens_BT[:, :-1])
    torch.nn.functional.cross_entropy(
        logits_BTV.flatten(0, 1), tokens_BT[:, 1:].flatten()
    ).backward()
    opt.step()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert "layers.1.ffn.experts.w1" in moved and "layers.0.attention.q_proj.weight" in moved


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        ({"lr": 0.0}, "optim.lr"),
        ({"momentum": 1.0}, "optim.momentum"),
        ({"ns_steps": 0}, "optim.ns_steps"),
        ({"weight_decay": -0.1}, "optim.weight_decay"),
        ({"adamw_betas": (0.9, 1.0)}, "optim.adamw_betas"),
        ({"adamw_lr": -1.0}, "optim.adamw_lr"),
        ({"bucket_mb": 0.0}, "optim.bucket_mb"),
    ],
)
def test_bad_settings_name_the_setting(overrides, setting):
    with pytest.raises(ValueError, match=setting):
        OptimConfig(**overrides)


def test_config_loads_from_a_recipe_table():
    cfg = from_dict(
        OptimConfig,
        {"name": "muon", "lr": 1, "adamw_betas": [0.8, 0.9], "ns_coefficients": "polar_express"},
        "optim",
    )
    assert (
        cfg.lr == 1.0 and cfg.adamw_betas == (0.8, 0.9) and cfg.ns_coefficients == "polar_express"
    )
    with pytest.raises(ValueError, match="optim.ns_dtype"):
        from_dict(OptimConfig, {"ns_dtype": "float16"}, "optim")
    with pytest.raises(ValueError, match="unknown config key 'optim.learning_rate'"):
        from_dict(OptimConfig, {"learning_rate": 0.1}, "optim")


def test_config_imports_without_torch():
    code = "import sys, etude.optim; etude.optim.OptimConfig(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
