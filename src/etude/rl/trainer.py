"""The RL trainer (``etude train RECIPE``): rollouts, feedback, GRPO-style loss with a hinted KL.

One step (``RLRun.run_step``: ``rollout`` -> ``score`` -> ``advantages`` -> ``teach`` ->
``update`` -> ``log`` -> ``checkpoint``), on every data-parallel rank (the trainer never
assumes one rank):

1. **tasks**: ``rollout.tasks_per_step`` tasks drawn from (seed, step); rank r takes its share;
   with the curriculum, rank 0 draws from its pool and broadcasts the records, and every
   ``tasks.spawn_every`` steps the pool spawns validated variants of mastered and never-solved
   tasks from ``tasks.repo`` (``etude.tasks.build.TaskFactory``, made on first need);
2. **rollout** (``etude.rl.rollout`` through ``etude.rl.pipeline``): G episodes per task with
   the rollout backend (the engine in this process, or a server); with
   ``rollout.max_staleness = k > 0`` the batches of the next k steps run while this one trains,
   and environments run on threads here or on Ray actors (``rollout.workers``);
3. **score**: the monitor (``etude.monitor.hook.apply_monitor``) flags hacks and zeroes their
   reward, then pass/fail and the curriculum's statistics are taken;
4. **feedback** (``etude.rl.feedback``): detectors attach hints to the turns that need one;
5. **advantages** (``etude.rl.advantages``): group-relative per task, broadcast to the
   trajectory's generated tokens; zero-variance groups counted (and dropped if configured);
6. **teacher** (``etude.rl.teacher``): one no-grad forward of the teacher weights on the hinted
   sequences, logits kept at the hinted turns' targets only (before any update, so the default
   teacher is exactly the rollout policy);
7. **update** (``update_policy``): the batch is split into ``rl.num_minibatches`` optimizer
   steps (Muon + AdamW); each accumulates micro-batches of ``rl.micro_batch_size``
   trajectories. Logprobs, entropy and KL are taken under the distribution the engine sampled
   (temperature, top-k/top-p). Loss per minibatch: token-level PPO-clip against the behavior
   logprobs (log-ratio clamped, dual clip) + ``teacher.beta`` x the KL on hinted turns +
   ``rl.ref_kl_coef`` x a KL to the initial policy (k3 estimator, off by default), every term
   divided by the same count (the minibatch's loss-carrying tokens on all ranks). A minibatch
   without gradient signal does not step (``rl.update_without_signal``);
8. **weights to the engine** (``etude.rl.weight_sync``: in process, by file, or over HTTP to the
   server; nothing when the engine runs the policy module itself), EMA teacher update, metrics
   (rank 0 prints, JSONL always), checkpoint.

Data parallel: under ``torchrun`` the policy is sharded with FSDP2 (``fully_shard`` per block and
at the root). The engine, the teacher and the reference are plain modules holding full weights
on every rank, because generation runs a different number of forwards on each rank. Every rank
has the same number of trajectories, hence the same number of sharded forwards. Losses are
normalized by global token counts and scaled by the world size (FSDP averages gradients).

Resume: a checkpoint holds model and optimizer (DCP), the step, the torch RNG, the EMA teacher
and the curriculum pool (``tasks.curriculum``); task draws and sampling seeds are functions of
(seed, step) and that state, so a resumed run continues the same run.

Not here: sequence packing; rollout workers that hold their own engine in another process.

Legend: B trajectories in a micro-batch, T tokens, V vocabulary, N selected tokens, G group size.
"""

from __future__ import annotations

import copy
import math
import random
import shutil
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from etude.config import to_dict
from etude.engine.sampling import sampling_logprobs
from etude.env.coding import EnvConfig
from etude.env.trajectory import ERROR_KINDS, Trajectory, is_infra_failure, write_jsonl
from etude.model.chat_family import check_rl_chat_format, policy_chat_format
from etude.monitor.hook import MonitorConfig
from etude.optim import OptimConfig
from etude.rl.advantages import group_advantages
from etude.rl.feedback import FeedbackConfig, apply_detectors, build_detectors
from etude.rl.losses import logprob_entropy, ppo_clip_loss
from etude.rl.pipeline import (
    RolloutPipeline,
    batch_metrics,
    check_staleness,
    make_backend,
    make_env_pool,
    separate_engine_needed,
)
from etude.rl.rollout import RolloutConfig
from etude.rl.teacher import (
    HintedTurn,
    TeacherConfig,
    TeacherWeights,
    build_hinted_turns,
    copy_full_weights,
    feedback_kl_loss,
    teacher_logits,
)
from etude.rl.weight_sync import build_weight_sync
from etude.runtime import all_reduce_sum, init_distributed, lr_factor, world
from etude.tasks.build import TaskBuildConfig, TaskFactory
from etude.tasks.curriculum import CurriculumConfig, TaskPool
from etude.tasks.record import TaskRecord


