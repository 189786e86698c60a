"""The grader: one code path that says whether a tree passes a task's tests.

``grade(pristine, final_tree, allowed, test_ids, test_env, pytest_args) -> Outcome`` is what the
reward, the agent's ``run_tests`` tool, the task validator and ``etude tasks check`` all call:

1. **Clean room** (``etude.sandbox.cleanroom``): a fresh copy of the pristine task workspace gets
   only the final tree's changes to allowed package source; tests, configuration, conftest
   files, plugins, start-up hooks, bytecode and new top-level modules never cross over.
2. **A fresh sandbox** runs ``python -P -B`` (the working directory is not put on ``sys.path``;
   nothing compiled is written) with a bootstrap that imports pytest and the grader's reporter
   *before* any file of the tree can be imported, then appends the test environment's
   ``PYTHONPATH`` entries and the workspace root *after* site-packages (the task's own packages,
   named by ``allowed``, are still found in the tree first, by a meta-path finder, where the
   environment has a copy installed), and points
   ``sys.pycache_prefix`` at an empty private directory, so neither Python nor pytest's
   assertion rewriter reads a ``__pycache__`` of the tree. pytest's configuration and conftest
   files are the pristine tree's (the clean room saw to it); the record's ``test_env`` and
   ``pytest_args`` apply to every run.
3. **A result channel** the code under test does not own: the bootstrap keeps a private
   duplicate of the stdout pipe and sends everything else written to fd 1 to stderr; the reporter
   streams one line per test phase as it finishes (with a per-run nonce), then a ``finish`` line
   from ``pytest_sessionfinish`` and an ``exit`` line after ``pytest.main`` returned. Nothing
   written earlier can be rewritten later (it is already in the grader's memory).
4. **Cross-checks** (`read_channel`): a ``boot`` line must come first and a ``ready`` line
   (sent at the first import of the task's package or at the session's start, whichever comes
   first: no code the agent could change has run before it) next, else the grader failed
   (``infra``: the sandbox, the interpreter or pytest's start-up; a solution cannot cause it);
   every expected id must be reported run and passed (a missing id fails, a requested file or
   class needs at least one test under it and all of them passing); a test with two different
   outcomes for one phase, a line after ``exit``, a malformed line, an ``exit`` code that differs
   from the process's, or a run that ends without ``exit`` fail the run. The reporter also snapshots pytest's run-and-report machinery at boot (the functions
   that run a test and build its report, the report class, ``pluggy``'s hook caller) and the
   set of registered plugins after configuration; a change to either (monkeypatching pytest's
   internals, a plugin registered by the code under test) is reported as ``tamper`` and the run
   scores ``error``, as is a test function, plugin or report hook whose code lies in a file the
   agent wrote (under ``allowed`` and changed from the pristine tree; a file the agent left
   alone, and a test or conftest file the package keeps inside itself, are the pristine tree's:
   ``etude.sandbox.cleanroom.pristine_sources``).

Statuses: ``passed`` (every expected id passed in a sound run), ``failed`` (a sound run where some
did not), ``error`` (the run itself broke: collection or usage error, timeout, tampering, a
report that stops short), ``infra`` (the grader could not grade: the sandbox did not start, the
pristine tree is missing, a copy failed). ``infra`` is never a score: callers mask it.

What the grader does not guarantee: code under test that finds the reporter in memory and forges
its whole stream (the protocol is open source) is not caught here; nor is code that passes the
tests by special-casing them (an object equal to everything, answers keyed on test inputs). The
tamper checks on test functions and hooks are tripwires that read where code says it comes from
(``co_filename``): a test function replaced by an existing function of the standard library or
of an unchanged file, or by code compiled under a false file name, is not caught by them. Those
are the monitor's job. The test process itself is contained by the sandbox backend, with that
backend's limits (see ``etude.sandbox``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from etude.sandbox.base import Sandbox, SandboxConfig
from etude.sandbox.cleanroom import build_graded_tree, pristine_sources
from etude.sandbox.reporter import BOOTSTRAP, read_channel

Status = Literal["passed", "failed", "error", "infra"]
STATUSES: tuple[Status, ...] = ("passed", "failed", "error", "infra")
# the worst per-test outcome first: it decides a group id (a file or class)
TEST_OUTCOMES = ("error", "failed", "skipped", "passed")
CHANNEL_BYTES = 64 << 20
"""Output kept per stream for a grading run: the result channel must never be cut."""
OUTPUT_EXCERPT_CHARS = 8000
PYTEST_FIXED_ARGS = (
    "-p",
    "no:cacheprovider",
    "-q",
    "-W",
    "ignore::pytest.PytestAssertRewriteWarning",
)
"""The reporter loads the environment's plugins before pytest starts, so pytest warns that it
cannot rewrite their asserts; a repository whose ``filterwarnings`` is ``error`` (itsdangerous)
would turn that warning into a start-up failure of every graded run."""


@dataclass(kw_only=True, slots=True)
class Outcome:
    """What grading one tree against one set of test ids found."""

    status: Status
    """``passed``, ``failed``, ``error`` (the run broke) or ``infra`` (not graded; never a score)."""
    passed_ids: list[str] = field(default_factory=list)
    """Expected ids that passed."""
    failed_ids: list[str] = field(default_factory=list)
    """Expected ids that did not pass (failed, errored, skipped or never reported)."""
    reason: str = ""
    """Why the status is not ``passed`` (one line); empty when passed."""
    seconds: float = 0.0
    """Wall-clock seconds of the whole grading (copy, sandboxed run, checks)."""
    outcomes: dict[str, str] = field(default_factory=dict)
    """Outcome per reported node id: ``passed``, ``failed``, ``error`` or ``skipped``."""
    collection_errors: list[str] = field(default_factory=list)
    """Node ids (files, directories) pytest could not collect."""
    changed: list[str] = field(default_factory=list)
    """Allowed files taken from the final tree (changed, added or removed)."""
    exit_code: int = 0
    """The test process's exit status (pytest's, or 128 + signal)."""
    timed_out: bool = False
    output: str = ""
    """The tail of the run's stdout and stderr (pytest's report)."""

    @property
    def ok(self) -> bool:
        return self.status == "passed"

    def outcome(self, test_id: str) -> str:
        """The outcome of a node id, or the worst one under a file/class id; ``error`` if none."""
        if test_id in self.outcomes:
            return self.outcomes[test_id]
        found = [o for i, o in self.outcomes.items() if _is_under(i, test_id)]
        return min(found, key=TEST_OUTCOMES.index) if found else "error"

    def to_dict(self) -> dict[str, object]:
        """The fields a trajectory records (``info['grade']``), without the per-test map."""
        return {
            "status": self.status,
            "reason": self.reason,
            "seconds": round(self.seconds, 3),
            "num_passed": len(self.passed_ids),
            "num_failed": len(self.failed_ids),
            "failed_ids": self.failed_ids[:50],
            "collection_errors": self.collection_errors[:20],
            "changed": self.changed[:200],
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
        }


def _is_under(node_id: str, group_id: str) -> bool:
    group = group_id.rstrip("/")
    return node_id.startswith(group + "::") or node_id.startswith(group + "/")


def trusted_roots() -> list[str]:
    """Where code that may register pytest plugins lives: the interpreter's installation."""
    roots = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    return sorted(os.path.realpath(r) for r in roots)


