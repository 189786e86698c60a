"""The run report: one self-contained ``report.html`` built from a run directory's own files.

``etude report RUN_DIR [RUN_DIR2]`` reads what a run wrote and renders it; nothing is recomputed
from a model. The page needs no network and opens from ``file://``: CSS, JavaScript and SVG are
inline and the data sits in the page as JSON (``<script id="etude-data">``), which the viewer
reads and a test can check against the files.

What a run directory may hold (each part is optional; the report shows what is present):

- ``metrics.jsonl``: one object per step (``step``, ``time`` and metric keys). Known keys get
  their own figures (reward and pass rate; tool-call error rates ``err/<kind>`` or
  ``errors/<kind>``; ``hints``, ``hints_detected`` and ``hint/<kind>``; ``kl``;
  ``monitor/category/<name>``; keys with ``tok/s``); every other numeric key is plotted under
  "Other metrics", grouped by the part of its name before the last ``/``. A resumed run may log
  a step twice: the later record wins; a half-written last line (a run still writing, or
  interrupted) is left out.
- ``trajectories/*.jsonl`` and ``trajectories*.jsonl`` (``etude.env.trajectory``): the step is
  read from a ``step_N`` file name, else from ``info["policy_step"]``. They feed the per-task
  statistics, the monitor counts when there is no ``monitor.json``, and the viewer.
- ``tasks/tasks.jsonl`` (``etude.tasks.record``): the table of tasks.
- a curriculum pool state (``etude.tasks.curriculum``: a JSON file with ``version`` and per-task
  ``tasks`` statistics, found among the top-level JSON files and those one directory down): the
  pass-rate histogram and the pool's status and variant counts.
- ``monitor.json`` (``etude.monitor.report.summarize``): flag counts by category.
- ``config.json``, ``versions.json``, ``eval.json`` (flat numbers shown in the summary) and
  ``tokenizer/`` (decodes tokens for the KL heat map).

A task counts as passed in a rollout when its reward is at least 1.0 (the trainer's rule).
With two run directories the line plots overlay both runs (the second run dashed where a plot
has several series), bar charts group them side by side, and the viewer can pick from either.

What it does not do: serve pages, watch a run live, or fetch anything.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from etude.env.trajectory import Trajectory, read_jsonl
from etude.model.tokenizer import Tokenizer
from etude.report import plots
from etude.report.plots import PALETTE, RUN_COLORS, Bars, Series
from etude.report.viewer import (
    VIEWER_CSS,
    VIEWER_HTML,
    VIEWER_JS,
    select_trajectories,
    turn_kl,
    viewer_record,
)
from etude.tasks.record import TaskRecord, load_tasks

PASS_REWARD = 1.0
DEFAULT_MAX_TRAJECTORIES = 120
MAX_EMBEDDED_CHARS = 12_000_000
"""Trajectory JSON beyond this many characters is left out (plain ones first), whatever the cap."""
MAX_SERIES = 10
"""Lines per 'other metrics' plot: the ones with the largest totals are kept."""
_STEP_FILE = re.compile(r"step_(\d+)")
_SKIP_KEYS = {"step", "time"}


@dataclass(kw_only=True, slots=True)
class RunData:
    """What one run directory holds, read once."""

    path: Path
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    trajectories: list[tuple[int | None, str, Trajectory]] = field(default_factory=list)
    """(step, source ``file:line``, trajectory), in file order."""
    tasks: list[TaskRecord] = field(default_factory=list)
    curriculum: dict[str, Any] | None = None
    curriculum_path: str | None = None
    monitor: dict[str, Any] | None = None
    evaluation: dict[str, Any] | None = None
    stages: dict[str, Any] | None = None
    """``stages.json`` of an ``etude demo`` run: per stage, its seconds (the whole job's wall
    time is their sum, over every invocation that did work)."""
    tokenizer: Tokenizer | None = None

    def keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for record in self.metrics:
            for key, value in record.items():
                if key not in _SKIP_KEYS and _number(value) is not None:
                    seen.setdefault(key, None)
        return list(seen)

    def column(
        self, key: str, *, unless_zero: str | None = None
    ) -> tuple[list[float], list[float | None]]:
        """Steps and values of ``key`` over the records that have it (non-finite -> None).

        ``unless_zero``: a count key; where a record has it and it is 0 the value is None (a
        mean over nothing, e.g. ``kl`` of a step with ``kl_tokens`` 0, is a gap, not a zero).
        """
        xs, ys = [], []
        for record in self.metrics:
            if key in record:
                xs.append(float(record["step"]))
                empty = unless_zero is not None and record.get(unless_zero) == 0
                ys.append(None if empty else _number(record[key]))
        return xs, ys

    def last(self, key: str) -> float | None:
        for record in reversed(self.metrics):
            if _number(record.get(key)) is not None:
                return _number(record[key])
        return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); rewrite or remove it") from None


def _is_pool_state(data: Any) -> bool:
    tasks = data.get("tasks") if isinstance(data, dict) else None
    return (
        "version" in data
        and isinstance(tasks, dict)
        and all(isinstance(s, dict) and "attempts" in s for s in tasks.values())
    )


def _find_curriculum(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    named = ("pool.json", "curriculum.json", "curriculum/pool.json", "tasks/pool.json")
    candidates = [run_dir / n for n in named]
    candidates += sorted(run_dir.glob("*.json")) + sorted(run_dir.glob("*/*.json"))
    skip = {"config.json", "versions.json", "monitor.json", "eval.json"}
    for path in dict.fromkeys(candidates):
        if path.name in skip or not path.is_file() or path.stat().st_size > 50_000_000:
            continue
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if _is_pool_state(data):
            return data, str(path.relative_to(run_dir))
    return None, None


EVAL_TRAJECTORIES = "eval_trajectories.jsonl"


def _trajectory_files(run_dir: Path) -> list[Path]:
    files = (
        sorted((run_dir / "trajectories").glob("*.jsonl"))
        + sorted(run_dir.glob("trajectories*.jsonl"))
        + [run_dir / EVAL_TRAJECTORIES]
    )
    return [f for f in dict.fromkeys(files) if f.is_file()]


def load_run(run_dir: str | Path, *, name: str | None = None) -> RunData:
    """Read a run directory; a missing directory is a ``ValueError`` naming it."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ValueError(
            f"run directory {str(path)!r} does not exist; pass the directory a training run wrote "
            "(it holds metrics.jsonl)"
        )
    run = RunData(path=path, name=name or path.resolve().name)
    for attr, file in (("config", "config.json"), ("versions", "versions.json")):
        if (path / file).is_file():
            setattr(run, attr, _read_json(path / file))
    if (path / "eval.json").is_file():
        run.evaluation = _read_json(path / "eval.json")
    if (path / "monitor.json").is_file():
        run.monitor = _read_json(path / "monitor.json")
    if (path / "stages.json").is_file():
        run.stages = _read_json(path / "stages.json")
    metrics_path = path / "metrics.jsonl"
    by_step: dict[int, dict[str, Any]] = {}
    if metrics_path.is_file():
        lines = metrics_path.read_text().splitlines()
        last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if lineno == last:
                    break  # an append that a running or interrupted run left half-written
                raise ValueError(f"{metrics_path}:{lineno}: not a JSON object") from None
            if not isinstance(record, dict) or _number(record.get("step")) is None:
                raise ValueError(f"{metrics_path}:{lineno}: a metrics record needs a 'step'")
            by_step[int(record["step"])] = record  # a resumed run re-logs steps: last wins
    run.metrics = [by_step[s] for s in sorted(by_step)]
    for file in _trajectory_files(path):
        match = _STEP_FILE.search(file.name)
        for n, traj in enumerate(read_jsonl(file)):
            step = int(match.group(1)) if match else traj.info.get("policy_step")
            if file.name == EVAL_TRAJECTORIES:
                step = None  # the final evaluation: no training step
            step = step if isinstance(step, int) and not isinstance(step, bool) else None
            run.trajectories.append((step, f"{file.relative_to(path)}:{n + 1}", traj))
    if (path / "tasks" / "tasks.jsonl").is_file():
        run.tasks = load_tasks(path / "tasks" / "tasks.jsonl")
    run.curriculum, run.curriculum_path = _find_curriculum(path)
    if run.curriculum is not None:
        records = path / (run.curriculum_path + ".tasks.jsonl")
        known = {t.instance_id for t in run.tasks}
        if records.is_file():
            run.tasks += [r for r in load_tasks(records) if r.instance_id not in known]
    if (path / "tokenizer" / "tokenizer.json").is_file():
        try:
            run.tokenizer = Tokenizer.load(path / "tokenizer")
        except ValueError as e:
            warnings.warn(f"tokenizer not used, KL heat maps show cells only: {e}", stacklevel=2)
    return run