@dataclass(kw_only=True, slots=True)
class TasksConfig:
    """The ``[tasks]`` section: where the training tasks come from."""

    path: str = "examples/tasks/handwritten/tasks.jsonl"
    """A tasks.jsonl file; relative workspaces resolve against its directory."""
    limit: int = 0
    """Use only the first ``limit`` tasks (0 = all)."""
    curriculum: bool = False
    """Draw tasks from the curriculum's pool (``etude.tasks.curriculum``, state in
    RUN/pool.json, saved with each checkpoint) instead of uniformly."""
    repo: str = ""
    """Source repository the tasks were built from; when set with ``curriculum`` on, the pool
    spawns harder variants of mastered tasks and easier variants of never-solved ones during the
    run (``etude.tasks.build.TaskFactory`` validates each; workspaces in RUN/variants/);
    '' = no spawning."""
    spawn_every: int = 5
    """Steps between spawn checks (with ``repo``)."""
    build: TaskBuildConfig = field(default_factory=TaskBuildConfig)
    """How variants are built and validated (``[tasks.build]``; ``variants_per_task`` caps the
    variants of one task per spawn)."""

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"tasks.limit={self.limit} must be >= 0 (0 = all)")
        if self.spawn_every < 1:
            raise ValueError(f"tasks.spawn_every={self.spawn_every} must be >= 1 (steps)")
        if self.repo and not self.curriculum:
            warnings.warn(
                f"tasks.repo={self.repo!r} is ignored without tasks.curriculum=true (variants "
                "are spawned by the curriculum's pool)",
                stacklevel=2,
            )


@dataclass(kw_only=True, slots=True)
class RLConfig:
    """The ``[rl]`` section: advantages and the policy loss."""

    clip_low: float = 0.2
    """PPO ratio clip below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = 0.28
    """PPO ratio clip above 1 (ratio <= 1 + clip_high; "clip-higher")."""
    normalize_std: bool = False
    """Divide group-centred rewards by the group's std."""
    drop_zero_variance: bool = False
    """Leave groups whose rewards are all equal out of the loss (they have zero advantage)."""
    num_minibatches: int = 1
    """Optimizer steps per rollout batch (1: fully on-policy)."""
    micro_batch_size: int = 4
    """Trajectories per forward/backward (gradient accumulation inside a minibatch)."""
    ref_kl_coef: float = 0.0
    """Weight of a KL to the initial policy on every trainable token (0 = off)."""
    max_log_ratio: float = 10.0
    """Clamp of the log importance ratio (a stale or off-support token can not make the loss
    NaN or the step huge)."""
    dual_clip: float = 3.0
    """Bound of a negative-advantage token's loss at ``dual_clip * |A|`` (dual-clip PPO; 0 = off,
    else > 1)."""
    measure_shift: bool = False
    """Measure (two extra no-grad forwards per step) how far the update moves the policy's
    logprobs on hinted-turn tokens vs the other generated tokens, and whether the hinted teacher
    disprefers the student's tokens there (metrics ``shift/*``, ``teacher_minus_student``)."""
    update_without_signal: bool = False
    """Take the optimizer step (weight decay, momentum, MoE bias balance) also when the batch
    carries no gradient signal (all advantages zero or dropped, no hint, no reference KL)."""

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"rl.clip_low={self.clip_low} must lie in [0, 1)")
        if not self.clip_high >= 0:
            raise ValueError(f"rl.clip_high={self.clip_high} must be >= 0")
        if self.num_minibatches < 1 or self.micro_batch_size < 1:
            raise ValueError("rl.num_minibatches and rl.micro_batch_size must be >= 1")
        if not self.ref_kl_coef >= 0:
            raise ValueError(f"rl.ref_kl_coef={self.ref_kl_coef} must be >= 0 (0 = off)")
        if not self.max_log_ratio > 0:
            raise ValueError(f"rl.max_log_ratio={self.max_log_ratio} must be > 0, e.g. 10")
        if self.dual_clip != 0 and not self.dual_clip > 1:
            raise ValueError(f"rl.dual_clip={self.dual_clip} must be > 1 (e.g. 3) or 0 (off)")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The ``[train]`` section: length, init, bookkeeping."""

    steps: int = 20
    """RL steps (one rollout batch each); a resumed run stops at the same step."""
    init: str = ""
    """Run directory of the warm start (``etude sft``): its export/ and tokenizer/ ('' = none)."""
    seed: int = 0
    """Seeds task draws, sampling and (without init) weight init."""
    warmup_steps: int = 0
    """Linear learning-rate warmup, then ``lr_schedule``."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: ``constant``, or ``cosine`` decay to 0 at ``steps``."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 turns clipping off."""
    log_every: int = 1
    """Steps between console step lines (metrics go to JSONL every step)."""
    checkpoint_every: int = 10
    """Steps between checkpoints (and one at the end)."""
    save_trajectories: bool = True
    """Write each step's trajectories to RUN/trajectories/step_N.jsonl (per rank under torchrun)."""
    run_dir: str = "runs/rl"
    """Directory for config, metrics, trajectories, checkpoints and the export."""
    device: str = "auto"
    """``auto`` (cuda when available, else cpu), ``cpu`` or ``cuda``."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"train.steps={self.steps} must be >= 1")
        if self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps={self.warmup_steps} must be >= 0")
        if self.log_every < 1 or self.checkpoint_every < 1:
            raise ValueError("train.log_every and train.checkpoint_every must be >= 1")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"train.lr_schedule={self.lr_schedule!r}: use constant or cosine")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.device={self.device!r}: use auto, cpu or cuda")
        if self.init.startswith("hf:"):
            from etude.parallel.checkpoint import check_hf_init

            check_hf_init(self.init)
        elif self.init and not (Path(self.init) / "export" / "model.safetensors").is_file():
            raise ValueError(
                f"train.init={self.init!r} has no export/model.safetensors; pass a run directory "
                "written by `etude sft` (or leave train.init empty to start from scratch)"
            )
        check_rl_chat_format(self.init)


@dataclass(kw_only=True, slots=True)
class TrainRecipe:
    """An RL recipe: ``configs/rl-tiny.toml`` and friends."""

    model: dict[str, Any] = field(default_factory=lambda: {"preset": "tiny"})
    """Model shape when ``train.init`` is empty (``preset`` + field overrides)."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Pool rules when ``tasks.curriculum`` is on."""


