"""The report's figures: which plots a run's files give, in which section, with what caption.

``LINE_FIGURES`` is the table of line plots over training steps: each ``LineSpec`` names the
metric keys it draws (exact keys, a prefix such as ``err/``, or a substring such as ``tok/s``),
its section and caption. Known keys get their own figures (reward and pass rate; tool-call error
rates ``err/<kind>`` or ``errors/<kind>``; ``hints``, ``hints_detected`` and ``hint/<kind>``;
``kl``; ``monitor/category/<name>``; keys with ``tok/s``); every other numeric key is plotted
under "Other metrics", grouped by the part of its name before the last ``/`` (at most
``MAX_SERIES`` lines a plot). Bar charts and histograms add the monitor's flagged trajectories
by category and the curriculum's task pass rates and pool status.

With two runs the line plots overlay both (one color per run for a single key, one color per
key for several; the second run's lines dashed), bar charts group them side by side. Each
``Figure`` carries the numbers it drew, which the page embeds as JSON for checks.

What it does not do: draw SVG (``etude.report.plots``), read run files
(``etude.report.run_data``), or lay figures out on the page (``etude.report.html``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from etude.report import plots
from etude.report.plots import PALETTE, RUN_COLORS, Bars, Series
from etude.report.run_data import RunData
from etude.report.summary import curriculum_rows, monitor_categories, task_statistics

MAX_SERIES = 10
"""Lines per 'other metrics' plot: the ones with the largest totals are kept."""


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
