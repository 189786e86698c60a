"""The main job: the whole Composer-style loop on the bundled example repo, on a laptop CPU.

Stages, each resumable (run again with the same run directory and finished stages are skipped,
the unfinished one continues from its last checkpoint):

1. ``tasks``: feature-deletion tasks built from ``examples/repos/textkit`` (mine per-test
   coverage, delete with LibCST, validate, rebuild clean workspaces, leak scan) -> RUN/tasks/;
   the demo asks for small symbol features, a size a tiny model can learn;
2. ``sft``: warm start of the tiny MoE model from scratch on WHOLE oracle-agent episodes (each
   ends in a passing submit; the compact tool declarations make them fit the context) with
   injected mistakes and hint-following examples -> RUN/sft/;
3. ``eval_sft``: the warm start rolled out ``demo.eval_group_size`` times per task, no hints
   -> RUN/eval_sft.json (the "before" of the verdict);
4. ``rl``: RL with text feedback (hinted-teacher KL on turns the detectors flag), the monitor on,
   curriculum sampling from the task pool -> RUN/ (metrics, trajectories, a checkpoint every
   step, pool);
5. ``eval``: the final policy, the same episodes count -> RUN/eval.json (pass@1 with a 95%
   Wilson interval, error rates, the verdict line) and RUN/eval_trajectories.jsonl;
6. ``report``: RUN/report.html (verdict, plots, task table, trajectory viewer with the eval
   episodes and the per-token KL of hinted turns).

Both evaluations run on the training tasks (there is no held-out split at this size); the
verdict line says so. ``--no-feedback`` runs the ablation (``beta = 0``: same loop, no KL on
hinted turns); point ``etude report RUN_A RUN_B`` at both run directories to overlay them.

What it is not: a benchmark of model quality. The tiny model memorizes a few small repairs;
the demo shows the machinery working end to end, with honest numbers.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from etude.config import apply_overrides, from_dict, load_toml, to_dict
from etude.rl.feedback import EDIT_TOOLS
from etude.rl.sft import SFTRecipe
from etude.rl.trainer import TrainRecipe
from etude.tasks.build import TaskBuildConfig

STAGES = ("tasks", "sft", "eval_sft", "rl", "eval", "report")
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
    eval_group_size: int = 6
    """Rollouts per task in each evaluation (warm start and final policy)."""

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

    from etude.tasks.build import build_tasks

    out = run / "tasks"
    if out.exists():  # a build that died half-way: tasks are never mixed into an old build
        shutil.rmtree(out)
    records, report = build_tasks(recipe.demo.repo, out, recipe.tasks, log=EtaLog())
    if not records:
        raise ValueError(f"no valid task could be built from {recipe.demo.repo!r}; see {out}")
    return {"tasks": len(records), "candidates": report.to_dict().get("candidates", len(records))}


class EtaLog:
    """The task builder's log lines on stderr, with an ETA appended to its ``[k/n]`` lines."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        import re
        import sys

        match = re.match(r"\[(\d+)/(\d+)\]", message)
        if match:
            k, n = int(match.group(1)), int(match.group(2))
            elapsed = time.perf_counter() - self.start
            left = elapsed / max(k, 1) * (n - k)
            message = f"{message}  [eta {left:.0f} s]"
        print(message, file=sys.stderr, flush=True)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (Wilson 1927); (0, 1) when n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def episode_metrics(trajectories: list, num_tasks: int) -> dict[str, float]:
    """pass@1 with its 95% interval, reward, submits and the tool-call error rates per turn.

    ``valid_after_malformed``: of the assistant turns right after a turn with a malformed call
    (``turns_after_malformed`` of them), the fraction that make a tool call without any error:
    whether the policy recovers from its own broken call JSON.

    Why episodes fail, as fractions of all episodes: ``failed_without_edit`` never made an edit
    call (``write_file`` / ``replace_in_file``) that ran without an error, ``failed_with_edit``
    made one and still did not pass (its content was wrong, or the episode ended before a
    submit). A hint about the call's form can help the first; only the edit's content fixes the
    second.
    """
    n = len(trajectories)
    turns = [turn for t in trajectories for _, turn in t.assistant_turns()]
    after_malformed = [
        bool(turn.tool_calls) and not turn.errors
        for t in trajectories
        for (_, prev), (_, turn) in itertools.pairwise(t.assistant_turns())
        if any(e.kind == "malformed_json" for e in prev.errors)
    ]
    errors = Counter(e.kind for turn in turns for e in turn.errors)
    passes = sum(float(t.reward or 0.0) >= 1.0 for t in trajectories)
    failed_edited = [
        any(
            not turn.errors and any(call.name in EDIT_TOOLS for call in turn.tool_calls)
            for _, turn in t.assistant_turns()
        )
        for t in trajectories
        if float(t.reward or 0.0) < 1.0
    ]
    low, high = wilson_interval(passes, n)
    first_valid = [
        bool(turn.tool_calls) and not turn.errors
        for t in trajectories
        for _, turn in list(t.assistant_turns())[:1]
    ]
    return {
        "episodes": float(n),
        "tasks": float(num_tasks),
        "pass_at_1": passes / max(n, 1),
        "pass_at_1_low": low,
        "pass_at_1_high": high,
        "pass_rate": passes / max(n, 1),
        "reward": sum(float(t.reward or 0.0) for t in trajectories) / max(n, 1),
        "submitted": sum(t.finish_reason == "submit" for t in trajectories) / max(n, 1),
        "turns_per_episode": len(turns) / max(n, 1),
        "first_call_valid": sum(first_valid) / max(len(first_valid), 1),
        "unknown_tool_rate": errors.get("unknown_tool", 0) / max(len(turns), 1),
        "malformed_rate": errors.get("malformed_json", 0) / max(len(turns), 1),
        "targeted_error_rate": (errors.get("unknown_tool", 0) + errors.get("malformed_json", 0))
        / max(len(turns), 1),
        "tool_error_rate": sum(errors.values()) / max(len(turns), 1),
        "turns_after_malformed": float(len(after_malformed)),
        "valid_after_malformed": sum(after_malformed) / max(len(after_malformed), 1),
        "failed_without_edit": failed_edited.count(False) / max(n, 1),
        "failed_with_edit": failed_edited.count(True) / max(n, 1),
    }


