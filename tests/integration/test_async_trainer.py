"""The trainer with the asynchronous pipeline, weight sync and Ray environment workers.

- ``rollout.max_staleness = 0`` through a separate engine fed by the file sync reproduces the
  synchronous trainer's metrics step for step (same seeds); staleness 1 stays within its bound.
- Rollout workers as Ray actors with their own engines, fed by the file sync, reproduce the
  in-process run; one killed mid-step is replaced and its share rolled out again: the same run,
  the loss counted.
- The demo's RL recipe on 2 Ray environment workers (a local Ray instance) gives the local
  pool's rewards and trajectories for the same seeds; a worker killed mid-step is survived: the
  step completes and the failure is counted.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from etude.config import apply_overrides, from_dict, load_toml
from etude.env.trajectory import read_jsonl
from etude.model.tokenizer import train_default_tokenizer
from etude.report.metrics import read_metrics
from etude.rl.trainer import RLRun, TrainRecipe, run_train

pytestmark = pytest.mark.slow  # several short RL runs with sandboxed test runs: a few minutes

ROOT = Path(__file__).parents[2]
TASKS = ROOT / "examples" / "tasks" / "handwritten" / "tasks.jsonl"
MODEL = [
    "model.preset='tiny'",
    "model.vocab_size=512",
    "model.dim=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=16",
    "model.num_dense_layers=1",
    "model.num_experts=4",
    "model.num_experts_per_tok=2",
    "model.expert_ffn_dim=32",
    "model.dense_ffn_dim=64",
    "model.max_seq_len=4096",
]
TIMING = ("time", "step_seconds", "rollout_tok/s", "train_tok/s", "async/", "sync/", "infra/")


def recipe(base: dict, run: Path, overrides: list[str]) -> TrainRecipe:
    data = apply_overrides(
        json.loads(json.dumps(base)), [*MODEL, *overrides, f"train.run_dir='{run}'"]
    )
    return from_dict(TrainRecipe, data, "recipe")


def rl_tiny() -> dict:
    return load_toml(ROOT / "configs" / "rl-tiny.toml")


def demo_rl() -> dict:
    return load_toml(ROOT / "configs" / "demo.toml")["rl"]


COMMON = [
    f"tasks.path='{TASKS}'",
    "tasks.limit=2",
    "tasks.curriculum=false",
    "tasks.repo=''",
    "env.max_turns=2",
    "env.max_tokens=4000",
    "rollout.tasks_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=12",
    "rollout.num_workers=2",
    "rl.micro_batch_size=2",
    "rl.update_without_signal=true",
    "train.init=''",
    "train.steps=3",
    "train.checkpoint_every=3",
    "train.progress=false",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    train_default_tokenizer(512).save(path)
    return path


def prepared(run: Path, tokenizer_dir: Path) -> Path:
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "tokenizer.json").write_bytes(
        (tokenizer_dir / "tokenizer.json").read_bytes()
    )
    return run


def comparable(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith(TIMING) and "seconds" not in k}
        for r in rows
    ]


def trajectories(run: Path) -> list[tuple]:
    out = []
    for path in sorted((run / "trajectories").glob("step_*.jsonl")):
        out += [(t.task_id, t.token_ids, t.reward, t.tests) for t in read_jsonl(path)]
    return out


def test_staleness_zero_reproduces_the_synchronous_trainer(tmp_path, tokenizer_dir) -> None:
    sync_run = prepared(tmp_path / "sync", tokenizer_dir)
    run_train(recipe(rl_tiny(), sync_run, COMMON))
    # the pipeline with a separate engine whose weights arrive by file, every step
    file_run = prepared(tmp_path / "file", tokenizer_dir)
    run_train(recipe(rl_tiny(), file_run, [*COMMON, "rollout.sync.kind='file'"]))
    a, b = read_metrics(sync_run), read_metrics(file_run)
    assert [r["step"] for r in a] == [1, 2, 3]
    assert comparable(a) == comparable(b)
    assert trajectories(sync_run) == trajectories(file_run)
    assert all(r["async/staleness_max"] == 0 for r in a + b)
    assert [r["sync/version"] for r in b] == [1.0, 2.0, 3.0]
    # one step ahead: within the bound, the same number of steps, every batch trained once
    async_run = prepared(tmp_path / "async", tokenizer_dir)
    run_train(recipe(rl_tiny(), async_run, [*COMMON, "rollout.max_staleness=1"]))
    c = read_metrics(async_run)
    assert [r["step"] for r in c] == [1, 2, 3]
    assert max(r["async/staleness_max"] for r in c) <= 1
    assert sorted(t[0] for t in trajectories(async_run)) == sorted(
        t[0] for t in trajectories(sync_run)
    )


def test_demo_rl_recipe_on_ray_workers(tmp_path, tokenizer_dir) -> None:
    ray_opts = ["rollout.workers='ray'", "rollout.ray_workers=2", "rollout.ray_num_cpus=2"]
    local_run = prepared(tmp_path / "local", tokenizer_dir)
    run_train(recipe(demo_rl(), local_run, COMMON))
    ray_run = prepared(tmp_path / "ray", tokenizer_dir)
    run_train(recipe(demo_rl(), ray_run, [*COMMON, *ray_opts]))
    a, b = read_metrics(local_run), read_metrics(ray_run)
    assert [r["reward"] for r in a] == [r["reward"] for r in b]
    assert comparable(a) == comparable(b)
    assert trajectories(local_run) == trajectories(ray_run)
    assert all(r["infra/worker_deaths"] == 0 and r["infra/episodes"] == 0 for r in b)

    # a worker killed while step 2's episodes are in flight
    killed_run = prepared(tmp_path / "killed", tokenizer_dir)
    cfg = recipe(demo_rl(), killed_run, [*COMMON, *ray_opts])
    with RLRun(cfg) as run:
        for step in range(run.start_step, cfg.train.steps):
            killer = None
            if step == 1:

                def kill_when_busy() -> None:
                    deadline = time.monotonic() + 120
                    while run.env_pool.in_flight() == 0 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    run.env_pool.kill_worker(0)

                killer = threading.Thread(target=kill_when_busy)
                killer.start()
            run.run_step(step)
            if killer is not None:
                killer.join()
        run.finish()
    rows = read_metrics(killed_run)
    assert [r["step"] for r in rows] == [1, 2, 3]  # every step completed
    assert rows[1]["infra/worker_deaths"] == 1 and rows[1]["infra/episodes"] >= 1
    assert rows[2]["infra/worker_deaths"] == 0  # the replacement worker took over
    failed = [
        t
        for t in read_jsonl(killed_run / "trajectories" / "step_000002.jsonl")
        if t.info.get("infra")
    ]
    assert failed and all(t.reward is None for t in failed)


def test_rollout_workers_on_ray_actors_follow_the_file_sync(tmp_path, tokenizer_dir) -> None:
    sync_run = prepared(tmp_path / "sync", tokenizer_dir)
    run_train(recipe(rl_tiny(), sync_run, COMMON))
    actors_run = prepared(tmp_path / "actors", tokenizer_dir)
    actors = ["rollout.ray_rollout_workers=2", "rollout.sync.kind='file'"]
    run_train(recipe(rl_tiny(), actors_run, [*COMMON, *actors]))
    # two actors, each with its own engine loading every version from RUN/weights: the same run
    assert comparable(read_metrics(sync_run)) == comparable(read_metrics(actors_run))
    assert trajectories(sync_run) == trajectories(actors_run)
    assert all(r["infra/worker_deaths"] == 0 for r in read_metrics(actors_run))

    # actor 0 killed (SIGKILL) while step 2's episodes run: a fresh actor rolls its share out
    # again, so the step completes with the undisturbed run's episodes, and the loss is counted
    killed_run = prepared(tmp_path / "killed", tokenizer_dir)
    cfg = recipe(rl_tiny(), killed_run, [*COMMON, *actors])
    with RLRun(cfg) as run:
        for step in range(run.start_step, cfg.train.steps):
            killer = None
            if step == 1:
                pid = run.ray_rollouts._ray.get(run.ray_rollouts.workers[0].pid.remote())
                killer = kill_when_busy(pid)
            run.run_step(step)
            if killer is not None:
                killer.join()
        run.finish()
    rows = read_metrics(killed_run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["infra/worker_deaths"] for r in rows] == [0, 1, 0]
    assert [r["infra/retried_episodes"] for r in rows] == [0, 2, 0]  # one group of 2
    assert comparable(rows) == comparable(read_metrics(actors_run))
    assert trajectories(killed_run) == trajectories(actors_run)


def kill_when_busy(pid: int) -> threading.Thread:
    """SIGKILL ``pid`` once it has a child process (a test run: in the middle of an episode)."""

    def has_child() -> bool:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    return True
            except (OSError, IndexError, ValueError):
                continue
        return False

    def run() -> None:
        deadline = time.monotonic() + 120
        while not has_child() and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=run)
    thread.start()
    return thread