# ---------------------------------------------------------------- numbers shown


def task_statistics(run: RunData) -> dict[str, dict[str, float]]:
    """Per task id: rollouts, passes, pass rate and mean reward over all trajectories read."""
    out: dict[str, dict[str, float]] = {}
    for _, _, traj in run.trajectories:
        row = out.setdefault(traj.task_id, {"rollouts": 0, "passes": 0, "reward_sum": 0.0})
        reward = float(traj.reward or 0.0)
        row["rollouts"] += 1
        row["passes"] += reward >= PASS_REWARD
        row["reward_sum"] += reward
    for row in out.values():
        row["pass_rate"] = row["passes"] / row["rollouts"]
        row["mean_reward"] = row.pop("reward_sum") / row["rollouts"]
    return out


def curriculum_rows(run: RunData) -> dict[str, dict[str, Any]]:
    """Per task in the pool state: status, generation, attempts, passes, posterior pass rate."""
    if run.curriculum is None:
        return {}
    cfg = run.curriculum.get("config", {})
    a0, b0 = float(cfg.get("prior_alpha", 1.0)), float(cfg.get("prior_beta", 1.0))
    out = {}
    for task_id, s in run.curriculum["tasks"].items():
        attempts, passes = int(s.get("attempts", 0)), int(s.get("passes", 0))
        out[task_id] = {
            "status": s.get("status", "active"),
            "generation": int(s.get("generation", 0)),
            "attempts": attempts,
            "passes": passes,
            "posterior_pass_rate": (a0 + passes) / (a0 + b0 + attempts),
        }
    return out


def monitor_categories(run: RunData) -> tuple[dict[str, int], str]:
    """Trajectories flagged per category, from ``monitor.json`` or else the trajectories."""
    if run.monitor is not None and isinstance(run.monitor.get("by_category"), dict):
        counts = {k: int(v.get("trajectories", 0)) for k, v in run.monitor["by_category"].items()}
        return counts, "monitor.json"
    counts: dict[str, int] = {}
    for _, _, traj in run.trajectories:
        for category in {f.category for f in traj.flags}:
            counts[category] = counts.get(category, 0) + 1
    return counts, "trajectories"


