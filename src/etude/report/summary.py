"""The report's numbers and tables: per-run headline numbers, per-task statistics, their HTML.

``run_summary`` gives the numbers of the summary header (final reward and pass rate, steps,
trajectories, tasks, flagged trajectories, hints, wall time, throughput, ``eval.json`` numbers);
``task_statistics`` and ``curriculum_rows`` give the task table's per-task rollout and pool
columns; ``monitor_categories`` counts flagged trajectories per category. ``summary_html`` and
``tasks_html`` render the header and the sortable task table.

A task counts as passed in a rollout when its reward is at least 1.0 (the trainer's rule). The
wall time of an ``etude demo`` run is the sum of its stages' seconds (``stages.json``: the whole
job, over every invocation that did work); otherwise the span of the logged ``time`` values.

What it does not do: read run files (``etude.report.run_data``), draw plots
(``etude.report.figures``), or assemble the page (``etude.report.html``).
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from etude.report.plots import RUN_COLORS
from etude.report.run_data import RunData, finite_number
from etude.tasks.record import TaskRecord

PASS_REWARD = 1.0


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
    times = [t for r in run.metrics if (t := finite_number(r.get("time"))) is not None]
    flagged = sum(any(f.severity >= 3 for f in t.flags) for _, _, t in run.trajectories)
    throughput = [
        v
        for r in run.metrics
        for k, v in r.items()
        if "tok/s" in k and finite_number(v) is not None
    ]
    rewards = [finite_number(r.get("reward")) for r in run.metrics]
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
            [v for r in run.metrics if (v := finite_number(r.get("rollout_tok/s"))) is not None]
        ),
        "any_tok_s": _mean(throughput),
    }
    if run.evaluation is not None:
        out["eval"] = {
            k: v for k, v in run.evaluation.items() if finite_number(v) is not None and "/" not in k
        }
    return out


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _job_seconds(run: RunData, times: Sequence[float]) -> float | None:
    """The whole job's wall time: the stages' seconds of a demo run, else the metrics' span."""
    if run.stages:
        seconds = [
            finite_number(v.get("seconds")) for v in run.stages.values() if isinstance(v, dict)
        ]
        if any(x is not None for x in seconds):
            return float(sum(x for x in seconds if x is not None))
    return (max(times) - min(times)) if len(times) > 1 else None


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


def summary_html(runs: Sequence[RunData], summaries: Sequence[dict[str, Any]]) -> str:
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


def tasks_html(runs: Sequence[RunData]) -> tuple[str, list[dict[str, Any]]]:
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
