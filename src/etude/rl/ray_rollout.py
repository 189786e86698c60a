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

What this does not do: share one engine between actors, place actors on GPUs, or survive an
actor's death inside a step (a dead rollout worker fails the step; environment-only Ray workers,
``etude.env.ray_pool``, mask such failures instead).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from etude.env.trajectory import Trajectory
from etude.tasks.record import TaskRecord


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
        actor = ray.remote(num_cpus=0)(RolloutWorker)
        self.workers = [
            actor.options(scheduling_strategy="SPREAD").remote(
                str(Path(weights_dir).resolve()),
                tokenizer.to_json(),
                env_cfg,
                str(Path(base_dir).resolve()),
                max_workers,
            )
            for _ in range(num_workers)
        ]

    def collect(
        self,
        tasks: Sequence[TaskRecord],
        rollout_cfg: Any,
        *,
        seed: int,
        step: int,
        group_offset: int,
    ) -> tuple[list[Trajectory], Any]:
        """The step's groups split into contiguous shares, one per actor; trajectories in order."""
        from etude.rl.rollout import RolloutStats

        n = len(self.workers)
        bounds = [len(tasks) * i // n for i in range(n + 1)]
        refs = [
            worker.rollout.remote(
                [t.to_json() for t in tasks[bounds[i] : bounds[i + 1]]],
                rollout_cfg,
                seed,
                step,
                group_offset + bounds[i],
            )
            for i, worker in enumerate(self.workers)
            if bounds[i + 1] > bounds[i]
        ]
        trajectories: list[Trajectory] = []
        stats = RolloutStats()
        for lines, part in self._ray.get(refs):
            trajectories += [Trajectory.from_json(line) for line in lines]
            for key, value in part.items():
                if key in ("seconds", "rounds"):  # the actors run side by side
                    setattr(stats, key, max(getattr(stats, key), value))
                else:
                    setattr(stats, key, getattr(stats, key) + value)
        return trajectories, stats

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