# ---------------------------------------------------------------- data parallel


def shard_policy(model: nn.Module) -> None:
    """FSDP2 over all ranks: each transformer block, then the root (embedding, norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)


# ---------------------------------------------------------------- tasks


def sample_tasks(
    tasks: Sequence[TaskRecord],
    num: int,
    *,
    seed: int,
    step: int,
    pool: TaskPool | None = None,
) -> list[TaskRecord]:
    """``num`` tasks for ``step``, from (seed, step): the curriculum's weighted draw when a
    ``pool`` is given, else uniform without replacement while the tasks last."""
    rng = random.Random(f"tasks:{seed}:{step}")
    if pool is not None:
        return pool.sample(num, rng)
    if num <= len(tasks):
        return rng.sample(list(tasks), num)
    return [rng.choice(list(tasks)) for _ in range(num)]


def broadcast_task_records(records: list[TaskRecord]) -> list[TaskRecord]:
    """Rank 0's drawn records on every rank.

    The curriculum pool lives on rank 0 and grows variants the other ranks never loaded, so the
    records themselves travel, not ids. Their workspaces are absolute paths on rank 0: spawned
    variants need a file system all ranks share (one node, or RUN/ on a shared mount).
    """
    if world()[1] == 1:
        return records
    box: list[Any] = [[r.to_json() for r in records]]
    dist.broadcast_object_list(box, src=0)
    return [TaskRecord.from_json(line) for line in box[0]]


class LazyTaskFactory:
    """A ``TaskFactory`` made (export + baseline runs of the suite) on first use only: most spawn
    checks find nothing to spawn, and a run that never masters or gives up on a task should not
    pay for the baseline. Use as a context manager; closing an unused one is free."""

    def __init__(self, repo: str | Path, out_dir: str | Path, cfg: TaskBuildConfig) -> None:
        self.repo = repo
        self.out_dir = out_dir
        self.cfg = cfg
        self.factory: TaskFactory | None = None

    def get(self) -> TaskFactory:
        if self.factory is None:
            factory = TaskFactory(self.repo, self.out_dir, self.cfg)
            factory.prepare()
            self.factory = factory
        return self.factory

    def close(self) -> None:
        if self.factory is not None:
            self.factory.close()
            self.factory = None

    def __enter__(self) -> LazyTaskFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn_pending(pool: TaskPool) -> bool:
    """Whether ``pool.maybe_spawn`` would ask a builder for variants (the rules of
    ``TaskPool.maybe_spawn``: mastered or unsolved, not yet asked, below ``max_generation``)."""
    return any(
        s.generation < pool.cfg.max_generation
        and (
            (s.status == "retired" and not s.spawned_harder)
            or (s.status == "unsolved" and not s.spawned_easier)
        )
        for s in pool.stats_by_id.values()
    )


def spawn_variants(
    task_pool: TaskPool,
    factory_getter: Callable[[], TaskFactory],
    step: int,
    cfg: TasksConfig,
) -> list[TaskRecord]:
    """Variants added to the pool after ``step`` steps: every ``cfg.spawn_every`` steps, with
    ``cfg.repo`` and ``cfg.curriculum`` set, when some task is due for variants. The factory is
    asked for only then (``factory_getter`` may build it lazily)."""
    if not (cfg.curriculum and cfg.repo) or step % cfg.spawn_every != 0:
        return []
    if not spawn_pending(task_pool):
        return []
    return task_pool.maybe_spawn(factory_getter())


def _graded(trajectory: Trajectory) -> bool:
    """Whether the episode has a reward: not an infrastructure failure (reward None)."""
    return trajectory.reward is not None and not is_infra_failure(trajectory)


def gather_group_rewards(
    trajectories: Sequence[Trajectory], group_size: int
) -> list[tuple[str, list[float]]]:
    """(task id, rewards) of every group of every rank, in rank order."""
    mine = [
        (
            trajectories[i].task_id,
            # an ungraded rollout (an infra outcome, reward None) is no evidence of difficulty
            [float(t.reward) for t in trajectories[i : i + group_size] if _graded(t)],
        )
        for i in range(0, len(trajectories), group_size)
    ]
    if world()[1] == 1:
        return mine
    gathered: list[Any] = [None] * world()[1]
    dist.all_gather_object(gathered, mine)
    return [group for part in gathered for group in part]


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
    valid_NG = torch.tensor([_graded(t) for t in trajectories]).view(-1, group_size)
    adv = group_advantages(rewards_NG, normalize_std=cfg.normalize_std, valid_NG=valid_NG)
    zero = adv.zero_variance_N[:, None].expand(-1, group_size).reshape(-1).tolist()
    return adv.advantages_NG.reshape(-1).tolist(), zero


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


# ---------------------------------------------------------------- the run, stage by stage


def _error_rates(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    turns = sum(1 for t in trajectories for _ in t.assistant_turns())
    counts = Counter(
        e.kind for t in trajectories for _, turn in t.assistant_turns() for e in turn.errors
    )
    return {"turns": float(turns), **{f"err/{k}": float(counts.get(k, 0)) for k in ERROR_KINDS}}


def _lr_factor(step: int, cfg: TrainConfig) -> float:
    return lr_factor(
        step, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps, schedule=cfg.lr_schedule
    )


def score_trajectories(
    trajectories: Sequence[Trajectory], cfg: MonitorConfig
) -> tuple[list[bool], Any]:
    """The monitor first (it zeroes hacked rewards), then which episodes passed."""
    from etude.monitor.hook import apply_monitor

    mstats = apply_monitor(list(trajectories), cfg)
    passed = [float(t.reward or 0.0) >= 1.0 for t in trajectories]
    return passed, mstats


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
            micro_rows = [rows[k] if k in batch.keep else _masked(rows[k]) for k in micro]
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


class RLRun:
    """One RL run: the state that lives across steps, and one method per stage of a step.

    ``run_step(step)`` = ``rollout`` -> ``score`` -> ``advantages`` -> ``teach`` -> ``update``
    -> ``log`` -> ``checkpoint``. Use as a context manager (it holds the env pool, the progress
    bar and the variant factory); ``finish`` exports the final policy.
    """

    def __init__(
        self,
        cfg: TrainRecipe,
        *,
        on_step: Callable[[int, nn.Module], dict[str, float]] | None = None,
    ) -> None:
        from contextlib import ExitStack

        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        from etude.engine import Engine
        from etude.optim import build_optimizer
        from etude.report.metrics import MetricsLogger, prepare_run_dir
        from etude.rl.sft import load_policy
        from etude.tasks.record import load_tasks

        self.cfg = cfg
        self.on_step = on_step
        tc = cfg.train
        self.device, self.rank, self.world_size = init_distributed(tc.device)
        rank, world_size = self.rank, self.world_size
        if cfg.rollout.tasks_per_step % world_size:
            raise ValueError(
                f"rollout.tasks_per_step={cfg.rollout.tasks_per_step} must be a multiple of the "
                f"world size ({world_size}); every rank rolls out the same number of groups"
            )
        self.run_dir = run_dir = Path(tc.run_dir)
        if rank == 0:
            prepare_run_dir(run_dir, to_dict(cfg))
        if world_size > 1:
            dist.barrier()

        # under torchrun an hf: init loads straight into each rank's FSDP2 shards; the engine
        # below still needs the full weights (every rank generates with a plain module)
        sharded_init = world_size > 1 and tc.init.startswith("hf:")
        if sharded_init:
            from etude.parallel.checkpoint import load_hf_model, load_hf_policy

            self.model, self.tok, self.mcfg = load_hf_policy(
                tc.init[3:], device=self.device, shard=shard_policy
            )
            if self.tok.vocab_size > self.mcfg.vocab_size:
                raise ValueError(
                    f"train.init={tc.init!r}: the tokenizer has {self.tok.vocab_size} ids but "
                    f"the model {self.mcfg.vocab_size}; use the checkpoint's own tokenizer"
                )
        else:
            self.model, self.tok, self.mcfg = load_policy(
                tc.init, cfg.model, run_dir, device=self.device, seed=tc.seed
            )
        if cfg.env.max_tokens > self.mcfg.max_seq_len:
            raise ValueError(
                f"env.max_tokens={cfg.env.max_tokens} exceeds model.max_seq_len="
                f"{self.mcfg.max_seq_len}; lower env.max_tokens (episodes must fit the model)"
            )
        self.task_path = Path(cfg.tasks.path)
        tasks = load_tasks(self.task_path)
        if cfg.tasks.limit:
            tasks = tasks[: cfg.tasks.limit]
        if not tasks:
            raise ValueError(f"tasks.path={cfg.tasks.path!r} holds no tasks")
        self.tasks = tasks
        self.task_pool = self._load_pool()

        # plain full-weight modules for generation, teacher and reference (see the docstring)
        model = self.model
        separate = separate_engine_needed(cfg.rollout, world_size)
        if sharded_init:  # the policy is sharded already: the engine's weights from the files
            self.engine_model = load_hf_model(tc.init[3:], device=self.device)[0]
        else:
            self.engine_model = copy.deepcopy(model) if separate else model
        self.teacher = TeacherWeights(cfg.teacher, self.engine_model)
        self.reference = None
        if cfg.rl.ref_kl_coef > 0:
            self.reference = copy.deepcopy(self.engine_model).requires_grad_(False).eval()
        if world_size > 1 and not sharded_init:
            shard_policy(model)
        self.optimizer = build_optimizer(model, cfg.optim)
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.engine = Engine(
            self.engine_model, max_seq_len=cfg.env.max_tokens, decode_fn=self.tok.decode
        )
        self.backend = make_backend(cfg.rollout, self.engine)
        self.sync = build_weight_sync(
            cfg.rollout.sync, backend=self.backend, model_config=to_dict(self.mcfg), run_dir=run_dir
        )
        self.pipeline: RolloutPipeline | None = None
        self.ray_rollouts: Any = None
        """``etude.rl.ray_rollout.RayRollouts`` with ``rollout.ray_rollout_workers`` (in the
        context)."""
        self.detectors = build_detectors(cfg.feedback)
        self.logger = MetricsLogger(run_dir if rank == 0 else None, config=to_dict(cfg))
        self.start_step = self._resume()
        self.initial: dict[str, float] = {}
        if on_step is not None:
            self.initial = {
                f"initial/{k}": v for k, v in on_step(self.start_step, self.engine_model).items()
            }
        self.local_groups = cfg.rollout.tasks_per_step // world_size
        self.last_metrics: dict[str, float] = {}
        self.progress = Progress(
            TextColumn("rl"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            disable=not tc.progress or rank != 0,
            transient=True,
        )
        self._stack = ExitStack()
        self.env_pool: Any = None
        self.variant_factory: LazyTaskFactory | None = None
        self.bar: Any = None

    # ---------------------------------------------------------------- set-up

    def _load_pool(self) -> TaskPool | None:
        from etude.parallel.checkpoint import latest_checkpoint

        cfg, run_dir = self.cfg, self.run_dir
        self.spawning = cfg.tasks.curriculum and bool(cfg.tasks.repo)
        if self.spawning and not Path(cfg.tasks.repo).is_dir():
            raise ValueError(
                f"tasks.repo={cfg.tasks.repo!r} is not a directory; pass the repository the "
                "tasks were built from (relative to the working directory) or '' to spawn no "
                "variants"
            )
        if not (cfg.tasks.curriculum and self.rank == 0):
            return None
        resume_from = latest_checkpoint(run_dir)
        if resume_from is not None and (resume_from / "pool.json").is_file():
            # the pool as it was at the checkpoint, not as a later crashed step left it
            for name in ("pool.json", "pool.json.tasks.jsonl"):
                shutil.copyfile(resume_from / name, run_dir / name)
        return TaskPool.load_or_create(
            run_dir / "pool.json", self.tasks, cfg.curriculum, base_dir=self.task_path.parent
        )

    def _resume(self) -> int:
        """Load the newest checkpoint, if any; the step to start from."""
        from etude.parallel.checkpoint import latest_checkpoint, load_checkpoint

        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            self.logger.truncate_after(0)
            return 0
        extra = load_checkpoint(ckpt, self.model, self.optimizer)
        start = int(extra["step"])
        torch.set_rng_state(torch.tensor(extra["torch_rng"], dtype=torch.uint8))
        ema_file = ckpt / "teacher_ema.pt"
        if ema_file.is_file():
            self.teacher.load_state_dict(torch.load(ema_file, weights_only=True))
        if self.engine_model is not self.model:
            copy_full_weights(self.model, self.engine_model)
        # the steps after the checkpoint are run again: their rows go, so no step is logged twice
        self.logger.truncate_after(start)
        if self.rank == 0:
            print(f"resumed from {ckpt} at step {start}")
        return start

    def __enter__(self) -> RLRun:
        cfg = self.cfg
        self.env_pool = self._stack.enter_context(
            make_env_pool(
                cfg.rollout,
                cfg.env,
                tokenizer=self.tok,
                base_dir=self.task_path.parent,
                chat_format=policy_chat_format(cfg.train.init),
            )
        )
        # the rollout side starts from the policy's weights, at the run's version
        self.sync.push(self.model, self.start_step)
        if cfg.rollout.ray_rollout_workers:
            from etude.rl.ray_rollout import RayRollouts

            if policy_chat_format(cfg.train.init) != "etude":
                raise ValueError(
                    "rollout.ray_rollout_workers render etude's chat format; this policy speaks "
                    f"{policy_chat_format(cfg.train.init)}: set rollout.ray_rollout_workers = 0"
                )

            self.ray_rollouts = self._stack.enter_context(
                RayRollouts(
                    cfg.rollout.ray_rollout_workers,
                    weights_dir=self.sync.directory,
                    tokenizer=self.tok,
                    env_cfg=cfg.env,
                    base_dir=self.task_path.parent,
                    max_workers=cfg.rollout.num_workers,
                    address=cfg.rollout.ray_address,
                    num_cpus=cfg.rollout.ray_num_cpus,
                )
            )
        self.pipeline = self._stack.enter_context(
            RolloutPipeline(
                self.draw_tasks,
                self._collect,
                max_staleness=cfg.rollout.max_staleness,
                start_step=self.start_step,
                end_step=cfg.train.steps,
            )
        )
        self._stack.enter_context(self.progress)
        self.variant_factory = self._stack.enter_context(
            LazyTaskFactory(cfg.tasks.repo, self.run_dir / "variants", cfg.tasks.build)
        )
        self.bar = self.progress.add_task(
            "rl", total=cfg.train.steps, completed=self.start_step, info=""
        )
        self.model.train()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # ---------------------------------------------------------------- the stages

    def draw_tasks(self, step: int) -> list[TaskRecord]:
        """This rank's share of the step's tasks."""
        cfg = self.cfg
        num, seed = cfg.rollout.tasks_per_step, cfg.train.seed
        if cfg.tasks.curriculum:
            drawn = []
            if self.task_pool is not None:
                drawn = sample_tasks(self.tasks, num, seed=seed, step=step, pool=self.task_pool)
            drawn = broadcast_task_records(drawn)
        else:
            drawn = sample_tasks(self.tasks, num, seed=seed, step=step)
        return drawn[self.rank * self.local_groups : (self.rank + 1) * self.local_groups]

    def _collect(self, step: int, tasks: list[TaskRecord]) -> tuple[list[Trajectory], Any]:
        """G episodes of each task of ``step`` (on a pipeline worker thread)."""
        from etude.rl.rollout import collect_rollouts

        if self.ray_rollouts is not None:  # on the rollout actors, with their own engines
            return self.ray_rollouts.collect(
                tasks,
                self.cfg.rollout,
                seed=self.cfg.train.seed,
                step=step,
                group_offset=self.rank * self.local_groups,
            )
        return collect_rollouts(
            self.backend,
            self.env_pool,
            tasks,
            self.cfg.rollout,
            seed=self.cfg.train.seed,
            step=step,
            group_offset=self.rank * self.local_groups,
        )

    def rollout(self, step: int) -> StepBatch:
        """Stage 1: step ``step``'s batch from the pipeline (``etude.rl.pipeline``): G episodes
        of each drawn task, generated at most ``rollout.max_staleness`` versions ago."""
        started = time.perf_counter()
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * _lr_factor(step, self.cfg.train)
        assert self.pipeline is not None, "use RLRun as a context manager"
        taken = self.pipeline.next_batch(step)
        trajectories, rstats = taken.result
        check_staleness(trajectories, step, self.cfg.rollout.max_staleness)
        batch = StepBatch(
            step=step, trajectories=trajectories, rollout_stats=rstats, started=started
        )
        batch.extra.update(batch_metrics(taken, trajectories))
        batch.extra["infra/episodes"] = float(sum(not _graded(t) for t in trajectories))
        take = getattr(self.env_pool, "take_failures", None)
        if take is not None:
            batch.extra["infra/worker_deaths"] = float(take().worker_deaths)
        return batch

    def score(self, batch: StepBatch) -> None:
        """Stage 2: the monitor zeroes hacked rewards, then pass/fail, the curriculum's
        statistics and (every ``tasks.spawn_every`` steps) new variants."""
        cfg = self.cfg
        batch.passed, batch.monitor_stats = score_trajectories(batch.trajectories, cfg.monitor)
        if not cfg.tasks.curriculum:
            return
        pool = self.task_pool
        for task_id, rewards in gather_group_rewards(batch.trajectories, cfg.rollout.group_size):
            if pool is not None and rewards:
                pool.update(task_id, rewards)
        if pool is not None and self.spawning:
            assert self.variant_factory is not None
            batch.spawned = spawn_variants(
                pool, self.variant_factory.get, batch.step + 1, cfg.tasks
            )
            if batch.spawned:
                self.progress.console.print(
                    f"curriculum: {len(batch.spawned)} variant(s) after step {batch.step + 1}: "
                    + ", ".join(r.instance_id for r in batch.spawned)
                )

    def advantages(self, batch: StepBatch) -> None:
        """Stage 3: hints on the turns the detectors flag; group-relative advantages."""
        cfg = self.cfg
        apply_detectors(batch.trajectories, self.detectors, cfg.feedback)
        batch.advantages, batch.zero_var = trajectory_advantages(
            batch.trajectories, cfg.rollout.group_size, cfg.rl
        )
        # a dropped zero-variance group still runs its forwards (masked) so that every rank
        # makes the same number of sharded forwards; its hinted turns keep their KL, since an
        # all-failed group is where the hint is the only signal
        batch.keep = {
            k
            for k in range(len(batch.trajectories))
            if not (cfg.rl.drop_zero_variance and batch.zero_var[k])
            and _graded(batch.trajectories[k])
        }

    def teach(self, batch: StepBatch) -> None:
        """Stage 4: the hinted teacher's logits at the hinted turns (before any update)."""
        cfg = self.cfg
        if cfg.teacher.beta <= 0:
            return
        batch.hinted = build_hinted_turns(
            batch.trajectories, self.tok, max_len=self.mcfg.max_seq_len
        )
        batch.teachers = teacher_logits(
            self.teacher.module, batch.hinted, max_batch=cfg.teacher.max_batch
        )

    def update(self, batch: StepBatch) -> None:
        """Stage 5: the optimizer steps (``update_policy``), then the engine's and the EMA
        teacher's weights follow the policy."""
        start = time.perf_counter()
        update_policy(
            self.model,
            self.optimizer,
            batch,
            self.cfg,
            reference=self.reference,
            device=self.device,
            world_size=self.world_size,
        )
        batch.train_seconds = time.perf_counter() - start
        # new weights to the rollout side (versions count steps, updated or not)
        record = self.sync.push(self.model, batch.step + 1)
        batch.extra.update(record.metrics())
        if self.cfg.rollout.server_url and self.engine_model is not self.model:
            copy_full_weights(self.model, self.engine_model)  # the local teacher's weights
        if batch.updated:
            self.teacher.update(self.model)

    def log(self, batch: StepBatch) -> dict[str, float]:
        """Stage 6: the step's metrics (JSONL, console line), its trajectories file."""
        from etude.report.metrics import format_step_line

        tc = self.cfg.train
        metrics = _step_metrics(
            batch.trajectories,
            batch.passed,
            batch.zero_var,
            batch.hinted,
            batch.sums,
            batch.rollout_stats,
            batch.train_seconds,
            batch.grad_norm,
            num_groups=self.local_groups,
            num_minibatches=batch.num_minibatches,
        )
        metrics.update(batch.monitor_stats.metrics())
        metrics.update(batch.extra)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["updated"] = float(batch.updated)
        if self.task_pool is not None:
            metrics.update(
                curriculum_metrics(self.task_pool, batch.spawned if self.spawning else None)
            )
        metrics["step_seconds"] = time.perf_counter() - batch.started
        done = batch.step + 1
        if self.on_step is not None:
            metrics.update(self.on_step(done, self.engine_model))
        if tc.save_trajectories:
            name = f"step_{done:06d}" + (f".rank{self.rank}" if self.world_size > 1 else "")
            write_jsonl(self.run_dir / "trajectories" / f"{name}.jsonl", batch.trajectories)
        if self.rank == 0:
            self.logger.log(done, metrics)
        self.progress.update(self.bar, advance=1, info=f"reward {metrics['reward']:.3f}")
        if self.rank == 0 and (done % tc.log_every == 0 or done == tc.steps):
            keys = (
                "loss",
                "reward",
                "pass_rate",
                "err/unknown_tool",
                "err/malformed_call",
                "hints",
                "kl",
                "entropy",
                "clip_frac",
                "rollout_tok/s",
                "train_tok/s",
            )
            self.progress.console.print(format_step_line(done, metrics, keys))
        batch.metrics = metrics
        self.last_metrics = metrics
        return metrics

    def checkpoint(self, done: int, *, force: bool = False) -> None:
        """Stage 7: every ``train.checkpoint_every`` steps, at the last step, or when forced."""
        from etude.parallel.checkpoint import save_checkpoint

        tc = self.cfg.train
        if not (force or done % tc.checkpoint_every == 0 or done == tc.steps):
            return
        extra = {"torch_rng": torch.get_rng_state().tolist(), "seed": tc.seed}
        path = save_checkpoint(self.run_dir, done, self.model, self.optimizer, extra)
        if self.task_pool is not None:
            self.task_pool.save()
            for name in ("pool.json", "pool.json.tasks.jsonl"):
                shutil.copyfile(self.run_dir / name, path / name)
        if self.rank == 0 and self.cfg.teacher.source == "ema":
            tmp = path / ".teacher_ema.pt.tmp"
            torch.save(self.teacher.state_dict(), tmp)
            tmp.replace(path / "teacher_ema.pt")

    def run_step(self, step: int) -> dict[str, float]:
        """One whole RL step; returns its metrics."""
        batch = self.rollout(step)
        self.score(batch)
        self.advantages(batch)
        self.teach(batch)
        self.update(batch)
        metrics = self.log(batch)
        self.checkpoint(step + 1)
        return metrics

    def finish(self) -> dict[str, float]:
        """Export the policy (safetensors + tokenizer); the last step's metrics."""
        from etude.parallel.checkpoint import export_safetensors

        export_safetensors(self.model, self.run_dir / "export", to_dict(self.mcfg))
        if self.rank == 0:
            self.tok.save(self.run_dir / "tokenizer")
        self.logger.close()
        return {"step": self.cfg.train.steps, **self.initial, **self.last_metrics}