def run_summary(run: RunData) -> dict[str, Any]:
    """The headline numbers of a run (what the summary header shows)."""
    steps = [int(r["step"]) for r in run.metrics]
    times = [t for r in run.metrics if (t := _number(r.get("time"))) is not None]
    flagged = sum(any(f.severity >= 3 for f in t.flags) for _, _, t in run.trajectories)
    throughput = [
        v for r in run.metrics for k, v in r.items() if "tok/s" in k and _number(v) is not None
    ]
    rewards = [_number(r.get("reward")) for r in run.metrics]
    rewards = [r for r in rewards if r is not None]
    out: dict[str, Any] = {
        "steps": max(steps) if steps else 0,
        "first_reward": rewards[0] if rewards else None,
        "final_reward": run.last("reward"),
        "final_pass_rate": run.last("pass_rate"),
        "best_reward": max(rewards) if rewards else None,
        "trajectories": len(run.trajectories),
        "tasks": len(run.tasks),
        "flagged": flagged,
        "hints": sum(len(t.feedback) for _, _, t in run.trajectories),
        "wall_seconds": _job_seconds(run, times),
        "rollout_tok_s": _mean(
            [v for r in run.metrics if (v := _number(r.get("rollout_tok/s"))) is not None]
        ),
        "any_tok_s": _mean(throughput),
    }
    if run.evaluation is not None:
        out["eval"] = {
            k: v for k, v in run.evaluation.items() if _number(v) is not None and "/" not in k
        }
    return out


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------- figures


@dataclass(kw_only=True, slots=True)
class Figure:
    """A rendered plot with its caption and the numbers it drew (embedded for checks)."""

    id: str
    section: str
    title: str
    svg: str
    caption: str
    data: dict[str, Any]


def _label(key: str, run: RunData, runs: Sequence[RunData], with_key: bool) -> str:
    if len(runs) < 2:
        return key
    return f"{key} ({run.name})" if with_key else run.name


def metric_figure(
    runs: Sequence[RunData],
    fig_id: str,
    section: str,
    title: str,
    keys: Sequence[str],
    caption: str,
    *,
    y_label: str = "",
    unit_range: bool = False,
    key_labels: bool = False,
    unless_zero: str | None = None,
) -> Figure | None:
    """A line plot of ``keys`` over steps for every run that has them; None when none has any.

    One key: one color per run. Several keys: one color per key, the second run dashed. Labels
    name the run when there are two, and the key too when there are several or ``key_labels``.
    """
    series, data = [], []
    keys = [k for k in keys if any(run.column(k)[0] for run in runs)]
    for r, run in enumerate(runs):
        for k, key in enumerate(keys):
            xs, ys = run.column(key, unless_zero=unless_zero)
            if not any(y is not None for y in ys):
                continue
            color = RUN_COLORS[r % 2] if len(keys) == 1 else PALETTE[k % len(PALETTE)]
            label = _label(key, run, runs, len(keys) > 1 or key_labels)
            series.append(Series(label=label, xs=xs, ys=ys, color=color, dashed=r > 0))
            data.append({"label": label, "run": r, "key": key, "x": xs, "y": ys})
    if not series:
        return None
    values = [y for s in series for y in s.ys if y is not None]
    y_range = (
        (0.0, 1.0) if unit_range and values and min(values) >= 0 and max(values) <= 1 else None
    )
    svg = plots.line_plot(
        fig_id, title, series, y_label=y_label, y_range=y_range, legend=len(runs) > 1
    )
    return Figure(
        id=fig_id, section=section, title=title, svg=svg, caption=caption, data={"series": data}
    )


def _keys_with(runs: Sequence[RunData], predicate: Any) -> list[str]:
    seen: dict[str, None] = {}
    for run in runs:
        for key in run.keys():
            if predicate(key):
                seen.setdefault(key, None)
    return list(seen)


def _nonzero(runs: Sequence[RunData], keys: Sequence[str]) -> list[str]:
    keep = [
        k for k in keys if any(any(y for y in run.column(k)[1] if y is not None) for run in runs)
    ]
    return keep or list(keys)


@dataclass(frozen=True, slots=True)
class LineSpec:
    """A line figure of the report: which metric keys it draws, and how."""

    id: str
    section: str
    title: str
    caption: str
    keys: tuple[str, ...] = ()
    """Exact keys, in legend order."""
    prefixes: tuple[str, ...] = ()
    """Or every logged key starting with one of these (a group such as ``err/``)."""
    contains: tuple[str, ...] = ()
    """Or every logged key containing one of these (``tok/s``)."""

    def select(self, runs: Sequence[RunData]) -> list[str]:
        if self.keys:
            return list(self.keys)
        return _keys_with(
            runs,
            lambda k: k.startswith(self.prefixes) or any(c in k for c in self.contains),
        )

    y_label: str = ""
    unit_range: bool = False
    """Fix the y axis to [0, 1] when every value lies in it."""
    drop_zero: bool = False
    """Leave out keys that are 0 at every step of every run (unless all are)."""
    unless_zero: str | None = None
    """A count key: where it is 0 the step is a gap (see ``RunData.column``)."""


