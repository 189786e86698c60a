"""DCP checkpoints and safetensors export: bitwise round trips, atomicity, clear errors."""

import json

import pytest
import torch

from etude.model.config import ModelConfig
from etude.model.transformer import build_model
from etude.optim import OptimConfig, build_optimizer
from etude.parallel.checkpoint import (
    export_safetensors,
    latest_checkpoint,
    load_checkpoint,
    load_safetensors,
    save_checkpoint,
)


def small_model(seed: int, **overrides):
    cfg = ModelConfig.preset(
        "tiny",
        vocab_size=64,
        dim=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        dense_ffn_dim=48,
        num_experts=4,
        expert_ffn_dim=16,
        **overrides,
    )
    return cfg, build_model(cfg, seed=seed)


def train_steps(model, opt, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 9), generator=g)
        loss = torch.nn.functional.cross_entropy(
            model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_round_trip_is_bitwise_and_training_continues_identically(tmp_path):
    cfg, model = small_model(0)
    opt = build_optimizer(model, OptimConfig(lr=0.02))
    train_steps(model, opt, 2)
    save_checkpoint(tmp_path, 2, model, opt, {"tokens_seen": 123})
    train_steps(model, opt, 2, seed=1)
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    _, fresh = small_model(seed=5)  # different init: everything must come from the checkpoint
    fresh_opt = build_optimizer(fresh, OptimConfig(lr=0.02))
    extra = load_checkpoint(latest_checkpoint(tmp_path), fresh, fresh_opt)
    assert extra == {"step": 2, "tokens_seen": 123}
    train_steps(fresh, fresh_opt, 2, seed=1)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, reference[k]), k


def test_latest_pointer_and_interrupted_save(tmp_path):
    _, model = small_model(0)
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 1, model)
    save_checkpoint(tmp_path, 2, model)
    save_checkpoint(tmp_path, 3, model)
    root = tmp_path / "checkpoints"
    assert latest_checkpoint(tmp_path) == root / "step_000003"
    assert sorted(p.name for p in root.glob("step_*")) == [
        "step_000002",
        "step_000003",
    ]  # keep_last=2
    # a save that died half-way leaves a .partial directory: it is ignored, then replaced
    (root / "step_000004.partial").mkdir()
    (root / "step_000004.partial" / "junk").write_text("x")
    assert latest_checkpoint(tmp_path) == root / "step_000003"
    save_checkpoint(tmp_path, 4, model)
    assert latest_checkpoint(tmp_path) == root / "step_000004"
    assert not (root / "step_000004.partial").exists()
    with pytest.raises(ValueError, match="not a complete etude checkpoint"):
        load_checkpoint(root / "step_000004.partial", model)


def test_saving_a_step_again_replaces_it(tmp_path):
    _, model = small_model(0)
    _, other = small_model(7)
    save_checkpoint(tmp_path, 1, model)
    save_checkpoint(tmp_path, 2, model)
    save_checkpoint(tmp_path, 2, other)  # e.g. a periodic save, then the final one
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]
    _, fresh = small_model(3)
    load_checkpoint(latest_checkpoint(tmp_path), fresh)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k
    # a copy left aside by an interrupted re-save does not count toward keep_last
    (root / "step_000002.old").mkdir()
    save_checkpoint(tmp_path, 3, model)
    assert sorted(p.name for p in root.glob("step_*")) == [
        "step_000002",
        "step_000002.old",
        "step_000003",
    ]


def test_safetensors_export_round_trip(tmp_path):
    cfg, model = small_model(0)
    path = export_safetensors(model, tmp_path / "export", {"dim": cfg.dim})
    assert json.loads((tmp_path / "export" / "config.json").read_text()) == {"dim": 32}
    _, other = small_model(7)
    load_safetensors(other, path)
    tokens = torch.randint(0, 64, (2, 8))
    assert torch.equal(model(tokens), other(tokens))


def test_safetensors_export_of_tied_weights(tmp_path):
    # the head shares the embedding's storage, which safetensors will not write as is
    cfg, model = small_model(0, tie_embeddings=True)
    path = export_safetensors(model, tmp_path / "export", {"dim": cfg.dim})
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.json", "model.safetensors"]
    _, other = small_model(7, tie_embeddings=True)
    load_safetensors(other, path)
    assert other.output.weight is other.tok_embeddings.weight
    tokens = torch.randint(0, 64, (2, 8))
    assert torch.equal(model(tokens), other(tokens))
