"""The curriculum: a persisted task pool that samples near p=0.5 and grows harder and easier tasks.

Group-relative RL learns nothing from a group whose rollouts all got the same reward: the
advantages are zero. So the pool keeps, per task, attempts and passes as a Beta posterior over
the pass rate p (prior ``Beta(prior_alpha, prior_beta)``) and samples each active task with weight

    w = min_weight + E[p (1 - p)] = min_weight + a b / ((a + b) (a + b + 1))

where ``a = prior_alpha + passes`` and ``b = prior_beta + failures``: the expected Bernoulli
variance of the reward, the expected learning signal of a group. It is largest for tasks solved
about half the time and shrinks as the posterior concentrates at 0 or 1; an unseen task starts at
``1/6 + min_weight`` with the uniform prior. Sampling is without replacement
(Efraimidis-Spirakis keys ``u ** (1 / w)``, "Weighted random sampling with a reservoir", 2006).

After each group, ``update`` reports whether every rollout got the same reward
(``zero_variance``), so the trainer can drop the group (dynamic filtering, as in DAPO,
arXiv:2503.14476); the pool counts such groups per task. A task is

- **retired** (weight 0) once mastered: at least ``min_attempts`` attempts and a posterior mean
  above ``retire_pass_rate``; ``maybe_spawn`` then asks the builder for harder variants;
- **unsolved** after ``unsolved_attempts`` attempts without a pass; it stays in the pool (its
  weight is small) and ``maybe_spawn`` asks for easier variants.

Variants come from a builder (``etude.tasks.build.TaskFactory`` has ``harder(record)`` and
``easier(record)``), which validates each like any task and sets ``etude.parent``. Spawning
stops at ``max_generation`` steps from an original task.

State lives in two files written atomically (temp file + rename): ``PATH`` (JSON: per-task
statistics and status) and ``PATH.tasks.jsonl`` (every record, workspaces as absolute paths).
``TaskPool.load_or_create(PATH, tasks)`` picks up where a previous process stopped.

API for the trainer::

    pool = TaskPool.load_or_create("run/pool.json", "tasks/")  # or a list of TaskRecord
    batch = pool.sample(8, rng)                 # list[TaskRecord]
    report = pool.update(task_id, rewards)      # GroupReport(zero_variance=..., ...)
    new = pool.maybe_spawn(factory)             # list[TaskRecord], validated, linked by parent
    pool.stats()                                # dict for logging

What it does not do: run rollouts, or make a pool safe for several writer processes (one
trainer owns it; ``update`` is not thread-safe).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import random
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from etude.tasks.record import TaskRecord, is_archive, load_tasks, save_tasks

STATE_VERSION = 1


@dataclass(kw_only=True, slots=True)
class CurriculumConfig:
    """Sampling and spawning rules of the task pool (TOML section ``[curriculum]``)."""

    prior_alpha: float = 1.0
    """Beta prior pseudo-passes."""
    prior_beta: float = 1.0
    """Beta prior pseudo-failures."""
    pass_threshold: float = 1.0
    """A rollout passes when its reward is at least this."""
    min_weight: float = 0.01
    """Weight added to every active task, so none starves."""
    retire_pass_rate: float = 0.9
    """Posterior mean pass rate above which a task is mastered (given ``min_attempts``)."""
    min_attempts: int = 16
    """Attempts before a task can be retired."""
    unsolved_attempts: int = 32
    """Attempts without any pass after which easier variants are asked for."""
    max_generation: int = 3
    """Variants of variants stop this many steps from an original task."""
    autosave: bool = True
    """Write the state after every ``update`` (else call ``save``, e.g. once per step)."""

    def __post_init__(self) -> None:
        if self.prior_alpha <= 0 or self.prior_beta <= 0:
            raise ValueError("curriculum.prior_alpha and prior_beta must be > 0 (1, 1 is uniform)")
        if self.min_weight < 0:
            raise ValueError(f"curriculum.min_weight={self.min_weight} must be >= 0")
        if not 0.0 < self.retire_pass_rate <= 1.0:
            raise ValueError(
                f"curriculum.retire_pass_rate={self.retire_pass_rate} must be in (0, 1]"
            )
        if self.min_attempts < 1 or self.unsolved_attempts < 1:
            raise ValueError("curriculum.min_attempts and unsolved_attempts must be >= 1")
        if self.max_generation < 0:
            raise ValueError(f"curriculum.max_generation={self.max_generation} must be >= 0")


@dataclass(kw_only=True, slots=True)
class TaskStats:
    """What the pool knows about one task."""

    attempts: int = 0
    passes: int = 0
    reward_sum: float = 0.0
    groups: int = 0
    zero_variance_groups: int = 0
    status: str = "active"
    """``active``, ``retired`` (mastered) or ``unsolved`` (never passed; still sampled)."""
    spawned_harder: bool = False
    spawned_easier: bool = False
    generation: int = 0
    """Steps from an original task (0 for tasks given to the pool)."""


@dataclass(kw_only=True, slots=True)
class GroupReport:
    """What ``update`` learned from one group of rollouts."""

    task_id: str
    zero_variance: bool
    """Every rollout got the same reward: no learning signal; drop the group."""
    mean_reward: float
    pass_rate: float
    """Posterior mean pass rate after the update."""
    status: str


class VariantBuilder(Protocol):
    """Makes validated variants of a task (``etude.tasks.build.TaskFactory`` is one)."""

    def harder(self, record: TaskRecord) -> list[TaskRecord]: ...

    def easier(self, record: TaskRecord) -> list[TaskRecord]: ...


def beta_weight(alpha: float, beta: float) -> float:
    """E[p (1 - p)] for p ~ Beta(alpha, beta)."""
    total = alpha + beta
    return alpha * beta / (total * (total + 1.0))


def is_zero_variance(rewards: Sequence[float]) -> bool:
    """Whether every reward of a group is the same (a group of one has no variance to speak of)."""
    return len(rewards) > 1 and max(rewards) - min(rewards) <= 1e-12


def _absolute(record: TaskRecord, base_dir: Path | None) -> TaskRecord:
    if record.etude is None:
        raise ValueError(f"task {record.instance_id!r} has no etude.workspace; the pool needs one")
    ws = Path(record.etude.workspace)
    if ws.is_absolute():
        return record
    if base_dir is None:
        raise ValueError(
            f"task {record.instance_id!r} has a relative workspace {str(ws)!r}; pass base_dir= "
            "(the directory of its tasks.jsonl) or the tasks.jsonl path itself"
        )
    data = record.to_dict()
    data["etude"]["workspace"] = str((base_dir / ws).absolute())
    return TaskRecord.from_dict(data)


class TaskPool:
    """Tasks with pass-rate statistics; see the module docstring."""

    def __init__(self, path: Path, cfg: CurriculumConfig) -> None:
        self.path = path
        self.cfg = cfg
        self.records: dict[str, TaskRecord] = {}
        self.stats_by_id: dict[str, TaskStats] = {}
        self.updates = 0

    # -- persistence -------------------------------------------------------------------------

    @property
    def records_path(self) -> Path:
        return self.path.with_name(self.path.name + ".tasks.jsonl")

    @classmethod
    def load_or_create(
        cls,
        path: str | Path,
        tasks: Iterable[TaskRecord] | str | Path,
        cfg: CurriculumConfig | None = None,
        *,
        base_dir: str | Path | None = None,
    ) -> TaskPool:
        """The pool saved at ``path``, or a new one; ``tasks`` not yet in it are added.

        ``tasks``: records, or a ``tasks.jsonl`` (or its directory), whose directory then
        resolves relative workspaces. Saved state wins over ``tasks`` for known ids.
        """
        pool = cls(Path(path), cfg if cfg is not None else CurriculumConfig())
        if isinstance(tasks, str | Path):
            task_file = Path(tasks)
            task_file = task_file / "tasks.jsonl" if task_file.is_dir() else task_file
            base = task_file.parent
            given = load_tasks(task_file)
        else:
            base = Path(base_dir) if base_dir is not None else None
            given = list(tasks)
        if pool.path.exists():
            pool._load()
        added = False
        for record in given:
            if record.instance_id not in pool.records:
                pool._add(_absolute(record, base), generation=0)
                added = True
        if added or not pool.path.exists():
            pool.save()
        return pool

    def _load(self) -> None:
        try:
            state = json.loads(self.path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"pool state {str(self.path)!r} is not valid JSON: {e}") from None
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"pool state {str(self.path)!r} has version {state.get('version')!r}, expected "
                f"{STATE_VERSION}; start a new pool file"
            )
        records = {r.instance_id: r for r in load_tasks(self.records_path)}
        missing = sorted(set(state["tasks"]) - set(records))
        if missing:
            raise ValueError(
                f"pool state names tasks missing from {self.records_path}: {missing[:3]}"
            )
        self.records = {i: records[i] for i in state["tasks"]}
        self.stats_by_id = {i: TaskStats(**s) for i, s in state["tasks"].items()}
        self.updates = int(state.get("updates", 0))

    def save(self) -> None:
        """Write records and statistics atomically (records first: state never names a task
        the records file lacks)."""
        save_tasks(self.records_path, self.records.values())
        state = {
            "version": STATE_VERSION,
            "updates": self.updates,
            "config": asdict(self.cfg),
            "tasks": {i: asdict(s) for i, s in self.stats_by_id.items()},
        }
        _write_json_atomic(self.path, state)

    def _add(self, record: TaskRecord, *, generation: int) -> None:
        if record.instance_id in self.records:
            raise ValueError(f"task {record.instance_id!r} is already in the pool")
        assert record.etude is not None
        ws = record.etude.workspace
        if not Path(ws).is_absolute():
            raise ValueError(f"pool records need absolute workspaces, got {ws!r}")
        if not (Path(ws).is_dir() or (is_archive(ws) and Path(ws).is_file())):
            raise ValueError(f"workspace {ws!r} of task {record.instance_id!r} does not exist")
        self.records[record.instance_id] = record
        self.stats_by_id[record.instance_id] = TaskStats(generation=generation)

    # -- sampling ----------------------------------------------------------------------------

    def posterior(self, task_id: str) -> tuple[float, float]:
        """Beta parameters (a, b) of the task's pass rate."""
        s = self.stats_by_id[task_id]
        return self.cfg.prior_alpha + s.passes, self.cfg.prior_beta + s.attempts - s.passes

    def pass_rate(self, task_id: str) -> float:
        """Posterior mean pass rate."""
        a, b = self.posterior(task_id)
        return a / (a + b)

    def weight(self, task_id: str) -> float:
        """Sampling weight (0 for retired tasks)."""
        if self.stats_by_id[task_id].status == "retired":
            return 0.0
        return self.cfg.min_weight + beta_weight(*self.posterior(task_id))

    def weights(self) -> dict[str, float]:
        return {i: self.weight(i) for i in self.stats_by_id}

    def sample(self, n: int, rng: random.Random) -> list[TaskRecord]:
        """``n`` tasks drawn by weight, distinct while there are enough active tasks (then the
        draw continues with replacement)."""
        if n < 1:
            raise ValueError(f"sample n={n} must be >= 1")
        weighted = [(i, w) for i, w in self.weights().items() if w > 0]
        if not weighted:
            raise ValueError("the pool has no active task; spawn variants or add tasks")
        # Efraimidis-Spirakis: the n largest u^(1/w) are a weighted sample without replacement
        keyed = sorted(
            weighted, key=lambda iw: math.log(max(rng.random(), 1e-300)) / iw[1], reverse=True
        )
        chosen = [i for i, _ in keyed[:n]]
        cumulative = list(itertools.accumulate(w for _, w in weighted))
        while len(chosen) < n:
            k = bisect.bisect_left(cumulative, rng.random() * cumulative[-1])
            chosen.append(weighted[min(k, len(weighted) - 1)][0])
        return [self.records[i] for i in chosen]

    # -- learning ----------------------------------------------------------------------------

    def update(self, task_id: str, rewards: Sequence[float]) -> GroupReport:
        """Record one group of rollouts of ``task_id``; retire or mark unsolved as the rules say."""
        if task_id not in self.stats_by_id:
            raise ValueError(f"unknown task {task_id!r}; it is not in the pool")
        rewards = [float(r) for r in rewards]
        if not rewards:
            raise ValueError(f"update of {task_id!r} needs at least one reward")
        s = self.stats_by_id[task_id]
        zero = is_zero_variance(rewards)
        s.attempts += len(rewards)
        s.passes += sum(r >= self.cfg.pass_threshold for r in rewards)
        s.reward_sum += sum(rewards)
        s.groups += 1
        s.zero_variance_groups += zero
        rate = self.pass_rate(task_id)
        if s.attempts >= self.cfg.min_attempts and rate > self.cfg.retire_pass_rate:
            s.status = "retired"
        elif s.status == "active" and s.passes == 0 and s.attempts >= self.cfg.unsolved_attempts:
            s.status = "unsolved"
        elif s.status == "unsolved" and s.passes > 0:
            s.status = "active"
        self.updates += 1
        if self.cfg.autosave:
            self.save()
        return GroupReport(
            task_id=task_id,
            zero_variance=zero,
            mean_reward=sum(rewards) / len(rewards),
            pass_rate=rate,
            status=s.status,
        )

    def maybe_spawn(self, builder: VariantBuilder | Sequence[VariantBuilder]) -> list[TaskRecord]:
        """Harder variants of retired tasks, easier ones of unsolved tasks, each asked for once.

        ``builder``: one builder or several (e.g. one per repository; the first that returns
        variants for a task wins). Returns the records added to the pool.
        """
        builders = list(builder) if isinstance(builder, Sequence) else [builder]
        added: list[TaskRecord] = []
        for task_id, s in list(self.stats_by_id.items()):
            if s.generation >= self.cfg.max_generation:
                continue
            if s.status == "retired" and not s.spawned_harder:
                direction, s.spawned_harder = "harder", True
            elif s.status == "unsolved" and not s.spawned_easier:
                direction, s.spawned_easier = "easier", True
            else:
                continue
            variants: list[TaskRecord] = []
            for b in builders:
                variants = getattr(b, direction)(self.records[task_id])
                if variants:
                    break
            for record in variants:
                if record.etude is None or record.etude.parent != task_id:
                    raise ValueError(
                        f"variant {record.instance_id!r} of {task_id!r} must set etude.parent to "
                        "its parent's instance_id"
                    )
                self._add(record, generation=s.generation + 1)
                added.append(record)
        self.save()
        return added

    def stats(self) -> dict[str, Any]:
        """Counts and rates for logging: tasks by status, attempts, zero-variance share, spawns."""
        all_stats = list(self.stats_by_id.values())
        groups = sum(s.groups for s in all_stats)
        zero = sum(s.zero_variance_groups for s in all_stats)
        rates = [self.pass_rate(i) for i in self.stats_by_id]
        by_status: dict[str, int] = {}
        for s in all_stats:
            by_status[s.status] = by_status.get(s.status, 0) + 1
        return {
            "tasks": len(all_stats),
            "active": by_status.get("active", 0),
            "retired": by_status.get("retired", 0),
            "unsolved": by_status.get("unsolved", 0),
            "variants": sum(s.generation > 0 for s in all_stats),
            "attempts": sum(s.attempts for s in all_stats),
            "groups": groups,
            "zero_variance_groups": zero,
            "zero_variance_fraction": zero / groups if groups else 0.0,
            "mean_pass_rate": sum(rates) / len(rates) if rates else 0.0,
            "near_half": sum(0.2 <= r <= 0.8 for r in rates),
            "updates": self.updates,
        }


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