def run_train(
    cfg: TrainRecipe,
    *,
    on_step: Callable[[int, nn.Module], dict[str, float]] | None = None,
) -> dict[str, float]:
    """Train (or resume) per ``cfg``; returns the last step's metrics.

    ``on_step(step, model)`` runs on every rank before the first step (step = the start step)
    and after each step with the engine's (full-weight) module; the numbers it returns join that
    step's metrics (``eval/...`` measurements of a benchmark, say). Its step-0 numbers are
    returned under ``initial``-prefixed keys in the result.
    """
    with RLRun(cfg, on_step=on_step) as run:
        for step in range(run.start_step, cfg.train.steps):
            run.run_step(step)
        return run.finish()


def curriculum_metrics(pool: TaskPool, spawned: Sequence[TaskRecord] | None) -> dict[str, float]:
    """The pool's ``stats()`` as ``curriculum/*`` metrics, plus ``curriculum/spawned`` (variants
    added this step) when spawning is on (``spawned`` not None)."""
    out = {f"curriculum/{k}": float(v) for k, v in pool.stats().items()}
    if spawned is not None:
        out["curriculum/spawned"] = float(len(spawned))
    return out


def _masked(row: Row) -> Row:
    """A row that contributes nothing (a dropped zero-variance group keeps the forward count)."""
    return Row(ids=row.ids, trainable=[0] * len(row.ids), behavior=row.behavior, advantage=0.0)


