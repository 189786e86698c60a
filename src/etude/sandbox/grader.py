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
   (``infra``: the sandbox, the interpreter or pytest's start-up; a solution cannot cause it); every expected id must be reported run and passed (a missing id fails, a
   requested file or class needs at least one test under it and all of them passing); a test
   with two different outcomes for one phase, a line after ``exit``, a malformed line, an
   ``exit`` code that differs from the process's, or a run that ends without ``exit`` fail the
   run. The reporter also snapshots pytest's run-and-report machinery at boot (the functions
   that run a test and build its report, the report class, ``pluggy``'s hook caller) and the
   set of registered plugins after configuration; a change to either (monkeypatching pytest's
   internals, a plugin registered by the code under test) is reported as ``tamper`` and the run
   scores ``error``.

Statuses: ``passed`` (every expected id passed in a sound run), ``failed`` (a sound run where some
did not), ``error`` (the run itself broke: collection or usage error, timeout, tampering, a
report that stops short), ``infra`` (the grader could not grade: the sandbox did not start, the
pristine tree is missing, a copy failed). ``infra`` is never a score: callers mask it.

What the grader does not guarantee: code under test that finds the reporter in memory and forges
its whole stream (the protocol is open source) is not caught here; nor is code that passes the
tests by special-casing them (an object equal to everything, answers keyed on test inputs). Those
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
from etude.sandbox.cleanroom import build_graded_tree

Status = Literal["passed", "failed", "error", "infra"]
STATUSES: tuple[Status, ...] = ("passed", "failed", "error", "infra")
# the worst per-test outcome first: it decides a group id (a file or class)
TEST_OUTCOMES = ("error", "failed", "skipped", "passed")
CHANNEL_BYTES = 64 << 20
"""Output kept per stream for a grading run: the result channel must never be cut."""
OUTPUT_EXCERPT_CHARS = 8000
PYTEST_FIXED_ARGS = ("-p", "no:cacheprovider", "-q")

