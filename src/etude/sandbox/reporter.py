"""The grader's reporter: the code that runs pytest inside the sandbox, and the reader of its
result channel.

``BOOTSTRAP`` runs as ``python -P -B -c BOOTSTRAP`` with its configuration as JSON on stdin
(nonce, pytest arguments, ``PYTHONPATH`` entries, allowed paths, the pristine sources under
them, trusted roots). It keeps a private duplicate of the stdout pipe as the result channel and
sends everything else written to fd 1 to stderr; imports pytest, its plugins and the
environment's plugins before anything of the tree can be imported; snapshots pytest's
run-and-report machinery; appends the tree to ``sys.path`` after site-packages (the task's own
packages found in the tree first by a meta-path finder); and runs ``pytest.main`` with a plugin
that streams, one JSON line each, tagged with the nonce: ``boot``, ``ready`` (at the first
import of the task's package or the session's start), ``start``, ``collect_error``, one
``report`` per test phase, ``tamper`` (a watched function replaced, a plugin or hook
implementation or test function from the agent's files), ``finish`` and, after ``pytest.main``
returned, ``exit``. The process then exits without ``atexit`` handlers.

The agent's files are those under the allowed prefixes except the pristine sources
(``etude.sandbox.cleanroom.pristine_sources``: the files the agent's tree did not change, and
the tests and conftest files a package keeps inside itself, which the clean room never takes
from an agent's tree): a test function or a conftest hook defined in ``toolz/tests/``, or a
test decorator of an unchanged ``pkg/testing.py``, is the task's own code.

``read_channel(stdout, nonce)`` parses the lines and cross-checks them (`ChannelReading`): boot
first, no line after exit, one outcome per phase of a test, no malformed line.

What this does not do: decide the grade (``etude.sandbox.grader`` does, from the reading and
the process's exit), or stop code in the same process from forging the stream from memory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

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
    # the files under the allowed prefixes whose text is the pristine tree's (the ones the
    # agent did not change; tests and conftest files kept inside the package): code there is
    # the task's, never the agent's
    _pristine_code = frozenset(cfg["pristine_sources"])
    def _in_allowed(path):
        path = os.path.realpath(path)
        if not path.startswith(_ws + os.sep):
            return False
        rel = path[len(_ws) + 1:]
        if rel in _pristine_code:
            return False
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
    # a profile or trace function lets code run between a test module's execution and its
    # collection (to swap its test functions for anything, the standard library's included):
    # installing one from the agent's files, or from code of no file, is tampering. An audit
    # hook cannot be removed; it sees the call, its caller is the frame above it.
    _getframe = sys._getframe
    def _audit(event, args):
        if event != "sys.setprofile" and event != "sys.settrace":
            return
        frame = _getframe(1)
        path = frame.f_code.co_filename if frame is not None else ""
        if _untrusted(path) and event not in _seen_tamper:
            _seen_tamper.add(event)
            _emit({"e": "tamper", "what": event + " called from " + path, "where": "run"})
            # the grade is decided (tampering is an error whatever the tests do): end the run
            # here, before the hook gets to run anything (under a profile function every call
            # costs a Python call: a suite ran 3x slower to no purpose)
            _exit(3)
    sys.addaudithook(_audit)
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