def evaluate_policy(
    rl: TrainRecipe,
    policy_dir: Path,
    group_size: int,
    *,
    out: Path | None = None,
    label: str = "eval",
    chunk_tasks: int = 4,
) -> dict[str, float]:
    """Roll out the policy in ``policy_dir`` (its export/ and tokenizer/) ``group_size`` times on
    every task, no hints, the monitor on; the trajectories go to ``out`` (JSONL).

    The tasks are the training tasks (the demo has no held-out split). Episodes run in chunks
    of ``chunk_tasks`` tasks so that the progress bar has an ETA.
    """
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from etude.engine import Engine
    from etude.env.pool import EnvPool
    from etude.env.trajectory import write_jsonl
    from etude.monitor.hook import apply_monitor
    from etude.rl.rollout import collect_rollouts
    from etude.rl.sft import load_policy
    from etude.tasks.record import load_tasks

    model, tok, _ = load_policy(
        str(policy_dir), rl.model, policy_dir, device=torch.device("cpu"), seed=rl.train.seed
    )
    task_path = Path(rl.tasks.path)
    tasks = load_tasks(task_path)
    engine = Engine(model, max_seq_len=rl.env.max_tokens, decode_fn=tok.decode)
    cfg = dataclasses.replace(rl.rollout, group_size=group_size)
    trajectories = []
    progress = Progress(
        TextColumn(label),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tasks"),
        TimeRemainingColumn(),
        transient=True,
    )
    with (
        EnvPool(
            rl.env, tokenizer=tok, base_dir=task_path.parent, max_workers=cfg.num_workers
        ) as pool,
        progress,
    ):
        bar = progress.add_task(label, total=len(tasks))
        for start in range(0, len(tasks), chunk_tasks):
            chunk = tasks[start : start + chunk_tasks]
            got, _ = collect_rollouts(
                engine,
                pool,
                chunk,
                cfg,
                seed=rl.train.seed + 10_007,
                step=0,
                group_offset=start,
            )
            trajectories.extend(got)
            progress.update(bar, advance=len(chunk))
    mstats = apply_monitor(trajectories, rl.monitor)
    if out is not None:
        write_jsonl(out, trajectories)
    return {
        **episode_metrics(trajectories, len(tasks)),
        "monitor_zeroed": float(mstats.metrics().get("monitor/zeroed", 0.0)),
    }


def verdict_line(before: dict, after: dict, rl_steps: int, feedback: bool) -> str:
    """One line with the numbers: pass@1 before and after RL, intervals, and what they mean."""
    n = int(after["episodes"])
    b, a = before["pass_at_1"], after["pass_at_1"]
    if after["pass_at_1_low"] > before["pass_at_1_high"]:
        call = "better"
    elif after["pass_at_1_high"] < before["pass_at_1_low"]:
        call = "WORSE"
    elif a > b:
        call = "higher; the intervals overlap"
    elif a < b:
        call = "lower; the intervals overlap"
    else:
        call = "unchanged"
    arm = "RL + text feedback" if feedback else "RL without text feedback"
    return (
        f"pass@1 {b:.2f} [{before['pass_at_1_low']:.2f}, {before['pass_at_1_high']:.2f}] -> "
        f"{a:.2f} [{after['pass_at_1_low']:.2f}, {after['pass_at_1_high']:.2f}] ({call}) over "
        f"{rl_steps} steps of {arm}; {n} eval episodes per policy on the "
        f"{int(after['tasks'])} training tasks, 1 seed, 95% Wilson intervals; per turn: "
        f"unknown-tool calls {before.get('unknown_tool_rate', 0.0):.2f} -> "
        f"{after.get('unknown_tool_rate', 0.0):.2f}, malformed calls "
        f"{before.get('malformed_rate', 0.0):.2f} -> {after.get('malformed_rate', 0.0):.2f}"
    )


