"""Baseline runs of a repository's suite: outcomes, flaky tests and a per-test coverage map.

``run_baseline`` runs the suite in the sandbox twice, once plain and once (in a copy at another
path) under coverage.py with one dynamic context per test (a small pytest plugin switches the
context at each test's start; coverage's C tracer is pinned with ``COVERAGE_CORE=ctrace`` because
the ``sys.monitoring`` core does not record dynamic contexts). Tests whose outcome differs between
the runs are flaky and excluded; tests that pass in both are the pool of F2P/P2P tests. The
result maps every executed line of the package to the node ids of the tests that ran it, and
keeps each run's duration (the factory derives its time limits from them).

The coverage pass runs inside the sandbox on a scratch copy of the repository; its plugin and
data file live in a randomly named directory of that copy and are removed afterwards.

What this module does not do: choose features (``etude.tasks.mine``).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from etude.sandbox.pytest import TestRun, junit_address, run_pytest
from etude.tasks.layout import Layout

_COVERAGE_PLUGIN = '''\
"""Per-test coverage contexts for etude's task factory (written for one run, then removed)."""
import os

import coverage

_cov = coverage.Coverage(
    data_file=os.environ["ETUDE_COV_DATA"],
    config_file=os.environ["ETUDE_COV_RC"],
    source=os.environ["ETUDE_COV_SOURCE"].split(os.pathsep),
)
_cov.start()


