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

Timeouts: no wait on a worker is unbounded. Each batch call waits at most its timeout
(``reset_timeout_s``, ``step_timeout_s``, ``finish_timeout_s``; by default derived from the env
config: the episode's wall clock plus the longest tool timeout for a step, the reward timeout plus
a margin for scoring). An env whose call overran is abandoned: ``step_many`` answers for it with a
finished ``timeout`` step, ``finish_many`` with an ``infra`` trajectory (reward None, the reason in
``info['grade']``; the trainer masks it), ``reset_many`` raises `PoolTimeout`. The stuck worker
is left to end on its own (every sandboxed command has its own deadline); its directory is
removed when it does. Threads cannot be killed, so a call that never returns keeps its worker.
``abandon(env, reason)`` gives an episode up from outside (the rollout does when the inference
server stops answering for it); ``is_abandoned`` tells the rollout loop to stop stepping it.

What this does not do: generate tokens, or run envs in other processes or on other machines.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol, TypeVar

from etude.env.coding import Agent, CodingEnv, EnvConfig, StepResult, run_episode
from etude.env.episode_chat import end_of_turn_id
from etude.env.trajectory import Trajectory
from etude.model.chat_family import check_chat_format
from etude.tasks.record import TaskRecord

T = TypeVar("T")


