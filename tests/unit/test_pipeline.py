"""The asynchronous pipeline's rules: admission within the staleness bound, pacing (a slow batch
is trained at its own step, never overtaken), version tags across a weight update."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from etude.engine import Engine, SamplingParams
from etude.engine.backends import EngineBackend, GenerationRequest
from etude.env.trajectory import Trajectory, Turn
from etude.model.config import ModelConfig
from etude.model.transformer import build_model
from etude.rl.pipeline import (
    RolloutPipeline,
    check_staleness,
    staleness_stats,
    steps_to_admit,
)
from etude.rl.weight_sync import InProcessSync


def test_admission_rule() -> None:
    # on-policy: only the step asked for
    assert list(steps_to_admit(0, 0, 0, 10)) == [0]
    assert list(steps_to_admit(3, 3, 0, 10)) == [3]
    # staleness 2: up to two steps ahead, never past the end, never twice
    assert list(steps_to_admit(0, 0, 2, 10)) == [0, 1, 2]
    assert list(steps_to_admit(1, 3, 2, 10)) == [3]
    assert list(steps_to_admit(8, 10, 2, 10)) == []
    assert list(steps_to_admit(5, 5, 0, 6)) == [5]


def episode(task: str, versions: list[int]) -> Trajectory:
    turns = [Turn(role="user", text=task)]
    turns += [Turn(role="assistant", text="", policy_version=v) for v in versions]
    return Trajectory(task_id=task, turns=turns, reward=0.0)


class Trainer:
    """A trainer's version counter and the events the pipeline's callbacks saw, in order."""

    def __init__(self) -> None:
        self.version = 0
        self.events: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def log(self, what: str, step: int) -> None:
        with self.lock:
            self.events.append((what, step, self.version))


def run(
    max_staleness: int, durations: dict[int, float], steps: int, rounds: int = 2
) -> tuple[Trainer, list]:
    """A pipeline whose step s batch takes ``durations[s]`` seconds over ``rounds`` turns, each
    turn tagged with the trainer's version when it is generated (as the engine does)."""
    trainer = Trainer()

    def draw(step: int) -> str:
        trainer.log("draw", step)
        return f"task{step}"

    def rollout(step: int, task: str) -> list[Trajectory]:
        trainer.log("start", step)
        versions = []
        for _ in range(rounds):
            versions.append(trainer.version)
            time.sleep(durations.get(step, 0.0) / rounds)
        trainer.log("end", step)
        return [episode(task, versions)]

    batches = []
    with RolloutPipeline(
        draw, rollout, max_staleness=max_staleness, start_step=0, end_step=steps
    ) as pipeline:
        for step in range(steps):
            batch = pipeline.next_batch(step)
            trainer.log("train", step)
            check_staleness(batch.result, step, max_staleness)
            batches.append(batch)
            time.sleep(0.05)  # the update
            trainer.version = step + 1
    return trainer, batches


def test_staleness_zero_is_the_synchronous_loop() -> None:
    trainer, batches = run(0, {0: 0.1, 1: 0.1, 2: 0.1}, steps=3)
    # every batch starts after the previous update and is generated at version = its step
    expected = []
    for s in range(3):
        expected += [("draw", s, s), ("start", s, s), ("end", s, s), ("train", s, s)]
    assert trainer.events == expected
    for s, batch in enumerate(batches):
        assert batch.admitted_version == s
        assert staleness_stats(batch.result, s)["async/staleness_max"] == 0.0


def test_a_slow_batch_is_trained_at_its_own_step_while_the_next_runs() -> None:
    # step 0's episodes are slow (a long test run), step 1's fast
    trainer, batches = run(1, {0: 0.6, 1: 0.05, 2: 0.05, 3: 0.05}, steps=4)
    order = [(what, step) for what, step, _ in trainer.events]
    # step 1 started (and ended) while step 0 still ran: the long tail overlaps the next batch
    assert order.index(("start", 1)) < order.index(("end", 0))
    assert order.index(("end", 1)) < order.index(("end", 0))
    # ... but the trainer's first batch is still step 0's: never overtaken, never dropped
    assert [b.result[0].task_id for b in batches] == ["task0", "task1", "task2", "task3"]
    assert batches[0].wait_seconds > 0.3
    # step 1 was generated at version 0 and trained at step 1: one step stale
    assert staleness_stats(batches[1].result, 1)["async/staleness_max"] == 1.0
    # a batch is drawn no earlier than the bound allows: step s at version >= s - 1
    for what, step, version in trainer.events:
        if what == "draw":
            assert version >= step - 1


def test_partial_rollouts_carry_both_versions() -> None:
    # step 1's batch runs across the update of step 0 -> its turns span versions 0 and 1
    trainer, batches = run(1, {0: 0.1, 1: 0.6}, steps=2, rounds=3)
    versions = [turn.policy_version for _, turn in batches[1].result[0].assistant_turns()]
    assert versions[0] == 0 and versions[-1] == 1
    stats = staleness_stats(batches[1].result, 1)
    assert stats["async/partial_episodes"] == 1.0 and stats["async/staleness_max"] == 1.0


def test_out_of_order_and_bad_settings() -> None:
    with pytest.raises(ValueError, match="rollout.max_staleness"):
        RolloutPipeline(lambda s: s, lambda s, t: t, max_staleness=-1, start_step=0, end_step=2)
    with RolloutPipeline(
        lambda s: s, lambda s, t: t, max_staleness=1, start_step=0, end_step=2
    ) as pipeline:
        with pytest.raises(ValueError, match="out of order"):
            pipeline.next_batch(1)
        assert pipeline.next_batch(0).result == 0
        assert pipeline.in_flight() == [1]


def test_a_weight_update_lands_between_generations() -> None:
    cfg = ModelConfig.preset(
        "tiny",
        vocab_size=64,
        dim=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        num_dense_layers=1,
        dense_ffn_dim=32,
        max_seq_len=64,
    )
    policy = build_model(cfg, seed=0)
    backend = EngineBackend(Engine(copy.deepcopy(policy)))
    sync = InProcessSync(backend)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    request = [GenerationRequest(prompt_ids=[1, 2, 3], params=params)]
    before = backend.generate(request)[0]
    assert before.policy_version == 0
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(3.0)
    # the update waits for a generation in flight on another thread, then applies whole
    started = threading.Event()
    results = []

    def generate_while_updating() -> None:
        started.set()
        results.append(backend.generate(request)[0])

    worker = threading.Thread(target=generate_while_updating)
    worker.start()
    started.wait()
    assert sync.push(policy, 1).version == 1
    worker.join()
    assert results[0].policy_version in (0, 1)
    after = backend.generate(request)[0]
    assert after.policy_version == 1
    reference = Engine(policy).generate([[1, 2, 3]], [params])[0]
    assert reference.token_ids == after.token_ids and reference.logprobs == after.logprobs
    assert after.logprobs != before.logprobs
