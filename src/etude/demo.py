"""The main job: the whole Composer-style loop on the bundled example repo, on a laptop CPU.

Stages, each resumable (run again with the same run directory and finished stages are skipped,
the unfinished one continues from its last checkpoint):

1. ``tasks``: feature-deletion tasks built from ``examples/repos/textkit`` (mine per-test
   coverage, delete with LibCST, validate, rebuild clean workspaces, leak scan) -> RUN/tasks/;
2. ``sft``: warm start of the tiny MoE model from scratch on oracle-agent episodes with injected
   mistakes and hint-following examples -> RUN/sft/;
3. ``rl``: RL with text feedback (hinted-teacher KL on turns the detectors flag), the monitor on,
   curriculum sampling from the task pool -> RUN/ (metrics, trajectories, checkpoints, pool);
4. ``eval``: the final policy rolled out on every task without hints -> RUN/eval.json;
5. ``report``: RUN/report.html (plots, task table, trajectory viewer).

``--no-feedback`` runs the ablation (``beta = 0``: same loop, no KL on hinted turns); point
``etude report RUN_A RUN_B`` at both run directories to overlay them.

What it is not: a benchmark of model quality. The tiny model learns the tool protocol and
some repairs; the demo shows the machinery working end to end, with honest numbers.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from etude.config import apply_overrides, from_dict, load_toml, to_dict
from etude.rl.sft import SFTRecipe
from etude.rl.trainer import TrainRecipe
from etude.tasks.build import TaskBuildConfig

STAGES = ("tasks", "sft", "rl", "eval", "report")
LENGTHS = {"short": 0.3, "default": 1.0, "long": 3.0}


@dataclass(kw_only=True, slots=True)
class DemoSettings:
    """The ``[demo]`` section: what the demo runs on and how long."""

    repo: str = "examples/repos/textkit"
    """Python repository with a pytest suite that tasks are built from."""
    run_dir: str = "runs/demo"
    """Everything goes here: tasks/, sft/, metrics, trajectories, checkpoints, report.html."""
    length: Literal["short", "default", "long"] = "default"
    """Scales the SFT and RL step counts (short 0.3x, long 3x)."""
    feedback: bool = True
    """Text feedback on (the hinted-teacher KL); off runs the ablation."""
    eval_group_size: int = 2
    """Rollouts per task in the final evaluation."""

    def __post_init__(self) -> None:
        if self.eval_group_size < 1:
            raise ValueError(f"demo.eval_group_size={self.eval_group_size} must be >= 1")


@dataclass(kw_only=True, slots=True)
class DemoRecipe:
    """``configs/demo.toml``: one section per stage; stage paths are set by the demo."""

    demo: DemoSettings = field(default_factory=DemoSettings)
    tasks: TaskBuildConfig = field(default_factory=TaskBuildConfig)
    sft: SFTRecipe = field(default_factory=SFTRecipe)
    rl: TrainRecipe = field(default_factory=TrainRecipe)


def load_demo_recipe(path: str | Path, overrides: list[str]) -> DemoRecipe:
    return from_dict(DemoRecipe, apply_overrides(load_toml(path), overrides))


def _scaled(steps: int, length: str) -> int:
    return max(2, round(steps * LENGTHS[length]))


def stage_recipes(recipe: DemoRecipe) -> tuple[SFTRecipe, TrainRecipe]:
    """The SFT and RL recipes with the demo's paths, length and feedback switch applied."""
    d = recipe.demo
    run = Path(d.run_dir)
    tasks_file = str(run / "tasks" / "tasks.jsonl")
    sft = recipe.sft
    sft_train = dataclasses.replace(
        sft.train,
        run_dir=str(run / "sft"),
        steps=_scaled(sft.train.steps, d.length),
        warmup_steps=min(sft.train.warmup_steps, _scaled(sft.train.steps, d.length)),
        checkpoint_every=min(sft.train.checkpoint_every, _scaled(sft.train.steps, d.length)),
    )
    sft = dataclasses.replace(
        sft, data=dataclasses.replace(sft.data, tasks=tasks_file), train=sft_train
    )
    rl = recipe.rl
    rl_steps = _scaled(rl.train.steps, d.length)
    rl = dataclasses.replace(
        rl,
        tasks=dataclasses.replace(rl.tasks, path=tasks_file),
        teacher=dataclasses.replace(rl.teacher, beta=rl.teacher.beta if d.feedback else 0.0),
        train=dataclasses.replace(rl.train, run_dir=str(run), steps=rl_steps, init=""),
    )
    return sft, rl


def _read_stages(run: Path) -> dict[str, dict]:
    path = run / "stages.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _mark_done(run: Path, stage: str, info: dict) -> None:
    from etude.report.metrics import write_json_atomic

    stages = _read_stages(run)
    stages[stage] = {"done": True, "time": time.time(), **info}
    write_json_atomic(run / "stages.json", stages)


def run_tasks_stage(recipe: DemoRecipe, run: Path) -> dict:
    import shutil

    from etude.tasks.build import build_tasks, log_to_stderr

    out = run / "tasks"
    if out.exists():  # a build that died half-way: tasks are never mixed into an old build
        shutil.rmtree(out)
    records, report = build_tasks(recipe.demo.repo, out, recipe.tasks, log=log_to_stderr)
    if not records:
        raise ValueError(f"no valid task could be built from {recipe.demo.repo!r}; see {out}")
    return {"tasks": len(records), "candidates": report.to_dict().get("candidates", len(records))}


