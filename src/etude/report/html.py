"""The run report: one self-contained ``report.html`` built from a run directory's own files.

``etude report RUN_DIR [RUN_DIR2]`` reads what a run wrote and renders it; nothing is recomputed
from a model. The page needs no network and opens from ``file://``: CSS, JavaScript and SVG are
inline and the data sits in the page as JSON (``<script id="etude-data">``), which the viewer
reads and a test can check against the files.

This module assembles the page: the summary header and task table (``etude.report.summary``),
the figures grouped by section (``etude.report.figures``; "Other metrics" collapsed after the
viewer), the trajectory viewer (``etude.report.viewer``) with the episodes chosen here (flagged,
hinted and KL-carrying first, the final evaluation's given up to a quarter, the whole bounded by
``--max-trajectories`` and ``MAX_EMBEDDED_CHARS``), links to each run's ``monitor.html``, and the
config and versions. What a run directory may hold is in ``etude.report.run_data``. With two run
directories the figures overlay both runs and the viewer can pick from either.

What it does not do: serve pages, watch a run live, or fetch anything.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from etude.env.trajectory import Trajectory
from etude.report.figures import Figure, build_figures
from etude.report.run_data import EVAL_TRAJECTORIES, RunData, load_run
from etude.report.summary import run_summary, summary_html, tasks_html
from etude.report.viewer import (
    VIEWER_CSS,
    VIEWER_HTML,
    VIEWER_JS,
    select_trajectories,
    turn_kl,
    viewer_record,
)

DEFAULT_MAX_TRAJECTORIES = 120
MAX_EMBEDDED_CHARS = 12_000_000
"""Trajectory JSON beyond this many characters is left out (plain ones first), whatever the cap."""


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
    tasks_table, tasks_data = tasks_html(runs)
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
{summary_html(runs, summaries)}
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
