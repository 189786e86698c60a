"""Coding episodes on Ray actors: each environment worker runs its own sandboxes.

``RayEnvPool`` has the interface of ``EnvPool`` (``make_env``, ``reset_many``, ``step_many``,
``finish_many``, ``release``, ``close``), so the rollout code runs unchanged
(``rollout.workers = "ray"``). Each of ``num_workers`` ``EnvWorker`` actors holds an ``EnvPool``
of its own (its sandboxes, episode directories and test runs live on the actor's machine);
episodes are placed round-robin over the live workers and stay on theirs. The driver keeps an
``RemoteEnv`` handle per episode, whose ``prompt_ids``, ``tokens_left`` and ``done`` are the
state the worker last returned. Calls of one batch go to all workers at once.

**Infrastructure failures are not rewards.** A worker that dies (its process killed, its node
lost) or does not answer within ``call_timeout_s`` (``rollout.ray_call_timeout_s``; a hung
worker: deadlocked, stopped, on a hung file system): every episode on it ends with
``finish_reason = "error"``, ``reward = None`` and ``info["infra"]`` saying why; the worker is
killed (``ray.kill``) and replaced by a new actor for later episodes. An episode whose own call raises an infrastructure
error inside the worker (``OSError``, ``subprocess.SubprocessError``, ``RuntimeError``,
``TimeoutError``: a sandbox that crashed, a workspace copy that failed) ends the same way; a
``ValueError`` (a bad task or setting) is raised as in ``EnvPool``. The trainer masks such
episodes from group statistics and the loss (``is_infra_failure``) and counts them per step
(``failures``: ``infra/episodes``, ``infra/worker_deaths``); none is ever scored 0.
``is_infra_failure`` (re-exported from ``etude.env.trajectory``) tells them apart.

Placement: with ``address = ""`` a local Ray instance is started (``num_cpus``); with ``"auto"``
or ``ray://...`` the pool joins a cluster started by ``ray start --head`` (and ``ray start
--address=HEAD:6379`` on the other machines) and spreads the workers over its nodes. The task
workspaces (paths in the task records, relative to ``base_dir``) must exist on every node: the
same checkout, or a shared file system.

What this does not do: move a running episode to another worker (its workspace is on the dead
one), retry a failed episode within the same step (the group is scored on the rest), or run the
engine (``etude.rl.pipeline`` and the inference backends do).
"""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from etude.env.coding import CodingEnv, EnvConfig
from etude.env.trajectory import Trajectory, Turn, is_infra_failure
from etude.model.tokenizer import Tokenizer
from etude.tasks.record import TaskRecord

INFRA_ERRORS = (OSError, subprocess.SubprocessError, RuntimeError, TimeoutError)
__all__ = ["EnvWorker", "RayEnvPool", "RemoteEnv", "is_infra_failure"]


@dataclass(kw_only=True, slots=True)
class EnvState:
    """What the driver mirrors of a remote episode after each call."""

    prompt_ids: list[int]
    tokens_left: int
    done: bool
    finish_reason: str
    infra: str = ""
    """Non-empty when the episode failed on infrastructure (the reason)."""


def _state(env: CodingEnv) -> EnvState:
    return EnvState(
        prompt_ids=list(env.prompt_ids),
        tokens_left=env.tokens_left,
        done=env.done,
        finish_reason=env.finish_reason,
    )


