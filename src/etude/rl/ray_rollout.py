"""Rollout workers as Ray actors: each holds its own engine and its own environments.

With ``rollout.ray_rollout_workers = N`` (and ``rollout.sync.kind = "file"``) the trainer's
rollout stage sends each of N ``RolloutWorker`` actors a contiguous share of the step's groups;
the actor runs ``collect_rollouts`` with an in-process engine and an ``EnvPool`` of its own (its
sandboxes run on its machine) and returns the trajectories. Weights reach the actors through the
file sync: before every ``generate`` call the actor's backend polls ``RUN/weights/LATEST``
(``FileWeightWatcher``) and loads a newer version if there is one, so an episode that runs
across a weight update continues with the new weights from its next turn (partial rollouts),
and every turn records the version that generated it.

Sampling seeds follow the group (``group_offset``), so N actors roll out the same trajectories
as one process with the same weights. The model is built from the ``config.json`` the file sync
writes beside the weights; the tokenizer travels as its JSON.

**A dying or hung actor does not fail the step.** When an actor dies while it holds a share (its
process killed, its node lost, the out-of-memory killer: ``RayActorError`` and its kin, see
``INFRA_ERRORS``), or holds it longer than ``rollout.ray_rollout_timeout_s`` (alive but not
answering: a deadlock, a stopped process, a hung file system; it is killed with ``ray.kill``), a
fresh actor takes its place and the share is rolled out again from the start on it, with the
same seeds (the same episodes as if nothing had happened, at the newest weights), up to
``retries`` times per share and step. A share still lost after that is masked: each of its
episodes becomes an infrastructure failure (``reward = None``, ``finish_reason = "error"``,
``info["infra"]`` says why), which the trainer leaves out of its group's statistics and the loss
and never scores 0. The batch's ``RolloutStats`` counts the lost actors, dead or hung
(``worker_deaths``), and the episodes rolled out again (``retried_episodes``); the trainer logs
them per step as
``infra/worker_deaths`` and ``infra/retried_episodes`` (masked episodes: ``infra/episodes``). An
exception raised by the rollout code itself (``RayTaskError``: a bad task or setting) is a bug,
not infrastructure, and is raised.

The timeout counts from the share's submission: an actor runs its calls one after another, so
with ``max_staleness = k`` a share may wait behind k others (the derived default allows for it).

What this does not do: share one engine between actors, place actors on GPUs, resume a share
mid-episode on another actor (it starts over; its partial episodes died with the actor), or tell
a hung actor from one that is only slow (a share past its timeout is lost either way).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from etude.env.trajectory import Trajectory, Turn
from etude.tasks.record import TaskRecord

INFRA_ERRORS = (
    "RayActorError",  # the actor died (killed, crashed) or is unreachable
    "WorkerCrashedError",
    "NodeDiedError",
    "OutOfMemoryError",
    "ObjectLostError",
)
"""Names in ``ray.exceptions`` of the errors that mean infrastructure, not the rollout's code."""


def rollout_timeout_s(rollout_cfg: Any, env_cfg: Any) -> float:
    """Seconds a share may take on its actor: ``rollout.ray_rollout_timeout_s``, or (0) the time
    an episode may take (its wall clock, scoring, 600 s for resets, the last turn's tools and
    loading weights) for each batch that may be in flight (``1 + max_staleness``)."""
    if rollout_cfg.ray_rollout_timeout_s > 0:
        return float(rollout_cfg.ray_rollout_timeout_s)
    episode = env_cfg.wall_clock_s + env_cfg.reward_timeout_s + 600.0
    return episode * (1 + rollout_cfg.max_staleness)