def _split_pythonpath(test_env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """``(environment without PYTHONPATH, its entries as workspace-relative paths)``."""
    env = {k: v for k, v in test_env.items() if k != "PYTHONPATH"}
    paths = []
    for entry in test_env.get("PYTHONPATH", "").split(os.pathsep):
        if not entry or entry == ".":
            continue
        if os.path.isabs(entry):
            raise ValueError(
                f"test_env PYTHONPATH entry {entry!r} must be relative to the workspace "
                "(e.g. 'src'), so that it names the graded copy"
            )
        paths.append(entry)
    return env, paths


def _check_ids(test_ids: Sequence[str]) -> tuple[str, ...]:
    ids = tuple(test_ids)
    for test_id in ids:
        if not isinstance(test_id, str) or not test_id or test_id.startswith("-"):
            raise ValueError(
                f"test id {test_id!r} must be a pytest node id such as "
                "'tests/test_x.py::test_y' (not empty, not an option)"
            )
    return ids


def grading_config(cfg: SandboxConfig) -> SandboxConfig:
    """The sandbox limits of a grading run: ``cfg`` with nothing hidden and an uncut channel."""
    return dataclasses.replace(
        cfg, hidden_paths=(), max_output_bytes=max(cfg.max_output_bytes, CHANNEL_BYTES)
    )


def grading_sandbox(sandbox: Sandbox | SandboxConfig | None) -> Sandbox:
    """A sandbox fit for grading: ``sandbox`` itself when its config already is, else a new one
    of the same backend with `grading_config` limits (default: the ``auto`` backend)."""
    from etude.sandbox import make_sandbox  # the package's factory (it imports this module)

    if sandbox is None or isinstance(sandbox, SandboxConfig):
        return make_sandbox(None, grading_config(sandbox or SandboxConfig()))
    cfg = sandbox.config
    if not cfg.hidden_paths and cfg.max_output_bytes >= CHANNEL_BYTES:
        return sandbox
    return make_sandbox(sandbox.name, grading_config(cfg))  # type: ignore[arg-type]


def _with_readonly(box: Sandbox, entries: Sequence[str]) -> Sandbox:
    """A sandbox like ``box`` with ``entries`` of the workspace read-only (bubblewrap binds;
    another backend cannot bind, and is used as it is)."""
    from etude.sandbox.bwrap import BwrapSandbox

    if not isinstance(box, BwrapSandbox):
        return box
    return BwrapSandbox(dataclasses.replace(box.config, readonly_paths=tuple(entries)))


def grade(
    pristine: str | os.PathLike[str],
    final_tree: str | os.PathLike[str] | None,
    allowed: Sequence[str],
    test_ids: Sequence[str],
    test_env: Mapping[str, str] | None = None,
    pytest_args: Sequence[str] = (),
    *,
    sandbox: Sandbox | SandboxConfig | None = None,
    timeout: float = 300.0,
    work_dir: str | os.PathLike[str] | None = None,
    exclude: Sequence[str] = (),
) -> Outcome:
    """Grade ``final_tree``'s allowed changes on a copy of ``pristine`` (module docstring).

    ``final_tree=None`` grades the pristine tree as it is (the validator's broken and stub
    trees). ``test_ids`` empty: the whole suite, every test of it must pass. ``sandbox``: a
    sandbox to run in (its limits and masks; give it no hidden paths) or a config for a fresh one
    (default: the ``auto`` backend). ``exclude``: paths removed from the graded copy (hidden
    tests an agent's own run must not show). ``work_dir``: where the scratch copy goes.
    """
    start = time.monotonic()
    ids = _check_ids(test_ids)
    env, paths = _split_pythonpath(dict(test_env or {}))
    for arg in pytest_args:
        if not isinstance(arg, str):
            raise ValueError(f"pytest_args entry {arg!r} must be a string")
    box = grading_sandbox(sandbox)
    pristine = Path(pristine)
    if not pristine.is_dir():
        return Outcome(
            status="infra",
            reason=f"the pristine workspace {str(pristine)!r} is not a directory",
            failed_ids=list(ids),
            seconds=time.monotonic() - start,
        )
    scratch = Path(tempfile.mkdtemp(prefix=f"etude-grade-{os.getpid()}-", dir=work_dir))
    try:
        ws = scratch / "ws"
        try:
            changed = build_graded_tree(pristine, final_tree, allowed, ws, exclude=exclude)
        except ValueError as e:
            return Outcome(
                status="failed",
                reason=str(e),
                failed_ids=list(ids),
                seconds=time.monotonic() - start,
            )
        except OSError as e:
            return Outcome(
                status="infra",
                reason=f"copying the workspace failed: {e}",
                failed_ids=list(ids),
                seconds=time.monotonic() - start,
            )
        # the tree's top-level entries (tests, configuration, the package) are read-only for the
        # run: code under test cannot rewrite a test file before pytest imports it
        run_box = _with_readonly(box, sorted(os.listdir(ws)))
        # code in these files is the pristine tree's: never "the agent's" to the tamper checks
        pristine_code = pristine_sources(ws, allowed, None if final_tree is None else changed)
        outcome = _run(
            run_box, ws, ids, env, paths, list(pytest_args), list(allowed), pristine_code, timeout
        )
        outcome.changed = changed
    finally:
        _remove_scratch(scratch)
    outcome.seconds = time.monotonic() - start
    return outcome


def _remove_scratch(path: Path) -> None:
    """Remove a scratch tree, also where the tests took away permissions (top-down chmod)."""
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)


