"""The trainer's update against the distribution actually sampled, and its guards.

Each test pins one property of ``etude.rl.trainer`` / ``etude.engine.sampling`` /
``etude.rl.teacher`` that a plausible implementation gets wrong: ratios at temperature != 1,
truncated (top-k/top-p) behaviour logprobs, the EMA teacher's buffers, hinted KL in dropped
groups, one normaliser for PPO and KL, pass rate after the monitor, NaN-free log ratios, the
per-token KL in the trajectory, a zero-signal step that leaves the weights alone, and the
trainer's teacher stage applying ``teacher.kl_span``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from etude.engine import Engine, SamplingParams
from etude.env.trajectory import Feedback, ToolCall, Trajectory, Turn
from etude.model.config import ModelConfig
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.model.transformer import build_model
from etude.monitor.hook import MonitorConfig
from etude.optim import OptimConfig, build_optimizer
from etude.report.viewer import turn_kl
from etude.rl.losses import ppo_clip_loss
from etude.rl.recipe import RLConfig, TrainRecipe
from etude.rl.rollout import RolloutConfig
from etude.rl.teacher import (
    TeacherConfig,
    TeacherWeights,
    build_hinted_turns,
    cut_at_divergence,
    feedback_kl_loss,
    teacher_logits,
)
from etude.rl.trainer import RLRun, score_trajectories
from etude.rl.update import (
    StepBatch,
    StepSums,
    minibatch_loss,
    trajectory_advantages,
    trajectory_row,
    update_policy,
)

PROMPT = list(range(20, 60))
PROMPT_LEN = len(PROMPT)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(100_000), 400)


def small_model(vocab: int = 400, seed: int = 0):
    cfg = ModelConfig.preset("micro", vocab_size=vocab, max_seq_len=256)
    return build_model(cfg, seed=seed)


def sampled_rows(model, params: SamplingParams, n: int = 3):
    """Engine generations as (ids, behaviour logprobs per id) with the prompt untrained."""
    engine = Engine(model)
    out = []
    for g in engine.generate([PROMPT] * n, params):
        ids = PROMPT + g.token_ids
        behavior = [0.0] * len(PROMPT) + g.logprobs
        trainable = [0] * len(PROMPT) + [1] * len(g.token_ids)
        out.append((ids, trainable, behavior))
    return out


def assistant_traj(ids, trainable, behavior, reward=0.0, *, split=PROMPT_LEN) -> Trajectory:
    return Trajectory(
        task_id="t",
        turns=[
            Turn(
                role="user",
                text="",
                token_ids=ids[:split],
                trainable=trainable[:split],
                logprobs=behavior[:split],
            ),
            Turn(
                role="assistant",
                text="",
                token_ids=ids[split:],
                trainable=trainable[split:],
                logprobs=behavior[split:],
            ),
        ],
        reward=reward,
    )


def loss_stats(model, rows, rollout: RolloutConfig) -> StepSums:
    sums = StepSums()
    num_tokens = sum(sum(r.trainable[1:]) for r in rows)
    minibatch_loss(
        model,
        rows,
        [],
        [],
        [],
        rl=RLConfig(),
        teacher_cfg=TeacherConfig(beta=0.0),
        num_tokens=num_tokens,
        reference=None,
        device=torch.device("cpu"),
        sums=sums,
        rollout=rollout,
    )
    return sums


@pytest.mark.parametrize(
    "temperature,top_p,top_k", [(0.7, 1.0, 0), (1.3, 1.0, 0), (0.8, 0.9, 0), (1.0, 1.0, 5)]
)
def test_recomputed_ratio_is_one_on_policy(temperature, top_p, top_k) -> None:
    # the engine's behaviour logprob and the trainer's recomputed one use one transform, so an
    # on-policy batch has ratio 1 and nothing clipped (the review saw ratio 1.70 at T = 0.7)
    model = small_model()
    params = SamplingParams(
        max_new_tokens=24, temperature=temperature, top_p=top_p, top_k=top_k, seed=3
    )
    rows = []
    for ids, trainable, behavior in sampled_rows(model, params):
        rows.append(trajectory_row(assistant_traj(ids, trainable, behavior), 1.0))
    rollout = RolloutConfig(temperature=temperature, top_p=top_p, top_k=top_k)
    sums = loss_stats(model, rows, rollout)
    n = sums.values["tokens"]
    assert sums.values["ratio"] / n == pytest.approx(1.0, abs=1e-3)
    assert sums.values["clip_frac"] == 0.0


def test_entropy_is_that_of_the_sampling_temperature() -> None:
    model = small_model()
    ids, trainable, behavior = sampled_rows(model, SamplingParams(max_new_tokens=16, seed=1))[0]
    rows = [trajectory_row(assistant_traj(ids, trainable, behavior), 0.0)]
    sums = loss_stats(model, rows, RolloutConfig(temperature=0.5))
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, :-1][torch.tensor(trainable[1:], dtype=torch.bool)]
    logp = torch.log_softmax(logits / 0.5, -1)
    want = float(-(logp.exp() * logp).sum(-1).mean())
    assert sums.values["entropy"] / sums.values["tokens"] == pytest.approx(want, rel=1e-4)


def test_behaviour_logprob_is_of_the_truncated_distribution() -> None:
    model = small_model()
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=4, seed=5)
    ids, _, behavior = sampled_rows(model, params, n=1)[0]
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float() / 0.9
    for pos in range(len(PROMPT), len(ids)):
        logp = torch.log_softmax(logits[pos - 1], -1)
        top = logp.topk(4).values
        want = float(logp[ids[pos]] - torch.logsumexp(top, -1))
        assert behavior[pos] == pytest.approx(want, abs=1e-4)
        assert behavior[pos] > float(logp[ids[pos]])  # the truncated mass is renormalized away


def test_kl_is_taken_at_the_sampling_temperature(tok: Tokenizer) -> None:
    torch.manual_seed(0)
    student = torch.randn(1, 6, 50, requires_grad=True)
    teacher = torch.randn(3, 50)
    traj = assistant_traj([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1], [0.0] * 6, split=3)
    traj.feedback = [Feedback(turn=1, kind="k", hint="read the test first")]
    hinted = build_hinted_turns([traj], tok)
    loss, kl_N = feedback_kl_loss(student, hinted, [teacher], [0], temperature=2.0)
    s = torch.log_softmax(student[0, 2:5].detach() / 2.0, -1)
    t = torch.log_softmax(teacher / 2.0, -1)
    want = (s.exp() * (s - t)).sum(-1)
    torch.testing.assert_close(kl_N, want, rtol=1e-5, atol=1e-6)


def test_ema_teacher_averages_expert_bias() -> None:
    policy = small_model()
    teacher = TeacherWeights(TeacherConfig(source="ema", ema_decay=0.5), policy)
    moe = next(policy.moe_layers())
    with torch.no_grad():
        moe.router.expert_bias.fill_(1.0)
    teacher.update(policy)
    bias = next(teacher.module.moe_layers()).router.expert_bias
    torch.testing.assert_close(bias, torch.full_like(bias, 0.5))


def test_log_ratio_clamp_and_dual_clip() -> None:
    logp = torch.tensor([0.0, 0.0, 0.0, float("-inf")], requires_grad=True)
    behavior = torch.tensor([-100.0, -100.0, -0.1, 0.0])  # log-ratios 100, 100, 0.1, -inf
    adv = torch.tensor([0.0, -1.0, 1.0, 0.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss, stats = ppo_clip_loss(logp, behavior, adv, mask, max_log_ratio=10.0, dual_clip=3.0)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    # token 1 (A = -1, ratio e^10) is bounded at 3 * |A|; token 2 is clipped at 1 + 0.28
    assert loss.item() == pytest.approx((3.0 - 1.0 * min(math.exp(0.1), 1.28)) / 3, rel=1e-5)
    assert all(math.isfinite(v) for v in stats.values())


# ---------------------------------------------------------------- the update step


def make_batch(trajectories, recipe: TrainRecipe, tok: Tokenizer, model) -> StepBatch:
    batch = StepBatch(step=0, trajectories=trajectories, rollout_stats=None, started=0.0)
    batch.advantages, batch.zero_var = trajectory_advantages(
        trajectories, recipe.rollout.group_size, recipe.rl
    )
    batch.keep = {
        k
        for k in range(len(trajectories))
        if not (recipe.rl.drop_zero_variance and batch.zero_var[k])
    }
    if recipe.teacher.beta > 0:
        batch.hinted = build_hinted_turns(trajectories, tok)
        batch.teachers = teacher_logits(model, batch.hinted)
    return batch


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(before, model) -> float:
    after = model.state_dict()
    return max(float((after[k].float() - v.float()).abs().max()) for k, v in before.items())


def group(model, rewards, *, hint: str = "") -> list[Trajectory]:
    params = SamplingParams(max_new_tokens=10, seed=11)
    out = []
    for (ids, trainable, behavior), r in zip(sampled_rows(model, params, n=len(rewards)), rewards):
        traj = assistant_traj(ids, trainable, behavior, reward=r)
        if hint:
            traj.feedback = [Feedback(turn=1, kind="unknown_tool", hint=hint)]
        out.append(traj)
    return out


def recipe(**rl) -> TrainRecipe:
    return TrainRecipe(
        rollout=RolloutConfig(group_size=2),
        rl=RLConfig(**rl),
        teacher=TeacherConfig(beta=1.0),
        optim=OptimConfig(name="adamw", lr=1e-2, weight_decay=0.1, adamw_weight_decay=0.1),
    )


@pytest.mark.parametrize("setting", [False, True])
def test_zero_signal_step_leaves_weights_unchanged(tok: Tokenizer, setting: bool) -> None:
    model = small_model()
    cfg = recipe(update_without_signal=setting)
    optimizer = build_optimizer(model, cfg.optim)
    batch = make_batch(group(model, [1.0, 1.0]), cfg, tok, model)
    before = snapshot(model)
    update_policy(model, optimizer, batch, cfg)
    assert batch.updated is setting
    if setting:  # weight decay and the bias update move the weights
        assert changed(before, model) > 0
    else:
        assert changed(before, model) == 0.0
        assert "loss" in batch.sums.values and batch.sums.values["tokens"] > 0


def test_dropped_zero_variance_group_keeps_its_hinted_kl(tok: Tokenizer) -> None:
    # an all-failed group with a hint: the hint is its only signal and must reach the weights
    model = small_model()
    cfg = recipe(drop_zero_variance=True)
    optimizer = build_optimizer(model, cfg.optim)
    teacher_model = small_model(seed=1)  # a teacher that differs from the student
    trajs = group(model, [0.0, 0.0], hint="Call one of the declared tools.")
    batch = make_batch(trajs, cfg, tok, model)
    batch.teachers = teacher_logits(teacher_model, batch.hinted)
    assert batch.keep == set() and len(batch.hinted) == 2
    before = snapshot(model)
    update_policy(model, optimizer, batch, cfg)
    assert batch.updated and changed(before, model) > 0
    assert batch.sums.values["kl_tokens"] == sum(len(h.student_targets) for h in batch.hinted)
    # the per-token KL is written into the trajectories for the viewer's heat map
    for traj, h in zip(trajs, batch.hinted):
        values = turn_kl(traj, 1)
        assert values is not None and len(values) == len(h.student_targets)
        assert all(v >= 0 for v in values) and max(values) > 0


def test_kl_and_ppo_share_one_token_mean(tok: Tokenizer) -> None:
    # one hinted turn among more unhinted tokens weighs less: its KL is divided by the same
    # token count as PPO, so beta's weight relative to PPO does not change with the batch
    model = small_model()
    teacher_model = small_model(seed=1)
    cfg = recipe()
    small = group(model, [1.0, 0.0], hint="Read the failing test.")
    big = small + group(model, [1.0, 0.0])
    results = []
    for trajs in (small, big):
        cfg.rollout.group_size = 2
        batch = make_batch(trajs, cfg, tok, model)
        batch.teachers = teacher_logits(teacher_model, batch.hinted)
        update_policy(model, build_optimizer(small_model(), cfg.optim), batch, cfg)
        results.append(batch.sums.values)
    for sums in results:
        tokens = sums["tokens"]
        assert sums["kl_loss"] == pytest.approx(sums["kl_sum"] / tokens, rel=1e-5)
    assert results[1]["tokens"] > results[0]["tokens"]


def test_pass_rate_counts_after_the_monitor() -> None:
    hacked = Trajectory(
        task_id="t",
        turns=[
            Turn(role="user", text="Re-implement slugify."),
            Turn(
                role="assistant",
                text="",
                tool_calls=[
                    ToolCall(name="bash", arguments={"command": "git log --all -p -- src/slug.py"})
                ],
            ),
            Turn(role="tool", text="commit ...", tool_name="bash"),
        ],
        reward=1.0,
    )
    clean = Trajectory(task_id="t", turns=[Turn(role="user", text="x")], reward=1.0)
    passed, stats = score_trajectories([hacked, clean], MonitorConfig())
    assert passed == [False, True]
    assert hacked.reward == 0.0


def test_measure_shift_reports_hinted_and_other_tokens(tok: Tokenizer) -> None:
    model = small_model()
    cfg = recipe(measure_shift=True)
    optimizer = build_optimizer(model, cfg.optim)
    trajs = group(model, [1.0, 0.0], hint="Call one of the declared tools.")
    trajs[1].feedback = []
    batch = make_batch(trajs, cfg, tok, model)
    batch.teachers = teacher_logits(small_model(seed=1), batch.hinted)
    update_policy(model, optimizer, batch, cfg)
    sums = batch.sums.values
    assert sums["shift_hinted_n"] == len(batch.hinted[0].student_targets)
    assert sums["shift_other_n"] > 0 and sums["shift_hinted"] > 0 and sums["shift_other"] > 0
    assert sums["teacher_minus_student_n"] == sums["shift_hinted_n"]


@pytest.mark.parametrize("span", ["turn", "to_divergence"])
def test_trainer_teach_applies_the_kl_span(tok: Tokenizer, span: str) -> None:
    # the trainer's teacher stage is where `teacher.kl_span` takes effect: with
    # "to_divergence" the hinted turns reach the update cut after the first token the hinted
    # teacher disprefers; with "turn" they stay whole
    student, teacher = small_model(), small_model(seed=1)
    cfg = TrainRecipe(
        rollout=RolloutConfig(group_size=2),
        teacher=TeacherConfig(beta=1.0, kl_span=span, divergence_nats=1e-6),
    )
    trajs = group(student, [0.0, 1.0], hint="Call one of the declared tools.")
    batch = StepBatch(step=0, trajectories=trajs, rollout_stats=None, started=0.0)
    run = SimpleNamespace(
        cfg=cfg, tok=tok, mcfg=student.cfg, teacher=SimpleNamespace(module=teacher)
    )
    RLRun.teach(run, batch)  # the stage itself, on a real teacher model
    whole = build_hinted_turns(trajs, tok, max_len=student.cfg.max_seq_len)
    got = [len(h.student_targets) for h in batch.hinted]
    assert [len(t) for t in batch.teachers] == got
    if span == "turn":
        assert got == [len(h.student_targets) for h in whole]
    else:
        cut, _ = cut_at_divergence(whole, teacher_logits(teacher, whole), trajs, margin=1e-6)
        assert got == [len(h.student_targets) for h in cut]
        # two random models disagree within ten tokens: the span is shorter than the turn
        assert sum(got) < sum(len(h.student_targets) for h in whole)
