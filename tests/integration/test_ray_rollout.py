"""Rollout workers as Ray actors (a local Ray instance, num_cpus=2): an actor killed in the
middle of a step, or one that stops answering (SIGSTOP: alive, never returns), does not fail it.
Its share is rolled out again on a fresh actor (the same episodes as an undisturbed step,
counted), or, with no retries left, masked: no reward, never 0, counted."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from etude.config import to_dict
from etude.env.coding import EnvConfig
from etude.env.trajectory import is_infra_failure
from etude.model.config import ModelConfig
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.model.transformer import build_model
from etude.rl.ray_rollout import RayRollouts
from etude.rl.rollout import RolloutConfig
from etude.rl.weight_sync import FileSync
from etude.tasks.record import load_tasks

pytestmark = pytest.mark.slow  # a Ray instance, four actors each importing torch: about a minute

TASKS = Path(__file__).parents[2] / "examples" / "tasks" / "handwritten"
CFG = RolloutConfig(tasks_per_step=2, group_size=2, max_new_tokens=8, num_workers=2)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(200_000), 512)


@pytest.fixture(scope="module")
def rollouts(tok: Tokenizer, tmp_path_factory):
    cfg = ModelConfig.preset("micro", vocab_size=tok.vocab_size, max_seq_len=4096)
    weights = tmp_path_factory.mktemp("weights")
    FileSync(weights, to_dict(cfg)).push(build_model(cfg, seed=0), 0)
    env_cfg = EnvConfig(max_turns=1, max_tokens=4000, work_dir=str(tmp_path_factory.mktemp("ep")))
    with RayRollouts(
        2,
        weights_dir=weights,
        tokenizer=tok,
        env_cfg=env_cfg,
        base_dir=TASKS,
        max_workers=2,
        num_cpus=2,
        retries=1,
    ) as pool:
        yield pool


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a running test or tool of the actor)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def kill_when_busy(pid: int, sig: int = signal.SIGKILL) -> threading.Thread:
    """Send ``sig`` to ``pid`` once it runs a child process: in the middle of an episode."""

    def run() -> None:
        deadline = time.monotonic() + 120
        while not children(pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(pid, sig)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def gone(pid: int, within_s: float = 30.0) -> bool:
    """Whether ``pid`` exits (or is a zombie) within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def summary(trajectories) -> list[tuple]:
    return [(t.task_id, t.token_ids, t.reward, t.tests) for t in trajectories]


def test_a_killed_rollout_actor_is_retried_then_masked(rollouts) -> None:
    tasks = load_tasks(TASKS / "tasks.jsonl")[:2]
    reference, stats = rollouts.collect(tasks, CFG, seed=3, step=0, group_offset=0)
    assert stats.worker_deaths == 0 and stats.retried_episodes == 0
    assert all(t.reward is not None for t in reference)

    # actor 0 (the first task's group) dies mid-step: a fresh actor rolls the share out again
    pid = rollouts._ray.get(rollouts.workers[0].pid.remote())
    killer = kill_when_busy(pid)
    retried, stats = rollouts.collect(tasks, CFG, seed=3, step=0, group_offset=0)
    killer.join()
    assert rollouts._ray.get(rollouts.workers[0].pid.remote()) != pid  # replaced
    assert stats.worker_deaths == 1 and stats.retried_episodes == CFG.group_size
    # the step's episodes are the undisturbed step's: the lost ones got their real rewards
    assert summary(retried) == summary(reference)
    assert not any(is_infra_failure(t) for t in retried)

    # no retries left: the lost share's episodes are masked, never scored
    rollouts.retries = 0
    pid = rollouts._ray.get(rollouts.workers[0].pid.remote())
    killer = kill_when_busy(pid)
    masked, stats = rollouts.collect(tasks, CFG, seed=3, step=0, group_offset=0)
    killer.join()
    assert stats.worker_deaths == 1 and stats.retried_episodes == 0
    assert [t.task_id for t in masked] == [t.task_id for t in reference]
    lost, kept = masked[: CFG.group_size], masked[CFG.group_size :]
    for traj in lost:
        assert is_infra_failure(traj) and traj.reward is None and traj.finish_reason == "error"
        assert "rollout worker lost" in traj.info["infra"]
        assert not any(m for turn in traj.turns for m in turn.trainable)
    assert summary(kept) == summary(reference[CFG.group_size :])


def test_a_hung_rollout_actor_is_killed_and_its_share_retried_then_masked(rollouts) -> None:
    """SIGSTOP: the actor is alive and holds its share but never answers. After
    ``rollout.ray_rollout_timeout_s`` it is killed (ray.kill) and replaced; the share is rolled
    out again (the undisturbed step's episodes) or, with no retries left, masked."""
    tasks = load_tasks(TASKS / "tasks.jsonl")[:2]
    # long enough for a fresh actor to import torch and roll its share out on a loaded machine
    cfg = replace(CFG, ray_rollout_timeout_s=60.0)
    rollouts.retries = 1
    reference, _ = rollouts.collect(tasks, cfg, seed=5, step=1, group_offset=0)
    assert all(t.reward is not None for t in reference)

    pid = rollouts._ray.get(rollouts.workers[0].pid.remote())
    stopper = kill_when_busy(pid, signal.SIGSTOP)
    retried, stats = rollouts.collect(tasks, cfg, seed=5, step=1, group_offset=0)
    stopper.join()
    assert rollouts._ray.get(rollouts.workers[0].pid.remote()) != pid  # killed and replaced
    assert gone(pid)  # the stopped process itself was killed, not only forgotten
    assert stats.worker_deaths == 1 and stats.retried_episodes == CFG.group_size
    assert summary(retried) == summary(reference)

    rollouts.retries = 0
    pid = rollouts._ray.get(rollouts.workers[0].pid.remote())
    stopper = kill_when_busy(pid, signal.SIGSTOP)
    masked, stats = rollouts.collect(tasks, cfg, seed=5, step=1, group_offset=0)
    stopper.join()
    assert stats.worker_deaths == 1 and stats.retried_episodes == 0
    lost, kept = masked[: CFG.group_size], masked[CFG.group_size :]
    for traj in lost:
        assert is_infra_failure(traj) and traj.reward is None and traj.finish_reason == "error"
        assert "timed out after 60 s" in traj.info["infra"]
    # the other actor's episodes are the undisturbed step's, rewards included
    assert summary(kept) == summary(reference[CFG.group_size :])
