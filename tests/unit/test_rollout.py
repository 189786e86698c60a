"""Rollouts and the trainer's batch: token bookkeeping, logprobs, advantages, masks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from etude.engine import Engine
from etude.env.coding import EnvConfig
from etude.env.pool import EnvPool
from etude.env.trajectory import Trajectory, Turn, read_jsonl, write_jsonl
from etude.model.config import ModelConfig
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.model.transformer import build_model
from etude.rl.recipe import RLConfig
from etude.rl.rollout import RolloutConfig, collect_rollouts, sampling_seed
from etude.rl.task_draw import sample_tasks
from etude.rl.teacher import TeacherConfig
from etude.rl.update import (
    StepSums,
    collate,
    minibatch_loss,
    token_logprobs,
    trajectory_advantages,
    trajectory_row,
)
from etude.tasks.record import load_tasks

TASKS = Path(__file__).parents[2] / "examples" / "tasks" / "handwritten"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(200_000), 512)


@pytest.fixture(scope="module")
def model(tok: Tokenizer):
    cfg = ModelConfig.preset("micro", vocab_size=tok.vocab_size, max_seq_len=4096)
    return build_model(cfg, seed=0)


@pytest.fixture(scope="module")
def rollouts(tok: Tokenizer, model, tmp_path_factory):
    tasks = load_tasks(TASKS / "tasks.jsonl")[:2]
    work = tmp_path_factory.mktemp("episodes")
    env_cfg = EnvConfig(max_turns=2, max_tokens=4000, work_dir=str(work))
    cfg = RolloutConfig(tasks_per_step=2, group_size=2, max_new_tokens=16, num_workers=2)
    engine = Engine(model, max_seq_len=4000, decode_fn=tok.decode)
    with EnvPool(env_cfg, tokenizer=tok, base_dir=TASKS, max_workers=2) as pool:
        both, stats = collect_rollouts(engine, pool, tasks, cfg, seed=7, step=3)
        # the second group alone, at its global group index: the same episodes
        alone, _ = collect_rollouts(engine, pool, tasks[1:], cfg, seed=7, step=3, group_offset=1)
    return both, alone, stats


def test_tokens_masks_and_behavior_logprobs(rollouts, model, tok: Tokenizer) -> None:
    trajectories, _, stats = rollouts
    assert len(trajectories) == 4
    assert [t.info["group"] for t in trajectories] == [0, 0, 1, 1]
    for traj in trajectories:
        assert traj.reward is not None and traj.finish_reason
        ids = traj.token_ids
        trainable = [m for t in traj.turns for m in t.trainable]
        behavior = [x for t in traj.turns for x in t.logprobs]
        # trainable tokens are exactly the generated ones, only in assistant turns
        assert sum(trainable) == traj.info["generated_tokens"] > 0
        for turn in traj.turns:
            if turn.role != "assistant":
                assert not any(turn.trainable) and not any(turn.logprobs)
        # the engine's logprobs equal a full forward of the final ids (temperature 1)
        with torch.no_grad():
            logp = token_logprobs(model(torch.tensor([ids])), torch.tensor([ids]))[0]
        where = torch.tensor(trainable[1:], dtype=torch.bool)
        torch.testing.assert_close(
            logp[where], torch.tensor(behavior[1:])[where], rtol=1e-3, atol=2e-3
        )
    assert stats.generated_tokens == sum(t.info["generated_tokens"] for t in trajectories)


def test_sampling_follows_the_group_not_the_batch(rollouts) -> None:
    both, alone, _ = rollouts
    assert [t.token_ids for t in both[2:]] == [t.token_ids for t in alone]
    assert sampling_seed(1, 2, 3, 4) != sampling_seed(1, 2, 4, 3)


def test_jsonl_round_trip(rollouts, tmp_path: Path) -> None:
    trajectories, _, _ = rollouts
    write_jsonl(tmp_path / "t.jsonl", trajectories)
    back = read_jsonl(tmp_path / "t.jsonl")
    assert [t.to_json() for t in back] == [t.to_json() for t in trajectories]


def _traj(reward: float, ids: list[int], trainable: list[int]) -> Trajectory:
    turn = Turn(
        role="assistant", text="", token_ids=ids, trainable=trainable, logprobs=[-1.0] * len(ids)
    )
    return Trajectory(task_id="t", turns=[turn], reward=reward)


def test_advantages_broadcast_to_generated_tokens() -> None:
    trajs = [
        _traj(1.0, [1, 2, 3, 4], [0, 1, 1, 0]),
        _traj(0.0, [1, 2, 3], [0, 0, 1]),
        _traj(0.5, [1, 2], [0, 1]),
        _traj(0.5, [1, 2], [0, 1]),
    ]
    adv, zero = trajectory_advantages(trajs, 2, RLConfig())
    assert adv == [0.5, -0.5, 0.0, 0.0] and zero == [False, False, True, True]
    rows = [trajectory_row(t, a) for t, a in zip(trajs, adv)]
    assert rows[0].ids == [1, 2, 3]  # cut after the last trainable token
    batch = collate(rows, torch.device("cpu"))
    want = torch.tensor([[0, 0.5, 0.5], [0, 0, -0.5], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(batch["adv_BT"], want)
    assert batch["mask_BT"].tolist()[1] == [False, False, True]


def test_negative_advantage_scale_keeps_positive_advantages() -> None:
    trajs = [_traj(r, [1, 2], [0, 1]) for r in (1.0, 0.0, 0.0, 0.0, 1.0, 1.0)]
    full, _ = trajectory_advantages(trajs, 3, RLConfig())
    half, _ = trajectory_advantages(trajs, 3, RLConfig(negative_advantage_scale=0.5))
    only_up, zero = trajectory_advantages(trajs, 3, RLConfig(negative_advantage_scale=0.0))
    assert full == pytest.approx([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3])
    assert half == pytest.approx([2 / 3, -1 / 6, -1 / 6, -1 / 3, 1 / 3, 1 / 3])
    assert only_up == pytest.approx([2 / 3, 0, 0, 0, 1 / 3, 1 / 3])
    assert zero == [False] * 6
    with pytest.raises(ValueError, match="negative_advantage_scale"):
        RLConfig(negative_advantage_scale=1.5)


def test_policy_loss_at_ratio_one(model) -> None:
    # behavior logprobs = current logprobs: ratio 1, loss = -mean advantage, no clipping
    ids = list(range(10, 40))
    trainable = [0] * 10 + [1] * 20
    with torch.no_grad():
        logp = token_logprobs(model(torch.tensor([ids])), torch.tensor([ids]))[0].tolist()
    rows = [trajectory_row(_traj(0.0, ids, trainable), 0.75)]
    rows[0].behavior = [0.0] + logp
    sums = StepSums()
    loss = minibatch_loss(
        model,
        rows,
        [],
        [],
        [],
        rl=RLConfig(),
        teacher_cfg=TeacherConfig(),
        num_tokens=20,
        reference=None,
        device=torch.device("cpu"),
        sums=sums,
    )
    assert loss.item() == pytest.approx(-0.75, rel=1e-4)
    assert sums.values["clip_frac"] == 0 and sums.values["tokens"] == 20
    assert sums.values["ratio"] / 20 == pytest.approx(1.0, abs=1e-4)


def test_task_draws_depend_on_seed_and_step() -> None:
    tasks = load_tasks(TASKS / "tasks.jsonl")
    a = sample_tasks(tasks, 2, seed=0, step=5)
    assert [t.instance_id for t in a] == [
        t.instance_id for t in sample_tasks(tasks, 2, seed=0, step=5)
    ]
    assert len({t.instance_id for t in a}) == 2
    assert len(sample_tasks(tasks, 5, seed=0, step=5)) == 5


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("ray_rollout_timeout_s", -1.0),
        ("ray_call_timeout_s", -5.0),
        ("server_timeout_s", 0.0),
        ("server_retries", -1),
    ],
)
def test_failure_settings_name_themselves(setting: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"rollout.{setting}="):
        RolloutConfig(**{setting: value})