class PoolTimeout(RuntimeError):
    """A batch call of the pool overran its timeout (an infrastructure failure)."""


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
        tokenizer: Any,
        base_dir: str | os.PathLike[str] = ".",
        max_workers: int = 4,
        reset_timeout_s: float | None = None,
        step_timeout_s: float | None = None,
        finish_timeout_s: float | None = None,
        chat_format: str = "etude",
    ) -> None:
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers={max_workers!r} must be an int >= 1")
        self.cfg = cfg if cfg is not None else EnvConfig()
        tools = self.cfg.tools
        slowest_tool = max(tools.bash_timeout_s, tools.test_timeout_s, tools.search_timeout_s)
        self.reset_timeout_s = _timeout("reset_timeout_s", reset_timeout_s, 600.0)
        self.step_timeout_s = _timeout(
            "step_timeout_s", step_timeout_s, self.cfg.wall_clock_s + slowest_tool + 60.0
        )
        self.finish_timeout_s = _timeout(
            "finish_timeout_s", finish_timeout_s, self.cfg.reward_timeout_s + 120.0
        )
        self._abandoned: dict[int, tuple[CodingEnv, str]] = {}
        """id -> (env, why) of the envs given up on; the env is held so its id is not reused."""
        self._stuck = False
        """Whether a call overran its timeout (``close`` does not wait for the workers then)."""
        self.tokenizer = tokenizer
        self.chat_format = check_chat_format(chat_format)
        self.stop_token_ids = (end_of_turn_id(chat_format, tokenizer),)
        """Where generation of an assistant turn stops (the chat format's end of turn)."""
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
        env = CodingEnv(
            task,
            self.cfg,
            tokenizer=self.tokenizer,
            base_dir=self.base_dir,
            chat_format=self.chat_format,
        )
        with self._lock:
            self._envs.append(env)
        return env

    def _map(
        self, function: Callable[..., T], items: Sequence[Any], timeout: float, what: str
    ) -> list[T | PoolTimeout]:
        """``function(item)`` for every item on the workers; results in order, a `PoolTimeout`
        in the place of each call that overran ``timeout`` seconds (all calls share the wait);
        all finish (or overrun) before the first exception (if any) is raised."""
        if self._closed:
            raise ValueError("the pool is closed; make a new EnvPool")
        futures: list[Future[T]] = [self._executor.submit(function, item) for item in items]
        wait(futures, timeout=timeout)
        out: list[T | PoolTimeout] = []
        for future in futures:
            if not future.done():
                out.append(PoolTimeout(f"{what} did not finish within {timeout:.0f} s"))
                continue
            error = future.exception()
            if error is not None:
                raise error
            out.append(future.result())
        return out

    def _abandon(self, env: CodingEnv, future_reason: str) -> None:
        """Stop using ``env``: its stuck call keeps its directory until it ends."""
        with self._lock:
            self._abandoned[id(env)] = (env, future_reason)
            self._stuck = True
            if env in self._envs:
                self._envs.remove(env)

    def abandon(self, env: CodingEnv, reason: str) -> None:
        """Give ``env``'s episode up as an infrastructure failure (no call of it is running):
        it takes no more turns and `finish_many` returns it ``infra`` (reward None)."""
        with self._lock:
            self._abandoned.setdefault(id(env), (env, reason))

    def _run_for(
        self, envs: Sequence[CodingEnv], function: Callable[..., T], timeout: float, what: str
    ) -> list[T | PoolTimeout]:
        """`_map` over envs; an env whose call overran is abandoned and closed once it ends."""
        results = self._map(function, envs, timeout, what)
        for env, result in zip(envs, results):
            if isinstance(result, PoolTimeout):
                self._abandon(env, str(result))
                threading.Thread(
                    target=_close_when_idle, args=(env,), daemon=True, name="etude-env-reaper"
                ).start()
        return results

    def is_abandoned(self, env: CodingEnv) -> bool:
        """Whether a call on ``env`` overran its timeout (the env is no longer used)."""
        entry = self._abandoned.get(id(env))
        return entry is not None and entry[0] is env

    def reset_many(self, envs: Sequence[CodingEnv]) -> list[Any]:
        """Reset every env concurrently (copying workspaces); their conversations in order.

        Raises `PoolTimeout` when a reset overran ``reset_timeout_s``.
        """
        results = self._run_for(envs, _reset, self.reset_timeout_s, "reset")
        for result in results:
            if isinstance(result, PoolTimeout):
                raise result
        return results  # type: ignore[return-value]

    def step_many(self, steps: Sequence[tuple[CodingEnv, str | Generated]]) -> list[StepResult]:
        """One assistant turn per env, their tool calls run concurrently; results in order.

        An env whose turn overran ``step_timeout_s`` is abandoned and answered with a finished
        ``timeout`` step (its trajectory is then scored ``infra`` by `finish_many`).
        """
        envs = [env for env, _ in steps]
        if len({id(env) for env in envs}) != len(envs):
            raise ValueError("step_many got the same env twice; give each env one turn per call")
        actions = {id(env): action for env, action in steps}

        def step(env: CodingEnv) -> StepResult:
            action = actions[id(env)]
            if isinstance(action, str):
                return env.step(action)
            return env.step(
                token_ids=action.token_ids,
                logprobs=action.logprobs,
                policy_version=getattr(action, "policy_version", None),
            )

        out: list[StepResult] = []
        for result in self._run_for(envs, step, self.step_timeout_s, "a tool call"):
            if isinstance(result, PoolTimeout):
                result = StepResult(
                    observations=[],
                    done=True,
                    finish_reason="timeout",
                    tool_calls=[],
                    errors=[],
                    num_tokens=0,
                )
            out.append(result)
        return out

    def finish_many(self, envs: Sequence[CodingEnv]) -> list[Trajectory]:
        """Score every (finished) env concurrently; their trajectories in order.

        An abandoned env, or one whose scoring overran ``finish_timeout_s``, gets an ``infra``
        trajectory: reward None (not a score), the reason in ``info['grade']``.
        """
        live = [env for env in envs if not self.is_abandoned(env)]
        scored = dict(
            zip(
                map(id, live),
                self._run_for(live, _finish, self.finish_timeout_s, "scoring"),
            )
        )
        out: list[Trajectory] = []
        for env in envs:
            result = scored.get(id(env))
            if result is None or isinstance(result, PoolTimeout):
                reason = str(result) if result is not None else self._abandoned[id(env)][1]
                result = infra_trajectory(env, reason)
            out.append(result)
        return out

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

        timeout = self.reset_timeout_s + self.cfg.wall_clock_s + self.finish_timeout_s
        results = self._map(episode, tasks, timeout, "an episode")
        for result in results:
            if isinstance(result, PoolTimeout):
                raise result
        return results  # type: ignore[return-value]

    def release(self, envs: Sequence[CodingEnv]) -> None:
        """Remove the episode directories of ``envs`` and stop tracking them (after scoring)."""
        with self._lock:
            released = {id(env) for env in envs}
            self._envs = [env for env in self._envs if id(env) not in released]
            for env in envs:
                if self.is_abandoned(env):
                    del self._abandoned[id(env)]
        for env in envs:
            env.close()

    def close(self) -> None:
        """Wait for running calls (not for abandoned ones), then remove every episode directory
        the pool still tracks."""
        self._closed = True
        self._executor.shutdown(wait=not self._stuck, cancel_futures=True)
        with self._lock:
            envs, self._envs = self._envs, []
        for env in envs:
            env.close()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _timeout(name: str, value: float | None, default: float) -> float:
    if value is None:
        return default
    if not value > 0:
        raise ValueError(f"EnvPool {name}={value} must be > 0 seconds (or None for the default)")
    return float(value)


def _reset(env: CodingEnv) -> Any:
    return env.reset()


def _finish(env: CodingEnv) -> Trajectory:
    return env.finish()


def _close_when_idle(env: CodingEnv) -> None:
    """Close an abandoned env once its stuck call has returned (the env's lock says so)."""
    with env.busy:
        env.close()


def infra_trajectory(env: CodingEnv, reason: str) -> Trajectory:
    """A copy of ``env``'s trajectory marked ungraded: reward None, ``info['grade']`` infra."""
    try:
        trajectory = copy.deepcopy(env.trajectory)
    except (ValueError, RuntimeError):  # no episode yet, or changed while copied
        trajectory = Trajectory(task_id=env.task.instance_id)
    trajectory.reward = None
    trajectory.finish_reason = trajectory.finish_reason or env.finish_reason or "timeout"
    trajectory.info["grade"] = {"status": "infra", "reason": reason}
    trajectory.info["infra"] = reason
    return trajectory
