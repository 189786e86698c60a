"""Which tasks an RL step rolls out: draws from (seed, step), the curriculum's pool across
ranks, and variants spawned during the run.

The trainer (``etude.rl.trainer``) calls these between steps: ``sample_tasks`` draws a step's
tasks (uniformly, or weighted by the pool's pass-rate statistics), ``broadcast_task_records``
sends rank 0's draw to every rank, ``gather_group_rewards`` brings every rank's group rewards
to the pool, and ``spawn_variants`` asks a (lazily built) ``TaskFactory`` for harder or easier
variants of mastered and never-solved tasks. Not here: the pool's rules
(``etude.tasks.curriculum``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from etude.env.trajectory import Trajectory
from etude.rl.recipe import TasksConfig
from etude.rl.update import is_graded
from etude.runtime import world
from etude.tasks.build import TaskBuildConfig, TaskFactory
from etude.tasks.curriculum import TaskPool
from etude.tasks.record import TaskRecord


def sample_tasks(
    tasks: Sequence[TaskRecord],
    num: int,
    *,
    seed: int,
    step: int,
    pool: TaskPool | None = None,
) -> list[TaskRecord]:
    """``num`` tasks for ``step``, from (seed, step): the curriculum's weighted draw when a
    ``pool`` is given, else uniform without replacement while the tasks last."""
    rng = random.Random(f"tasks:{seed}:{step}")
    if pool is not None:
        return pool.sample(num, rng)
    if num <= len(tasks):
        return rng.sample(list(tasks), num)
    return [rng.choice(list(tasks)) for _ in range(num)]


def broadcast_task_records(records: list[TaskRecord]) -> list[TaskRecord]:
    """Rank 0's drawn records on every rank.

    The curriculum pool lives on rank 0 and grows variants the other ranks never loaded, so the
    records themselves travel, not ids. Their workspaces are absolute paths on rank 0: spawned
    variants need a file system all ranks share (one node, or RUN/ on a shared mount).
    """
    if world()[1] == 1:
        return records
    box: list[Any] = [[r.to_json() for r in records]]
    dist.broadcast_object_list(box, src=0)
    return [TaskRecord.from_json(line) for line in box[0]]


class LazyTaskFactory:
    """A ``TaskFactory`` made (export + baseline runs of the suite) on first use only: most spawn
    checks find nothing to spawn, and a run that never masters or gives up on a task should not
    pay for the baseline. Use as a context manager; closing an unused one is free."""

    def __init__(self, repo: str | Path, out_dir: str | Path, cfg: TaskBuildConfig) -> None:
        self.repo = repo
        self.out_dir = out_dir
        self.cfg = cfg
        self.factory: TaskFactory | None = None

    def get(self) -> TaskFactory:
        if self.factory is None:
            factory = TaskFactory(self.repo, self.out_dir, self.cfg)
            factory.prepare()
            self.factory = factory
        return self.factory

    def close(self) -> None:
        if self.factory is not None:
            self.factory.close()
            self.factory = None

    def __enter__(self) -> LazyTaskFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn_pending(pool: TaskPool) -> bool:
    """Whether ``pool.maybe_spawn`` would ask a builder for variants (the rules of
    ``TaskPool.maybe_spawn``: mastered or unsolved, not yet asked, below ``max_generation``)."""
    return any(
        s.generation < pool.cfg.max_generation
        and (
            (s.status == "retired" and not s.spawned_harder)
            or (s.status == "unsolved" and not s.spawned_easier)
        )
        for s in pool.stats_by_id.values()
    )


def spawn_variants(
    task_pool: TaskPool,
    factory_getter: Callable[[], TaskFactory],
    step: int,
    cfg: TasksConfig,
) -> list[TaskRecord]:
    """Variants added to the pool after ``step`` steps: every ``cfg.spawn_every`` steps, with
    ``cfg.repo`` and ``cfg.curriculum`` set, when some task is due for variants. The factory is
    asked for only then (``factory_getter`` may build it lazily)."""
    if not (cfg.curriculum and cfg.repo) or step % cfg.spawn_every != 0:
        return []
    if not spawn_pending(task_pool):
        return []
    return task_pool.maybe_spawn(factory_getter())


def gather_group_rewards(
    trajectories: Sequence[Trajectory], group_size: int
) -> list[tuple[str, list[float]]]:
    """(task id, rewards) of every group of every rank, in rank order."""
    mine = [
        (
            trajectories[i].task_id,
            # an ungraded rollout (an infra outcome, reward None) is no evidence of difficulty
            [float(t.reward) for t in trajectories[i : i + group_size] if is_graded(t)],
        )
        for i in range(0, len(trajectories), group_size)
    ]
    if world()[1] == 1:
        return mine
    gathered: list[Any] = [None] * world()[1]
    dist.all_gather_object(gathered, mine)
    return [group for part in gathered for group in part]


def curriculum_metrics(pool: TaskPool, spawned: Sequence[TaskRecord] | None) -> dict[str, float]:
    """The pool's ``stats()`` as ``curriculum/*`` metrics, plus ``curriculum/spawned`` (variants
    added this step) when spawning is on (``spawned`` not None)."""
    out = {f"curriculum/{k}": float(v) for k, v in pool.stats().items()}
    if spawned is not None:
        out["curriculum/spawned"] = float(len(spawned))
    return out
