"""Asynchronous rollouts with bounded staleness: rollout batches run ahead of the trainer.

The synchronous loop rolls out step s's batch with the current weights, trains on it, and only
then starts step s + 1: the trainer idles while episodes run, and the whole batch waits for its
slowest episode. Here rollout batches run on background workers while the trainer trains,
within a bound on how old the generating weights may be.

**Versions.** The policy version is the number of optimizer steps applied to the weights (the
initial weights are version 0, a resumed run's are its start step). Every assistant turn records
the version of the weights that generated it (``Turn.policy_version``, set from the engine's
``Generation.policy_version``). A turn of step s's batch generated at version v is ``s - v``
steps stale.

**Admission (the staleness bound).** Step s's batch may start once the trainer's version is at
least ``s - max_staleness``. The trainer asks for step s's batch after applying s updates
(version s), so ``next_batch(s)`` first submits every not yet submitted step up to
``s + max_staleness`` (``steps_to_admit``), then waits for step s's own batch. Every turn of a
batch is generated at a version >= the version at its admission, so no turn the trainer sees
is more than ``max_staleness`` steps stale. ``max_staleness = 0`` admits step s only after update
s - 1: exactly the synchronous loop, with the same tasks, seeds and weights.

**Pacing (no starvation of slow episodes).** A batch belongs to the step it was admitted for and
is trained on at that step, whatever its episodes' durations: the trainer waits for the slowest
episode of step s's batch, while the batches of steps s + 1 .. s + max_staleness keep running.
A late episode is used with the versions that generated its turns (its importance ratio is
against the behaviour logprobs stored per token); it is never dropped, re-weighted or replaced by
a faster episode, so the batch's task mix does not drift toward short episodes. (Taking the
first batches to finish instead would raise throughput further but bias training toward easy,
fast tasks, and could exceed the bound.)

**Partial rollouts.** An episode in flight when the weights change continues with the new
weights from its next turn on: the backend serves whatever version it holds at each call (the
in-process ``EngineBackend`` serializes generation and ``update_weights``, so one call never sees
two versions; a server applies a reload between decode steps). Such an episode's turns carry
different versions (``partial_episodes`` counts them).

Tasks are drawn on the trainer's thread (``draw(step)``, inside ``next_batch``), so the
curriculum's broadcast and any other collective stay on one thread; with ``max_staleness > 0``
the draw for step s happens before the pool has seen the rewards of steps s - max_staleness ..
s - 1 (the curriculum lags by that many steps).

What this does not do: run rollouts in other processes (the Ray pool, ``etude.env.ray_pool``,
runs the environments elsewhere; a remote inference server takes the ``http`` weight sync), or
adapt ``max_staleness`` during a run.

Legend: k = max_staleness.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from etude.env.trajectory import Trajectory

T = TypeVar("T")


# ---------------------------------------------------------------- the rules (pure functions)


def steps_to_admit(step: int, submitted_until: int, max_staleness: int, end: int) -> range:
    """Steps to submit when the trainer (at version ``step``) asks for step ``step``'s batch:
    those in ``[submitted_until, min(step + max_staleness, end - 1)]``."""
    assert max_staleness >= 0 and step >= 0
    return range(submitted_until, min(step + max_staleness, end - 1) + 1)


def turn_versions(trajectory: Trajectory) -> list[int]:
    """The policy versions of the trajectory's generated turns (turns with none are skipped)."""
    return [
        turn.policy_version
        for _, turn in trajectory.assistant_turns()
        if turn.policy_version is not None
    ]


def staleness_stats(trajectories: Sequence[Trajectory], step: int) -> dict[str, float]:
    """Staleness of a batch trained at ``step``: max and mean over generated turns, and the
    number of episodes whose turns span more than one version (partial rollouts)."""
    per_turn = [step - v for t in trajectories for v in turn_versions(t)]
    partial = sum(1 for t in trajectories if len(set(turn_versions(t))) > 1)
    return {
        "async/staleness_max": float(max(per_turn, default=0)),
        "async/staleness_mean": sum(per_turn) / len(per_turn) if per_turn else 0.0,
        "async/partial_episodes": float(partial),
    }


def check_staleness(trajectories: Sequence[Trajectory], step: int, max_staleness: int) -> None:
    """Assert the bound (an invariant of the admission rule, not a user error)."""
    for traj in trajectories:
        for version in turn_versions(traj):
            assert 0 <= step - version <= max_staleness, (traj.task_id, step, version)


# ---------------------------------------------------------------- the pipeline


@dataclass(kw_only=True, slots=True)
class PipelineBatch(Generic[T]):
    """Step ``step``'s rollouts, with when they were admitted and how long the trainer waited."""

    step: int
    result: T
    admitted_version: int
    wait_seconds: float
    """Seconds the trainer spent blocked in ``next_batch`` for this batch (trainer idle)."""
    rollout_seconds: float
    """Seconds from the batch's start on a worker to its end."""


