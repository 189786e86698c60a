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
7. **update** (``etude.rl.update.update_policy``): the batch is split into ``rl.num_minibatches`` optimizer
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

The pieces live beside this file: the recipe's sections (``etude.rl.recipe``), the run's
state built from the recipe and resumed from a checkpoint, and the policy's FSDP2 sharding
(``etude.rl.run_setup``), the task draws and variant spawning (``etude.rl.task_draw``), the
loss and the optimizer steps (``etude.rl.update``), the step's metrics
(``etude.rl.step_metrics``). This file holds the run: one method per stage, the context it
runs in, the checkpoint save.

Not here: sequence packing; rollout workers that hold their own engine in another process.

Legend: B trajectories in a micro-batch, T tokens, V vocabulary, N selected tokens, G group size.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from etude.config import to_dict
from etude.env.trajectory import Trajectory, write_jsonl
from etude.model.chat_family import policy_chat_format
from etude.monitor.hook import MonitorConfig
from etude.rl.feedback import apply_detectors
from etude.rl.pipeline import (
    RolloutPipeline,
    batch_metrics,
    check_staleness,
    make_env_pool,
)
from etude.rl.recipe import RLConfig, TasksConfig, TrainConfig, TrainRecipe
from etude.rl.run_setup import RLRunSetup
from etude.rl.step_metrics import step_metrics
from etude.rl.task_draw import (
    LazyTaskFactory,
    broadcast_task_records,
    curriculum_metrics,
    gather_group_rewards,
    sample_tasks,
    spawn_variants,
)
from etude.rl.teacher import (
    build_hinted_turns,
    copy_full_weights,
    cut_at_divergence,
    teacher_logits,
)
from etude.rl.update import StepBatch, is_graded, trajectory_advantages, update_policy
from etude.runtime import lr_factor
from etude.tasks.record import TaskRecord

__all__ = ["RLConfig", "RLRun", "TasksConfig", "TrainConfig", "TrainRecipe", "run_train"]


# ---------------------------------------------------------------- the run, stage by stage


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


class RLRun(RLRunSetup):
    """One RL run: the state that lives across steps, and one method per stage of a step.

    ``run_step(step)`` = ``rollout`` -> ``score`` -> ``advantages`` -> ``teach`` -> ``update``
    -> ``log`` -> ``checkpoint``. Use as a context manager (it holds the env pool, the progress
    bar and the variant factory); ``finish`` exports the final policy. ``RLRunSetup.__init__``
    (``etude.rl.run_setup``) builds the state and resumes from the newest checkpoint.
    """

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
                    retries=cfg.rollout.ray_rollout_retries,
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
        from etude.report.metrics import StepClock

        self.clock = StepClock(self.start_step, cfg.train.steps)
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
        batch.extra["infra/episodes"] = float(sum(not is_graded(t) for t in trajectories))
        take = getattr(self.env_pool, "take_failures", None)
        if take is not None or self.ray_rollouts is not None:
            # Ray environment workers and Ray rollout actors lost during the step
            deaths = take().worker_deaths if take is not None else 0
            batch.extra["infra/worker_deaths"] = float(deaths + rstats.worker_deaths)
        if self.ray_rollouts is not None:
            batch.extra["infra/retried_episodes"] = float(rstats.retried_episodes)
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
            and is_graded(batch.trajectories[k])
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
        if cfg.teacher.kl_span == "to_divergence":
            batch.hinted, batch.teachers = cut_at_divergence(
                batch.hinted,
                batch.teachers,
                batch.trajectories,
                temperature=cfg.rollout.temperature,
                top_k=cfg.rollout.top_k,
                top_p=cfg.rollout.top_p,
                margin=cfg.teacher.divergence_nats,
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
        metrics = step_metrics(
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
            self.progress.console.print(
                format_step_line(done, metrics, keys, total=tc.steps, eta_s=self.clock.eta(done))
            )
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