def evaluate_policy(rl: TrainRecipe, run: Path, group_size: int) -> dict[str, float]:
    """Roll out the final policy on every task, no hints, and measure what it does."""
    import torch

    from etude.engine import Engine
    from etude.env.pool import EnvPool
    from etude.monitor.hook import apply_monitor
    from etude.rl.rollout import collect_rollouts
    from etude.rl.sft import load_policy
    from etude.tasks.record import load_tasks

    model, tok, _ = load_policy(
        str(run), rl.model, run, device=torch.device("cpu"), seed=rl.train.seed
    )
    task_path = Path(rl.tasks.path)
    tasks = load_tasks(task_path)
    engine = Engine(model, max_seq_len=rl.env.max_tokens, decode_fn=tok.decode)
    cfg = dataclasses.replace(rl.rollout, group_size=group_size)
    with EnvPool(
        rl.env, tokenizer=tok, base_dir=task_path.parent, max_workers=cfg.num_workers
    ) as pool:
        trajectories, _ = collect_rollouts(
            engine, pool, tasks, cfg, seed=rl.train.seed + 10_007, step=0
        )
    mstats = apply_monitor(trajectories, rl.monitor)
    turns = [turn for t in trajectories for _, turn in t.assistant_turns()]
    errors = Counter(e.kind for turn in turns for e in turn.errors)
    from etude.env.trajectory import write_jsonl

    write_jsonl(run / "eval_trajectories.jsonl", trajectories)
    result = {
        "episodes": float(len(trajectories)),
        "tasks": float(len(tasks)),
        "pass_rate": sum(float(t.reward or 0.0) >= 1.0 for t in trajectories) / len(trajectories),
        "reward": sum(float(t.reward or 0.0) for t in trajectories) / len(trajectories),
        "submitted": sum(t.finish_reason == "submit" for t in trajectories) / len(trajectories),
        "turns_per_episode": len(turns) / len(trajectories),
        "unknown_tool_rate": errors.get("unknown_tool", 0) / max(len(turns), 1),
        "tool_error_rate": sum(errors.values()) / max(len(turns), 1),
        "monitor_zeroed": float(mstats.metrics().get("monitor/zeroed", 0.0)),
    }
    return result


def run_demo(recipe: DemoRecipe) -> dict[str, float]:
    """Run (or resume) every stage; returns the evaluation numbers."""
    from rich.console import Console

    from etude.report.html import write_report
    from etude.report.metrics import write_json_atomic
    from etude.rl.sft import run_sft
    from etude.rl.trainer import run_train

    console = Console()
    run = Path(recipe.demo.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run / "demo_config.json", to_dict(recipe))
    sft, rl = stage_recipes(recipe)
    done = _read_stages(run)
    summary: dict[str, float] = {}

    def banner(i: int, stage: str, text: str) -> None:
        console.rule(f"[bold]{i}/{len(STAGES)} {stage}[/bold]: {text}")

    banner(1, "tasks", f"feature-deletion tasks from {recipe.demo.repo}")
    if "tasks" in done:
        console.print(f"done before: {done['tasks']['tasks']} tasks in {run / 'tasks'}")
    else:
        t0 = time.perf_counter()
        info = run_tasks_stage(recipe, run)
        _mark_done(run, "tasks", info)
        console.print(
            f"{info['tasks']} valid tasks in {time.perf_counter() - t0:.0f} s -> {run / 'tasks'}"
        )

    banner(2, "sft", f"warm start on oracle episodes, {sft.train.steps} steps")
    if "sft" in done:
        console.print(f"done before: {run / 'sft'}")
    else:
        t0 = time.perf_counter()
        out = run_sft(sft)
        _mark_done(run, "sft", {"loss": out.get("loss", float("nan"))})
        console.print(
            f"sft loss {out.get('loss', float('nan')):.3f} in {time.perf_counter() - t0:.0f} s"
        )

    feedback = "with text feedback" if recipe.demo.feedback else "without text feedback (ablation)"
    banner(3, "rl", f"{rl.train.steps} RL steps {feedback}, monitor on, curriculum sampling")
    rl = dataclasses.replace(rl, train=dataclasses.replace(rl.train, init=str(run / "sft")))
    if "rl" in done:
        console.print(f"done before: {run}")
    else:
        t0 = time.perf_counter()
        out = run_train(rl)
        _mark_done(run, "rl", {"reward": out.get("reward", float("nan"))})
        console.print(
            f"final step reward {out.get('reward', float('nan')):.3f} in {time.perf_counter() - t0:.0f} s"
        )

    banner(4, "eval", f"final policy, no hints, {recipe.demo.eval_group_size} rollouts per task")
    if "eval" in done and (run / "eval.json").is_file():
        summary = json.loads((run / "eval.json").read_text())
    else:
        summary = evaluate_policy(rl, run, recipe.demo.eval_group_size)
        write_json_atomic(run / "eval.json", summary)
        _mark_done(run, "eval", {})
    console.print(
        f"pass rate {summary['pass_rate']:.3f} | unknown-tool rate {summary['unknown_tool_rate']:.3f} "
        f"| tool-error rate {summary['tool_error_rate']:.3f} over {int(summary['episodes'])} episodes"
    )

    banner(5, "report", "self-contained HTML")
    path = write_report([run], run / "report.html")
    _mark_done(run, "report", {"path": str(path)})
    console.print(f"report: {path}  (open it in a browser; file:// works)")
    return summary