class RolloutPipeline(Generic[T]):
    """Runs ``rollout(step, tasks)`` for up to ``max_staleness + 1`` steps at once.

    ``draw(step)`` gives the tasks of a step (called on the thread that calls ``next_batch``);
    ``rollout(step, tasks)`` produces the step's batch on a worker thread. Steps run from
    ``start_step`` to ``end_step - 1``; ``next_batch`` must be called for them in order.
    """

    def __init__(
        self,
        draw: Callable[[int], Any],
        rollout: Callable[[int, Any], T],
        *,
        max_staleness: int,
        start_step: int,
        end_step: int,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"rollout.max_staleness={max_staleness} must be >= 0 (0 = on-policy)")
        self.draw = draw
        self.rollout = rollout
        self.max_staleness = max_staleness
        self.end_step = end_step
        self._next_to_take = start_step
        self._submitted_until = start_step
        self._futures: dict[int, Future[tuple[T, float]]] = {}
        self._admitted: dict[int, int] = {}
        self._executor = ThreadPoolExecutor(max_staleness + 1, thread_name_prefix="etude-rollout")

    def _run(self, step: int, tasks: Any) -> tuple[T, float]:
        start = time.perf_counter()
        result = self.rollout(step, tasks)
        return result, time.perf_counter() - start

    def next_batch(self, step: int) -> PipelineBatch[T]:
        """Admit what the bound allows at version ``step``, then wait for step ``step``'s batch."""
        if step != self._next_to_take:
            raise ValueError(f"next_batch({step}) out of order: expected step {self._next_to_take}")
        if not step < self.end_step:
            raise ValueError(f"step {step} is past the pipeline's last step {self.end_step - 1}")
        for s in steps_to_admit(step, self._submitted_until, self.max_staleness, self.end_step):
            tasks = self.draw(s)
            self._admitted[s] = step
            self._futures[s] = self._executor.submit(self._run, s, tasks)
            self._submitted_until = s + 1
        waited = time.perf_counter()
        result, seconds = self._futures.pop(step).result()
        wait_seconds = time.perf_counter() - waited
        self._next_to_take = step + 1
        return PipelineBatch(
            step=step,
            result=result,
            admitted_version=self._admitted.pop(step),
            wait_seconds=wait_seconds,
            rollout_seconds=seconds,
        )

    def in_flight(self) -> list[int]:
        """Steps submitted and not yet taken."""
        return sorted(self._futures)

    def close(self) -> None:
        """Wait for the batches in flight (their environments clean up), then stop the workers."""
        for future in self._futures.values():
            future.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._futures.clear()

    def __enter__(self) -> RolloutPipeline[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- the trainer's side


def separate_engine_needed(cfg: Any, world_size: int) -> bool:
    """Whether the rollout engine needs its own copy of the weights (``cfg``: the ``[rollout]``
    section): under data parallelism (the policy is sharded), when batches run ahead of the
    trainer (the policy changes while they generate), or when weights reach it by file."""
    return world_size > 1 or cfg.max_staleness > 0 or cfg.sync.kind != "in_process"


def make_env_pool(
    cfg: Any, env_cfg: Any, *, tokenizer: Any, base_dir: Any, chat_format: str = "etude"
) -> Any:
    """The environment pool ``cfg.workers`` asks for: threads here, or Ray actors; episodes in
    the policy's ``chat_format`` (Ray workers speak ``etude`` only)."""
    if cfg.workers == "ray":
        if chat_format != "etude":
            raise ValueError(
                f"rollout.workers='ray' renders etude's chat format; this policy speaks "
                f"{chat_format}: set rollout.workers = 'local'"
            )
        from etude.env.ray_pool import RayEnvPool

        return RayEnvPool(
            env_cfg,
            tokenizer=tokenizer,
            base_dir=base_dir,
            num_workers=cfg.ray_workers,
            max_workers=cfg.num_workers,
            address=cfg.ray_address,
            num_cpus=cfg.ray_num_cpus,
            call_timeout_s=cfg.ray_call_timeout_s or None,
        )
    from etude.env.pool import EnvPool

    return EnvPool(
        env_cfg,
        tokenizer=tokenizer,
        base_dir=base_dir,
        max_workers=cfg.num_workers,
        chat_format=chat_format,
    )


def make_backend(cfg: Any, engine: Any) -> Any:
    """The rollout backend: the in-process ``engine``, or the server at ``cfg.server_url``."""
    from etude.engine.backends import EngineBackend, HTTPBackend, HTTPBackendConfig

    if cfg.server_url:
        return HTTPBackend(
            HTTPBackendConfig(
                url=cfg.server_url, timeout=cfg.server_timeout_s, max_retries=cfg.server_retries
            )
        )
    return EngineBackend(engine)


def batch_metrics(
    batch: PipelineBatch[Any], trajectories: Sequence[Trajectory]
) -> dict[str, float]:
    """The ``async/*`` metrics of the batch trained at ``batch.step``; with the rollout's stats
    (``(trajectories, RolloutStats)`` as the batch's result), where its time went: generating
    (waiting for the engine included) and in the environments (waiting for a thread included)."""
    stats = batch.result[1] if isinstance(batch.result, tuple) else None
    where: dict[str, float] = {}
    if stats is not None and hasattr(stats, "generate_seconds"):
        where = {
            "async/generate_seconds": stats.generate_seconds,
            "async/env_seconds": stats.env_seconds,
        }
    return {
        **where,
        "async/wait_seconds": batch.wait_seconds,
        "async/batch_seconds": batch.rollout_seconds,
        "async/admitted_version": float(batch.admitted_version),
        **staleness_stats(trajectories, batch.step),
    }
