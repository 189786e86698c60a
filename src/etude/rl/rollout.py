"""Multi-turn rollouts: the engine writes assistant turns, the environment answers them.

For a batch of tasks x G samples, every episode runs in lockstep rounds: each running episode's
conversation (``env.prompt_ids``, ending with an open assistant header) goes to the engine, the
generated ids and their behavior logprobs go back to the env (``EnvPool.step_many``: tool calls
run concurrently), the observations are appended as tokens, and the next round starts, until
every episode has ended (submit, turn or token limit). Then all are scored concurrently.

Per token the trajectory keeps the id, the trainable mask (1 on generated ids only) and the
behavior logprob (``log_softmax(logits / T)`` of the sampled id, as the engine reports it); per
turn its ids, calls and typed errors (``etude.env.trajectory``). ``info`` records the group, the
sample, the policy step and the generated token count.

Sampling is seeded per (run seed, step, group, round), and each group is generated in its own
engine call: a group's samples do not depend on which other groups share the batch or the
rank, so one process and N data-parallel ranks roll out the same trajectories.

What this does not do: compute rewards beyond the env's (``etude.env.reward``), advantages, or
any loss; continuous batching across rounds (an episode that ends early frees its row only at
the round's end).

Legend: G samples per task.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from etude.engine import Engine, SamplingParams
from etude.env.pool import EnvPool
from etude.env.trajectory import Trajectory
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
    num_workers: int = 4
    """Threads running tool calls and reward runs."""

    def __post_init__(self) -> None:
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
    engine: Engine,
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
    if pool.cfg.max_tokens > engine.max_seq_len:
        raise ValueError(
            f"env.max_tokens={pool.cfg.max_tokens} exceeds the engine's max_seq_len "
            f"({engine.max_seq_len}); lower env.max_tokens or raise model.max_seq_len"
        )
    tokenizer = pool.tokenizer
    started = time.perf_counter()
    stats = RolloutStats()
    groups = [[pool.make_env(task) for _ in range(cfg.group_size)] for task in tasks]
    envs = [env for group in groups for env in group]
    stats.num_episodes = len(envs)
    try:
        pool.reset_many(envs)
        generated = [0] * len(envs)
        round_index = 0
        while True:
            steps = []
            t0 = time.perf_counter()
            for g, group in enumerate(groups):
                running = [env for env in group if not env.done]
                if not running:
                    continue
                budget = max(env.tokens_left for env in running)
                params = SamplingParams(
                    max_new_tokens=max(1, min(cfg.max_new_tokens, budget)),
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    stop_token_ids=(tokenizer.im_end_id,),
                    seed=sampling_seed(seed, step, group_offset + g, round_index),
                )
                outputs = engine.generate([env.prompt_ids for env in running], params)
                for env, out in zip(running, outputs):
                    # the engine's own budget is max_seq_len - prompt; the env's is tokens_left
                    if len(out.token_ids) > env.tokens_left:
                        out.token_ids = out.token_ids[: env.tokens_left]
                        out.logprobs = out.logprobs[: env.tokens_left]
                    steps.append((env, out))
            stats.generate_seconds += time.perf_counter() - t0
            if not steps:
                break
            for env, out in steps:
                generated[envs.index(env)] += len(out.token_ids)
            t0 = time.perf_counter()
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
        g, sample = divmod(k, cfg.group_size)
        traj.info.update(
            group=group_offset + g, sample=sample, policy_step=step, generated_tokens=generated[k]
        )
    stats.generated_tokens = sum(generated)
    stats.seconds = time.perf_counter() - started
    return trajectories, stats
