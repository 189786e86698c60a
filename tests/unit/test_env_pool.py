"""The environment pool: concurrent episodes, lockstep stepping, and no directory left behind."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from etude.env.coding import EnvConfig, StepResult
from etude.env.oracle import OracleAgent
from etude.env.pool import EnvPool
from etude.model.tokenizer import TOOL_CALL_END, TOOL_CALL_START, Tokenizer, default_corpus
from etude.tasks.record import TaskRecord, load_tasks

BASE = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "handwritten"
TASKS = load_tasks(BASE / "tasks.jsonl")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(200_000), 512)


def make_pool(tok: Tokenizer, work: Path, max_workers: int) -> EnvPool:
    work.mkdir(exist_ok=True)
    return EnvPool(
        EnvConfig(work_dir=str(work)), tokenizer=tok, base_dir=BASE, max_workers=max_workers
    )


class CountingOracle(OracleAgent):
    """The oracle, counting how many episodes are between their first act and their end."""

    def __init__(self, task: TaskRecord, gauge: dict[str, Any]) -> None:
        super().__init__(task, base_dir=str(BASE))
        self.gauge = gauge

    def act(self, last: StepResult | None) -> str:
        if last is None:
            with self.gauge["lock"]:
                self.gauge["now"] += 1
                self.gauge["max"] = max(self.gauge["max"], self.gauge["now"])
                self.gauge["threads"].add(threading.current_thread().name)
        return super().act(last)

    def episode_info(self) -> dict[str, Any]:
        with self.gauge["lock"]:
            self.gauge["now"] -= 1
        return super().episode_info()


def test_run_episodes_concurrently(tok: Tokenizer, tmp_path: Path) -> None:
    tasks = [*TASKS, TASKS[0]]
    gauge = {"lock": threading.Lock(), "now": 0, "max": 0, "threads": set()}
    with make_pool(tok, tmp_path / "work", max_workers=2) as pool:
        trajectories = pool.run_episodes(tasks, lambda task: CountingOracle(task, gauge))
        assert list((tmp_path / "work").iterdir()) == []  # each episode cleaned when scored
    assert [t.task_id for t in trajectories] == [t.instance_id for t in tasks]
    assert [t.reward for t in trajectories] == [1.0] * len(tasks)
    assert gauge["now"] == 0 and gauge["max"] <= 2  # the bound on parallelism holds
    assert len(gauge["threads"]) == 2  # and both workers ran episodes


@dataclass
class Generation:
    """What an engine returns for one turn."""

    token_ids: list[int]
    logprobs: list[float]


def test_lockstep_rollout_with_text_and_ids(tok: Tokenizer, tmp_path: Path) -> None:
    work = tmp_path / "work"
    with make_pool(tok, work, max_workers=3) as pool:
        envs = [pool.make_env(task) for task in TASKS]
        conversations = pool.reset_many(envs)
        assert [c.ids for c in conversations] == [env.prompt_ids for env in envs]
        assert len(list(work.iterdir())) == len(envs)
        agents = [OracleAgent(task, base_dir=str(BASE)) for task in TASKS]
        last: dict[int, StepResult | None] = {i: None for i in range(len(envs))}
        rounds = 0
        while not all(env.done for env in envs):
            running = [i for i, env in enumerate(envs) if not env.done]
            batch = []
            for i in running:
                text = agents[i].act(last[i])
                if i % 2:  # as an engine would hand it over: ids ending with <|im_end|>
                    ids = tok.encode(text, allow_special=[TOOL_CALL_START, TOOL_CALL_END])
                    ids.append(tok.im_end_id)
                    batch.append((envs[i], Generation(ids, [-0.5] * len(ids))))
                else:
                    batch.append((envs[i], text))
            for i, result in zip(running, pool.step_many(batch)):
                last[i] = result
            rounds += 1
        trajectories = pool.finish_many(envs)
        assert [t.reward for t in trajectories] == [1.0] * len(envs)
        for i, trajectory in enumerate(trajectories):
            trained = [lp for t in trajectory.turns for lp, m in zip(t.logprobs, t.trainable) if m]
            assert trained == [-0.5 if i % 2 else 0.0] * len(trained)
            assert trajectory.token_ids == envs[i].conversation.ids
        assert rounds == max(len(a.turns) for a in agents)
        pool.release(envs)
        assert list(work.iterdir()) == []


def test_step_many_rejects_the_same_env_twice(tok: Tokenizer, tmp_path: Path) -> None:
    with make_pool(tok, tmp_path / "work", max_workers=2) as pool:
        env = pool.make_env(TASKS[0])
        env.reset()
        with pytest.raises(ValueError, match="same env twice"):
            pool.step_many([(env, "a"), (env, "b")])


class FailingAgent:
    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.turns = 0

    def act(self, last: StepResult | None) -> str:
        self.turns += 1
        if self.turns == self.fail_at:
            raise RuntimeError("the policy crashed")
        return f'{TOOL_CALL_START}{{"name": "list_files"}}{TOOL_CALL_END}'

    def episode_info(self) -> dict[str, Any]:
        return {}


def test_directories_are_removed_when_episodes_fail(tok: Tokenizer, tmp_path: Path) -> None:
    work = tmp_path / "work"
    with make_pool(tok, work, max_workers=2) as pool:
        with pytest.raises(RuntimeError, match="the policy crashed"):
            pool.run_episodes(TASKS, lambda task: FailingAgent(fail_at=2))
        assert list(work.iterdir()) == []
    # lockstep envs that were never finished are removed when the pool closes on an exception
    with pytest.raises(RuntimeError, match="rollout failed"):
        with make_pool(tok, work, max_workers=2) as pool:
            envs = [pool.make_env(task) for task in TASKS]
            pool.reset_many(envs)
            pool.step_many([(env, "no call") for env in envs])
            assert len(list(work.iterdir())) == len(envs)
            raise RuntimeError("rollout failed")
    assert list(work.iterdir()) == []
    with pytest.raises(ValueError, match="the pool is closed"):
        pool.make_env(TASKS[0])
