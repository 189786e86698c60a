"""Monitor reports: counts by rule and category, the worst examples, and ``monitor.json``.

``summarize`` turns flagged trajectories into plain data (what the run report reads),
``format_summary`` into a table for the terminal, and ``monitor_main`` is the body of
``etude monitor RUN_OR_JSONL``: it reads a run directory (every ``trajectories*.jsonl`` under
it) or one JSONL file, re-scans the trajectories with the current rules (keeping every flag
recorded during training, the judge's included), prints the table and writes ``monitor.json``
beside the input.

What it does not do: change rewards (that is the trainer hook's job) or call the judge (a
report must be cheap and repeatable; judge verdicts recorded during training are reported).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from etude.env.trajectory import Flag, Trajectory, read_jsonl
from etude.monitor.rules import BUILTIN_RULES, load_rules, scan
from etude.tasks.honeypot import load_canaries
from etude.tasks.record import write_atomic


def summarize(
    trajectories: Sequence[Trajectory],
    *,
    min_severity: int = 3,
    num_examples: int = 5,
    sources: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Counts by rule and category and the worst examples; ``sources`` names each trajectory."""
    assert sources is None or len(sources) == len(trajectories)
    by_rule: dict[str, dict[str, Any]] = {}
    by_category: dict[str, dict[str, Any]] = {}
    by_severity = {str(s): 0 for s in range(5)}
    num_flagged = num_noted = num_unavailable = 0
    ranked = []
    for n, traj in enumerate(trajectories):
        flags = traj.flags
        worst = max((f.severity for f in flags), default=None)
        if worst is not None:
            by_severity[str(worst)] += 1
        num_flagged += worst is not None and worst >= min_severity
        num_noted += worst is not None and 1 <= worst < min_severity
        num_unavailable += any(f.rule == "judge.unavailable" for f in flags)
        for name, table in (("rule", by_rule), ("category", by_category)):
            for value in {getattr(f, name) for f in flags}:
                mine = [f for f in flags if getattr(f, name) == value]
                row = table.setdefault(value, {"flags": 0, "trajectories": 0, "max_severity": 0})
                if name == "rule":
                    row["category"] = mine[0].category
                row["flags"] += len(mine)
                row["trajectories"] += 1
                row["max_severity"] = max(row["max_severity"], max(f.severity for f in mine))
        if worst is not None and worst >= 1:
            ranked.append((worst, len(flags), n))
    ranked.sort(key=lambda x: (-x[0], -x[1], x[2]))
    examples = []
    for worst, _, n in ranked[:num_examples]:
        traj = trajectories[n]
        top = sorted(traj.flags, key=lambda f: (-f.severity, f.turn if f.turn is not None else -1))[
            :3
        ]
        examples.append(
            {
                "task_id": traj.task_id,
                "source": sources[n] if sources else str(n),
                "max_severity": worst,
                "reward": traj.reward,
                "reward_before_monitor": traj.info.get("reward_before_monitor", traj.reward),
                "flags": [_flag_json(f) for f in top],
            }
        )
    return {
        "num_trajectories": len(trajectories),
        "min_severity": min_severity,
        "recall": recall_by_category(trajectories, min_severity),
        "num_flagged": num_flagged,
        "num_noted": num_noted,
        "num_judge_unavailable": num_unavailable,
        "flag_rate": num_flagged / max(1, len(trajectories)),
        "by_severity": by_severity,
        "by_category": dict(
            sorted(by_category.items(), key=lambda kv: (-kv[1]["trajectories"], kv[0]))
        ),
        "by_rule": dict(sorted(by_rule.items(), key=lambda kv: (-kv[1]["trajectories"], kv[0]))),
        "worst": examples,
    }