SECTIONS = (
    "Learning",
    "Tool calls",
    "Text feedback",
    "Monitor",
    "Curriculum",
    "Throughput",
    "Other metrics",
)
LINE_FIGURES = (
    LineSpec(
        id="reward",
        section="Learning",
        title="Reward and pass rate",
        keys=("reward", "pass_rate"),
        unit_range=True,
        caption="Mean reward of the step's rollouts and the share that passed every test "
        "(reward >= 1), after the monitor zeroed flagged episodes.",
    ),
    LineSpec(
        id="loss",
        section="Learning",
        title="Loss",
        keys=("loss", "pg_loss"),
        caption="Total loss (RL + beta x KL) and its PPO-clip policy-gradient part.",
    ),
    LineSpec(
        id="entropy",
        section="Learning",
        title="Policy entropy",
        keys=("entropy",),
        caption="Mean entropy of the policy over generated tokens (nats).",
    ),
    LineSpec(
        id="clip_frac",
        section="Learning",
        title="Clipped fraction",
        keys=("clip_frac",),
        caption="Share of generated tokens whose importance ratio was clipped.",
    ),
    LineSpec(
        id="tool_errors",
        section="Tool calls",
        title="Tool-call errors by kind",
        prefixes=("err/", "errors/"),
        drop_zero=True,
        y_label="per assistant turn",
        caption="Typed tool-call errors per assistant turn: unknown tools, malformed JSON, bad "
        "arguments, paths outside the workspace, failed tools, turns without a call. Kinds "
        "that never occur are left out.",
    ),
    LineSpec(
        id="hints",
        section="Text feedback",
        title="Hints per batch",
        keys=("hints", "hints_detected"),
        caption="hints: distinct assistant turns that got a hint spliced in (their KL enters "
        "the loss); hints_detected: hints the detectors produced (one turn may get several).",
    ),
    LineSpec(
        id="hint_kinds",
        section="Text feedback",
        title="Hints by detector",
        prefixes=("hint/",),
        caption="Hints per batch by the detector that wrote them.",
    ),
    LineSpec(
        id="kl",
        section="Text feedback",
        title="KL on hinted turns",
        keys=("kl",),
        unless_zero="kl_tokens",
        caption="Mean per-token KL between the student and the hinted teacher over the hinted "
        "turns' generated tokens (fp32; reverse KL unless configured otherwise). A step "
        "without hinted turns (kl_tokens = 0) is a gap, not a zero.",
    ),
    LineSpec(
        id="monitor_flags",
        section="Monitor",
        title="Monitor flags by category",
        prefixes=("monitor/category/",),
        caption="Trajectories flagged per batch, by hack category (monitor/category/<name>).",
    ),
    LineSpec(
        id="monitor_zeroed",
        section="Monitor",
        title="Rewards zeroed by the monitor",
        keys=("monitor/zeroed",),
        caption="Trajectories per batch whose reward the monitor set to zero.",
    ),
    LineSpec(
        id="curriculum_metrics",
        section="Curriculum",
        title="Curriculum over training",
        prefixes=("curriculum/", "pool/"),
        caption="Pool statistics logged by the trainer.",
    ),
    LineSpec(
        id="throughput",
        section="Throughput",
        title="Throughput",
        contains=("tok/s",),
        y_label="tokens / s",
        caption="Tokens per second: rollout (generated tokens over rollout time) and training "
        "(episode tokens over train time).",
    ),
    LineSpec(
        id="step_seconds",
        section="Throughput",
        title="Seconds per step",
        keys=("step_seconds",),
        caption="Wall-clock seconds of each step (rollouts, teacher, updates, checkpoint).",
    ),
)


def _bar_figure(
    fig_id: str,
    section: str,
    title: str,
    caption: str,
    categories: list[str],
    groups: list[Bars],
    y_label: str,
) -> Figure:
    svg = plots.bar_chart(fig_id, title, categories, groups, y_label=y_label)
    data = {
        "categories": categories,
        "groups": [{"label": g.label, "values": g.values} for g in groups],
    }
    return Figure(id=fig_id, section=section, title=title, svg=svg, caption=caption, data=data)


def build_figures(runs: Sequence[RunData]) -> list[Figure]:
    """Every figure of the report, in page order; figures whose data is absent are left out."""
    figs: list[Figure | None] = []
    used: set[str] = set()
    for spec in LINE_FIGURES:
        keys = spec.select(runs)
        used.update(keys)
        if spec.drop_zero:
            keys = _nonzero(runs, keys)
        figs.append(
            metric_figure(
                runs,
                spec.id,
                spec.section,
                spec.title,
                keys,
                spec.caption,
                y_label=spec.y_label,
                unit_range=spec.unit_range,
                key_labels=not spec.keys,
                unless_zero=spec.unless_zero,
            )
        )
    totals = [monitor_categories(run) for run in runs]
    categories = sorted({c for counts, _ in totals for c in counts})
    if categories:
        groups = [
            Bars(
                label=run.name,
                values=[float(counts.get(c, 0)) for c in categories],
                color=RUN_COLORS[r % 2],
            )
            for r, (run, (counts, _)) in enumerate(zip(runs, totals))
        ]
        source = " and ".join(sorted({src for _, src in totals}))
        caption = (
            f"Whole run, from {source}: trajectories with at least one flag of the category "
            "(any severity)."
        )
        figs.append(
            _bar_figure(
                "monitor_categories",
                "Monitor",
                "Flagged trajectories by category",
                caption,
                categories,
                groups,
                "trajectories",
            )
        )
    figs += _curriculum_figures(runs)
    figs += _other_figures(runs, used)
    present = [f for f in figs if f is not None]
    assert all(f.section in SECTIONS for f in present)
    # stable: within a section, line figures keep the table's order, bar charts follow
    return sorted(present, key=lambda f: SECTIONS.index(f.section))


