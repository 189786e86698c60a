"""SVG plots for the run report, written as strings in Python: line plots and bar charts.

Why not matplotlib: the report must be one self-contained HTML file that opens from ``file://``
with no network, stays small, and renders crisply at any zoom. Inline SVG does all of that, and
the few plot kinds the report needs (lines over training steps, with a second run overlaid;
histograms; grouped bars) fit in one short module with no dependency.

What a plot is: an ``<svg class="plot">`` element with a title, y axis ticks with a light grid,
x axis ticks, axis labels, the data, and a legend under the plot area. Every data mark carries a
``<title>`` (the browser's tooltip). The root element records what it drew in ``data-`` attributes
(``data-plot`` the id, ``data-series`` and ``data-points`` the counts) so a test or a script can
check that a figure has data without parsing paths.

What this module does not do: read run files, choose which metrics to plot
(``etude.report.figures`` does), interactive zoom, or log scales.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

# Colors of a series by position (Okabe-Ito-like, readable for common color-vision deficiencies);
# the report uses RUN_COLORS for "one line per run" plots so a run keeps its color everywhere.
PALETTE = (
    "#2563eb",  # blue
    "#ea580c",  # orange
    "#059669",  # green
    "#db2777",  # pink
    "#7c3aed",  # violet
    "#ca8a04",  # ochre
    "#0891b2",  # cyan
    "#dc2626",  # red
    "#4b5563",  # slate
    "#65a30d",  # lime
)
RUN_COLORS = ("#2563eb", "#ea580c")
AXIS_COLOR = "#9ca3af"
GRID_COLOR = "#e5e7eb"
TEXT_COLOR = "#374151"
FONT = "font-family=\"ui-sans-serif, system-ui, -apple-system, 'Segoe UI', sans-serif\""

# at most this many points get a hoverable marker; longer series are drawn as lines only
MAX_MARKERS = 80


@dataclass(kw_only=True, slots=True)
class Series:
    """One line: points (x, y) in x order; a None or non-finite y is a gap in the line."""

    label: str
    xs: list[float]
    ys: list[float | None]
    color: str = PALETTE[0]
    dashed: bool = False
    """Drawn dashed (the report draws the second run of an overlay dashed)."""

    def __post_init__(self) -> None:
        assert len(self.xs) == len(self.ys), (self.label, len(self.xs), len(self.ys))


@dataclass(kw_only=True, slots=True)
class Bars:
    """One group of bars: a value per category (grouped side by side with other groups)."""

    label: str
    values: list[float]
    color: str = PALETTE[0]


@dataclass(kw_only=True, slots=True)
class Frame:
    """Pixel geometry of a plot: outer size and the margins around the plot area."""

    width: int = 520
    height: int = 230
    left: int = 56
    right: int = 14
    top: int = 30
    bottom: int = 40
    legend_rows: int = 0

    @property
    def plot_w(self) -> float:
        return self.width - self.left - self.right

    @property
    def plot_h(self) -> float:
        return self.height - self.top - self.bottom


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]: steps of 1, 2, 2.5 or 5 times a power of ten."""
    assert hi >= lo, (lo, hi)
    if hi == lo:
        return [lo]
    raw = (hi - lo) / max(target, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * magnitude >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    k = 0
    while first + k * step <= hi + step * 1e-9:
        ticks.append(round(first + k * step, 12))
        k += 1
    return ticks


def format_number(v: float, step: float | None = None) -> str:
    """Short label: thousands as k/M, else as many decimals as the tick step needs."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if step is not None and step > 0:
        decimals = max(0, -math.floor(math.log10(step) + 1e-9))
        if step * 10**decimals % 1 > 1e-6:  # 2.5 steps need one more decimal
            decimals += 1
        return f"{v:.{min(decimals, 6)}f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 0.01:
        return f"{v:.3g}"
    return f"{v:.2e}"


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _padded_range(values: Sequence[float], floor_zero: bool) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if floor_zero and lo >= 0:
        lo = 0.0
    if hi == lo:
        pad = abs(hi) * 0.1 or 1.0
        return (lo if floor_zero and lo == 0 else lo - pad), hi + pad
    return lo, hi


def _legend(
    frame: Frame, entries: Sequence[tuple[str, str, bool]], kind: str, force: bool = False
) -> list[str]:
    """Legend rows under the plot area; entries are (label, color, dashed)."""
    if len(entries) < 2 and not (force and entries):
        return []
    out, x, row = [], frame.left, 0
    y0 = frame.height - frame.legend_rows * 18 + 6
    for label, color, dashed in entries:
        w = 28 + 6.2 * len(label)
        if x + w > frame.width - frame.right and x > frame.left:
            x, row = frame.left, row + 1
        y = y0 + row * 18
        if kind == "line":
            dash = ' stroke-dasharray="5 3"' if dashed else ""
            out.append(
                f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x + 18:.1f}" y2="{y:.1f}" '
                f'stroke="{color}" stroke-width="2.2"{dash}/>'
            )
        else:
            out.append(
                f'<rect x="{x + 4:.1f}" y="{y - 5:.1f}" width="10" height="10" rx="2" fill="{color}"/>'
            )
        out.append(
            f'<text x="{x + 23:.1f}" y="{y + 4:.1f}" font-size="11" fill="{TEXT_COLOR}">'
            f"{escape(label)}</text>"
        )
        x += w
    return ['<g class="legend">', *out, "</g>"]


def _legend_rows(frame: Frame, labels: Sequence[str], force: bool = False) -> int:
    if len(labels) < 2 and not (force and labels):
        return 0
    rows, x = 1, frame.left
    for label in labels:
        w = 28 + 6.2 * len(label)
        if x + w > frame.width - frame.right and x > frame.left:
            x, rows = frame.left, rows + 1
        x += w
    return rows


def _open(frame: Frame, plot_id: str, title: str, n_series: int, n_points: int) -> list[str]:
    return [
        f'<svg class="plot" data-plot="{escape(plot_id)}" data-series="{n_series}" '
        f'data-points="{n_points}" xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {frame.width} {frame.height}" width="{frame.width}" '
        f'height="{frame.height}" role="img" aria-label="{escape(title)}" {FONT}>',
        f'<text x="{frame.left}" y="17" font-size="13" font-weight="600" fill="#111827">'
        f"{escape(title)}</text>",
    ]


def _y_axis(frame: Frame, lo: float, hi: float, label: str) -> tuple[list[str], float, float]:
    """Grid lines and labels of the y axis; returns the drawn range (ticks may widen it)."""
    ticks = nice_ticks(lo, hi)
    step = None
    if len(ticks) > 1:
        # widen to the next round value on each side, so the data's ends sit inside labels
        step = ticks[1] - ticks[0]
        if ticks[0] > lo + step * 1e-9:
            ticks.insert(0, round(ticks[0] - step, 12))
        if ticks[-1] < hi - step * 1e-9:
            ticks.append(round(ticks[-1] + step, 12))
        lo, hi = ticks[0], ticks[-1]
    out = []
    for t in ticks:
        y = frame.top + frame.plot_h * (1 - (t - lo) / (hi - lo))
        out.append(
            f'<line x1="{frame.left}" y1="{y:.1f}" x2="{frame.width - frame.right}" y2="{y:.1f}" '
            f'stroke="{GRID_COLOR}" stroke-width="1"/>'
        )
        out.append(
            f'<text x="{frame.left - 6}" y="{y + 3.5:.1f}" font-size="10.5" text-anchor="end" '
            f'fill="{TEXT_COLOR}">{format_number(t, step)}</text>'
        )
    if label:
        cy = frame.top + frame.plot_h / 2
        out.append(
            f'<text x="12" y="{cy:.1f}" font-size="11" text-anchor="middle" fill="{TEXT_COLOR}" '
            f'transform="rotate(-90 12 {cy:.1f})">{escape(label)}</text>'
        )
    return out, lo, hi


def _frame_lines(frame: Frame) -> list[str]:
    x0, y1 = frame.left, frame.top + frame.plot_h
    return [
        f'<line x1="{x0}" y1="{y1:.1f}" x2="{frame.width - frame.right}" y2="{y1:.1f}" '
        f'stroke="{AXIS_COLOR}" stroke-width="1"/>',
        f'<line x1="{x0}" y1="{frame.top}" x2="{x0}" y2="{y1:.1f}" stroke="{AXIS_COLOR}" '
        'stroke-width="1"/>',
    ]


def line_plot(
    plot_id: str,
    title: str,
    series: Sequence[Series],
    *,
    x_label: str = "step",
    y_label: str = "",
    y_range: tuple[float, float] | None = None,
    width: int = 520,
    height: int = 230,
    legend: bool = False,
) -> str:
    """Lines over a shared x axis, one per series, with a legend when there are two or more
    (or always, with ``legend``).

    ``y_range`` fixes the y axis (e.g. (0, 1) for rates); otherwise it spans the data, from 0
    when all values are non-negative. A plot without any finite point says "no data".
    """
    frame = Frame(width=width, height=height)
    frame.legend_rows = _legend_rows(frame, [s.label for s in series], force=legend)
    frame.height += frame.legend_rows * 18
    frame.bottom += frame.legend_rows * 18
    points = [(x, y) for s in series for x, y in zip(s.xs, s.ys) if _finite(y) and _finite(x)]
    out = _open(frame, plot_id, title, len(series), len(points))
    if not points:
        out.append(
            f'<text x="{frame.width / 2}" y="{frame.height / 2}" font-size="12" '
            f'text-anchor="middle" fill="{AXIS_COLOR}">no data</text></svg>'
        )
        return "\n".join(out)
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_lo, y_hi = y_range if y_range is not None else _padded_range(ys, floor_zero=True)
    y_lo, y_hi = min(y_lo, min(ys)), max(y_hi, max(ys))
    axis, y_lo, y_hi = _y_axis(frame, y_lo, y_hi, y_label)
    out += axis

    def px(x: float) -> float:
        return frame.left + frame.plot_w * (x - x_lo) / (x_hi - x_lo)

    def py(y: float) -> float:
        return frame.top + frame.plot_h * (1 - (y - y_lo) / (y_hi - y_lo))

    x_ticks = nice_ticks(x_lo, x_hi, target=6)
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else None
    base = frame.top + frame.plot_h
    for t in x_ticks:
        out.append(
            f'<line x1="{px(t):.1f}" y1="{base:.1f}" x2="{px(t):.1f}" y2="{base + 4:.1f}" '
            f'stroke="{AXIS_COLOR}"/>'
        )
        out.append(
            f'<text x="{px(t):.1f}" y="{base + 16:.1f}" font-size="10.5" text-anchor="middle" '
            f'fill="{TEXT_COLOR}">{format_number(t, x_step)}</text>'
        )
    out.append(
        f'<text x="{frame.left + frame.plot_w / 2:.1f}" y="{base + 32:.1f}" font-size="11" '
        f'text-anchor="middle" fill="{TEXT_COLOR}">{escape(x_label)}</text>'
    )
    out += _frame_lines(frame)
    for s in series:
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        segments: list[list[tuple[float, float]]] = [[]]
        for x, y in zip(s.xs, s.ys):
            if _finite(y) and _finite(x):
                segments[-1].append((x, y))
            elif segments[-1]:
                segments.append([])
        out.append(f'<g class="series" data-label="{escape(s.label)}">')
        for seg in segments:
            if len(seg) > 1:
                pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in seg)
                out.append(
                    f'<polyline points="{pts}" fill="none" stroke="{s.color}" stroke-width="2" '
                    f'stroke-linejoin="round" stroke-linecap="round"{dash}/>'
                )
        n = sum(len(seg) for seg in segments)
        for seg in segments:
            for x, y in seg:
                if n > MAX_MARKERS and len(seg) > 1:
                    continue
                out.append(
                    f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.6" fill="{s.color}">'
                    f"<title>{escape(s.label)}: {x_label} {format_number(x)}, "
                    f"{format_number(y)}</title></circle>"
                )
        out.append("</g>")
    out += _legend(frame, [(s.label, s.color, s.dashed) for s in series], "line", force=legend)
    out.append("</svg>")
    return "\n".join(out)


def bar_chart(
    plot_id: str,
    title: str,
    categories: Sequence[str],
    groups: Sequence[Bars],
    *,
    x_label: str = "",
    y_label: str = "",
    width: int = 520,
    height: int = 230,
) -> str:
    """Bars per category, groups side by side (e.g. one group per run), legend for 2+ groups."""
    for g in groups:
        assert len(g.values) == len(categories), (g.label, len(g.values), len(categories))
    frame = Frame(width=width, height=height)
    rotate = (
        len(categories) > 6
        or max((len(c) for c in categories), default=0) * len(categories) * 6.5 > frame.plot_w
    )
    if rotate:
        longest = max(len(c) for c in categories)
        frame.bottom += int(min(longest, 28) * 4.6)
        frame.height += int(min(longest, 28) * 4.6)
    frame.legend_rows = _legend_rows(frame, [g.label for g in groups])
    frame.height += frame.legend_rows * 18
    frame.bottom += frame.legend_rows * 18
    values = [v for g in groups for v in g.values if _finite(v)]
    nonzero = sum(1 for v in values if v != 0)
    out = _open(frame, plot_id, title, len(groups), nonzero)
    if not categories or not values:
        out.append(
            f'<text x="{frame.width / 2}" y="{frame.height / 2}" font-size="12" '
            f'text-anchor="middle" fill="{AXIS_COLOR}">no data</text></svg>'
        )
        return "\n".join(out)
    lo, hi = _padded_range([0.0, *values], floor_zero=True)
    axis, lo, hi = _y_axis(frame, lo, hi, y_label)
    out += axis
    slot = frame.plot_w / len(categories)
    bar_w = min(slot * 0.78 / max(len(groups), 1), 44.0)
    base = frame.top + frame.plot_h
    for c, category in enumerate(categories):
        x0 = frame.left + (c + 0.5) * slot - bar_w * len(groups) / 2
        for k, g in enumerate(groups):
            v = g.values[c]
            if not _finite(v):
                continue
            y = frame.top + frame.plot_h * (1 - (v - lo) / (hi - lo))
            zero = frame.top + frame.plot_h * (1 - (0 - lo) / (hi - lo))
            top, h = min(y, zero), abs(zero - y)
            label = f"{g.label}: " if len(groups) > 1 else ""
            out.append(
                f'<rect class="bar" x="{x0 + k * bar_w:.1f}" y="{top:.1f}" '
                f'width="{max(bar_w - 1.5, 1):.1f}" height="{h:.1f}" rx="1.5" fill="{g.color}">'
                f"<title>{escape(label + category)}: {format_number(v)}</title></rect>"
            )
        cx = frame.left + (c + 0.5) * slot
        if rotate:
            out.append(
                f'<text x="{cx:.1f}" y="{base + 12:.1f}" font-size="10.5" text-anchor="end" '
                f'fill="{TEXT_COLOR}" transform="rotate(-40 {cx:.1f} {base + 12:.1f})">'
                f"{escape(category[:28])}</text>"
            )
        else:
            out.append(
                f'<text x="{cx:.1f}" y="{base + 15:.1f}" font-size="10.5" text-anchor="middle" '
                f'fill="{TEXT_COLOR}">{escape(category)}</text>'
            )
    if x_label:
        out.append(
            f'<text x="{frame.left + frame.plot_w / 2:.1f}" '
            f'y="{frame.height - frame.legend_rows * 18 - 8:.1f}" font-size="11" '
            f'text-anchor="middle" fill="{TEXT_COLOR}">{escape(x_label)}</text>'
        )
    out += _frame_lines(frame)
    out += _legend(frame, [(g.label, g.color, False) for g in groups], "bar")
    out.append("</svg>")
    return "\n".join(out)


def histogram_counts(
    values: Sequence[float], *, bins: int = 10, lo: float = 0.0, hi: float = 1.0
) -> tuple[list[str], list[int]]:
    """Counts of ``values`` in ``bins`` equal bins over [lo, hi] (the last bin closed) and labels
    ``"0.0-0.1"``; values outside the range fall into the first or last bin."""
    assert bins >= 1 and hi > lo
    counts = [0] * bins
    for v in values:
        k = int((v - lo) / (hi - lo) * bins)
        counts[min(max(k, 0), bins - 1)] += 1
    width = (hi - lo) / bins
    digits = 0 if width >= 1 else 2 if width * 10 % 1 > 1e-9 else 1
    labels = [f"{lo + k * width:.{digits}f}-{lo + (k + 1) * width:.{digits}f}" for k in range(bins)]
    return labels, counts


def histogram(
    plot_id: str,
    title: str,
    groups: Sequence[tuple[str, Sequence[float], str]],
    *,
    bins: int = 10,
    lo: float = 0.0,
    hi: float = 1.0,
    x_label: str = "",
    y_label: str = "count",
    width: int = 520,
    height: int = 230,
) -> str:
    """Histogram of each (label, values, color) group over [lo, hi], groups side by side."""
    labels: list[str] = []
    bars = []
    for label, values, color in groups:
        labels, counts = histogram_counts(values, bins=bins, lo=lo, hi=hi)
        bars.append(Bars(label=label, values=[float(c) for c in counts], color=color))
    if not groups:
        labels, _ = histogram_counts([], bins=bins, lo=lo, hi=hi)
    return bar_chart(
        plot_id,
        title,
        labels,
        bars,
        x_label=x_label,
        y_label=y_label,
        width=width,
        height=height,
    )
