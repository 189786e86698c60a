"""Environments on Ray actors (a local Ray instance, num_cpus=2): the same episodes as the
local pool, and a worker killed mid-rollout is survived, counted and never scored."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from etude.engine import Engine, SamplingParams
from etude.env.coding import EnvConfig
from etude.env.pool import EnvPool
from etude.env.ray_pool import RayEnvPool, is_infra_failure
from etude.model.config import ModelConfig
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.model.transformer import build_model
from etude.rl.rollout import RolloutConfig, collect_rollouts
from etude.tasks.record import load_tasks

TASKS = Path(__file__).parents[2] / "examples" / "tasks" / "handwritten"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(200_000), 512)


@pytest.fixture(scope="module")
def engine(tok: Tokenizer) -> Engine:
    cfg = ModelConfig.preset("micro", vocab_size=tok.vocab_size, max_seq_len=4096)
    return Engine(build_model(cfg, seed=0), max_seq_len=4000, decode_fn=tok.decode)


@pytest.fixture(scope="module")
def ray_pool(tok: Tokenizer, tmp_path_factory):
    env_cfg = EnvConfig(max_turns=2, max_tokens=4000, work_dir=str(tmp_path_factory.mktemp("ray")))
    with RayEnvPool(
        env_cfg, tokenizer=tok, base_dir=TASKS, num_workers=2, max_workers=2, num_cpus=2
    ) as pool:
        yield pool


def summary(trajectories) -> list[tuple]:
    return [
        (t.task_id, t.token_ids, [m for turn in t.turns for m in turn.trainable], t.reward, t.tests)
        for t in trajectories
    ]


def test_same_episodes_and_rewards_as_the_local_pool(ray_pool, engine, tok, tmp_path) -> None:
    tasks = load_tasks(TASKS / "tasks.jsonl")[:2]
    cfg = RolloutConfig(tasks_per_step=2, group_size=2, max_new_tokens=16, num_workers=2)
    remote, _ = collect_rollouts(engine, ray_pool, tasks, cfg, seed=7, step=3)
    env_cfg = EnvConfig(max_turns=2, max_tokens=4000, work_dir=str(tmp_path))
    with EnvPool(env_cfg, tokenizer=tok, base_dir=TASKS, max_workers=2) as pool:
        local, _ = collect_rollouts(engine, pool, tasks, cfg, seed=7, step=3)
    assert summary(remote) == summary(local)
    assert all(t.reward is not None for t in remote)
    # both workers ran episodes, each in its own process
    pids = ray_pool.worker_pids()
    assert len(set(pids)) == 2
    assert ray_pool.take_failures().episodes == 0


def test_a_killed_worker_fails_its_episodes_and_is_replaced(ray_pool, engine, tok) -> None:
    tasks = load_tasks(TASKS / "tasks.jsonl")[:2]
    envs = [ray_pool.make_env(task) for task in tasks for _ in range(2)]
    ray_pool.reset_many(envs)
    victim = envs[0].worker
    ray_pool.kill_worker(victim)  # mid-episode: after the reset, before the first turn
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(tok.im_end_id,), seed=1)
    while True:
        running = [env for env in envs if not env.done]
        if not running:
            break
        outputs = engine.generate([env.prompt_ids for env in running], params)
        ray_pool.step_many(list(zip(running, outputs)))
    trajectories = ray_pool.finish_many(envs)
    ray_pool.release(envs)
    failed = [t for t, env in zip(trajectories, envs) if env.worker == victim]
    scored = [t for t, env in zip(trajectories, envs) if env.worker != victim]
    assert failed and scored
    for traj in failed:
        # an infrastructure failure: no reward (not 0), never trained on, reason recorded
        assert is_infra_failure(traj) and traj.reward is None and traj.finish_reason == "error"
        assert "worker died" in traj.info["infra"]
        assert traj.token_ids and not any(m for turn in traj.turns for m in turn.trainable)
    assert all(t.reward is not None and not is_infra_failure(t) for t in scored)
    counts = ray_pool.take_failures()
    assert counts.worker_deaths == 1 and counts.episodes == len(failed)
    # the replacement worker takes new episodes
    env = ray_pool.make_env(tasks[0])
    ray_pool.reset_many([env])
    assert not env.done and env.prompt_ids
    ray_pool.release([env])
    assert ray_pool.take_failures().episodes == 0


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a workspace copy, tool or test run of a worker)."""
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


def stop_when_busy(pid: int) -> threading.Thread:
    """SIGSTOP ``pid`` once it runs a child process: in the middle of an episode."""

    def run() -> None:
        deadline = time.monotonic() + 120
        while not children(pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(pid, signal.SIGSTOP)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.slow  # waits out a 10 s call timeout: about 20 s on the shared machine
def test_a_hung_worker_is_killed_replaced_and_its_episodes_masked(ray_pool, engine, tok, tmp_path):
    """SIGSTOP mid-episode: the worker is alive but never answers. After ``call_timeout_s`` it
    is killed and replaced; its episodes are masked (reward None, never 0) and counted; the
    other worker's episodes are those of a run without the fault."""
    tasks = load_tasks(TASKS / "tasks.jsonl")[:2]
    cfg = RolloutConfig(tasks_per_step=2, group_size=2, max_new_tokens=16, num_workers=2)
    env_cfg = EnvConfig(max_turns=2, max_tokens=4000, work_dir=str(tmp_path))
    with EnvPool(env_cfg, tokenizer=tok, base_dir=TASKS, max_workers=2) as pool:
        reference, _ = collect_rollouts(engine, pool, tasks, cfg, seed=7, step=4)
    ray_pool.take_failures()
    pid = ray_pool.worker_pids()[0]
    stopper = stop_when_busy(pid)
    ray_pool.call_timeout_s, default = 10.0, ray_pool.call_timeout_s
    try:
        rollouts, _ = collect_rollouts(engine, ray_pool, tasks, cfg, seed=7, step=4)
    finally:
        ray_pool.call_timeout_s = default
        stopper.join()
    lost = [k for k, traj in enumerate(rollouts) if traj.reward is None]
    kept = [k for k in range(len(rollouts)) if k not in lost]
    assert len(lost) == 2  # round robin: two of the four episodes were on the stopped worker
    for k in lost:
        traj = rollouts[k]
        assert is_infra_failure(traj) and traj.finish_reason == "error"
        assert "timed out after 10 s" in traj.info["infra"]
    assert summary([rollouts[k] for k in kept]) == summary([reference[k] for k in kept])
    counts = ray_pool.take_failures()
    assert counts.worker_deaths == 1 and counts.episodes == 2
    assert pid not in ray_pool.worker_pids()  # replaced, and the stopped process killed:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the stopped worker {pid} is still there")