class RolloutWorker:
    """The actor: an engine that follows the file sync, and environments on this machine."""

    def __init__(
        self, weights_dir: str, tokenizer_json: str, env_cfg: Any, base_dir: str, max_workers: int
    ) -> None:
        import tokenizers

        from etude.env.pool import EnvPool
        from etude.model.tokenizer import Tokenizer
        from etude.rl.weight_sync import FileWeightWatcher

        self.tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(tokenizer_json))
        self.watcher = FileWeightWatcher(weights_dir)
        self.env_cfg = env_cfg
        self.pool = EnvPool(
            env_cfg, tokenizer=self.tokenizer, base_dir=base_dir, max_workers=max_workers
        )
        self.backend: Any = None

    def pid(self) -> int:
        return os.getpid()

    def _backend(self) -> Any:
        """The engine, built from the newest version's config on first use."""
        if self.backend is not None:
            return self.backend
        from etude.config import from_dict
        from etude.engine import Engine
        from etude.model.config import ModelConfig
        from etude.model.transformer import build_model
        from etude.rl.weight_sync import latest_version

        found = latest_version(self.watcher.directory)
        if found is None:
            raise ValueError(
                f"no weights in {self.watcher.directory}: the trainer pushes them (file sync) "
                "before the first rollout"
            )
        cfg = from_dict(ModelConfig, json.loads((found[1] / "config.json").read_text()), "model")
        model = build_model(cfg, seed=0).eval()
        engine = Engine(model, max_seq_len=self.env_cfg.max_tokens, decode_fn=self.tokenizer.decode)
        self.backend = _FollowingBackend(engine, self.watcher)
        return self.backend

    def rollout(
        self, task_lines: list[str], rollout_cfg: Any, seed: int, step: int, group_offset: int
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        from etude.rl.rollout import collect_rollouts

        tasks = [TaskRecord.from_json(line) for line in task_lines]
        trajectories, stats = collect_rollouts(
            self._backend(),
            self.pool,
            tasks,
            rollout_cfg,
            seed=seed,
            step=step,
            group_offset=group_offset,
        )
        fields = ("num_episodes", "generated_tokens", "rounds", "generate_seconds", "env_seconds")
        return [t.to_json() for t in trajectories], {
            **{k: getattr(stats, k) for k in fields},
            "seconds": stats.seconds,
        }

    def close(self) -> None:
        self.pool.close()


class _FollowingBackend:
    """An ``EngineBackend`` that loads a newer file-synced version before each generation."""

    def __init__(self, engine: Any, watcher: Any) -> None:
        from etude.engine.backends import EngineBackend

        self.inner = EngineBackend(engine)
        self.watcher = watcher

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @property
    def max_seq_len(self) -> int:
        return self.inner.max_seq_len

    def generate(self, requests: Sequence[Any]) -> list[Any]:
        model = self.inner.engine.model
        version = self.watcher.poll(model)
        if version is not None:
            self.inner.policy_version = version
        return self.inner.generate(requests)

    def update_weights(self, source: Any, version: int) -> None:
        self.inner.update_weights(source, version)


class RayRollouts:
    """The trainer's side: ``num_workers`` rollout actors sharing each step's groups."""

    def __init__(
        self,
        num_workers: int,
        *,
        weights_dir: str | Path,
        tokenizer: Any,
        env_cfg: Any,
        base_dir: str | Path,
        max_workers: int,
        address: str = "",
        num_cpus: int = 2,
        retries: int = 2,
    ) -> None:
        import ray

        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
            if address:
                ray.init(address=address, **kwargs)
            else:
                ray.init(num_cpus=num_cpus, include_dashboard=False, **kwargs)
                self._started = True
        if retries < 0:
            raise ValueError(f"rollout.ray_rollout_retries={retries} must be >= 0")
        self.retries = retries
        self._infra = tuple(getattr(ray.exceptions, name) for name in INFRA_ERRORS)
        self._eos_id = tokenizer.eos_id
        self.env_cfg = env_cfg
        self._actor = ray.remote(num_cpus=0)(RolloutWorker)
        self._args = (
            str(Path(weights_dir).resolve()),
            tokenizer.to_json(),
            env_cfg,
            str(Path(base_dir).resolve()),
            max_workers,
        )
        self._lock = threading.Lock()  # pipeline threads collect side by side (staleness > 0)
        self.workers = [self._new_worker() for _ in range(num_workers)]

    def _new_worker(self) -> Any:
        return self._actor.options(scheduling_strategy="SPREAD").remote(*self._args)

    def _replace(self, index: int, dead: Any) -> bool:
        """Put a fresh actor in place of ``dead`` at ``index``; False if another thread did
        (both of its calls failed: one death, counted once)."""
        with self._lock:
            if self.workers[index] is not dead:
                return False
            self._ray.kill(dead, no_restart=True)
            self.workers[index] = self._new_worker()
            return True

    def collect(
        self,
        tasks: Sequence[TaskRecord],
        rollout_cfg: Any,
        *,
        seed: int,
        step: int,
        group_offset: int,
    ) -> tuple[list[Trajectory], Any]:
        """The step's groups split into contiguous shares, one per actor; trajectories in order.
        A share whose actor dies, or does not answer within ``rollout_timeout_s``, is rolled out
        again on a fresh actor, or masked (see the module docstring); ``worker_deaths`` and
        ``retried_episodes`` of the stats count it."""
        from etude.rl.rollout import RolloutStats

        n = len(self.workers)
        bounds = [len(tasks) * i // n for i in range(n + 1)]
        shares = [(i, bounds[i], bounds[i + 1]) for i in range(n) if bounds[i + 1] > bounds[i]]
        stats = RolloutStats()
        timeout = rollout_timeout_s(rollout_cfg, self.env_cfg)

        def submit(index: int, lo: int, hi: int) -> tuple[Any, Any, float]:
            worker = self.workers[index]
            lines = [t.to_json() for t in tasks[lo:hi]]
            ref = worker.rollout.remote(lines, rollout_cfg, seed, step, group_offset + lo)
            return worker, ref, time.monotonic() + timeout

        pending = {k: submit(*share) for k, share in enumerate(shares)}
        attempts = dict.fromkeys(pending, 0)
        done: dict[int, list[Trajectory]] = {}

        def lost(k: int, worker: Any, reason: str) -> None:
            """Share k's actor is lost: replace it, then roll the share out again or mask it."""
            index, lo, hi = shares[k]
            if self._replace(index, worker):
                stats.worker_deaths += 1
            if attempts[k] < self.retries:
                attempts[k] += 1
                stats.retried_episodes += (hi - lo) * rollout_cfg.group_size
                pending[k] = submit(index, lo, hi)
            else:
                done[k] = self._masked(tasks[lo:hi], rollout_cfg.group_size, reason)

        while pending:
            by_ref = {ref: k for k, (_, ref, _) in pending.items()}
            first_deadline = min(deadline for _, _, deadline in pending.values())
            ready, _ = self._ray.wait(
                list(by_ref), num_returns=1, timeout=max(0.0, first_deadline - time.monotonic())
            )
            if not ready:  # a share ran past its deadline: its actor is hung
                now = time.monotonic()
                for k in [k for k, (_, _, deadline) in pending.items() if deadline <= now]:
                    worker, _, _ = pending.pop(k)
                    lost(k, worker, f"rollout worker timed out after {timeout:.0f} s")
                continue
            k = by_ref[ready[0]]
            worker, ref, _ = pending.pop(k)
            try:
                lines, part = self._ray.get(ref)
            except self._infra as e:
                lost(k, worker, f"rollout worker lost: {type(e).__name__}")
                continue
            done[k] = [Trajectory.from_json(line) for line in lines]
            for key, value in part.items():
                if key in ("seconds", "rounds"):  # the actors run side by side
                    setattr(stats, key, max(getattr(stats, key), value))
                else:
                    setattr(stats, key, getattr(stats, key) + value)
        trajectories = [t for k in sorted(done) for t in done[k]]
        return trajectories, stats

    def _masked(
        self, tasks: Sequence[TaskRecord], group_size: int, reason: str
    ) -> list[Trajectory]:
        """The records of episodes lost with their actor: no reward (never 0), never trained on
        (one untrainable token, so that the batch's forwards keep their shape)."""
        return [
            Trajectory(
                task_id=task.instance_id,
                turns=[
                    Turn(
                        role="user",
                        text="",
                        token_ids=[self._eos_id],
                        trainable=[0],
                        logprobs=[0.0],
                    )
                ],
                reward=None,
                finish_reason="error",
                info={"infra": reason},
            )
            for task in tasks
            for _ in range(group_size)
        ]

    def close(self) -> None:
        for worker in self.workers:
            try:
                self._ray.get(worker.close.remote(), timeout=120)
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
                pass
            self._ray.kill(worker, no_restart=True)
        if self._started:
            self._ray.shutdown()

    def __enter__(self) -> RayRollouts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