def run_demo(recipe: DemoRecipe) -> dict[str, float]:
    """Run (or resume) every stage; returns the evaluation numbers."""
    import warnings

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
    d = recipe.demo

    def banner(i: int, stage: str, text: str) -> None:
        console.rule(f"[bold]{i}/{len(STAGES)} {stage}[/bold]: {text}")

    def timed(stage: str, fn, info=lambda out: {}):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        out = fn()
        _mark_done(run, stage, {"seconds": time.perf_counter() - t0, **info(out)})
        return out, time.perf_counter() - t0

    banner(1, "tasks", f"feature-deletion tasks from {d.repo}")
    if "tasks" in done:
        console.print(f"done before: {done['tasks']['tasks']} tasks in {run / 'tasks'}")
    else:
        info, secs = timed("tasks", lambda: run_tasks_stage(recipe, run), lambda out: out)
        console.print(f"{info['tasks']} valid tasks in {secs:.0f} s -> {run / 'tasks'}")

    banner(2, "sft", f"warm start on whole oracle episodes, {sft.train.steps} steps")
    if "sft" in done:
        console.print(f"done before: {run / 'sft'}")
    else:
        out, secs = timed("sft", lambda: run_sft(sft), lambda o: {"loss": o.get("loss")})
        console.print(f"sft loss {out.get('loss', float('nan')):.3f} in {secs:.0f} s")

    banner(3, "eval", f"warm start, no hints, {d.eval_group_size} rollouts per task")
    before_path = run / "eval_sft.json"
    if "eval_sft" in done and before_path.is_file():
        before = json.loads(before_path.read_text())
    else:
        before, _ = timed(
            "eval_sft",
            lambda: evaluate_policy(rl, run / "sft", d.eval_group_size, label="eval sft"),
        )
        write_json_atomic(before_path, before)
    console.print(_eval_line("warm start", before))
    if d.length == "short" and before["first_call_valid"] < 0.5:
        warnings.warn(
            f"--length short: the warm start is too weak to act (a valid first tool call in "
            f"{before['first_call_valid']:.0%} of episodes, pass@1 {before['pass_at_1']:.2f}); "
            "RL has little to work with. Use the default length for a policy that earns reward.",
            stacklevel=2,
        )

    feedback = "with text feedback" if d.feedback else "without text feedback (ablation)"
    banner(4, "rl", f"{rl.train.steps} RL steps {feedback}, monitor on, curriculum sampling")
    rl = dataclasses.replace(rl, train=dataclasses.replace(rl.train, init=str(run / "sft")))
    if "rl" in done:
        console.print(f"done before: {run}")
    else:
        out, secs = timed("rl", lambda: run_train(rl), lambda o: {"reward": o.get("reward")})
        console.print(f"last step reward {out.get('reward', float('nan')):.3f} in {secs:.0f} s")

    banner(5, "eval", f"final policy, no hints, {d.eval_group_size} rollouts per task")
    if "eval" in done and (run / "eval.json").is_file():
        summary = json.loads((run / "eval.json").read_text())
    else:
        after, _ = timed(
            "eval",
            lambda: evaluate_policy(
                rl, run, d.eval_group_size, out=run / "eval_trajectories.jsonl", label="eval rl"
            ),
        )
        summary = {
            **after,
            **{f"sft_{k}": v for k, v in before.items()},
            "verdict": verdict_line(before, after, rl.train.steps, d.feedback),
        }
        write_json_atomic(run / "eval.json", summary)
    console.print(_eval_line("after RL", summary))

    banner(6, "report", "self-contained HTML")
    t0 = time.perf_counter()
    path = write_report([run], run / "report.html")
    stages = _read_stages(run)
    _mark_done(run, "report", {"path": str(path), "seconds": time.perf_counter() - t0})
    job = sum(float(v.get("seconds", 0.0)) for v in stages.values() if isinstance(v, dict))
    console.print(f"report: {path}  (open it in a browser; file:// works)")
    console.print(f"whole job: {job / 60:.1f} min of work in {run}")
    console.print(f"[bold]verdict: {summary['verdict']}[/bold]")
    return summary


def _eval_line(name: str, m: dict) -> str:
    return (
        f"{name}: pass@1 {m['pass_at_1']:.3f} [{m['pass_at_1_low']:.2f}, "
        f"{m['pass_at_1_high']:.2f}] | valid first call {m['first_call_valid']:.2f} | "
        f"targeted errors/turn {m['targeted_error_rate']:.3f} | submitted {m['submitted']:.2f} "
        f"over {int(m['episodes'])} episodes"
    )