def _curriculum_figures(runs: Sequence[RunData]) -> list[Figure]:
    figs = []
    groups, sources = [], []
    for r, run in enumerate(runs):
        rows = curriculum_rows(run)
        if rows:
            rates = [row["posterior_pass_rate"] for row in rows.values()]
            sources.append("pool state (posterior mean)")
        else:
            rates = [row["pass_rate"] for row in task_statistics(run).values()]
            sources.append("trajectories (observed)")
        if rates:
            groups.append((run.name, rates, RUN_COLORS[r % 2]))
    if groups:
        labels, _ = plots.histogram_counts([], bins=10)
        figs.append(
            Figure(
                id="curriculum_pass_rate",
                section="Curriculum",
                title="Task pass rates",
                svg=plots.histogram(
                    "curriculum_pass_rate",
                    "Task pass rates",
                    groups,
                    x_label="pass rate",
                    y_label="tasks",
                ),
                caption="Tasks by pass rate, from the "
                + " / ".join(dict.fromkeys(sources))
                + ". The curriculum samples tasks near 0.5, where a group's rewards vary most.",
                data={
                    "bins": labels,
                    "groups": [
                        {"label": g[0], "counts": plots.histogram_counts(g[1], bins=10)[1]}
                        for g in groups
                    ],
                },
            )
        )
    categories = ["active", "retired", "unsolved", "variants"]
    pool_groups = []
    for r, run in enumerate(runs):
        rows = curriculum_rows(run)
        if not rows:
            continue
        counts = [sum(row["status"] == c for row in rows.values()) for c in categories[:3]]
        counts.append(sum(row["generation"] > 0 for row in rows.values()))
        pool_groups.append(
            Bars(label=run.name, values=[float(c) for c in counts], color=RUN_COLORS[r % 2])
        )
    if pool_groups:
        figs.append(
            _bar_figure(
                "curriculum_pool",
                "Curriculum",
                "Pool: status and variants spawned",
                "Tasks in the pool by status (retired = mastered, unsolved = never passed) and "
                "variants spawned (harder ones of retired tasks, easier ones of unsolved tasks).",
                categories,
                pool_groups,
                "tasks",
            )
        )
    return figs


def _other_figures(runs: Sequence[RunData], used: set[str]) -> list[Figure | None]:
    groups: dict[str, list[str]] = {}
    for key in _keys_with(runs, lambda k: k not in used):
        prefix = key.rsplit("/", 1)[0] if "/" in key else key
        groups.setdefault(prefix, []).append(key)
    figs = []
    for prefix, keys in groups.items():
        note = ""
        if len(keys) > MAX_SERIES:

            def total(k: str) -> float:
                return sum(abs(y) for run in runs for y in run.column(k)[1] if y is not None)

            keys = sorted(keys, key=total, reverse=True)[:MAX_SERIES]
            note = f" The {MAX_SERIES} keys with the largest totals of {len(groups[prefix])}."
        fig_id = "other_" + re.sub(r"[^A-Za-z0-9]+", "_", prefix).strip("_")
        figs.append(
            metric_figure(
                runs,
                fig_id,
                "Other metrics",
                prefix,
                keys,
                f"Logged keys under {prefix!r}.{note}",
                key_labels=True,
            )
        )
    return figs


# ---------------------------------------------------------------- page


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else escape(str(v))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s"


def _summary_html(runs: Sequence[RunData], summaries: Sequence[dict[str, Any]]) -> str:
    cards = [
        ("final reward", "final_reward", 3),
        ("final pass rate", "final_pass_rate", 3),
        ("steps", "steps", 0),
        ("trajectories", "trajectories", 0),
        ("tasks", "tasks", 0),
        ("flagged (sev >= 3)", "flagged", 0),
        ("hints", "hints", 0),
    ]
    blocks = []
    for r, (run, s) in enumerate(zip(runs, summaries)):
        items = [
            f'<div class="stat"><div class="v" data-stat="{key}">{_fmt(s[key], d)}</div>'
            f'<div class="k">{escape(label)}</div></div>'
            for label, key, d in cards
        ]
        items.append(
            f'<div class="stat"><div class="v" data-stat="wall">{_duration(s["wall_seconds"])}</div>'
            '<div class="k">wall time</div></div>'
        )
        rollout = s["rollout_tok_s"] is not None
        tput = s["rollout_tok_s"] if rollout else s["any_tok_s"]
        items.append(
            f'<div class="stat"><div class="v" data-stat="tok_s">'
            f"{'-' if tput is None else f'{tput:,.0f}'}</div>"
            f'<div class="k">{"rollout tok/s" if rollout else "tok/s"}</div></div>'
        )
        for key, value in (s.get("eval") or {}).items():
            items.append(
                f'<div class="stat eval"><div class="v" data-stat="eval/{escape(key)}">'
                f'{_fmt(value)}</div><div class="k">eval {escape(key)}</div></div>'
            )
        trend = ""
        if s["first_reward"] is not None and s["final_reward"] is not None:
            trend = (
                f'<span class="trend">reward {_fmt(s["first_reward"])} at the first step, '
                f"{_fmt(s['final_reward'])} at the last, best {_fmt(s['best_reward'])}</span>"
            )
        verdict = (run.evaluation or {}).get("verdict")
        verdict_html = (
            f'<div class="verdict" data-verdict="{r}">{escape(verdict)}</div>'
            if isinstance(verdict, str) and verdict
            else ""
        )
        blocks.append(
            f'<div class="run-summary" data-run="{r}"><div class="run-name">'
            f'<span class="swatch" style="background:{RUN_COLORS[r % 2]}"></span>'
            f'{escape(run.name)} <span class="path">{escape(str(run.path))}</span>{trend}</div>'
            f'{verdict_html}<div class="stats">{"".join(items)}</div></div>'
        )
    return "\n".join(blocks)


