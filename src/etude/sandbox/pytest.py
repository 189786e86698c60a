"""Run pytest test ids inside a sandbox and read back one outcome per test id.

Test-based rewards and task validation both ask the same question: did these node ids
(``tests/test_x.py::TestCls::test_y[param]``) pass on this workspace? ``run_pytest`` runs
``python -m pytest`` in the sandbox with a JUnit XML report, then maps each ``<testcase>``
(``classname`` + ``name``) back to its pytest node id.

The rules that keep a broken run from looking like a clean one:

- a collection error, a usage or internal error, "no tests collected", a timeout or a missing or
  unreadable report sets ``collection_error``/``timed_out``, and ``all_passed`` is then False;
- a requested id that produced no result (not found, not collected) counts as ``error``;
- only ``passed`` passes: ``skipped`` (xfail included) does not.

The run leaves nothing in the workspace: no cache (``-p no:cacheprovider``), no bytecode
(``PYTHONDONTWRITEBYTECODE=1`` in every sandbox environment), and the report file is removed.
It does not guard against a workspace that rigs its own test run (a ``conftest.py`` that rewrites
outcomes): restoring test files and monitoring are the environment's job.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import sys
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from etude.sandbox.base import Sandbox

TestOutcome = Literal["passed", "failed", "error", "skipped"]
# the worst outcome first: it decides the outcome of a group (a file or class id)
OUTCOME_ORDER: tuple[TestOutcome, ...] = ("error", "failed", "skipped", "passed")
# pytest exit codes that mean the requested tests were never run: interrupted (collection
# errors), internal error, usage error (e.g. a file that does not exist), no tests collected
NOT_RUN_EXIT_CODES = (2, 3, 4, 5)
MAX_REPORT_BYTES = 64 << 20
OUTPUT_EXCERPT_CHARS = 8000


@dataclass(kw_only=True, slots=True)
class TestRun:
    """Per-test outcomes of one sandboxed pytest run."""

    __test__ = False  # a result record, not a test class for pytest to collect

    requested: tuple[str, ...]
    """The test ids asked for (empty: the whole suite of the workspace)."""
    results: dict[str, TestOutcome]
    """Outcome per node id that ran, plus ``error`` for each requested id that produced nothing."""
    exit_code: int
    """pytest's exit status (0 all passed, 1 failures, 2-5 the run broke; 137 killed)."""
    collection_error: bool
    """The tests were not (all) collected and run: a collection, usage or internal error, no tests
    collected, or no readable report (a timeout also leaves none)."""
    timed_out: bool
    """The sandbox's wall-clock limit killed the run."""
    output: str
    """The tail of pytest's stdout and stderr, for logs and for the agent."""
    duration: float
    """Wall-clock seconds of the sandboxed run."""

    def outcome(self, test_id: str) -> TestOutcome:
        """The outcome of a node id, or the worst outcome under a file/class id; ``error`` if none."""
        if test_id in self.results:
            return self.results[test_id]
        found = [o for i, o in self.results.items() if _is_under(i, test_id)]
        return min(found, key=OUTCOME_ORDER.index) if found else "error"

    def all_passed(self, ids: Iterable[str] | None = None) -> bool:
        """Every id in ``ids`` (default: the requested ones) passed, and the run itself was sound.

        Never True for an empty selection or a run that broke collection or timed out.
        """
        ids = list(self.requested if ids is None else ids)
        if self.collection_error or self.timed_out:
            return False
        if not ids:
            return bool(self.results) and all(o == "passed" for o in self.results.values())
        return all(self.outcome(i) == "passed" for i in ids)


def _is_under(node_id: str, group_id: str) -> bool:
    """Whether ``node_id`` lies in the file, directory or class ``group_id``."""
    group = group_id.rstrip("/")
    return node_id.startswith(group + "::") or node_id.startswith(group + "/")


