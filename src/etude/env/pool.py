"""Many coding episodes at once: tool calls and reward runs on a bounded thread pool.

Why threads: an episode's time goes to sandboxed subprocesses (commands, pytest), which release
the GIL, so a ``ThreadPoolExecutor`` with ``max_workers`` threads keeps that many sandboxes busy
without pickling tokenizers or tasks to other processes. ``max_workers`` is the bound on
parallelism: at most that many tool calls or reward runs are in flight.

Two ways to drive it:

- **lockstep** (the RL rollout): ``make_env`` per task and sample, ``reset_many``, then per round
  the engine generates one assistant turn for every running env and ``step_many([(env, gen),
  ...])`` runs all their tool calls concurrently (``gen`` is text, or anything with ``token_ids``
  and ``logprobs``, such as the engine's ``Generation``); ``finish_many`` scores them concurrently;
- **whole episodes** (scripted agents, benchmarks): ``run_episodes(tasks, make_agent)`` runs
  each episode start to end on one worker and closes it.

Cleanup: the pool tracks every env it made; ``close()`` (and leaving the ``with`` block, also on
an exception) removes every episode directory that is still there; ``release(envs)`` does it
for finished envs early (a long rollout loop should). ``run_episodes`` closes each episode as
soon as it is scored. When several calls of one batch fail, the first exception is
raised after all of them ended, so no worker is left running on a directory being removed.

What this does not do: generate tokens, or run envs in other processes or on other machines.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from etude.env.coding import Agent, CodingEnv, EnvConfig, StepResult, run_episode
from etude.env.trajectory import Trajectory
from etude.model.chat import Conversation
from etude.model.tokenizer import Tokenizer
from etude.tasks.record import TaskRecord

T = TypeVar("T")


class Generated(Protocol):
    """An engine output for one turn (``etude.engine.sampling.Generation`` fits)."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]


class EnvPool:
    """Creates, steps, scores and cleans up coding episodes with bounded parallelism."""

    def __init__(
        self,
        cfg: EnvConfig | None = None,
        *,
        tokenizer: Tokenizer,
        base_dir: str | os.PathLike[str] = ".",
        max_workers: int = 4,
    ) -> None:
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers={max_workers!r} must be an int >= 1")
        self.cfg = cfg if cfg is not None else EnvConfig()
        self.tokenizer = tokenizer
        self.base_dir = Path(base_dir)
        self.max_workers = max_workers
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="etude-env")
        self._envs: list[CodingEnv] = []
        self._lock = threading.Lock()
        self._closed = False

    def make_env(self, task: TaskRecord) -> CodingEnv:
        """A new env for ``task``, tracked for cleanup (call ``reset`` or ``reset_many`` on it)."""
        if self._closed:
            raise ValueError("the pool is closed; make a new EnvPool")
        env = CodingEnv(task, self.cfg, tokenizer=self.tokenizer, base_dir=self.base_dir)
        with self._lock:
            self._envs.append(env)
        return env

    def _map(self, function: Callable[..., T], items: Sequence[Any]) -> list[T]:
        """``function(item)`` for every item on the workers; results in order; all finish before
        the first exception (if any) is raised."""
        if self._closed:
            raise ValueError("the pool is closed; make a new EnvPool")
        futures: list[Future[T]] = [self._executor.submit(function, item) for item in items]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return [f.result() for f in futures]

    def reset_many(self, envs: Sequence[CodingEnv]) -> list[Conversation]:
        """Reset every env concurrently (copying workspaces); their conversations in order."""
        return self._map(lambda env: env.reset(), envs)

    def step_many(self, steps: Sequence[tuple[CodingEnv, str | Generated]]) -> list[StepResult]:
        """One assistant turn per env, their tool calls run concurrently; results in order."""
        envs = [env for env, _ in steps]
        if len({id(env) for env in envs}) != len(envs):
            raise ValueError("step_many got the same env twice; give each env one turn per call")

        def step(item: tuple[CodingEnv, str | Generated]) -> StepResult:
            env, action = item
            if isinstance(action, str):
                return env.step(action)
            return env.step(
                token_ids=action.token_ids,
                logprobs=action.logprobs,
                policy_version=getattr(action, "policy_version", None),
            )

        return self._map(step, steps)

    def finish_many(self, envs: Sequence[CodingEnv]) -> list[Trajectory]:
        """Score every (finished) env concurrently; their trajectories in order."""
        return self._map(lambda env: env.finish(), envs)

    def run_episodes(
        self, tasks: Sequence[TaskRecord], make_agent: Callable[[TaskRecord], Agent]
    ) -> list[Trajectory]:
        """One whole episode per task, ``max_workers`` at a time; trajectories in task order.

        Each episode's directory is removed as soon as it is scored (or fails).
        """

        def episode(task: TaskRecord) -> Trajectory:
            env = self.make_env(task)
            try:
                return run_episode(env, make_agent(task))
            finally:
                env.close()
                with self._lock:
                    self._envs.remove(env)

        return self._map(episode, tasks)

    def release(self, envs: Sequence[CodingEnv]) -> None:
        """Remove the episode directories of ``envs`` and stop tracking them (after scoring)."""
        with self._lock:
            released = {id(env) for env in envs}
            self._envs = [env for env in self._envs if id(env) not in released]
        for env in envs:
            env.close()

    def close(self) -> None:
        """Wait for running calls, then remove every episode directory the pool still tracks."""
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            envs, self._envs = self._envs, []
        for env in envs:
            env.close()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
