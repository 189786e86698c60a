"""What a build reports: the outcome of each candidate and the build's summary.

``TaskOutcome`` is what became of one feature (a record, or the one-line reason it was
rejected); ``BuildReport`` is ``build_report.json`` (candidates, yield, rejections by reason,
timings); ``reason_category`` maps a reason to the short category the counts use.

What this module does not do: decide anything; it only records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from etude.tasks.record import TaskRecord


@dataclass(kw_only=True, slots=True)
class TaskOutcome:
    """What became of one feature."""

    feature: str
    """Feature name."""
    record: TaskRecord | None
    """The task, or None when rejected."""
    reason: str = ""
    """Why it was rejected."""
    seconds: float = 0.0
    """Wall-clock seconds spent on it."""
    test_seconds: float = 0.0
    """Seconds of sandboxed runs (tests, import probe)."""
    test_runs: int = 0


@dataclass(kw_only=True, slots=True)
class BuildReport:
    """Summary of a build, written as ``build_report.json``."""

    repo: str
    packages: list[str]
    num_tests: int
    num_passing: int
    flaky: list[str]
    baseline_failing: int
    candidates: int
    valid: int
    rejected: dict[str, str]
    """Feature (or symbol) -> reason, for proposals and for symbols never proposed."""
    reject_counts: dict[str, int]
    """Rejection reason category -> count, for validated candidates."""
    skip_counts: dict[str, int]
    """Reason category -> count, for symbols and modules skipped before validation."""
    seconds_total: float
    seconds_baseline: float
    seconds_tests: float
    """Sandboxed test-run seconds (baseline and validation), summed over workers."""
    seconds_per_task: float
    """Mean wall-clock seconds per validated candidate (valid or not)."""
    tasks: list[str] = field(default_factory=list)
    diagnoses: list[str] = field(default_factory=list)
    """One line per problem the baseline showed (missing modules, pytest usage errors...)."""
    not_tried: int = 0
    """Candidates left untried when the time budget ran out."""
    time_limit_s: float = 0.0
    """Time limit of one validation run (derived from the baseline unless fixed)."""
    test_requirements: list[str] = field(default_factory=list)
    """Requirements installed into the workspaces' ``.etude-deps``."""
    median_fail_to_pass: float = 0.0
    """Median FAIL_TO_PASS count of the accepted tasks."""

    @property
    def yield_(self) -> float:
        return self.valid / self.candidates if self.candidates else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["yield"] = round(self.yield_, 4)
        return out


def reason_category(reason: str) -> str:
    """A short category for counting rejection reasons."""
    for prefix, name in (
        ("PASS_TO_PASS broken", "breaks other tests"),
        ("no test fails", "no test fails"),
        ("a trivial body", "stub passes"),
        ("package no longer imports", "package does not import"),
        ("leak scan", "leak"),
        ("gold", "gold patch"),
        ("every FAIL_TO_PASS test is flaky", "flaky"),
        ("used by", "used outside the feature"),
        ("agent proposal: ", "agent proposal"),
        ("needed at import time", "needed at import time"),
        ("imported by", "imported elsewhere"),
        ("needed to collect", "needed to collect other tests"),
        ("no passing test", "no tests"),
        ("exercised by", "too many tests"),
        ("broken-tree run timed out", "timeout"),
        ("copy of the deleted code", "copy elsewhere"),
        ("below the difficulty floor", "below the difficulty floor"),
        ("duplicate FAIL_TO_PASS", "duplicate FAIL_TO_PASS set"),
        ("not tried", "not tried (time budget)"),
        ("deletion refused", "deletion refused"),
        ("attribute ", "used outside the feature"),
        ("dunder or nested", "dunder or nested method"),
        ("its module does not import", "module does not import"),
        ("does not import", "module does not import"),
        ("package __init__", "package __init__"),
    ):
        if reason.startswith(prefix):
            return name
    if "units only its tests reach" in reason:
        return "no feature-sized group"
    if "lines, outside the budget" in reason:
        return "size budget"
    if "used by" in reason:
        return "used outside the feature"
    if "needed at import time" in reason:
        return "needed at import time"
    if "bound more than once" in reason:
        return "defined more than once"
    return "other"
