"""Curriculum: Beta-posterior weights, sampling, retirement, restart, and spawned variants."""

import math
import random

import pytest
from test_tasks_mine import write_mini_repo

from etude.tasks.build import TaskBuildConfig, TaskFactory
from etude.tasks.curriculum import CurriculumConfig, TaskPool, beta_weight, is_zero_variance
from etude.tasks.proposal import ProposalConfig
from etude.tasks.record import EtudeInfo, TaskRecord


def _record(
    tmp_path, instance_id, *, symbols=("pkg.mod.f",), detail="full", extra=None, repo="pkg"
):
    ws = tmp_path / "workspaces" / instance_id
    ws.mkdir(parents=True, exist_ok=True)
    return TaskRecord(
        instance_id=instance_id,
        repo=repo,
        FAIL_TO_PASS=["tests/test_x.py::test_a"],
        etude=EtudeInfo(
            workspace=str(ws), symbols=list(symbols), detail_level=detail, extra=extra or {}
        ),
    )


def test_beta_weight_is_the_expected_bernoulli_variance():
    for a, b in [(1, 1), (2, 5), (30, 3), (0.5, 0.5)]:
        # E[p(1-p)] by the midpoint rule over the Beta density
        n = 200000
        norm = math.gamma(a) * math.gamma(b) / math.gamma(a + b)
        total = 0.0
        for i in range(n):
            p = (i + 0.5) / n
            total += p * (1 - p) * p ** (a - 1) * (1 - p) ** (b - 1) / norm / n
        assert beta_weight(a, b) == pytest.approx(total, rel=2e-3)
    assert beta_weight(1, 1) == pytest.approx(1 / 6)


def test_weights_prefer_pass_rates_near_half(tmp_path):
    records = [_record(tmp_path, name) for name in ("half", "never", "always", "new")]
    pool = TaskPool.load_or_create(
        tmp_path / "pool.json", records, CurriculumConfig(min_attempts=100)
    )
    pool.update("half", [1, 0] * 10)
    pool.update("never", [0] * 20)
    pool.update("always", [1] * 20)
    w = pool.weights()
    assert w["half"] > w["new"] > w["never"] and w["half"] > w["always"]
    assert w["never"] == pytest.approx(w["always"])  # symmetric prior, mirrored counts
    assert w["new"] == pytest.approx(pool.cfg.min_weight + 1 / 6)
    assert w["half"] == pytest.approx(pool.cfg.min_weight + beta_weight(11, 11))


def test_sampling_is_distinct_and_follows_the_weights(tmp_path):
    records = [_record(tmp_path, f"t{i}") for i in range(4)]
    pool = TaskPool.load_or_create(
        tmp_path / "pool.json", records, CurriculumConfig(autosave=False, min_attempts=1000)
    )
    pool.update("t0", [1, 0] * 20)
    pool.update("t1", [0] * 40)
    rng = random.Random(0)
    batch = pool.sample(4, rng)
    assert sorted(r.instance_id for r in batch) == ["t0", "t1", "t2", "t3"]
    assert len(pool.sample(6, rng)) == 6  # more than the pool: continues with replacement
    weights = pool.weights()
    total = sum(weights.values())
    draws = 20000
    counts = {i: 0 for i in weights}
    for _ in range(draws):
        counts[pool.sample(1, rng)[0].instance_id] += 1
    for task_id, weight in weights.items():
        p = weight / total
        assert abs(counts[task_id] / draws - p) < 4 * math.sqrt(p * (1 - p) / draws)


def test_updates_retire_mark_unsolved_and_report_zero_variance(tmp_path):
    cfg = CurriculumConfig(min_attempts=8, retire_pass_rate=0.75, unsolved_attempts=8)
    pool = TaskPool.load_or_create(
        tmp_path / "pool.json", [_record(tmp_path, "easy"), _record(tmp_path, "hard")], cfg
    )
    report = pool.update("easy", [1.0, 1.0, 1.0, 1.0])
    assert report.zero_variance and report.status == "active"  # too few attempts to retire
    report = pool.update("easy", [1.0, 1.0, 1.0, 0.5])
    assert not report.zero_variance and report.status == "retired"
    assert pool.weight("easy") == 0.0
    assert pool.update("hard", [0.0] * 8).status == "unsolved"
    assert pool.update("hard", [1.0, 0.0]).status == "active"
    stats = pool.stats()
    assert stats["retired"] == 1 and stats["groups"] == 4 and stats["zero_variance_groups"] == 2
    assert (
        is_zero_variance([0.3, 0.3])
        and not is_zero_variance([0.3])
        and not is_zero_variance([0, 1])
    )
    with pytest.raises(ValueError, match="unknown task"):
        pool.update("nope", [1.0])
    lone = TaskPool.load_or_create(tmp_path / "lone.json", [_record(tmp_path, "only")], cfg)
    lone.update("only", [1.0] * 20)
    with pytest.raises(ValueError, match="no active task"):
        lone.sample(1, random.Random(0))


