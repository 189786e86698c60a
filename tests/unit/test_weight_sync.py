"""Weight sync: in-process copy, safetensors + LATEST on disk, change accounting."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from etude.engine import Engine
from etude.engine.backends import EngineBackend
from etude.model.config import ModelConfig
from etude.model.transformer import build_model
from etude.rl.weight_sync import (
    LATEST,
    FileSync,
    FileWeightWatcher,
    InProcessSync,
    WeightSyncConfig,
    build_weight_sync,
    changed_bytes,
    latest_version,
)


def tiny_model(seed: int = 0):
    cfg = ModelConfig.preset(
        "tiny",
        vocab_size=64,
        dim=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        num_dense_layers=1,
        num_experts=2,
        num_experts_per_tok=1,
        expert_ffn_dim=16,
        dense_ffn_dim=32,
        max_seq_len=32,
    )
    return build_model(cfg, seed=seed), cfg


def perturb(model, scale: float = 1e-2) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids)


def test_in_process_copies_into_the_engine_module() -> None:
    policy, _ = tiny_model(0)
    backend = EngineBackend(Engine(copy.deepcopy(policy)))
    engine = backend.engine.model
    sync = InProcessSync(backend, track_changes=True)
    first = sync.push(policy, 0)
    assert first.changed_bytes is None and first.total_bytes > 0
    perturb(policy)
    record = sync.push(policy, 1)
    ids = torch.randint(0, 64, (2, 12))
    assert torch.equal(logits(policy, ids), logits(engine, ids))
    # every parameter moved; buffers (RoPE tables, expert bias) did not
    assert 0 < record.changed_fraction < 1
    assert record.metrics()["sync/version"] == 1.0
    assert backend.policy_version == 1


def test_in_process_with_the_same_module_sets_the_version_only() -> None:
    policy, _ = tiny_model(0)
    backend = EngineBackend(Engine(policy))
    record = InProcessSync(backend).push(policy, 3)
    assert record.version == 3 and record.changed_bytes is None and backend.policy_version == 3


def test_file_sync_versions_latest_and_watcher(tmp_path) -> None:
    policy, cfg = tiny_model(0)
    reader, _ = tiny_model(1)
    sync = FileSync(tmp_path, {"dim": cfg.dim}, keep=2, track_changes=True)
    watcher = FileWeightWatcher(tmp_path)
    assert watcher.poll(reader) is None  # nothing pushed yet
    ids = torch.randint(0, 64, (1, 10))
    for version in range(4):
        if version:
            perturb(policy)
        record = sync.push(policy, version)
        assert latest_version(tmp_path) == (version, tmp_path / f"v{version:06d}")
        assert watcher.poll(reader) == version
        assert watcher.poll(reader) is None  # nothing newer
        assert torch.equal(logits(policy, ids), logits(reader, ids))
        assert (record.changed_bytes is None) == (version == 0)
    # only the newest `keep` versions stay; no temp files are left
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["v000002", "v000003"]
    assert not [p for p in tmp_path.rglob(".*")]
    assert json.loads((tmp_path / LATEST).read_text()) == {"version": 3, "path": "v000003"}
    assert json.loads((tmp_path / "v000003" / "config.json").read_text()) == {"dim": cfg.dim}


def test_changed_bytes_counts_elements_bit_for_bit() -> None:
    a = {"w": torch.zeros(4, 4), "b": torch.zeros(3, dtype=torch.bfloat16)}
    b = {k: v.clone() for k, v in a.items()}
    assert changed_bytes(a, b) == (0, 64 + 6)
    b["w"][0, :2] = 1.0
    b["b"][1] = -0.0  # -0.0 == 0.0 numerically, but its bits differ: a sync must send it
    assert changed_bytes(a, b) == (2 * 4 + 2, 70)
    b["new"] = torch.ones(2)
    assert changed_bytes(a, b) == (2 * 4 + 2 + 8, 78)


def test_config_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match="rollout.sync.kind"):
        WeightSyncConfig(kind="nccl")
    with pytest.raises(ValueError, match="rollout.sync.keep"):
        WeightSyncConfig(kind="file", keep=1)
    with pytest.raises(ValueError, match="in_process"):
        build_weight_sync(WeightSyncConfig(), backend=None, model_config={}, run_dir=".")


def test_file_sync_feeds_an_engine_backend(tmp_path) -> None:
    policy, cfg = tiny_model(0)
    backend = EngineBackend(Engine(tiny_model(1)[0]))
    sync = build_weight_sync(
        WeightSyncConfig(kind="file"), backend=backend, model_config={}, run_dir=tmp_path
    )
    perturb(policy)
    record = sync.push(policy, 5)
    assert backend.policy_version == 5 and record.seconds > 0
    assert (tmp_path / "weights" / "v000005" / "model.safetensors").is_file()
    ids = torch.randint(0, 64, (1, 10))
    assert torch.equal(logits(policy, ids), logits(backend.engine.model, ids))


def test_rollout_settings_that_do_not_fit_together() -> None:
    from etude.rl.rollout import RolloutConfig

    with pytest.raises(ValueError, match="rollout.sync.kind='http'"):
        RolloutConfig(server_url="http://127.0.0.1:8000")
    with pytest.raises(ValueError, match="rollout.server_url"):
        RolloutConfig(sync=WeightSyncConfig(kind="http"))
    with pytest.raises(ValueError, match="rollout.max_staleness"):
        RolloutConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="rollout.workers"):
        RolloutConfig(workers="k8s")