def pytest_runtest_logstart(nodeid, location):
    _cov.switch_context(nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _cov.switch_context("")


def pytest_unconfigure(config):
    _cov.stop()
    _cov.save()
'''
# the C tracer records dynamic contexts; sys.monitoring (coverage's default on 3.12+) does not
_COVERAGE_RC = "[run]\ncore = ctrace\nbranch = false\n"

_IMPORT_PROBE = """
import importlib, json, sys
ok = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        continue
    ok.append(name)
print(json.dumps(ok))
"""


@dataclass(kw_only=True, slots=True)
class Baseline:
    """Outcomes of the unmodified suite and the per-test coverage map."""

    passing: tuple[str, ...]
    """Canonical node ids that passed in every baseline run."""
    failing: tuple[str, ...]
    """Ids that failed (or errored, or were skipped) in every run."""
    flaky: tuple[str, ...]
    """Ids whose outcome differed between runs: excluded from every task."""
    canonical: dict[tuple[str, str], str]
    """JUnit address -> pytest node id, for ids reconstructed from reports."""
    line_tests: dict[str, dict[int, frozenset[str]]]
    """Relative path -> line -> ids of the tests that executed the line."""
    importable: tuple[str, ...]
    """Modules of the package that import in the sandbox."""
    run_seconds: float = 0.0
    """Wall-clock seconds of the baseline's sandboxed runs."""
    output: str = ""
    """The end of the coverage run's pytest output (for error messages)."""
    plain_seconds: tuple[float, ...] = ()
    """Wall-clock seconds of each plain (not coverage) run of the whole suite."""
    exit_code: int | None = None
    """pytest's exit code of the first plain run (4: usage error, 5: no tests collected)."""
    plain_output: str = ""
    """The end of the first plain run's output (what ``etude.tasks.diagnose`` reads)."""

    def suite_seconds(self) -> float:
        """The slowest plain run of the whole suite (the base of the derived time limits)."""
        return max(self.plain_seconds, default=self.run_seconds)

    def outcomes(self, run: TestRun) -> dict[str, str]:
        """A run's outcomes keyed by canonical ids."""
        return canonical_outcomes(run, self.canonical)


def canonical_outcomes(run: TestRun, canonical: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """``run.results`` with each id replaced by the canonical id of its JUnit address."""
    out: dict[str, str] = {}
    for test_id, outcome in run.results.items():
        out[canonical.get(junit_address(test_id), test_id)] = outcome
    return out


def workspace_env(test_env: Mapping[str, str], workspace: Path) -> dict[str, str]:
    """``test_env`` with each relative ``PYTHONPATH`` entry made absolute under ``workspace``."""
    env = dict(test_env)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(
            p if os.path.isabs(p) else str(workspace / p)
            for p in env["PYTHONPATH"].split(os.pathsep)
        )
    return env


def derived_time_limit(baseline: Baseline, *, factor: float, floor: float, ceiling: float) -> float:
    """A per-run limit from the baseline: ``factor`` times its slowest whole-suite run, at least
    ``floor`` and at most ``ceiling`` seconds. Every validation run runs the whole suite or a
    part of it, so a run past the limit is a hanging stub or a deletion that hangs the suite."""
    return round(min(ceiling, max(floor, factor * baseline.suite_seconds())), 1)


def probe_imports(
    sandbox: Any, workspace: Path, modules: Iterable[str], env: Mapping[str, str], timeout: float
) -> list[str]:
    """Modules that import without error in ``sandbox`` from ``workspace``."""
    names = sorted(modules)
    if not names:
        return []
    result = sandbox.run(
        ["python", "-c", _IMPORT_PROBE, *names], workspace, timeout=timeout, env=dict(env)
    )
    if result.exit_code != 0 or not result.stdout.strip():
        return []
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_baseline(
    sandbox: Any,
    workspace: str | Path,
    layout: Layout,
    *,
    runs: int = 2,
    timeout: float = 600.0,
    pytest_args: Iterable[str] = (),
) -> Baseline:
    """Run the suite ``runs`` times: ``runs - 1`` plain runs in ``workspace`` (a scratch copy),
    then one under coverage in a copy of it beside it, at another path (removed afterwards).
    """
    if runs < 2:
        raise ValueError(f"baseline runs={runs}: need at least 2 to see flaky tests")
    ws = Path(workspace).resolve()
    env = workspace_env(layout.test_env, ws)
    args = ["--continue-on-collection-errors", *pytest_args]
    importable = probe_imports(sandbox, ws, layout.modules, env, timeout)
    plain: list[TestRun] = [
        run_pytest(sandbox, ws, [], timeout=timeout, extra_args=args, env=env)
        for _ in range(runs - 1)
    ]
    # the coverage run happens in a copy at another path (made after the plain runs, so state
    # they left behind carries over): tests that depend on where the tree lies, or on files an
    # earlier run wrote, then differ between the runs and are caught as flaky
    cws = ws.parent / f"{ws.name}-{uuid.uuid4().hex[:10]}"
    shutil.copytree(ws, cws, symlinks=True)
    try:
        cov_dir = cws / f".etude-cov-{uuid.uuid4().hex}"
        cov_dir.mkdir()
        (cov_dir / "etude_cov_plugin.py").write_text(_COVERAGE_PLUGIN)
        (cov_dir / "coveragerc").write_text(_COVERAGE_RC)
        source_dirs = sorted(
            {str(cws / PurePosixPath(rel).parent) for rel in layout.modules.values()}
        )
        cov_env = workspace_env(layout.test_env, cws)
        cov_env.update(
            {
                "PYTHONPATH": ":".join(
                    p for p in (str(cov_dir), cov_env.get("PYTHONPATH", "")) if p
                ),
                "COVERAGE_CORE": "ctrace",
                "ETUDE_COV_DATA": str(cov_dir / "data"),
                "ETUDE_COV_RC": str(cov_dir / "coveragerc"),
                "ETUDE_COV_SOURCE": ":".join(source_dirs),
            }
        )
        covered = run_pytest(
            sandbox,
            cws,
            [],
            timeout=timeout,
            extra_args=["-p", "etude_cov_plugin", *args],
            env=cov_env,
        )
        line_tests, contexts = _read_coverage(cov_dir / "data", cws)
    finally:
        shutil.rmtree(cws, ignore_errors=True)
    if covered.timed_out or any(r.timed_out for r in plain):
        raise ValueError(
            f"the test suite of {layout.name} ran past the timeout of {timeout:.0f}s; raise "
            "test_timeout_s"
        )
    if not contexts and "passed" in covered.results.values():
        raise ValueError(
            "coverage recorded no per-test contexts (is coverage's C tracer installed? "
            f"pytest output: {covered.output[-500:]})"
        )
    canonical = {junit_address(c): c for c in contexts}
    all_runs = [*plain, covered]
    per_run = [canonical_outcomes(r, canonical) for r in all_runs]
    ids = sorted(set().union(*per_run))
    passing, failing, flaky = [], [], []
    for test_id in ids:
        outcomes = {run.get(test_id, "error") for run in per_run}
        if outcomes == {"passed"}:
            passing.append(test_id)
        elif "passed" in outcomes:
            flaky.append(test_id)
        else:
            failing.append(test_id)
    return Baseline(
        passing=tuple(passing),
        failing=tuple(failing),
        flaky=tuple(flaky),
        canonical=canonical,
        line_tests=line_tests,
        importable=tuple(importable),
        run_seconds=sum(r.duration for r in all_runs),
        output=covered.output[-2000:],
        plain_seconds=tuple(r.duration for r in plain),
        exit_code=plain[0].exit_code,
        plain_output=plain[0].output,
    )


def _read_coverage(
    data_file: Path, ws: Path
) -> tuple[dict[str, dict[int, frozenset[str]]], set[str]]:
    import coverage

    if not data_file.exists():
        return {}, set()
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    contexts = {c for c in data.measured_contexts() if c}
    out: dict[str, dict[int, frozenset[str]]] = {}
    for filename in data.measured_files():
        path = Path(filename)
        if ws not in path.parents:
            continue
        by_line = {
            line: frozenset(c for c in ctxs if c)
            for line, ctxs in data.contexts_by_lineno(filename).items()
        }
        out[path.relative_to(ws).as_posix()] = {k: v for k, v in by_line.items() if v}
    return out, contexts