def junit_address(node_id: str) -> tuple[str, str]:
    """``(classname, name)`` that pytest's JUnit report gives ``node_id``.

    Mirrors pytest's own mangling: parameters are split off at the first ``[``, the rest splits
    on ``::``, the file path turns into a dotted module path, and the parameters go back onto
    the last name.
    """
    path, bracket, params = node_id.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def node_id_from_junit(classname: str, name: str, workspace: Path) -> str:
    """Best reconstruction of a node id from a JUnit address, using the workspace's files.

    Dots are ambiguous (``a.b.TestC`` may be ``a/b.py::TestC`` or ``a/b/TestC.py``); the split is
    the shortest dotted prefix that names an existing ``.py`` file.
    """
    if not classname:  # a collection error: the name is the dotted file or directory
        for candidate in (name.replace(".", "/") + ".py", name.replace(".", "/"), name):
            if (workspace / candidate).exists():
                return candidate
        return name
    parts = classname.split(".")
    for k in range(1, len(parts) + 1):
        candidate = "/".join(parts[:k]) + ".py"
        if (workspace / candidate).is_file():
            return "::".join([candidate, *parts[k:], name])
    return f"{classname}::{name}"


def _read_report(path: Path) -> bytes | None:
    """The report's bytes, refusing anything but a regular file the sandbox wrote in place."""
    try:
        # a planted symlink must not be followed, and a planted FIFO must not block the open
        # (the tests see the report path in pytest's argv and may replace it)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_REPORT_BYTES + 1)
    return data if len(data) <= MAX_REPORT_BYTES else None


def parse_junit(
    data: bytes, requested: Sequence[str], workspace: Path
) -> tuple[dict[str, TestOutcome], bool] | None:
    """``(outcome per node id, saw a collection error)`` from report bytes; None if unparseable."""
    try:
        root = ET.fromstring(data)
    except ET.ParseError:
        return None
    by_address = {junit_address(i): i for i in requested}
    results: dict[str, TestOutcome] = {}
    collection_error = False
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        tags = {child.tag: child for child in case}
        if "failure" in tags:
            outcome: TestOutcome = "failed"
        elif "error" in tags:
            outcome = "error"
            if tags["error"].get("message", "") == "collection failure":
                collection_error = True
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        node_id = by_address.get((classname, name)) or node_id_from_junit(
            classname, name, workspace
        )
        previous = results.get(node_id)
        if previous is None or OUTCOME_ORDER.index(outcome) < OUTCOME_ORDER.index(previous):
            results[node_id] = outcome
    return results, collection_error


def run_pytest(
    sandbox: Sandbox,
    workspace: str | os.PathLike[str],
    test_ids: Sequence[str],
    *,
    timeout: float | None = None,
    python: str = sys.executable,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> TestRun:
    """Run ``test_ids`` (node ids relative to ``workspace``; empty: all) with pytest in ``sandbox``.

    ``python`` must have pytest installed and be visible in the sandbox (the running interpreter
    is; another needs ``extra_ro_paths``). ``extra_args`` go before the ids; ``env`` adds
    environment variables (e.g. ``PYTHONPATH=src`` for a src layout).
    """
    ids = tuple(test_ids)
    for test_id in ids:
        if not isinstance(test_id, str) or not test_id or test_id.startswith("-"):
            raise ValueError(
                f"test id {test_id!r} must be a pytest node id such as "
                "'tests/test_x.py::test_y' (not empty, not an option)"
            )
    ws = Path(workspace).resolve()
    # a fresh random name: the sandboxed tests cannot know it in advance to plant a fake report
    report = ws / f".etude-junit-{uuid.uuid4().hex}.xml"
    argv = [
        python,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        f"--rootdir={ws}",  # node ids relative to the workspace, whatever ini files say
        f"--junitxml={report}",
        "-o",
        "junit_family=xunit2",
        *extra_args,
        *ids,
    ]
    try:
        result = sandbox.run(argv, ws, timeout=timeout, env=env)
        data = _read_report(report)
    finally:
        # the tests may have put a directory in the report's place: no crash, no leftover
        if report.is_dir() and not report.is_symlink():
            shutil.rmtree(report, ignore_errors=True)
        else:
            report.unlink(missing_ok=True)
    parsed = parse_junit(data, ids, ws) if data is not None else None
    results, saw_collection_error = parsed if parsed is not None else ({}, False)
    for test_id in ids:
        if not any(i == test_id or _is_under(i, test_id) for i in results):
            results[test_id] = "error"  # asked for, never reported
    collection_error = (
        parsed is None or saw_collection_error or result.exit_code in NOT_RUN_EXIT_CODES
    )
    output = result.stdout + result.stderr
    return TestRun(
        requested=ids,
        results=results,
        exit_code=result.exit_code,
        collection_error=collection_error,
        timed_out=result.timed_out,
        output=output[-OUTPUT_EXCERPT_CHARS:],
        duration=result.duration,
    )