class EnvWorker:
    """The actor: coding episodes on this machine, ``max_workers`` calls at a time."""

    def __init__(
        self, cfg: EnvConfig, tokenizer_json: str, base_dir: str, max_workers: int
    ) -> None:
        self.cfg = cfg
        self.tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(tokenizer_json))
        self.base_dir = Path(base_dir)
        self.envs: dict[int, CodingEnv] = {}
        self.executor = ThreadPoolExecutor(max_workers, thread_name_prefix="etude-ray-env")

    def pid(self) -> int:
        return os.getpid()

    def _each(self, function: Any, items: Sequence[Any]) -> list[tuple[str, Any]]:
        """``function(item)`` per item concurrently: ("ok", result) or ("infra", reason)."""

        def guarded(item: Any) -> tuple[str, Any]:
            try:
                return "ok", function(item)
            except INFRA_ERRORS as e:
                return "infra", f"{type(e).__name__}: {e}"

        return list(self.executor.map(guarded, items))

    def make(self, env_id: int, task_json: str) -> None:
        task = TaskRecord.from_json(task_json)
        self.envs[env_id] = CodingEnv(
            task, self.cfg, tokenizer=self.tokenizer, base_dir=self.base_dir
        )

    def reset_many(self, env_ids: list[int]) -> list[tuple[str, Any]]:
        def reset(env_id: int) -> EnvState:
            env = self.envs[env_id]
            env.reset()
            return _state(env)

        return self._each(reset, env_ids)

    def step_many(
        self, items: list[tuple[int, list[int], list[float], int | None]]
    ) -> list[tuple[str, Any]]:
        def step(item: tuple[int, list[int], list[float], int | None]) -> EnvState:
            env_id, token_ids, logprobs, version = item
            env = self.envs[env_id]
            env.step(token_ids=token_ids, logprobs=logprobs, policy_version=version)
            return _state(env)

        return self._each(step, items)

    def finish_many(self, env_ids: list[int]) -> list[tuple[str, Any]]:
        return self._each(lambda env_id: self.envs[env_id].finish().to_json(), env_ids)

    def release(self, env_ids: list[int]) -> None:
        for env_id in env_ids:
            env = self.envs.pop(env_id, None)
            if env is not None:
                env.close()

    def close(self) -> None:
        self.release(list(self.envs))
        self.executor.shutdown(wait=True)


class RemoteEnv:
    """The driver's handle of an episode on a worker (mirrors the state the worker returned)."""

    def __init__(self, env_id: int, worker: int, task: TaskRecord) -> None:
        self.env_id = env_id
        self.worker = worker
        self.task = task
        self.state: EnvState | None = None

    def _get(self) -> EnvState:
        if self.state is None:
            raise ValueError("no episode: call reset_many first")
        return self.state

    @property
    def prompt_ids(self) -> list[int]:
        return self._get().prompt_ids

    @property
    def tokens_left(self) -> int:
        return self._get().tokens_left

    @property
    def done(self) -> bool:
        return self._get().done

    @property
    def finish_reason(self) -> str:
        return self._get().finish_reason

    def fail(self, reason: str) -> None:
        """End the episode as an infrastructure failure."""
        prompt = self.state.prompt_ids if self.state is not None else []
        self.state = EnvState(
            prompt_ids=prompt, tokens_left=0, done=True, finish_reason="error", infra=reason
        )


@dataclass(kw_only=True, slots=True)
class FailureCounts:
    """Infrastructure failures since the last ``take``."""

    episodes: int = 0
    worker_deaths: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "infra/episodes": float(self.episodes),
            "infra/worker_deaths": float(self.worker_deaths),
        }


