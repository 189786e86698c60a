"""The trainer's curriculum spawning: cadence, lazy factory, validated and persisted variants."""

import random
from pathlib import Path

import pytest

from etude.rl.recipe import TasksConfig
from etude.rl.task_draw import (
    LazyTaskFactory,
    broadcast_task_records,
    curriculum_metrics,
    sample_tasks,
    spawn_pending,
    spawn_variants,
)
from etude.tasks.build import TaskBuildConfig
from etude.tasks.curriculum import CurriculumConfig, TaskPool
from etude.tasks.record import EtudeInfo, TaskRecord

ROOT = Path(__file__).resolve().parents[2]
TEXTKIT = ROOT / "examples" / "repos" / "textkit"


def _record(base: Path, instance_id: str, symbol: str, detail: str) -> TaskRecord:
    """A textkit task with a relative workspace (as a built tasks.jsonl has them)."""
    (base / "workspaces" / instance_id).mkdir(parents=True)
    return TaskRecord(
        instance_id=instance_id,
        repo="textkit",
        FAIL_TO_PASS=["tests/test_case.py::test_slugify"],
        etude=EtudeInfo(
            workspace=f"workspaces/{instance_id}",
            symbols=[symbol],
            detail_level=detail,
            extra={"feature_kind": "function"},
        ),
    )


def _never_called():
    pytest.fail("the factory was asked for although nothing is due")


def test_config_errors_and_ignored_repo():
    with pytest.raises(ValueError, match="tasks.spawn_every"):
        TasksConfig(spawn_every=0)
    with pytest.warns(UserWarning, match="tasks.repo"):
        TasksConfig(repo=str(TEXTKIT), curriculum=False)


def test_nothing_due_never_builds_a_factory(tmp_path):
    tasks = [_record(tmp_path, "textkit__case.slugify", "textkit.case.slugify", "full")]
    pool = TaskPool.load_or_create(tmp_path / "pool.json", tasks, base_dir=tmp_path)
    cfg = TasksConfig(curriculum=True, repo=str(TEXTKIT), spawn_every=2)
    pool.update("textkit__case.slugify", [0.0, 1.0])
    assert not spawn_pending(pool)
    assert spawn_variants(pool, _never_called, 2, cfg) == []
    pool.update("textkit__case.slugify", [0.0] * 64)
    assert pool.stats_by_id["textkit__case.slugify"].status == "active"  # it passed once
    fresh = _record(tmp_path, "textkit__roman", "textkit.roman", "full")
    pool = TaskPool.load_or_create(tmp_path / "pool2.json", [fresh], base_dir=tmp_path)
    pool.update("textkit__roman", [0.0] * 32)
    assert pool.stats_by_id["textkit__roman"].status == "unsolved" and spawn_pending(pool)
    assert spawn_variants(pool, _never_called, 3, cfg) == []  # off the cadence
    off = TasksConfig(curriculum=True, repo="", spawn_every=2)
    assert spawn_variants(pool, _never_called, 2, off) == []  # no repo: no spawning


def test_never_solved_task_gets_a_validated_easier_variant(tmp_path):
    stuck_id = "textkit__case.slugify@docstring"
    tasks = [
        _record(tmp_path, stuck_id, "textkit.case.slugify", "docstring"),
        _record(tmp_path, "textkit__roman", "textkit.roman", "full"),
    ]
    path = tmp_path / "run" / "pool.json"
    curriculum = CurriculumConfig(unsolved_attempts=8, max_generation=1)
    pool = TaskPool.load_or_create(path, tasks, curriculum, base_dir=tmp_path)
    pool.update(stuck_id, [0.0] * 8)
    assert pool.stats_by_id[stuck_id].status == "unsolved" and spawn_pending(pool)

    cfg = TasksConfig(curriculum=True, repo=str(TEXTKIT), spawn_every=2)
    build = TaskBuildConfig(workers=1, variants_per_task=1)
    with LazyTaskFactory(TEXTKIT, tmp_path / "run" / "variants", build) as lazy:
        assert spawn_variants(pool, lazy.get, 1, cfg) == []  # off the cadence
        assert lazy.factory is None
        spawned = spawn_variants(pool, lazy.get, 2, cfg)
        assert lazy.factory is not None
        assert spawn_variants(pool, lazy.get, 4, cfg) == []  # each task is asked once
    assert lazy.factory is None  # closed with the context

    assert len(spawned) == 1
    variant = spawned[0]
    assert variant.etude.parent == stuck_id
    assert variant.etude.detail_level == "full"  # easier: more detail than its parent
    assert variant.etude.symbols == ["textkit.case.slugify"]
    assert variant.FAIL_TO_PASS and variant.etude.leak_scan["clean"]
    workspace = Path(variant.etude.workspace)
    assert workspace.is_absolute() and workspace.is_dir()
    assert workspace.parent == (tmp_path / "run" / "variants" / "workspaces").resolve()
    assert pool.stats_by_id[variant.instance_id].generation == 1

    # the variant is drawn afterwards (three active tasks, three distinct draws)
    drawn = sample_tasks([], 3, seed=0, step=5, pool=pool)
    assert variant.instance_id in {t.instance_id for t in drawn}
    assert broadcast_task_records(drawn) == drawn  # one process: the records themselves
    assert TaskRecord.from_json(variant.to_json()) == variant  # what torchrun ranks receive

    metrics = curriculum_metrics(pool, spawned)
    assert metrics["curriculum/spawned"] == 1.0
    assert metrics["curriculum/variants"] == 1.0 and metrics["curriculum/tasks"] == 3.0
    assert metrics["curriculum/unsolved"] == 1.0
    assert "curriculum/spawned" not in curriculum_metrics(pool, None)

    restarted = TaskPool.load_or_create(path, [], curriculum)
    assert restarted.records[variant.instance_id] == variant
    assert restarted.stats_by_id[stuck_id].spawned_easier
    assert not spawn_pending(restarted)
    rng = random.Random(0)
    assert variant.instance_id in {t.instance_id for t in restarted.sample(3, rng)}
