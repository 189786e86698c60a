"""Multi-turn rollouts: an inference backend writes assistant turns, the environment answers.

For a batch of tasks x G samples, every episode runs in lockstep rounds: every running episode's
conversation (``env.prompt_ids``, ending with an open assistant header) goes to the backend in
ONE ``generate`` call (the in-process engine batches them continuously: a turn that ends frees
its row for the next waiting one at once), the generated ids and their behavior logprobs go
back to the env (``EnvPool.step_many``: tool calls run concurrently), the observations are
appended as tokens, and the next round starts, until every episode has ended (submit, turn or
token limit). Then all are scored concurrently.

The backend is anything that speaks ``etude.engine.backends.InferenceBackend``: the in-process
engine (an `Engine` passed here is wrapped in an `EngineBackend`) or an OpenAI-compatible
server (``HTTPBackend``: etude serve, vLLM, SGLang). Each request carries the episode's session
id, so a server can keep an episode's prefix where it is cached.

Per token the trajectory keeps the id, the trainable mask (1 on generated ids only) and the
behavior logprob (as the backend reports it: the logprob under the distribution sampled, after
temperature and top-k/top-p); per turn its ids, calls and typed errors
(``etude.env.trajectory``). ``info`` records the group, the sample, the policy step, the
generated token count and the policy versions that generated the episode.

Sampling is seeded per (run seed, step, group, round, sample), one generator per request: an
episode's samples do not depend on which other episodes share the batch or the rank, so one
process and N data-parallel ranks roll out the same trajectories.

Infrastructure failures end an episode, not the batch: when the inference server does not answer
a request within its timeout and retries (``ServerUnavailable``), that episode is given up
(``pool.abandon``) and the others go on; the pool then returns it with ``reward = None`` and
``info["infra"]`` (masked by the trainer, never scored 0). An episode the pool gave up on (a
hung tool call, a lost Ray worker) takes no more turns (``pool.is_abandoned``).

What this does not do: compute rewards beyond the env's (``etude.env.reward``), advantages, or
any loss; overlap one episode's tool calls with other episodes' generation (a round ends when
its longest turn ends).

Legend: G samples per task.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from etude.engine import Engine, SamplingParams
from etude.engine.backends import (
    EngineBackend,
    GenerationRequest,
    InferenceBackend,
    ServerUnavailable,
)
from etude.engine.engine import derive_seed
from etude.env.pool import EnvPool
from etude.env.trajectory import Trajectory
from etude.rl.weight_sync import WeightSyncConfig
from etude.tasks.record import TaskRecord


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """The ``[rollout]`` section: batch shape and sampling of the episodes of one step."""

    tasks_per_step: int = 2
    """Tasks (groups) per optimizer step, over all data-parallel ranks."""
    group_size: int = 4
    """Samples per task (G); advantages are relative within a group."""
    max_new_tokens: int = 128
    """Most tokens of one assistant turn."""
    temperature: float = 1.0
    """Sampling temperature (> 0: the importance ratio needs the sampling distribution)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Sample among the top_k most likely tokens only (0 = off)."""
    num_workers: int = 4
    """Threads running tool calls and reward runs (per environment worker)."""
    max_staleness: int = 0
    """Steps a rollout batch may run ahead of the trainer (``etude.rl.pipeline``): step s's
    batch starts once the policy version is >= s - max_staleness. 0 = on-policy (the
    synchronous loop)."""
    workers: str = "local"
    """Where environments run: ``local`` (threads of the trainer's process) or ``ray`` (Ray
    actors, ``etude.env.ray_pool``)."""
    ray_workers: int = 2
    """Environment workers (Ray actors) with ``workers = "ray"``."""
    ray_address: str = ""
    """Ray cluster to join ('' = start a local instance; ``auto`` = the one ``ray start`` made)."""
    ray_rollout_workers: int = 0
    """Rollout workers as Ray actors, each with its own engine and environments
    (``etude.rl.ray_rollout``; weights by ``sync.kind = "file"``); 0 = generate here."""
    ray_rollout_retries: int = 2
    """Times a share of a step's groups is rolled out again on a fresh actor when its rollout
    actor dies; after that its episodes are masked as infrastructure failures (never reward 0)."""
    ray_rollout_timeout_s: float = 0.0
    """Seconds a rollout actor may hold its share of a step's groups before it counts as hung
    (alive, not answering): it is killed and replaced, and the share is retried or masked as
    when an actor dies. 0 = derived: (``env.wall_clock_s`` + ``env.reward_timeout_s`` + 600)
    x (1 + ``max_staleness``), as an actor runs the shares of the batches in flight in turn."""
    ray_call_timeout_s: float = 0.0
    """Seconds a call to a Ray environment worker (reset, one turn's tool calls, scoring) may
    take before the worker counts as hung: killed and replaced, its episodes masked.
    0 = derived: ``env.wall_clock_s`` + ``env.reward_timeout_s`` + 60."""
    ray_num_cpus: int = 2
    """CPUs of the local Ray instance (with ``ray_address = ""``)."""
    server_url: str = ""
    """Roll out through an OpenAI-compatible server (``etude serve``) at this URL instead of the
    in-process engine ('' = in process); weights reach it by ``sync.kind = "http"``."""
    server_timeout_s: float = 600.0
    """Seconds one request to the rollout server may take (connect, queue, generate) before it
    counts as failed; it is retried ``server_retries`` times, then the episode is masked as an
    infrastructure failure (never scored 0)."""
    server_retries: int = 3
    """Retries of a rollout server request after a timeout, a lost connection, 429 or 5xx."""
    sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How new weights reach the rollout engine after each step (``[rollout.sync]``)."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(
                f"rollout.max_staleness={self.max_staleness} must be >= 0 (0 = on-policy)"
            )
        if self.workers not in ("local", "ray"):
            raise ValueError(f"rollout.workers={self.workers!r}: use 'local' or 'ray'")
        if self.ray_workers < 1 or self.ray_num_cpus < 1:
            raise ValueError("rollout.ray_workers and rollout.ray_num_cpus must be >= 1")
        if self.ray_rollout_retries < 0:
            raise ValueError(f"rollout.ray_rollout_retries={self.ray_rollout_retries} must be >= 0")
        for name in ("ray_rollout_timeout_s", "ray_call_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(
                    f"rollout.{name}={getattr(self, name)} must be > 0 seconds, or 0 for the "
                    "default derived from env.wall_clock_s and env.reward_timeout_s"
                )
        if not self.server_timeout_s > 0:
            raise ValueError(
                f"rollout.server_timeout_s={self.server_timeout_s} must be > 0 seconds (one "
                "request's time to generate a turn, e.g. 600)"
            )
        if not isinstance(self.server_retries, int) or self.server_retries < 0:
            raise ValueError(f"rollout.server_retries={self.server_retries!r} must be an int >= 0")
        if self.ray_rollout_workers < 0:
            raise ValueError(f"rollout.ray_rollout_workers={self.ray_rollout_workers} must be >= 0")
        if self.ray_rollout_workers and self.sync.kind != "file":
            raise ValueError(
                "rollout.ray_rollout_workers > 0: the actors read new weights from files; set "
                "rollout.sync.kind='file' (RUN/weights on a file system every node sees)"
            )
        if self.server_url and self.sync.kind != "http":
            raise ValueError(
                f"rollout.server_url={self.server_url!r} rolls out through a server, which gets "
                "new weights only over HTTP: set rollout.sync.kind='http'"
            )
        if self.sync.kind == "http" and not self.server_url:
            raise ValueError(
                "rollout.sync.kind='http' pushes weights to the rollout server: set "
                "rollout.server_url (e.g. 'http://127.0.0.1:8000')"
            )
        if self.tasks_per_step < 1:
            raise ValueError(f"rollout.tasks_per_step={self.tasks_per_step} must be >= 1")
        if self.group_size < 1:
            raise ValueError(
                f"rollout.group_size={self.group_size} must be >= 1 (>= 2 for any advantage)"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.temperature > 0:
            raise ValueError(
                f"rollout.temperature={self.temperature} must be > 0; greedy rollouts have no "
                "sampling distribution to take importance ratios against"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p} must lie in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k={self.top_k} must be >= 0 (0 = off)")
        if self.num_workers < 1:
            raise ValueError(f"rollout.num_workers={self.num_workers} must be >= 1")


@dataclass(kw_only=True, slots=True)
class RolloutStats:
    """Throughput of one rollout batch."""

    num_episodes: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    generate_seconds: float = 0.0
    env_seconds: float = 0.0
    """Tool calls and reward runs."""
    seconds: float = 0.0
    worker_deaths: int = 0
    """Rollout actors lost while they held part of this batch (``etude.rl.ray_rollout``)."""
    retried_episodes: int = 0
    """Episodes rolled out again on a fresh actor after their actor was lost."""

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


def sampling_seed(seed: int, step: int, group: int, round_index: int) -> int:
    """A 62-bit seed for one (step, group, round): independent of batch layout and rank."""
    value = seed
    for part in (step, group, round_index):
        value = (value * 1_000_003 + part + 0x9E3779B9) % (1 << 62)
    return value


def collect_rollouts(
    backend: InferenceBackend | Engine,
    pool: EnvPool,
    tasks: Sequence[TaskRecord],
    cfg: RolloutConfig,
    *,
    seed: int,
    step: int,
    group_offset: int = 0,
) -> tuple[list[Trajectory], RolloutStats]:
    """Roll out ``cfg.group_size`` episodes of each task; trajectories grouped task by task.

    ``group_offset`` is the global index of ``tasks[0]``'s group (a data-parallel rank's share
    starts there), so that sampling seeds follow the group, not the rank.
    """
    if isinstance(backend, Engine):
        backend = EngineBackend(backend)
    limit = backend.max_seq_len
    if limit is not None and pool.cfg.max_tokens > limit:
        raise ValueError(
            f"env.max_tokens={pool.cfg.max_tokens} exceeds the backend's max_seq_len "
            f"({limit}); lower env.max_tokens or raise model.max_seq_len"
        )
    started = time.perf_counter()
    stats = RolloutStats()
    G = cfg.group_size
    envs = [pool.make_env(task) for task in tasks for _ in range(G)]
    stats.num_episodes = len(envs)
    versions: list[list[int]] = [[] for _ in envs]
    try:
        pool.reset_many(envs)
        generated = [0] * len(envs)
        round_index = 0
        while True:
            # an env the pool gave up on (a hung call, a lost worker or server) is over
            running = [k for k, env in enumerate(envs) if not (env.done or pool.is_abandoned(env))]
            if not running:
                break
            requests = []
            for k in running:
                group, sample = divmod(k, G)
                env = envs[k]
                group_seed = sampling_seed(seed, step, group_offset + group, round_index)
                params = SamplingParams(
                    max_new_tokens=max(1, min(cfg.max_new_tokens, env.tokens_left)),
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    top_k=cfg.top_k,
                    stop_token_ids=pool.stop_token_ids,
                    seed=derive_seed(group_seed, sample),
                )
                session = f"step{step}-group{group_offset + group}-sample{sample}"
                requests.append(
                    GenerationRequest(prompt_ids=env.prompt_ids, params=params, session_id=session)
                )
            t0 = time.perf_counter()
            try:
                outputs: list[Any] = backend.generate(requests)
            except ServerUnavailable as error:
                # the server stopped answering: the episodes whose requests failed are lost to
                # infrastructure (masked, never scored 0); the others go on
                outputs = error.outputs or [None] * len(requests)
                for k, out in zip(running, outputs):
                    if out is None:
                        pool.abandon(envs[k], f"inference server did not answer: {error}")
            stats.generate_seconds += time.perf_counter() - t0
            steps = []
            for k, out in zip(running, outputs):
                if out is None:
                    continue
                env = envs[k]
                # a server's budget may exceed the env's: keep the env's limit
                if len(out.token_ids) > env.tokens_left:
                    out.token_ids = out.token_ids[: env.tokens_left]
                    out.logprobs = out.logprobs[: env.tokens_left]
                generated[k] += len(out.token_ids)
                versions[k].append(out.policy_version)
                steps.append((env, out))
            t0 = time.perf_counter()
            if steps:
                pool.step_many(steps)
            stats.env_seconds += time.perf_counter() - t0
            round_index += 1
        stats.rounds = round_index
        t0 = time.perf_counter()
        trajectories = pool.finish_many(envs)
        stats.env_seconds += time.perf_counter() - t0
    finally:
        pool.release(envs)
    for k, traj in enumerate(trajectories):
        g, sample = divmod(k, G)
        traj.info.update(
            group=group_offset + g,
            sample=sample,
            policy_step=step,
            generated_tokens=generated[k],
            policy_version_min=min(versions[k], default=0),
            policy_version_max=max(versions[k], default=0),
        )
    stats.generated_tokens = sum(generated)
    stats.seconds = time.perf_counter() - started
    return trajectories, stats