def _tasks_html(runs: Sequence[RunData]) -> tuple[str, list[dict[str, Any]]]:
    records: dict[str, TaskRecord] = {}
    for run in runs:
        for t in run.tasks:
            records.setdefault(t.instance_id, t)
    stats = [task_statistics(run) for run in runs]
    pools = [curriculum_rows(run) for run in runs]
    ids = list(records)
    ids += sorted({i for s in stats for i in s} - set(ids))
    multi = len(runs) > 1
    head = ["task", "kind", "parent", "deleted", "F2P", "P2P", "difficulty"]
    for run in runs:
        suffix = f" ({run.name})" if multi else ""
        head += [f"rollouts{suffix}", f"pass rate{suffix}", f"mean reward{suffix}"]
        if any(pools):
            head += [f"pool status{suffix}", f"posterior{suffix}"]
    rows, data = [], []
    for task_id in ids:
        rec = records.get(task_id)
        info = rec.etude if rec is not None else None
        difficulty = ", ".join(f"{k} {v:g}" for k, v in (info.difficulty if info else {}).items())
        row = {
            "task": task_id,
            "kind": info.kind if info else "",
            "parent": (info.parent or "") if info else "",
            "deleted": ", ".join(info.symbols or info.deleted_files) if info else "",
            "F2P": len(rec.FAIL_TO_PASS) if rec else None,
            "P2P": len(rec.PASS_TO_PASS) if rec else None,
            "difficulty": difficulty,
            "runs": [],
        }
        cells = [
            escape(row["task"]),
            escape(row["kind"]),
            escape(row["parent"]),
            escape(row["deleted"][:80]),
            _fmt(row["F2P"]),
            _fmt(row["P2P"]),
            escape(difficulty),
        ]
        for r in range(len(runs)):
            st = stats[r].get(task_id)
            pool = pools[r].get(task_id)
            row["runs"].append({**(st or {}), **({"pool": pool} if pool else {})})
            cells += [
                _fmt(st["rollouts"] if st else None),
                _fmt(st["pass_rate"] if st else None),
                _fmt(st["mean_reward"] if st else None),
            ]
            if any(pools):
                cells += [
                    escape(pool["status"]) if pool else "-",
                    _fmt(pool["posterior_pass_rate"] if pool else None),
                ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        data.append(row)
    if not rows:
        return '<p class="note">No tasks/tasks.jsonl and no trajectories in the run.</p>', []
    table = (
        '<div class="table-wrap"><table id="tasks" class="sortable"><thead><tr>'
        + "".join(f"<th>{escape(h)}</th>" for h in head)
        + "</tr></thead><tbody>"
        + "\n".join(rows)
        + "</tbody></table></div>"
    )
    return table, data


def _job_seconds(run: RunData, times: Sequence[float]) -> float | None:
    """The whole job's wall time: the stages' seconds of a demo run, else the metrics' span."""
    if run.stages:
        seconds = [_number(v.get("seconds")) for v in run.stages.values() if isinstance(v, dict)]
        if any(x is not None for x in seconds):
            return float(sum(x for x in seconds if x is not None))
    return (max(times) - min(times)) if len(times) > 1 else None


def _is_eval(src: str) -> bool:
    return src.startswith(EVAL_TRAJECTORIES + ":")


def _viewer_data(runs: Sequence[RunData], max_trajectories: int) -> tuple[list[dict], str]:
    items = [
        (r, step, src, traj) for r, run in enumerate(runs) for step, src, traj in run.trajectories
    ]

    def priority(traj: Trajectory) -> int:
        if traj.flags:
            return 0
        kl = any(turn_kl(traj, i) is not None for i in range(len(traj.turns)))
        return 1 if traj.feedback or kl else 2

    priorities = [priority(t) for _, _, _, t in items]
    # the final evaluation's episodes always get a share of the page (up to a quarter)
    evals = [i for i, (_, _, src, _) in enumerate(items) if _is_eval(src)]
    train = [i for i in range(len(items)) if not _is_eval(items[i][2])]
    num_eval = min(len(evals), max(max_trajectories // 4, 1) if max_trajectories > 0 else 0)
    picked_eval = [evals[k] for k in select_trajectories([2] * len(evals), num_eval)]
    picked_train = select_trajectories(
        [priorities[i] for i in train], max_trajectories - len(picked_eval)
    )
    chosen = sorted(picked_eval + [train[k] for k in picked_train])
    size, dropped = 0, 0
    order = sorted(chosen, key=lambda i: priorities[i])
    kept: dict[int, dict] = {}
    for i in order:
        r, step, src, traj = items[i]
        rec = viewer_record(
            traj, index=i, run=r, step=step, source=src, tokenizer=runs[r].tokenizer
        )
        n = len(json.dumps(rec))
        if size + n > MAX_EMBEDDED_CHARS:
            dropped += 1
            continue
        size += n
        kept[i] = rec
    records = [kept[i] for i in sorted(kept)]
    assert len(records) + dropped == len(chosen)
    note = f"{len(records)} of {len(items)} trajectories embedded"
    if len(records) < len(items):
        note += (
            " (flagged, hinted and KL-carrying ones first, spread over the run; raise "
            "--max-trajectories to embed more)"
        )
    if dropped:
        note += f"; {dropped} left out to keep the page under {MAX_EMBEDDED_CHARS // 1_000_000} MB"
    return records, note + ". Click a row to read it."


PAGE_CSS = """
:root { --ink: #111827; --muted: #6b7280; --line: #e5e7eb; --bg: #f6f7f9; --run0: #2563eb;
  --run1: #ea580c; --mono: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--ink); line-height: 1.5;
  font: 14px/1.5 ui-sans-serif, system-ui, -apple-system, "Segoe UI", sans-serif; }
header { background: #111827; color: #f9fafb; padding: 22px 32px 18px; }
header h1 { margin: 0; font-size: 22px; font-weight: 650; letter-spacing: -.01em; }
header p { margin: 4px 0 0; color: #9ca3af; font-size: 13px; }
main { max-width: 1240px; margin: 0 auto; padding: 18px 24px 48px; }
nav { display: flex; flex-wrap: wrap; gap: 6px 14px; margin: 2px 0 14px; font-size: 13px; }
nav a { color: var(--muted); text-decoration: none; }
nav a:hover { color: var(--ink); }
.run-summary { background: #fff; border: 1px solid var(--line); border-radius: 10px;
  padding: 12px 16px; margin-bottom: 10px; }
.verdict { font-size: 16px; font-weight: 650; margin: 6px 0 10px; padding: 8px 12px; border-left: 4px solid #2563eb; background: #eff6ff; }
.run-name { font-weight: 650; font-size: 15px; display: flex; align-items: center; gap: 8px;
  flex-wrap: wrap; }
.run-name .path { font-weight: 400; color: var(--muted); font-size: 12px; font-family: var(--mono); }
.run-name .trend { font-weight: 400; color: var(--muted); font-size: 12.5px; margin-left: auto; }
.swatch { width: 12px; height: 12px; border-radius: 3px; display: inline-block; }
.stats { display: flex; flex-wrap: wrap; gap: 8px 28px; margin-top: 8px; }
.stat .v { font-size: 22px; font-weight: 650; font-variant-numeric: tabular-nums; }
.stat .k { font-size: 11.5px; color: var(--muted); text-transform: uppercase; letter-spacing: .04em; }
.stat.eval .v { color: #047857; }
h2 { font-size: 17px; margin: 0 0 4px; letter-spacing: -.01em; }
section.group { margin-top: 22px; }
section.group > h2 { margin: 0 0 10px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 14px; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 10px; padding: 12px 14px; }
.card.wide { margin-top: 22px; }
figure { margin: 0; }
figure svg { width: 100%; height: auto; display: block; }
figcaption { font-size: 12.5px; color: var(--muted); margin-top: 4px; }
.note { font-size: 12.5px; color: var(--muted); margin: 2px 0 8px; }
.table-wrap { max-height: 520px; overflow: auto; border: 1px solid var(--line); border-radius: 8px; }
table.sortable { border-collapse: collapse; width: 100%; font-size: 12.5px; }
table.sortable th { position: sticky; top: 0; background: #f9fafb; text-align: left; padding: 6px 8px;
  border-bottom: 1px solid var(--line); cursor: pointer; white-space: nowrap; font-weight: 600; }
table.sortable td { padding: 5px 8px; border-bottom: 1px solid #f3f4f6; font-variant-numeric: tabular-nums; }
table.sortable tr:hover td { background: #fafafa; }
details { margin-top: 22px; }
details summary { cursor: pointer; font-weight: 650; font-size: 15px; }
details pre { font-family: var(--mono); font-size: 12px; background: #fff; border: 1px solid var(--line);
  border-radius: 8px; padding: 10px; max-height: 420px; overflow: auto; }
#report-errors { background: #fef2f2; color: #991b1b; border: 1px solid #fecaca; border-radius: 8px;
  padding: 8px 12px; margin: 10px 0; font-family: var(--mono); font-size: 12px; }
"""

ERRORS_JS = """
window.__reportErrors = [];
window.__reportError = function (message) {
  window.__reportErrors.push(String(message));
  const box = document.getElementById("report-errors");
  if (box) { box.hidden = false; box.textContent = window.__reportErrors.join("\\n");
    box.dataset.count = String(window.__reportErrors.length); }
};
window.addEventListener("error", e => window.__reportError("error: " + e.message));
const consoleError = console.error.bind(console);
console.error = (...args) => { window.__reportError("console: " + args.join(" ")); consoleError(...args); };
window.addEventListener("unhandledrejection", e => window.__reportError("rejection: " + e.reason));
"""

MAIN_JS = """
function sortableTables() {
  for (const table of document.querySelectorAll("table.sortable")) {
    table.querySelectorAll("th").forEach((th, col) => th.addEventListener("click", () => {
      const body = table.tBodies[0];
      const dir = th.dataset.dir === "asc" ? -1 : 1;
      th.dataset.dir = dir === 1 ? "asc" : "desc";
      const value = tr => { const t = tr.cells[col].textContent.replace(/,/g, "");
        const n = parseFloat(t); return isNaN(n) || t === "-" ? t : n; };
      const rows = [...body.rows].sort((a, b) => { const x = value(a), y = value(b);
        if (typeof x === typeof y) return (x < y ? -1 : x > y ? 1 : 0) * dir;
        return (typeof x === "number" ? -1 : 1) * dir; });
      body.append(...rows);
    }));
  }
}
try {
  const data = JSON.parse(document.getElementById("etude-data").textContent);
  renderViewer(data);
  sortableTables();
  const plots = document.querySelectorAll("svg.plot");
  document.body.dataset.plots = String(plots.length);
  document.body.dataset.emptyPlots = String([...plots].filter(p => p.dataset.points === "0").length);
  document.body.dataset.rendered = "1";
} catch (e) {
  window.__reportError("render: " + (e && e.stack ? e.stack : e));
}
"""


def _embed_json(data: Any) -> str:
    # '<' escaped so no text inside the data can close the script element
    return json.dumps(data, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")


def build_report(
    run_dirs: Sequence[str | Path], *, max_trajectories: int = DEFAULT_MAX_TRAJECTORIES
) -> str:
    """The report page for one run, or two overlaid, as an HTML string."""
    if not 1 <= len(run_dirs) <= 2:
        raise ValueError(f"pass one or two run directories, got {len(run_dirs)}")
    if max_trajectories < 0:
        raise ValueError(f"--max-trajectories={max_trajectories} must be >= 0 (0 embeds none)")
    names = [Path(d).resolve().name for d in run_dirs]
    if len(names) == 2 and names[0] == names[1]:
        names = [f"{Path(d).resolve().parent.name}/{n}" for d, n in zip(run_dirs, names)]
    runs = [load_run(d, name=n) for d, n in zip(run_dirs, names)]
    summaries = [run_summary(run) for run in runs]
    figures = build_figures(runs)
    tasks_table, tasks_data = _tasks_html(runs)
    trajectories, viewer_note = _viewer_data(runs, max_trajectories)

    sections: dict[str, list[Figure]] = {}
    for fig in figures:
        sections.setdefault(fig.section, []).append(fig)
    body, other, nav, nav_other = [], [], [], []
    for section, figs in sections.items():
        sid = "sec-" + re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-")
        cards = "\n".join(
            f'<div class="card"><figure id="fig-{f.id}">{f.svg}'
            f"<figcaption>{escape(f.caption)}</figcaption></figure></div>"
            for f in figs
        )
        if section == "Other metrics":  # collapsed, after the viewer
            nav_other.append(f'<a href="#{sid}">{escape(section)}</a>')
            other.append(
                f'<details id="{sid}"><summary>Other metrics ({len(figs)})</summary>'
                f'<div class="grid" style="margin-top:10px">{cards}</div></details>'
            )
        else:
            nav.append(f'<a href="#{sid}">{escape(section)}</a>')
            body.append(
                f'<section class="group" id="{sid}"><h2>{escape(section)}</h2>'
                f'<div class="grid">{cards}</div></section>'
            )
    nav += ['<a href="#tasks-section">Tasks</a>', '<a href="#viewer">Trajectory viewer</a>']
    nav += nav_other
    for run in runs:  # written by `etude monitor RUN_DIR`, beside the run's monitor.json
        if (run.path / "monitor.html").is_file():
            href = os.path.relpath(run.path / "monitor.html", runs[0].path)
            label = "Monitor report" + (f" ({run.name})" if len(runs) > 1 else "")
            nav.append(f'<a href="{escape(href)}">{escape(label)}</a>')

    data = {
        "runs": [
            {"name": run.name, "path": str(run.path), "summary": s}
            for run, s in zip(runs, summaries)
        ],
        "figures": {f.id: {"title": f.title, "section": f.section, **f.data} for f in figures},
        "tasks": tasks_data,
        "trajectories": trajectories,
        "viewer_note": viewer_note,
    }
    configs = "".join(
        f"<h3>{escape(run.name)}</h3><pre>{escape(json.dumps(run.config, indent=2)[:40_000])}</pre>"
        f"<pre>{escape(json.dumps(run.versions, indent=2))}</pre>"
        for run in runs
    )
    title = " vs ".join(run.name for run in runs)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>etude report: {escape(title)}</title>
<style>{PAGE_CSS}{VIEWER_CSS}</style>
<script>{ERRORS_JS}</script>
</head><body>
<header><h1>etude run report: {escape(title)}</h1>
<p>Built from the run directory's own files: metrics.jsonl, trajectories, tasks, curriculum and
monitor state. Hover a point or bar for its value.</p></header>
<main>
<div id="report-errors" hidden data-count="0"></div>
<nav>{"".join(nav)}</nav>
{_summary_html(runs, summaries)}
{"".join(body)}
<section class="card wide" id="tasks-section"><h2>Tasks</h2>
<p class="note">Pass rate and mean reward over every rollout in the run's trajectory files
(passed = reward &gt;= 1); posterior = the curriculum's Beta posterior mean. Click a column to sort.</p>
{tasks_table}</section>
{VIEWER_HTML}
{"".join(other)}
<details id="config"><summary>Config and versions</summary>{configs}</details>
</main>
<script type="application/json" id="etude-data">{_embed_json(data)}</script>
<script>{VIEWER_JS}
{MAIN_JS}</script>
</body></html>
"""


def write_report(
    run_dirs: Sequence[str | Path],
    out: str | Path | None = None,
    *,
    max_trajectories: int = DEFAULT_MAX_TRAJECTORIES,
) -> Path:
    """Build the report and write it (default ``RUN_DIR/report.html``) atomically."""
    page = build_report(run_dirs, max_trajectories=max_trajectories)
    path = Path(out) if out is not None else Path(run_dirs[0]) / "report.html"
    if path.is_dir():
        raise ValueError(f"--out {str(path)!r} is a directory; name the HTML file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path