# Runs as `python -P -B -c BOOTSTRAP` in the sandbox; its configuration comes as JSON on stdin.
# Everything lives in one function's scope: nothing of it is an attribute of `__main__`.
BOOTSTRAP = r"""
def _grade_main():
    import json, os, sys
    cfg = json.loads(sys.stdin.read())
    _null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(_null, 0)
    os.close(_null)
    _chan = os.dup(1)
    os.dup2(2, 1)
    _nonce = cfg["nonce"].encode()
    _write, _dumps, _exit = os.write, json.dumps, os._exit
    def _emit(record):
        data = _nonce + b" " + _dumps(record).encode() + b"\n"
        while data:
            data = data[_write(_chan, data):]
    _emit({"e": "boot"})
    import tempfile
    sys.dont_write_bytecode = True
    import pluggy, pytest, _pytest.main, _pytest.python, _pytest.reports, _pytest.runner
    import importlib, importlib.metadata, _pytest.config
    # pytest's own plugins and the environment's (entry points) are loaded here, before the
    # `ready` line: a failure to load them is the grader's, and they read their own bytecode
    for _name in _pytest.config.default_plugins:
        try:
            importlib.import_module("_pytest." + _name)
        except Exception:
            pass
    if not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        for _ep in importlib.metadata.entry_points(group="pytest11"):
            try:
                _ep.load()
            except Exception:
                pass
    # from here on bytecode is looked up in an empty private directory only: no __pycache__ of
    # the tree is read, by the import system or by pytest's assertion rewriter (pytest and
    # the standard library modules above were loaded from their own caches)
    sys.pycache_prefix = os.path.join(tempfile.gettempdir(), "etude-pyc-" + cfg["nonce"])
    _WATCHED = {
        "runner.call_and_report": (_pytest.runner, "call_and_report"),
        "runner.runtestprotocol": (_pytest.runner, "runtestprotocol"),
        "runner.call_runtest_hook": (_pytest.runner, "call_runtest_hook"),
        "runner.pytest_runtest_makereport": (_pytest.runner, "pytest_runtest_makereport"),
        "runner.CallInfo.from_call": (_pytest.runner.CallInfo, "from_call"),
        "reports.TestReport.from_item_and_call": (_pytest.reports.TestReport, "from_item_and_call"),
        "reports.TestReport.__init__": (_pytest.reports.TestReport, "__init__"),
        "reports.BaseReport.passed": (_pytest.reports.BaseReport, "passed"),
        "reports.BaseReport.failed": (_pytest.reports.BaseReport, "failed"),
        "python.Function.runtest": (_pytest.python.Function, "runtest"),
        "python.pytest_pyfunc_call": (_pytest.python, "pytest_pyfunc_call"),
        "main.pytest_runtestloop": (_pytest.main, "pytest_runtestloop"),
        "pluggy.HookCaller.__call__": (pluggy.HookCaller, "__call__"),
        "pluggy.PluginManager._hookexec": (pluggy.PluginManager, "_hookexec"),
        "pytest.main": (pytest, "main"),
        "os._exit": (os, "_exit"),
    }
    def _attr(owner, name):
        return owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    _SNAPSHOT = {k: _attr(o, n) for k, (o, n) in _WATCHED.items()}
    _MODULES = {m: sys.modules[m] for m in ("pytest", "_pytest", "pluggy", "_pytest.runner")}
    _seen_tamper = set()
    def _check(where):
        for key, (owner, name) in _WATCHED.items():
            if _attr(owner, name) is not _SNAPSHOT[key] and key not in _seen_tamper:
                _seen_tamper.add(key)
                _emit({"e": "tamper", "what": key + " was replaced", "where": where})
        for name, module in _MODULES.items():
            if sys.modules.get(name) is not module and name not in _seen_tamper:
                _seen_tamper.add(name)
                _emit({"e": "tamper", "what": "module " + name + " was replaced", "where": where})
    _ws = os.path.realpath(os.getcwd())
    _trusted_roots = tuple(os.path.realpath(p) + os.sep for p in cfg["trusted_roots"])
    def _in_allowed(path):
        path = os.path.realpath(path)
        if not path.startswith(_ws + os.sep):
            return False
        rel = path[len(_ws) + 1:]
        return any(rel == a or rel.startswith(a) for a in cfg["allowed"])
    def _untrusted(path):
        if not path or not os.path.isabs(path):
            return True
        if _in_allowed(path):
            return True
        path = os.path.realpath(path)
        return not path.startswith(_ws + os.sep) and not path.startswith(_trusted_roots)
    def _plugin_file(plugin):
        f = getattr(plugin, "__file__", None)
        if f is None:
            module = sys.modules.get(getattr(type(plugin), "__module__", ""), None)
            f = getattr(module, "__file__", None)
        return f
    class _Reporter:
        def __init__(self):
            self.plugins = None
            self.config = None
        def _check_plugins(self, where):
            if self.config is None:
                return
            pm = self.config.pluginmanager
            for plugin in pm.get_plugins():
                if plugin is self or id(plugin) in self.plugins:
                    continue
                self.plugins.add(id(plugin))
                path = _plugin_file(plugin)
                if path is None or _untrusted(path):
                    _emit({"e": "tamper", "what": "plugin registered from " + str(path), "where": where})
            for hook in ("pytest_runtest_makereport", "pytest_runtest_logreport",
                         "pytest_runtest_call", "pytest_pyfunc_call", "pytest_runtest_protocol",
                         "pytest_report_teststatus", "pytest_sessionfinish"):
                for impl in getattr(pm.hook, hook).get_hookimpls():
                    code = getattr(impl.function, "__code__", None)
                    path = code.co_filename if code is not None else None
                    key = (hook, id(impl.function))
                    if key in self.plugins:
                        continue
                    self.plugins.add(key)
                    if path is not None and _untrusted(path) and impl.plugin is not self:
                        _emit({"e": "tamper", "what": hook + " implemented in " + path, "where": where})
        @pytest.hookimpl(tryfirst=True)
        def pytest_configure(self, config):
            self.config = config
            self.plugins = set()
            _emit({"e": "start"})
        @pytest.hookimpl(tryfirst=True)
        def pytest_sessionstart(self, session):
            _mark_ready()
        @pytest.hookimpl(tryfirst=True)
        def pytest_collectreport(self, report):
            if report.failed:
                _emit({"e": "collect_error", "id": report.nodeid})
        @pytest.hookimpl(tryfirst=True)
        def pytest_collection_finish(self, session):
            _check("collection")
            self._check_plugins("collection")
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_call(self, item):
            obj = getattr(item, "obj", None)
            obj = getattr(obj, "__func__", obj)
            code = getattr(obj, "__code__", None)
            path = code.co_filename if code is not None else ""
            if path and os.path.isabs(path) and _in_allowed(path):
                _emit({"e": "tamper", "what": "test function replaced by code in " + path,
                       "where": item.nodeid})
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_logreport(self, report):
            _check(report.nodeid)
            self._check_plugins(report.nodeid)
            _emit({"e": "report", "id": report.nodeid, "when": report.when,
                   "outcome": report.outcome, "xfail": hasattr(report, "wasxfail")})
        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(self, session, exitstatus):
            _check("sessionfinish")
            self._check_plugins("sessionfinish")
            _emit({"e": "finish", "exit": int(exitstatus), "collected": session.testscollected})
    # `ready`: the last moment before code the agent could have changed may run (the first
    # import of the task's package, or the session's start). A failure before it is the
    # grader's (the sandbox, the interpreter, pytest's start-up), never the solution's.
    _ready = []
    def _mark_ready():
        if not _ready:
            _ready.append(True)
            _emit({"e": "ready"})
    sys.path[:] = [p for p in sys.path if p and p != os.curdir and os.path.realpath(p) != _ws]
    sys.path += [os.path.join(_ws, p) for p in cfg["paths"]] + [_ws]
    import importlib.machinery
    _pins = {}
    for _prefix in cfg["allowed"]:
        _parts = _prefix.rstrip("/").split("/")
        _name = _parts[-1][:-3] if _parts[-1].endswith(".py") else _parts[-1]
        _pins[_name] = [os.path.join(_ws, *_parts[:-1])]
    class _TaskPackagesFromTree:
        # the task's own packages come from the graded tree even where the environment has a
        # copy installed (site-packages precedes the tree on sys.path)
        def find_spec(self, name, path=None, target=None):
            where = _pins.get(name) if path is None else None
            if where is None:
                return None
            _mark_ready()
            return importlib.machinery.PathFinder.find_spec(name, where)
    sys.meta_path.insert(0, _TaskPackagesFromTree())
    try:
        _ret = int(pytest.main(cfg["args"], plugins=[_Reporter()]))
    except SystemExit as e:
        _ret = e.code if isinstance(e.code, int) else 1
    _check("exit")
    _emit({"e": "exit", "code": _ret})
    os.close(_chan)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    _exit(_ret)
_grade_main()
"""


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