class RayEnvPool:
    """``EnvPool``'s interface over ``num_workers`` Ray actors (see the module docstring)."""

    def __init__(
        self,
        cfg: EnvConfig | None = None,
        *,
        tokenizer: Tokenizer,
        base_dir: str | os.PathLike[str] = ".",
        num_workers: int = 2,
        max_workers: int = 4,
        address: str = "",
        num_cpus: int = 2,
        call_timeout_s: float | None = None,
    ) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("rollout.workers='ray' needs Ray: pip install -e '.[ray]'") from None
        if num_workers < 1:
            raise ValueError(f"rollout.ray_workers={num_workers} must be >= 1")
        self.cfg = cfg if cfg is not None else EnvConfig()
        self.tokenizer = tokenizer
        self.stop_token_ids = (tokenizer.im_end_id,)
        """Where generation of an assistant turn stops (etude's ``<|im_end|>``)."""
        self.base_dir = Path(base_dir).resolve()
        self.max_workers = max_workers
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise ValueError(
                f"rollout.ray_call_timeout_s={call_timeout_s} must be > 0 seconds (0 in the "
                "config: derived from env.wall_clock_s and env.reward_timeout_s)"
            )
        self.call_timeout_s = (
            call_timeout_s
            if call_timeout_s is not None
            else self.cfg.wall_clock_s + self.cfg.reward_timeout_s + 60.0
        )
        self._ray = ray
        self._started_ray = False
        if not ray.is_initialized():
            if address:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            else:
                ray.init(
                    num_cpus=num_cpus,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                )
                self._started_ray = True
        self._actor_class = ray.remote(num_cpus=0)(EnvWorker)
        self._tokenizer_json = tokenizer.to_json()
        self.workers = [self._new_worker() for _ in range(num_workers)]
        self._ids = itertools.count()
        self._next = itertools.cycle(range(num_workers))
        self._envs: dict[int, RemoteEnv] = {}
        self.failures = FailureCounts()
        self._closed = False

    def _new_worker(self) -> Any:
        return self._actor_class.options(scheduling_strategy="SPREAD").remote(
            self.cfg, self._tokenizer_json, str(self.base_dir), self.max_workers
        )

    # ------------------------------------------------------------ calls

    def _worker_died(self, index: int, reason: str) -> None:
        """Fail every episode on worker ``index`` and put a new actor in its place."""
        self.failures.worker_deaths += 1
        for env in self._envs.values():
            if env.worker == index and not (env.state is not None and env.state.infra):
                env.fail(reason)
                self.failures.episodes += 1
        self._ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self._new_worker()

    def _call(self, method: str, envs: Sequence[RemoteEnv], args: Sequence[Any]) -> list[Any]:
        """``worker.method(args of its envs)`` on every worker at once; per env, the worker's
        ("ok", value) / ("infra", reason), or ("infra", ...) for the envs of a dead worker."""
        by_worker: dict[int, list[int]] = {}
        for k, env in enumerate(envs):
            by_worker.setdefault(env.worker, []).append(k)
        refs = {
            w: getattr(self.workers[w], method).remote([args[k] for k in ks])
            for w, ks in by_worker.items()
        }
        out: list[Any] = [None] * len(envs)
        for w, ks in by_worker.items():
            try:
                results = self._ray.get(refs[w], timeout=self.call_timeout_s)
            except self._ray.exceptions.RayActorError as e:
                self._worker_died(w, f"worker died: {type(e).__name__}")
                results = [("infra", "worker died")] * len(ks)
            except self._ray.exceptions.GetTimeoutError:
                self._worker_died(w, f"worker timed out after {self.call_timeout_s:.0f} s")
                results = [("infra", "worker timed out")] * len(ks)
            for k, result in zip(ks, results):
                out[k] = result
        return out

    def _live(self, envs: Sequence[RemoteEnv]) -> list[RemoteEnv]:
        return [env for env in envs if not (env.state is not None and env.state.infra)]

    def _apply_states(self, envs: Sequence[RemoteEnv], results: Sequence[Any]) -> None:
        for env, (status, value) in zip(envs, results):
            if env.state is not None and env.state.infra:
                continue  # already failed with its worker
            if status == "ok":
                env.state = value
            else:
                env.fail(value)
                self.failures.episodes += 1

    # ------------------------------------------------------------ EnvPool's interface

    def make_env(self, task: TaskRecord) -> RemoteEnv:
        if self._closed:
            raise ValueError("the pool is closed; make a new RayEnvPool")
        env = RemoteEnv(next(self._ids), next(self._next), task)
        try:
            self._ray.get(
                self.workers[env.worker].make.remote(env.env_id, task.to_json()),
                timeout=self.call_timeout_s,
            )
        except self._ray.exceptions.RayActorError as e:
            self._worker_died(env.worker, f"worker died: {type(e).__name__}")
            self._make_on_fresh_worker(env)
        except self._ray.exceptions.GetTimeoutError:
            self._worker_died(env.worker, f"worker timed out after {self.call_timeout_s:.0f} s")
            self._make_on_fresh_worker(env)
        self._envs[env.env_id] = env
        return env

    def _make_on_fresh_worker(self, env: RemoteEnv) -> None:
        """Make ``env`` on the actor that replaced its lost worker (a second loss is raised)."""
        self._ray.get(
            self.workers[env.worker].make.remote(env.env_id, env.task.to_json()),
            timeout=self.call_timeout_s,
        )

    def reset_many(self, envs: Sequence[RemoteEnv]) -> None:
        live = self._live(envs)
        self._apply_states(live, self._call("reset_many", live, [e.env_id for e in live]))

    def step_many(self, steps: Sequence[tuple[RemoteEnv, Any]]) -> None:
        envs = [env for env, _ in steps]
        if len({id(env) for env in envs}) != len(envs):
            raise ValueError("step_many got the same env twice; give each env one turn per call")
        live = [(env, gen) for env, gen in steps if not (env.state and env.state.infra)]
        args = [
            (
                env.env_id,
                list(gen.token_ids),
                list(gen.logprobs),
                getattr(gen, "policy_version", None),
            )
            for env, gen in live
        ]
        live_envs = [env for env, _ in live]
        self._apply_states(live_envs, self._call("step_many", live_envs, args))

    def finish_many(self, envs: Sequence[RemoteEnv]) -> list[Trajectory]:
        live = self._live(envs)
        results = dict(
            zip(map(id, live), self._call("finish_many", live, [e.env_id for e in live]))
        )
        out = []
        for env in envs:
            status, value = results.get(id(env), ("infra", None))
            if status == "ok" and not (env.state is not None and env.state.infra):
                out.append(Trajectory.from_json(value))
                continue
            if status != "ok" and not (env.state is not None and env.state.infra):
                env.fail(value)
                self.failures.episodes += 1
            out.append(self._failed_trajectory(env))
        return out

    def _failed_trajectory(self, env: RemoteEnv) -> Trajectory:
        """The record of an episode lost to infrastructure: the prompt only, never trained on."""
        assert env.state is not None and env.state.infra
        prompt = env.state.prompt_ids
        turn = Turn(
            role="user",
            text="",
            token_ids=list(prompt),
            trainable=[0] * len(prompt),
            logprobs=[0.0] * len(prompt),
        )
        return Trajectory(
            task_id=env.task.instance_id,
            turns=[turn] if prompt else [],
            reward=None,
            finish_reason="error",
            info={"infra": env.state.infra},
        )

    def abandon(self, env: RemoteEnv, reason: str) -> None:
        """Give ``env``'s episode up as an infrastructure failure (counted; no more turns)."""
        if not self.is_abandoned(env):
            env.fail(reason)
            self.failures.episodes += 1

    def is_abandoned(self, env: RemoteEnv) -> bool:
        """Whether ``env`` ended by an infrastructure failure (its worker, or `abandon`)."""
        return env.state is not None and bool(env.state.infra)

    def release(self, envs: Sequence[RemoteEnv]) -> None:
        by_worker: dict[int, list[int]] = {}
        for env in envs:
            self._envs.pop(env.env_id, None)
            by_worker.setdefault(env.worker, []).append(env.env_id)
        refs = [self.workers[w].release.remote(ids) for w, ids in by_worker.items()]
        for ref in refs:
            try:
                self._ray.get(ref, timeout=self.call_timeout_s)
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
                # a dead worker's episode directories died with it (or its node)
                continue

    def in_flight(self) -> int:
        """Episodes started (reset) and not yet released."""
        return sum(1 for env in list(self._envs.values()) if env.state is not None)

    def take_failures(self) -> FailureCounts:
        """The failure counts since the last call (per step), reset to zero."""
        counts, self.failures = self.failures, FailureCounts()
        return counts

    def kill_worker(self, index: int) -> None:
        """Kill worker ``index``'s process (what a lost node does); tests and drills use it."""
        self._ray.kill(self.workers[index], no_restart=True)

    def worker_pids(self) -> list[int]:
        return self._ray.get([w.pid.remote() for w in self.workers])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        refs = [w.close.remote() for w in self.workers]
        for ref in refs:
            try:
                self._ray.get(ref, timeout=self.call_timeout_s)
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
                pass
        for w in self.workers:
            self._ray.kill(w, no_restart=True)
        self._envs.clear()
        if self._started_ray:
            self._ray.shutdown()

    def __enter__(self) -> RayEnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