def _step_metrics(
    trajectories: Sequence[Trajectory],
    passed: Sequence[bool],
    zero_var: Sequence[bool],
    hinted: Sequence[HintedTurn],
    sums: StepSums,
    rstats: Any,
    train_seconds: float,
    grad_norm: float,
    *,
    num_groups: int,
    num_minibatches: int,
) -> dict[str, float]:
    """The step's metrics, summed over ranks (means are ratios of global sums)."""
    local: dict[str, float] = {
        # infrastructure failures have no reward: the means run over scored episodes
        "episodes": sum(1 for t in trajectories if _graded(t)),
        "reward_sum": sum(float(t.reward or 0.0) for t in trajectories),
        "grade_infra": sum(not _graded(t) for t in trajectories),
        "passed": sum(passed),
        "zero_var_groups": sum(zero_var) / max(len(zero_var), 1) * num_groups,
        "hinted_turns": len({(h.row, h.turn) for h in hinted}),
        "hints_detected": sum(len(t.feedback) for t in trajectories),
        "gen_tokens": rstats.generated_tokens,
        "rollout_seconds": rstats.seconds,
        "train_seconds": train_seconds,
        "episode_tokens": sum(len(t.token_ids) for t in trajectories),
        **_error_rates(trajectories),
        **{k: float(v) for k, v in sums.values.items()},
    }
    kinds = Counter(f.kind for t in trajectories for f in t.feedback)
    for kind in sorted(kinds):
        local[f"hint/{kind}"] = kinds[kind]
    keys = sorted(local)
    if world()[1] > 1:
        # ranks may have seen different hint kinds: agree on the key set first
        gathered: list[list[str]] = [[] for _ in range(world()[1])]
        dist.all_gather_object(gathered, keys)
        keys = sorted({k for ks in gathered for k in ks})
    total = dict(zip(keys, all_reduce_sum([float(local.get(k, 0.0)) for k in keys])))
    world_size = world()[1]
    episodes = max(total["episodes"], 1.0)
    tokens = max(total.get("tokens", 0.0), 1.0)
    turns = max(total["turns"], 1.0)
    out = {
        "loss": total.get("loss", 0.0) / num_minibatches,
        "pg_loss": total.get("pg_loss", 0.0) / num_minibatches,
        "reward": total["reward_sum"] / episodes,
        "grade_infra": total["grade_infra"],
        "pass_rate": total["passed"] / episodes,
        "zero_var_groups": total["zero_var_groups"],
        "hints": total["hinted_turns"],
        "hints_detected": total["hints_detected"],
        "kl": total.get("kl_sum", 0.0) / max(total.get("kl_tokens", 0.0), 1.0),
        "kl_tokens": total.get("kl_tokens", 0.0),
        "entropy": total.get("entropy", 0.0) / tokens,
        "clip_frac": total.get("clip_frac", 0.0) / tokens,
        "ratio": total.get("ratio", 0.0) / tokens,
        "behavior_kl": total.get("behavior_kl", 0.0) / tokens,
        "grad_norm": grad_norm,
        "turns_per_episode": total["turns"] / episodes,
        "tokens_per_episode": total["episode_tokens"] / episodes,
        "trained_tokens": total.get("tokens", 0.0),
        # throughput of the whole job: tokens over the slowest rank's time
        "rollout_tok/s": total["gen_tokens"] / max(total["rollout_seconds"] / world_size, 1e-9),
        "train_tok/s": total["episode_tokens"] / max(total["train_seconds"] / world_size, 1e-9),
    }
    if "ref_kl" in total:
        out["ref_kl"] = total["ref_kl"] / tokens
    if total.get("shift_hinted_n", 0.0) > 0:
        out["shift/hinted"] = total["shift_hinted"] / total["shift_hinted_n"]
        out["shift/other"] = total["shift_other"] / max(total["shift_other_n"], 1.0)
    if total.get("teacher_minus_student_n", 0.0) > 0:
        out["teacher_minus_student"] = (
            total["teacher_minus_student"] / total["teacher_minus_student_n"]
        )
    for kind in ERROR_KINDS:
        out[f"err/{kind}"] = total[f"err/{kind}"] / turns
    for key in keys:
        if key.startswith("hint/"):
            out[key] = total[key]
    assert all(math.isfinite(v) for v in out.values()), out
    return out
