"""The RL recipe (``etude train RECIPE``): one small config dataclass per section.

``TrainRecipe`` is what ``configs/rl-tiny.toml`` (and the ``[rl]`` section of ``configs/demo.toml``)
load into: tasks, environment, rollout, the policy loss, the teacher, feedback detectors, the
monitor, bookkeeping, the optimizer and the curriculum. The trainer that runs it is
``etude.rl.trainer``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from etude.env.coding import EnvConfig
from etude.model.chat_family import check_rl_chat_format
from etude.monitor.hook import MonitorConfig
from etude.optim import OptimConfig
from etude.rl.feedback import FeedbackConfig
from etude.rl.rollout import RolloutConfig
from etude.rl.teacher import TeacherConfig
from etude.tasks.build import TaskBuildConfig
from etude.tasks.curriculum import CurriculumConfig


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
    negative_advantage_scale: float = 1.0
    """Factor on negative advantages: 1 = plain group-relative advantages (GRPO); 0 = only
    episodes above their group's mean are reinforced (filtered imitation of the policy's own
    successes, as in RAFT, https://arxiv.org/abs/2304.06767, and ReST,
    https://arxiv.org/abs/2308.08998). Below 1 a failing episode's tokens are pushed down less.
    Why it can help: a failing episode is longer (retries, extra turns), so under a token mean
    its shared tokens (the call syntax) get more negative weight than the passing episodes give
    them positive weight; on the demo, RL alone went 0.41 -> 0.26 with 1 and 0.41 -> 0.46 with 0
    (seed 0, docs/rl.md)."""
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
        if not 0.0 <= self.negative_advantage_scale <= 1.0:
            raise ValueError(
                f"rl.negative_advantage_scale={self.negative_advantage_scale} must lie in [0, 1] "
                "(1 = plain group-relative advantages, 0 = reinforce only above-mean episodes)"
            )
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