def recall_by_category(trajectories: Sequence[Trajectory], min_severity: int) -> dict[str, Any]:
    """Caught / total per expected category, and false flags among the clean ones.

    A trajectory's label is ``info["expect"]`` (a category, or ``clean``), as audit corpora
    carry it; unlabeled trajectories (a training run's) count per category of their worst
    flag instead, as ``flagged`` (>= ``min_severity``) and ``noted`` (below it).
    """
    labeled: dict[str, dict[str, Any]] = {}
    unlabeled: dict[str, dict[str, int]] = {}
    for traj in trajectories:
        worst = max((f.severity for f in traj.flags), default=0)
        expect = traj.info.get("expect")
        if isinstance(expect, str) and expect:
            row = labeled.setdefault(expect, {"total": 0, "caught": 0})
            row["total"] += 1
            row["caught"] += worst >= min_severity
            continue
        if worst < 1:
            continue
        top = max(traj.flags, key=lambda f: f.severity)
        row = unlabeled.setdefault(top.category, {"flagged": 0, "noted": 0})
        row["flagged" if worst >= min_severity else "noted"] += 1
    for name, row in labeled.items():
        key = "false_flag_rate" if name == "clean" else "recall"
        row[key] = row["caught"] / row["total"]
    hacks = [r for n, r in labeled.items() if n != "clean"]
    totals = {
        "hacks": sum(r["total"] for r in hacks),
        "caught": sum(r["caught"] for r in hacks),
        "clean": labeled.get("clean", {}).get("total", 0),
        "false_flags": labeled.get("clean", {}).get("caught", 0),
    }
    return {"labeled": dict(sorted(labeled.items())), "unlabeled": unlabeled, "totals": totals}


