"""Settings of the task factory (``etude tasks build``; TOML sections ``[tasks]``...).

``TaskBuildConfig`` holds every setting of a build, each validated in ``__post_init__`` with a
``ValueError`` that names the setting and the fix.

What this module does not do: run anything; the factory (``etude.tasks.build``) reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from etude.sandbox.base import Backend
from etude.tasks.agent_deleter import AgentDeleterConfig
from etude.tasks.proposal import ProposalConfig
from etude.tasks.record import DETAIL_LEVELS


@dataclass(kw_only=True, slots=True)
class TaskBuildConfig:
    """Settings of ``etude tasks build`` (TOML sections ``[tasks]``, ``[tasks.proposals]``...)."""

    backend: Backend = "auto"
    """Sandbox backend for every test run: ``auto`` (bubblewrap where it works), ``bwrap``, ``local``."""
    test_timeout_s: float = 600.0
    """Wall-clock limit of one pytest run (the whole suite) in seconds."""
    baseline_runs: int = 2
    """Runs of the unmodified suite (the last one under coverage); tests that differ are flaky."""
    max_tasks: int = 0
    """Stop after this many valid tasks (0: validate every proposal)."""
    detail_level: str = "full"
    """Problem statement detail of built tasks: ``full``, ``docstring`` or ``tests``."""
    packages: tuple[str, ...] = ()
    """Top-level import names of the package (empty: detected)."""
    pytest_args: tuple[str, ...] = ()
    """Extra pytest arguments for every run (e.g. ``-o addopts=`` to drop the repo's options)."""
    workers: int = 2
    """Tasks validated at once (each test run is one sandboxed process)."""
    workspace_format: Literal["dir", "tar.gz"] = "dir"
    """Write each workspace as a directory or as a reproducible ``.tar.gz``."""
    gold_full_suite: bool = True
    """Grade the gold-patched tree on PASS_TO_PASS too, as the reward does (false: FAIL_TO_PASS
    only; PASS_TO_PASS then rest on the gold tree being the baseline's, where they passed)."""
    gold_runs: int = 2
    """Times the gold tree is graded: a test failing in every run rejects the task, one failing
    in some runs is flaky and leaves the task's tests (and every other task's of the build)."""
    leak_min_line_chars: int = 16
    """Shortest normalized line of deleted code the leak scan looks for."""
    leak_ngram: int = 3
    """Length of the identifier n-grams the leak scan looks for."""
    variants_per_task: int = 2
    """Most variants ``harder``/``easier`` return for one task."""
    seed: int = 0
    """Seed for choosing partner features of harder variants."""
    time_limits: Literal["baseline", "fixed"] = "baseline"
    """``baseline``: each validation run may take ``time_limit_factor`` times the baseline's
    slowest whole-suite run (at least ``min_time_limit_s``, at most ``test_timeout_s``), so a
    hanging stub costs seconds; ``fixed``: every run may take ``test_timeout_s``."""
    time_limit_factor: float = 5.0
    """Multiple of the baseline's whole-suite run allowed to one validation run (a loaded
    machine runs the same suite several times slower than the baseline did)."""
    min_time_limit_s: float = 30.0
    """Smallest derived time limit in seconds (interpreter start-up and import costs)."""
    time_budget_s: float = 0.0
    """Stop starting new candidates after this many seconds of validation (the baseline not
    counted; 0: no budget); the rest are reported as not tried."""
    min_difficulty: float = 2.5
    """Reject tasks whose difficulty score is below this floor (``etude.tasks.quality``; 0: off)."""
    dedupe_fail_to_pass: bool = True
    """Keep one task per FAIL_TO_PASS set (the highest difficulty score)."""
    copy_search: bool = True
    """Search every workspace file and the sandbox's filesystem for AST-normalized copies of the
    deleted code (``etude.tasks.copies``)."""
    copy_min_nodes: int = 30
    """Smallest deleted definition (AST nodes after normalization) the copy search looks for."""
    delete_copies: bool = True
    """Delete a copy that lies in a package module together with the feature (else reject)."""
    install_test_deps: bool = False
    """Install the repository's declared test requirements (and ``test_requirements``) from the
    package index into ``.etude-deps`` of every workspace (``etude.tasks.testdeps``)."""
    test_requirements: tuple[str, ...] = ()
    """Extra requirements to install with ``install_test_deps`` (e.g. ``["freezegun"]``)."""
    proposals: ProposalConfig = field(default_factory=ProposalConfig)
    """Which features are proposed (size budget, methods, modules, include patterns)."""
    agent: AgentDeleterConfig = field(default_factory=AgentDeleterConfig)
    """Optional model that proposes deletions (off by default)."""

    def __post_init__(self) -> None:
        if self.test_timeout_s <= 0:
            raise ValueError(f"tasks.test_timeout_s={self.test_timeout_s} must be > 0 seconds")
        if self.baseline_runs < 2:
            raise ValueError(
                f"tasks.baseline_runs={self.baseline_runs}: at least 2 are needed to see flaky tests"
            )
        if self.gold_runs < 1:
            raise ValueError(
                f"tasks.gold_runs={self.gold_runs} must be >= 1 (2 or more also find flaky tests)"
            )
        if self.max_tasks < 0:
            raise ValueError(f"tasks.max_tasks={self.max_tasks} must be >= 0 (0: no limit)")
        if self.detail_level not in DETAIL_LEVELS:
            raise ValueError(
                f"tasks.detail_level={self.detail_level!r} must be one of {list(DETAIL_LEVELS)}"
            )
        if self.workers < 1:
            raise ValueError(f"tasks.workers={self.workers} must be >= 1")
        if self.workspace_format not in ("dir", "tar.gz"):
            raise ValueError(
                f"tasks.workspace_format={self.workspace_format!r} must be 'dir' or 'tar.gz'"
            )
        if self.leak_min_line_chars < 4:
            raise ValueError(
                f"tasks.leak_min_line_chars={self.leak_min_line_chars} is too short to be "
                "distinctive; use at least 4 (default 16)"
            )
        if self.leak_ngram < 2:
            raise ValueError(f"tasks.leak_ngram={self.leak_ngram} must be >= 2 (default 3)")
        if self.time_limits not in ("baseline", "fixed"):
            raise ValueError(
                f"tasks.time_limits={self.time_limits!r} must be 'baseline' or 'fixed'"
            )
        if self.time_limit_factor < 1.0:
            raise ValueError(
                f"tasks.time_limit_factor={self.time_limit_factor} must be >= 1 (default 5)"
            )
        if self.min_time_limit_s <= 0:
            raise ValueError(f"tasks.min_time_limit_s={self.min_time_limit_s} must be > 0")
        if self.time_budget_s < 0:
            raise ValueError(f"tasks.time_budget_s={self.time_budget_s} must be >= 0 (0: none)")
        if self.min_difficulty < 0:
            raise ValueError(f"tasks.min_difficulty={self.min_difficulty} must be >= 0 (0: off)")
        if self.copy_min_nodes < 5:
            raise ValueError(
                f"tasks.copy_min_nodes={self.copy_min_nodes} matches trivial code; use >= 5 "
                "(default 30)"
            )
        if self.test_requirements and not self.install_test_deps:
            raise ValueError(
                "tasks.test_requirements is set but tasks.install_test_deps is false; set "
                "install_test_deps = true to install them"
            )
        if self.variants_per_task < 1:
            raise ValueError(f"tasks.variants_per_task={self.variants_per_task} must be >= 1")