def test_state_survives_a_restart(tmp_path):
    path = tmp_path / "run" / "pool.json"
    pool = TaskPool.load_or_create(path, [_record(tmp_path, "a"), _record(tmp_path, "b")])
    pool.update("a", [1, 0, 1])
    del pool
    again = TaskPool.load_or_create(path, [_record(tmp_path, "a"), _record(tmp_path, "c")])
    assert sorted(again.records) == ["a", "b", "c"]
    assert again.stats_by_id["a"].attempts == 3 and again.stats_by_id["a"].passes == 2
    assert again.stats_by_id["c"].attempts == 0
    assert again.updates == 1
    relative = TaskRecord.from_dict(
        {
            **_record(tmp_path, "rel").to_dict(),
            "etude": {"workspace": "workspaces/rel"},
            "instance_id": "rel2",
        }
    )
    with pytest.raises(ValueError, match="base_dir"):
        TaskPool.load_or_create(tmp_path / "other.json", [relative])
    pool = TaskPool.load_or_create(tmp_path / "other.json", [relative], base_dir=tmp_path)
    assert pool.records["rel2"].etude.workspace == str(tmp_path / "workspaces" / "rel")


def test_config_errors_name_the_setting():
    with pytest.raises(ValueError, match="retire_pass_rate"):
        CurriculumConfig(retire_pass_rate=1.5)
    with pytest.raises(ValueError, match="prior_alpha"):
        CurriculumConfig(prior_alpha=0)


def test_spawned_variants_are_validated_and_linked(tmp_path):
    """Records from an earlier session (rebuilt from their symbols) get real, validated variants."""
    repo = write_mini_repo(tmp_path / "repo")
    cfg = TaskBuildConfig(workers=1, variants_per_task=2, proposals=ProposalConfig(min_lines=2))
    mastered = _record(
        tmp_path,
        "minipkg__shapes.perimeter@docstring",
        symbols=["minipkg.shapes.perimeter"],
        detail="docstring",
        repo="minipkg",
        extra={"feature_kind": "function"},
    )
    stuck = _record(
        tmp_path,
        "minipkg__shapes.Box",
        symbols=["minipkg.shapes.Box"],
        repo="minipkg",
        extra={"feature_kind": "class"},
    )
    curriculum = CurriculumConfig(min_attempts=4, retire_pass_rate=0.7, unsolved_attempts=4)
    path = tmp_path / "pool.json"
    pool = TaskPool.load_or_create(path, [mastered, stuck], curriculum)
    pool.update(mastered.instance_id, [1.0] * 8)
    pool.update(stuck.instance_id, [0.0] * 8)
    with TaskFactory(repo, tmp_path / "variants", cfg) as factory:
        spawned = pool.maybe_spawn(factory)
        assert pool.maybe_spawn(factory) == []  # each task is asked once
    by_parent: dict[str, list[TaskRecord]] = {}
    for record in spawned:
        by_parent.setdefault(record.etude.parent, []).append(record)
        assert record.FAIL_TO_PASS and record.etude.leak_scan["clean"]
        assert pool.stats_by_id[record.instance_id].generation == 1
    harder = by_parent[mastered.instance_id]
    assert [(r.etude.detail_level, len(r.etude.symbols) > 1) for r in harder] == [
        ("tests", False),
        ("docstring", True),
    ]
    assert harder[1].etude.extra["feature_kind"] == "multi"
    easier = by_parent[stuck.instance_id]
    assert {tuple(r.etude.symbols) for r in easier} <= {
        ("minipkg.shapes.Box.volume",),
        ("minipkg.shapes.Box.describe",),
    }
    assert len(easier) == 2
    restarted = TaskPool.load_or_create(path, [])
    assert set(restarted.records) == {
        mastered.instance_id,
        stuck.instance_id,
        *(r.instance_id for r in spawned),
    }
    assert restarted.stats()["variants"] == len(spawned)