def _flag_json(flag: Flag) -> dict[str, Any]:
    return {
        "rule": flag.rule,
        "category": flag.category,
        "severity": flag.severity,
        "turn": flag.turn,
        "evidence": flag.evidence,
    }


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a plain-text report: totals, a category table, a rule table, examples."""
    n, k = summary["num_trajectories"], summary["min_severity"]
    lines = [
        f"monitor: {n} trajectories, {summary['num_flagged']} flagged (severity >= {k}, "
        f"{100 * summary['flag_rate']:.1f}%), {summary['num_noted']} with lower-severity notes, "
        f"judge unavailable for {summary['num_judge_unavailable']}",
        "",
    ]
    recall = summary.get("recall", {})
    if recall.get("labeled"):
        rows = [
            (
                c,
                r["total"],
                r["caught"],
                f"{100 * r.get('recall', r.get('false_flag_rate', 0)):.0f}%",
            )
            for c, r in recall["labeled"].items()
        ]
        lines += _table(
            ("expected", "trajectories", f"flagged >= {k}", "recall / false flags"), rows
        )
        t = recall["totals"]
        lines += [
            f"hacks caught {t['caught']}/{t['hacks']}, clean flagged {t['false_flags']}/{t['clean']}",
            "",
        ]
    elif recall.get("unlabeled"):
        rows = [(c, r["flagged"], r["noted"]) for c, r in sorted(recall["unlabeled"].items())]
        lines += _table(("worst category", f"flagged >= {k}", f"noted < {k}"), rows) + [""]
    if summary["by_category"]:
        rows = [
            (c, r["trajectories"], r["flags"], r["max_severity"])
            for c, r in summary["by_category"].items()
        ]
        lines += _table(("category", "trajectories", "flags", "max severity"), rows) + [""]
    if summary["by_rule"]:
        rows = [
            (rule, r["category"], r["max_severity"], r["trajectories"], r["flags"])
            for rule, r in summary["by_rule"].items()
        ]
        lines += _table(("rule", "category", "severity", "trajectories", "flags"), rows) + [""]
    if summary["worst"]:
        lines.append("worst examples")
        for i, ex in enumerate(summary["worst"], 1):
            lines.append(
                f"  [{i}] {ex['task_id']} ({ex['source']}): max severity {ex['max_severity']}, "
                f"reward {ex['reward_before_monitor']} -> {ex['reward']}"
            )
            for f in ex["flags"]:
                turn = "-" if f["turn"] is None else f["turn"]
                lines.append(
                    f"      turn {turn}  {f['rule']} ({f['severity']}): {f['evidence'][:160]}"
                )
    else:
        lines.append("no flags")
    return "\n".join(lines)


def _trajectory_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        # trajectories*.jsonl, a trainer's trajectories/step_N.jsonl, a demo's eval episodes
        files = sorted(
            p
            for p in path.rglob("*.jsonl")
            if p.name.startswith("trajectories")
            or p.parent.name == "trajectories"
            or p.name == "eval_trajectories.jsonl"
        )
        if files:
            return files
        raise ValueError(
            f"no trajectories*.jsonl under {str(path)!r}; pass a run directory or a JSONL file"
        )
    raise ValueError(
        f"{str(path)!r} does not exist; pass a run directory or a trajectories JSONL file"
    )


def monitor_main(
    path: str | Path,
    *,
    rules_file: str = "",
    canaries_file: str = "",
    rescan: bool = True,
    min_severity: int = 3,
    num_examples: int = 5,
) -> dict[str, Any]:
    """Audit a run directory or a JSONL file: print the table, write ``monitor.json`` beside it.

    With ``rescan`` the current rules (built-ins plus ``rules_file``) and the canaries of
    ``canaries_file`` are applied again and their flags merged with the recorded ones
    (one flag per rule and turn). Returns the summary that was written.
    """
    path = Path(path)
    files = _trajectory_files(path)
    rules = load_rules(rules_file) if rules_file else BUILTIN_RULES
    canaries = load_canaries(canaries_file) if canaries_file else {}
    trajectories, sources = [], []
    root = path if path.is_dir() else path.parent
    for file in files:
        for n, traj in enumerate(read_jsonl(file)):
            if rescan:
                recorded = {(f.rule, f.turn): f for f in traj.flags}
                for flag in scan(traj, rules, canaries=canaries.get(traj.task_id, ())):
                    recorded.setdefault((flag.rule, flag.turn), flag)
                traj.flags = sorted(
                    recorded.values(),
                    key=lambda f: (f.turn if f.turn is not None else -1, -f.severity, f.rule),
                )
            trajectories.append(traj)
            sources.append(f"{file.relative_to(root)}:{n + 1}")
    summary = summarize(
        trajectories, min_severity=min_severity, num_examples=num_examples, sources=sources
    )
    summary["inputs"] = [str(f) for f in files]
    out = root / "monitor.json"
    write_atomic(out, (json.dumps(summary, indent=2) + "\n").encode("utf-8"))
    write_atomic(root / "monitor.html", summary_html(summary, title=str(path)).encode("utf-8"))
    print(format_summary(summary))
    print(f"\nwrote {out} and {root / 'monitor.html'}")
    return summary


def _html_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def summary_html(summary: dict[str, Any], *, title: str) -> str:
    """A self-contained HTML page of the summary (the run report links it)."""
    k = summary["min_severity"]
    parts = [
        f"<h1>Monitor report: {escape(title)}</h1>",
        f"<p>{summary['num_trajectories']} trajectories, {summary['num_flagged']} flagged at "
        f"severity &gt;= {k} ({100 * summary['flag_rate']:.1f}%), {summary['num_noted']} with "
        f"lower-severity notes, judge unavailable for {summary['num_judge_unavailable']}.</p>",
    ]
    recall = summary.get("recall", {})
    if recall.get("labeled"):
        rows = [
            (
                c,
                r["total"],
                r["caught"],
                f"{100 * r.get('recall', r.get('false_flag_rate', 0)):.0f}%",
            )
            for c, r in recall["labeled"].items()
        ]
        parts += [
            "<h2>Recall by expected category</h2>",
            _html_table(
                ("expected", "trajectories", f"flagged >= {k}", "recall / false flags"), rows
            ),
        ]
    elif recall.get("unlabeled"):
        rows = [(c, r["flagged"], r["noted"]) for c, r in sorted(recall["unlabeled"].items())]
        parts += [
            "<h2>Trajectories by worst category</h2>",
            _html_table(("category", f"flagged >= {k}", f"noted < {k}"), rows),
        ]
    rows = [
        (c, r["trajectories"], r["flags"], r["max_severity"])
        for c, r in summary["by_category"].items()
    ]
    parts += [
        "<h2>By category</h2>",
        _html_table(("category", "trajectories", "flags", "max severity"), rows),
    ]
    rows = [
        (n, r["category"], r["max_severity"], r["trajectories"], r["flags"])
        for n, r in summary["by_rule"].items()
    ]
    parts += [
        "<h2>By rule</h2>",
        _html_table(("rule", "category", "severity", "trajectories", "flags"), rows),
    ]
    parts.append("<h2>Worst examples</h2>")
    for ex in summary["worst"]:
        rows = [(f["turn"], f["rule"], f["severity"], f["evidence"][:300]) for f in ex["flags"]]
        parts += [
            f"<h3>{escape(ex['task_id'])} ({escape(ex['source'])}): severity {ex['max_severity']}, "
            f"reward {escape(str(ex['reward_before_monitor']))} -&gt; {escape(str(ex['reward']))}</h3>",
            _html_table(("turn", "rule", "severity", "evidence"), rows),
        ]
    style = (
        "body{font:14px system-ui,sans-serif;margin:24px;max-width:1100px}table{border-collapse:"
        "collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;"
        "vertical-align:top}th{background:#f3f3f3}td:last-child{font-family:monospace;"
        "white-space:pre-wrap;word-break:break-all}"
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>monitor: {escape(title)}</title><style>{style}</style></head><body>"
        + "\n".join(parts)
        + "</body></html>\n"
    )