def _run(
    box: Sandbox,
    ws: Path,
    ids: tuple[str, ...],
    env: dict[str, str],
    paths: list[str],
    pytest_args: list[str],
    allowed: list[str],
    pristine_code: list[str],
    timeout: float,
) -> Outcome:
    nonce = "etude-" + secrets.token_hex(12)
    args = [*PYTEST_FIXED_ARGS, f"--rootdir={ws}", *pytest_args, *ids]
    request = {
        "nonce": nonce,
        "args": args,
        "paths": paths,
        "allowed": [a.rstrip("/") + ("/" if a.endswith("/") else "") for a in allowed],
        "pristine_sources": pristine_code,
        "trusted_roots": trusted_roots(),
    }
    argv = [sys.executable, "-P", "-B", "-c", BOOTSTRAP]
    result = box.run(argv, ws, timeout=timeout, env=env, stdin=json.dumps(request))
    reading = read_channel(result.stdout, nonce)
    output = (result.stderr if result.stderr else result.stdout)[-OUTPUT_EXCERPT_CHARS:]
    outcome = Outcome(
        status="failed",
        outcomes=dict(reading.outcomes),
        collection_errors=list(reading.collection_errors),
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        output=output,
    )
    expected = ids if ids else tuple(sorted(reading.outcomes))
    for test_id in expected:
        (outcome.passed_ids if outcome.outcome(test_id) == "passed" else outcome.failed_ids).append(
            test_id
        )
    if not reading.booted or not reading.ready:
        # nothing of the tree ran before `ready`: the sandbox, the interpreter or pytest itself
        # failed (or the machine was too slow to start them): not the solution's fault
        outcome.status = "infra"
        last = (result.stderr.strip().splitlines() or [""])[-1][:300]
        where = "never started" if not reading.booted else "could not load pytest"
        outcome.reason = f"the sandboxed interpreter {where} (exit code {result.exit_code}): {last}"
        if result.timed_out:
            outcome.reason = f"the sandboxed run timed out after {timeout:.0f} s before it started"
    elif "bytes of stdout truncated by the sandbox" in result.stdout:
        # stdout is the channel: a cut there may hide reports (stderr, pytest's own output,
        # may overflow harmlessly: only its tail is kept)
        outcome.status = "error"
        outcome.reason = "the run's output overflowed the result channel"
    elif reading.problems:
        outcome.status = "error"
        outcome.reason = reading.problems[0]
    elif result.timed_out:
        outcome.status = "error"
        outcome.reason = f"the tests timed out after {timeout:.0f} s"
    elif reading.exit_code is None or not reading.finished:
        outcome.status = "error"
        outcome.reason = (
            f"the test process ended (exit code {result.exit_code}) before its report was complete"
        )
    elif reading.exit_code != result.exit_code:
        outcome.status = "error"
        outcome.reason = (
            f"pytest returned {reading.exit_code} but the process exited {result.exit_code}"
        )
    elif reading.exit_code in (2, 3, 4) or reading.collection_errors:
        outcome.status = "error"
        what = {2: "interrupted", 3: "internal error", 4: "usage error"}.get(reading.exit_code)
        first = reading.collection_errors[0] if reading.collection_errors else ""
        outcome.reason = (
            f"pytest could not collect {first}" if first else f"pytest stopped: {what}"
        ) + f" (exit code {reading.exit_code})"
    elif not expected:
        outcome.status = "error"
        outcome.reason = "no tests ran"
    elif outcome.failed_ids:
        outcome.status = "failed"
        first = outcome.failed_ids[0]
        outcome.reason = (
            f"{len(outcome.failed_ids)} of {len(expected)} tests did not pass, e.g. {first} "
            f"({outcome.outcome(first)})"
        )
    elif reading.exit_code != 0:
        outcome.status = "failed"
        outcome.reason = f"every expected test passed but pytest exited {reading.exit_code}"
    else:
        outcome.status = "passed"
    return outcome