@dataclass(kw_only=True, slots=True)
class ChannelReading:
    """What the result channel of one run said (`read_channel`)."""

    booted: bool = False
    ready: bool = False
    """pytest and the reporter loaded, before any file of the tree could run."""
    finished: bool = False
    exit_code: int | None = None
    outcomes: dict[str, str] = field(default_factory=dict)
    collection_errors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Reasons the stream cannot be trusted (tampering, conflicts, lines after exit)."""


def _phase_outcome(phases: Mapping[str, tuple[str, bool]]) -> str:
    """A test's outcome from its phases' ``(outcome, xfail)``, as pytest's summary counts it."""
    setup = phases.get("setup")
    call = phases.get("call")
    teardown = phases.get("teardown")
    if setup is not None and setup[0] == "failed":
        return "error"
    if teardown is not None and teardown[0] == "failed":
        return "error" if call is None or call[0] != "failed" else "failed"
    if setup is not None and setup[0] == "skipped":
        return "skipped"
    if call is None:
        return "error"
    if call[0] == "passed":
        return "passed"
    return "skipped" if call[0] == "skipped" else "failed"


def read_channel(stdout: str, nonce: str) -> ChannelReading:
    """Parse and cross-check the reporter's lines in ``stdout`` (see the module docstring)."""
    reading = ChannelReading()
    phases: dict[str, dict[str, tuple[str, bool]]] = {}
    marker = nonce + " "
    exited = False
    for line in stdout.splitlines():
        if not line.startswith(marker):
            if nonce in line:
                reading.problems.append("a malformed line on the result channel")
            continue
        try:
            record = json.loads(line[len(marker) :])
            event = record["e"]
        except (ValueError, KeyError, TypeError):
            reading.problems.append("a malformed line on the result channel")
            continue
        if exited:
            reading.problems.append(f"a {event!r} line after the run's exit line")
            continue
        if event == "boot":
            if reading.booted:
                reading.problems.append("a second boot line")
            reading.booted = True
        elif not reading.booted:
            reading.problems.append(f"a {event!r} line before the boot line")
        elif event == "ready":
            reading.ready = True
        elif event == "tamper":
            reading.problems.append(f"tampering: {record.get('what')} (at {record.get('where')})")
        elif event == "collect_error":
            reading.collection_errors.append(str(record.get("id", "")))
        elif event == "report":
            test_id, when = str(record.get("id", "")), str(record.get("when", ""))
            seen = phases.setdefault(test_id, {})
            value = (str(record.get("outcome", "")), bool(record.get("xfail")))
            if when in seen and seen[when] != value:
                reading.problems.append(f"two different {when} reports for {test_id}")
            seen[when] = value
        elif event == "finish":
            if reading.finished:
                reading.problems.append("a second finish line")
            reading.finished = True
        elif event == "exit":
            reading.exit_code = int(record.get("code", -1))
            exited = True
    reading.outcomes = {test_id: _phase_outcome(p) for test_id, p in phases.items()}
    return reading


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
        outcome = _run(run_box, ws, ids, env, paths, list(pytest_args), list(allowed), timeout)
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
    timeout: float,
) -> Outcome:
    nonce = "etude-" + secrets.token_hex(12)
    args = [*PYTEST_FIXED_ARGS, f"--rootdir={ws}", *pytest_args, *ids]
    request = {
        "nonce": nonce,
        "args": args,
        "paths": paths,
        "allowed": [a.rstrip("/") + ("/" if a.endswith("/") else "") for a in allowed],
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
