"""What an RL run holds and how it starts: the base class of ``etude.rl.trainer.RLRun``.

``RLRunSetup.__init__`` builds the run's state from a ``TrainRecipe``: the process group and
device, the run directory, the policy (loaded whole, or straight into FSDP2 shards under
``torchrun`` with an ``hf:`` init), the tasks and the curriculum pool, the full-weight modules
for the engine, the teacher and the reference, the optimizer, the rollout backend, the weight
sync, the detectors and the metrics logger; then it resumes from the newest checkpoint, if any
(model, optimizer, step, torch RNG, EMA teacher, pool). ``shard_policy`` is the policy's FSDP2
wrapping.

Not here: the stages of a step, the context manager (env pool, rollout pipeline, progress bar)
and the checkpoint save (``etude.rl.trainer.RLRun``); the recipe's sections
(``etude.rl.recipe``).
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from etude.config import to_dict
from etude.rl.feedback import build_detectors
from etude.rl.pipeline import RolloutPipeline, make_backend, separate_engine_needed
from etude.rl.recipe import TrainRecipe
from etude.rl.task_draw import LazyTaskFactory
from etude.rl.teacher import TeacherWeights, copy_full_weights
from etude.rl.weight_sync import build_weight_sync
from etude.runtime import init_distributed
from etude.tasks.curriculum import TaskPool

__all__ = ["RLRunSetup", "shard_policy"]


# ---------------------------------------------------------------- data parallel


def shard_policy(model: nn.Module) -> None:
    """FSDP2 over all ranks: each transformer block, then the root (embedding, norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)


class RLRunSetup:
    """The state of one RL run, built from its recipe, resumed from its newest checkpoint.

    ``etude.rl.trainer.RLRun`` adds the stages of a step on top of it.
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
