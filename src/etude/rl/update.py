"""The policy update of one RL step: trajectories -> training rows -> PPO-clip + hinted KL.

``update_policy`` takes a scored ``StepBatch`` (advantages, kept groups, hinted turns and the
teacher's logits filled in by ``etude.rl.trainer.RLRun``) and runs ``rl.num_minibatches``
optimizer steps over it. The loss of a micro-batch (``minibatch_loss``) is token-level PPO-clip
against the behaviour logprobs the engine stored, plus ``teacher.beta`` x the KL to the hinted
teacher on the hinted turns' tokens (``etude.rl.teacher``), plus an optional KL to the initial
policy, every term divided by the same token count. Logprobs, entropy and the KL are taken
under the distribution the engine sampled (temperature, then top-k / top-p). A minibatch with no
gradient signal does not step (``rl.update_without_signal``).

``row_logprobs`` / ``logprob_shift`` measure (``rl.measure_shift``) how far an update moved the
hinted turns against the rest.

Legend: B trajectories in a micro-batch, T tokens, V vocabulary, N selected tokens, G group size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from etude.engine.sampling import sampling_logprobs
from etude.env.trajectory import Trajectory, is_infra_failure
from etude.rl.advantages import group_advantages
from etude.rl.losses import logprob_entropy, ppo_clip_loss
from etude.rl.recipe import RLConfig
from etude.rl.rollout import RolloutConfig
from etude.rl.teacher import HintedTurn, TeacherConfig, feedback_kl_loss
from etude.runtime import all_reduce_sum
from etude.tasks.record import TaskRecord

if TYPE_CHECKING:
    from etude.rl.recipe import TrainRecipe


def is_graded(trajectory: Trajectory) -> bool:
    """Whether the episode has a reward: not an infrastructure failure (reward None)."""
    return trajectory.reward is not None and not is_infra_failure(trajectory)


# ---------------------------------------------------------------- batches


@dataclass(kw_only=True, slots=True)
class Row:
    """One trajectory as training tensors (ids cut after the last trainable token)."""

    ids: list[int]
    trainable: list[int]
    behavior: list[float]
    advantage: float


def trajectory_row(traj: Trajectory, advantage: float) -> Row:
    ids = traj.token_ids
    trainable = [m for t in traj.turns for m in t.trainable]
    behavior = [x for t in traj.turns for x in t.logprobs]
    assert len(ids) == len(trainable) == len(behavior)
    last = max((k for k, m in enumerate(trainable) if m), default=0)
    end = last + 1
    return Row(
        ids=ids[:end], trainable=trainable[:end], behavior=behavior[:end], advantage=advantage
    )


def collate(rows: Sequence[Row], device: torch.device) -> dict[str, Tensor]:
    """Right-padded [B, T] ids, mask, behavior logprobs and per-token advantages."""
    length = max(len(r.ids) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    behavior = torch.zeros(len(rows), length)
    for b, r in enumerate(rows):
        n = len(r.ids)
        ids[b, :n] = torch.tensor(r.ids)
        mask[b, :n] = torch.tensor(r.trainable, dtype=torch.bool)
        behavior[b, :n] = torch.tensor(r.behavior)
    adv = mask.float() * torch.tensor([r.advantage for r in rows])[:, None]
    return {
        "ids_BT": ids.to(device),
        "mask_BT": mask.to(device),
        "behavior_BT": behavior.to(device),
        "adv_BT": adv.to(device),
    }


def token_logprobs(
    logits_BTV: Tensor,
    ids_BT: Tensor,
    temperature: float = 1.0,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Tensor:
    """log p(ids[t] | ids[<t]) at t >= 1, fp32 [B, T-1] (from the logits at t - 1), under the
    distribution the engine samples with these settings (``etude.engine.sampling``)."""
    B, T, V = logits_BTV.shape
    logp_NV = sampling_logprobs(
        logits_BTV[:, :-1].reshape(-1, V), temperature, top_k=top_k, top_p=top_p
    )
    return logp_NV.gather(-1, ids_BT[:, 1:].reshape(-1, 1)).view(B, T - 1)


def trajectory_advantages(
    trajectories: Sequence[Trajectory], group_size: int, cfg: RLConfig
) -> tuple[list[float], list[bool]]:
    """Per trajectory: its group-relative advantage, and whether its group had zero variance."""
    assert len(trajectories) % group_size == 0
    rewards_NG = torch.tensor([float(t.reward or 0.0) for t in trajectories]).view(-1, group_size)
    # an infra outcome (the grader could not grade) is masked from the group's statistics
    valid_NG = torch.tensor([is_graded(t) for t in trajectories]).view(-1, group_size)
    adv = group_advantages(rewards_NG, normalize_std=cfg.normalize_std, valid_NG=valid_NG)
    zero = adv.zero_variance_N[:, None].expand(-1, group_size).reshape(-1).tolist()
    adv_NG = adv.advantages_NG
    if cfg.negative_advantage_scale != 1.0:
        adv_NG = torch.where(adv_NG < 0, adv_NG * cfg.negative_advantage_scale, adv_NG)
    return adv_NG.reshape(-1).tolist(), zero


# ---------------------------------------------------------------- the loss


@dataclass(kw_only=True, slots=True)
class StepSums:
    """Sums over a step's micro-batches (and ranks), to become the step's metrics."""

    values: Counter = field(default_factory=Counter)

    def add(self, **kv: float) -> None:
        for k, v in kv.items():
            self.values[k] += float(v)


def minibatch_loss(
    model: nn.Module,
    rows: Sequence[Row],
    hinted: Sequence[HintedTurn],
    teachers: Sequence[Tensor | None],
    hint_rows: Sequence[int],
    *,
    rl: RLConfig,
    teacher_cfg: TeacherConfig,
    num_tokens: int,
    reference: nn.Module | None,
    device: torch.device,
    sums: StepSums,
    rollout: RolloutConfig | None = None,
    kl_values: dict[tuple[int, int], list[float]] | None = None,
) -> Tensor:
    """Loss of one micro-batch: PPO-clip + beta * hinted KL (+ ref KL); sums updated.

    ``num_tokens``: the loss-carrying tokens of the whole minibatch on all ranks (trainable
    tokens of kept rows plus hinted targets of dropped rows): the one normalizer of every term,
    so that ``beta`` weighs a hinted token against a PPO token the same way at every step.
    ``hint_rows[k]``: row of ``hinted[k]`` in ``rows``. ``rollout``: the sampling settings
    (temperature, top-p, top-k) whose transform the recomputed logprobs, the entropy and the KL
    apply (default: plain softmax). ``kl_values`` receives each hinted turn's per-token KL under
    the key (trajectory index, turn index).
    """
    temperature = rollout.temperature if rollout is not None else 1.0
    top_p = rollout.top_p if rollout is not None else 1.0
    top_k = rollout.top_k if rollout is not None else 0
    batch = collate(rows, device)
    logits_BTV = model(batch["ids_BT"])
    mask_BT = batch["mask_BT"][:, 1:]
    # the sampled distribution of every trainable position: temperature, then top-k / top-p
    logp_NV = sampling_logprobs(logits_BTV[:, :-1][mask_BT], temperature, top_k=top_k, top_p=top_p)
    targets_N = batch["ids_BT"][:, 1:][mask_BT]
    logp_N = logp_NV.gather(-1, targets_N[:, None])[:, 0]
    behavior_N = batch["behavior_BT"][:, 1:][mask_BT]
    adv_N = batch["adv_BT"][:, 1:][mask_BT]
    ones_N = torch.ones_like(logp_N)
    pg_loss, stats = ppo_clip_loss(
        logp_N,
        behavior_N,
        adv_N,
        ones_N,
        clip_low=rl.clip_low,
        clip_high=rl.clip_high,
        num_tokens=num_tokens,
        max_log_ratio=rl.max_log_ratio,
        dual_clip=rl.dual_clip,
    )
    n = float(len(logp_N))
    with torch.no_grad():
        entropy_N = logprob_entropy(logp_NV)
    sums.add(
        pg_loss=pg_loss.item(),
        tokens=n,
        entropy=float(entropy_N.sum()),
        clip_frac=stats["clip_frac"] * n,
        ratio=stats["ratio_mean"] * n,
        behavior_kl=stats["approx_kl_behavior"] * n,
    )
    loss = pg_loss
    if teacher_cfg.beta > 0 and hinted:
        kl_loss, kl_N = feedback_kl_loss(
            logits_BTV,
            hinted,
            teachers,
            hint_rows,
            kind=teacher_cfg.kl_kind,
            topk=teacher_cfg.topk,
            num_tokens=num_tokens,
            temperature=temperature,
        )
        loss = loss + teacher_cfg.beta * kl_loss
        sums.add(kl_loss=kl_loss.item(), kl_sum=float(kl_N.sum()), kl_tokens=len(kl_N))
        if kl_values is not None:
            start = 0
            for h in hinted:
                end = start + len(h.student_targets)
                kl_values[(h.row, h.turn)] = [round(float(v), 6) for v in kl_N[start:end]]
                start = end
    if reference is not None and rl.ref_kl_coef > 0:
        with torch.no_grad():
            ref_logits_NV = reference(batch["ids_BT"])[:, :-1][mask_BT]
            ref_logp_N = sampling_logprobs(
                ref_logits_NV, temperature, top_k=top_k, top_p=top_p
            ).gather(-1, targets_N[:, None])[:, 0]
        # k3 estimator of KL(policy || reference) on sampled tokens (Schulman 2020, "Approximating KL")
        log_r_N = (ref_logp_N - logp_N).clamp(-rl.max_log_ratio, rl.max_log_ratio)
        ref_kl_N = torch.exp(log_r_N) - log_r_N - 1
        ref_loss = ref_kl_N.sum() / float(max(num_tokens, 1))
        loss = loss + rl.ref_kl_coef * ref_loss
        sums.add(ref_kl=float(ref_kl_N.detach().sum()))
    return loss


# ---------------------------------------------------------------- the update


def loss_tokens(rows: dict[int, Row], hinted: Sequence[HintedTurn], keep: set[int]) -> dict:
    """Per trajectory: its loss-carrying tokens (trainable tokens if kept, else its hinted
    targets), and whether it carries gradient signal (a non-zero advantage on a kept row, or a
    non-empty hint)."""
    tokens = {k: (sum(r.trainable[1:]) if k in keep else 0) for k, r in rows.items()}
    signal = {k: k in keep and rows[k].advantage != 0.0 and tokens[k] > 0 for k in rows}
    for h in hinted:
        if h.row not in keep:
            tokens[h.row] += len(h.student_targets)
        if h.num_hint_ids > 0:
            signal[h.row] = True
    return {"tokens": tokens, "signal": signal}


@dataclass(kw_only=True, slots=True)
class StepBatch:
    """What one RL step carries from stage to stage (``RLRun.run_step``)."""

    step: int
    """0-based index of the step (the step number logged is ``step + 1``)."""
    trajectories: list[Trajectory]
    rollout_stats: Any
    started: float
    passed: list[bool] = field(default_factory=list)
    monitor_stats: Any = None
    spawned: list[TaskRecord] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    zero_var: list[bool] = field(default_factory=list)
    keep: set[int] = field(default_factory=set)
    hinted: list[HintedTurn] = field(default_factory=list)
    teachers: list[Tensor | None] = field(default_factory=list)
    sums: StepSums = field(default_factory=StepSums)
    kl_values: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    grad_norm: float = 0.0
    updated: bool = False
    """Whether the optimizer stepped (False: no gradient signal, weights left as they were)."""
    num_minibatches: int = 1
    train_seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    """Metrics of the pipeline, the weight sync and infrastructure failures (``async/*``,
    ``sync/*``, ``infra/*``)."""
    metrics: dict[str, float] = field(default_factory=dict)


def update_policy(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: StepBatch,
    cfg: TrainRecipe,
    *,
    reference: nn.Module | None = None,
    device: torch.device | None = None,
    world_size: int = 1,
) -> None:
    """``rl.num_minibatches`` optimizer steps over a scored batch (advantages, keep, hinted
    turns and teacher logits filled in); sets ``batch.updated``, ``grad_norm``, ``sums`` and
    writes each hinted turn's per-token KL into its trajectory (``info["kl"]``, the viewer's
    heat map).

    A minibatch without gradient signal (every advantage zero or dropped, no non-empty hint,
    no reference KL) leaves the weights, the optimizer state and the MoE balance as they were,
    unless ``rl.update_without_signal``: decoupled weight decay, momentum and the bias update
    would otherwise move a policy that nothing asked to move. Its forward still runs (no grad)
    for the step's metrics.
    """
    device = device or next(model.parameters()).device
    trajectories = batch.trajectories
    rows = {
        k: trajectory_row(trajectories[k], batch.advantages[k]) for k in range(len(trajectories))
    }
    info = loss_tokens(rows, batch.hinted, batch.keep)
    before = (
        row_logprobs(model, rows, cfg, device) if cfg.rl.measure_shift and batch.hinted else None
    )
    # same split on every rank: every rank holds the same number of trajectories
    order = list(range(len(trajectories)))
    minibatches = [order[i :: cfg.rl.num_minibatches] for i in range(cfg.rl.num_minibatches)]
    batch.num_minibatches = len(minibatches)
    for minibatch in minibatches:
        local_tokens = sum(info["tokens"][k] for k in minibatch)
        local_signal = sum(1 for k in minibatch if info["signal"][k])
        num_tokens, num_signal = (int(x) for x in all_reduce_sum([local_tokens, local_signal]))
        step_it = num_signal > 0 or reference is not None or cfg.rl.update_without_signal
        optimizer.zero_grad(set_to_none=True)
        for i in range(0, len(minibatch), cfg.rl.micro_batch_size):
            micro = minibatch[i : i + cfg.rl.micro_batch_size]
            micro_rows = [rows[k] if k in batch.keep else masked_row(rows[k]) for k in micro]
            where = {k: b for b, k in enumerate(micro)}
            sel = [j for j, h in enumerate(batch.hinted) if h.row in where]
            with torch.set_grad_enabled(step_it):
                loss = minibatch_loss(
                    model,
                    micro_rows,
                    [batch.hinted[j] for j in sel],
                    [batch.teachers[j] for j in sel],
                    [where[batch.hinted[j].row] for j in sel],
                    rl=cfg.rl,
                    teacher_cfg=cfg.teacher,
                    num_tokens=num_tokens,
                    reference=reference,
                    device=device,
                    sums=batch.sums,
                    rollout=cfg.rollout,
                    kl_values=batch.kl_values,
                )
            if step_it:
                # FSDP averages gradients over ranks; the loss is already a global mean
                (loss * world_size).backward()
            batch.sums.add(loss=loss.item())
        if not step_it:
            for moe in model.moe_layers():  # the balance counts of a step not taken
                moe.tokens_per_expert.zero_()
            continue
        clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        batch.grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
        batch.updated = True
        if world_size > 1:  # the balancing update needs the load of the global batch
            for moe in model.moe_layers():
                dist.all_reduce(moe.tokens_per_expert)
        model.update_expert_bias()
    for (row, turn), values in batch.kl_values.items():
        trajectories[row].info.setdefault("kl", {})[str(turn)] = values
    if before is not None and batch.updated:
        after = row_logprobs(model, rows, cfg, device)
        batch.sums.add(**logprob_shift(rows, batch.hinted, batch.teachers, before, after, cfg))


@torch.no_grad()
def row_logprobs(
    model: nn.Module, rows: dict[int, Row], cfg: TrainRecipe, device: torch.device
) -> dict[int, Tensor]:
    """Per row, the policy's logprob [T-1] of every next token under the sampled distribution
    (``rl.measure_shift``: once before and once after the update)."""
    was_training = model.training
    model.eval()
    out = {}
    r = cfg.rollout
    try:
        for k, row in rows.items():
            ids_BT = torch.tensor([row.ids], device=device)
            out[k] = token_logprobs(
                model(ids_BT), ids_BT, r.temperature, top_k=r.top_k, top_p=r.top_p
            )[0].cpu()
    finally:
        model.train(was_training)
    return out


def logprob_shift(
    rows: dict[int, Row],
    hinted: Sequence[HintedTurn],
    teachers: Sequence[Tensor | None],
    before: dict[int, Tensor],
    after: dict[int, Tensor],
    cfg: TrainRecipe,
) -> dict[str, float]:
    """Sums (over tokens) of how far the update moved the policy on hinted-turn tokens and on
    every other generated token (``|logp_after - logp_before|``), and of how much more (or
    less) likely the hinted teacher found the student's own tokens at the hinted turns
    (``teacher logp - student logp`` before the update: negative = the teacher disprefers what
    the student did there). Metrics ``shift/hinted``, ``shift/other``, ``teacher_minus_student``
    are these sums over their token counts."""
    hinted_pos = {(h.row, t) for h in hinted for t in h.student_targets}
    sums = {"shift_hinted": 0.0, "shift_hinted_n": 0.0, "shift_other": 0.0, "shift_other_n": 0.0}
    for k, row in rows.items():
        delta = (after[k] - before[k]).abs()
        for t, m in enumerate(row.trainable):
            if t == 0 or not m:
                continue
            key = "shift_hinted" if (k, t) in hinted_pos else "shift_other"
            sums[key] += float(delta[t - 1])
            sums[key + "_n"] += 1.0
    pref, n = 0.0, 0
    for h, teacher in zip(hinted, teachers):
        if teacher is None:
            continue
        ids = rows[h.row].ids
        targets = torch.tensor([ids[t] for t in h.student_targets])
        r = cfg.rollout
        logp_t = sampling_logprobs(teacher, r.temperature, top_k=r.top_k, top_p=r.top_p)
        picked = logp_t.gather(-1, targets[:, None])[:, 0]
        student = torch.stack([before[h.row][t - 1] for t in h.student_targets])
        finite = torch.isfinite(picked) & torch.isfinite(student)
        pref += float((picked - student)[finite].sum())
        n += int(finite.sum())
    sums["teacher_minus_student"] = pref
    sums["teacher_minus_student_n"] = float(n)
    return sums


def masked_row(row: Row) -> Row:
    """A row that contributes nothing (a dropped zero-variance group keeps the forward count)."""
    return Row(ids=row.ids, trainable=[0] * len(row.ids), behavior=row.behavior, advantage=0.0)
