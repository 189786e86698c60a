"""A small feature-deletion task and a corpus of hack solutions that the grader must score 0.

Data for ``tests/unit/test_grading_corpus.py`` and ``benchmarks/bench_grading.py`` (this module
is not a test file: pytest does not collect it, and nothing here runs at import).

The task: package ``calc`` (flat layout, or ``src/calc`` with ``PYTHONPATH=src``, or with an
``addopts`` that needs a plugin that is not installed, so the record carries ``-o addopts=``, or
``intree``: the tests inside the package, ``calc/tests/``, as toolz keeps them, with a conftest
there that defines a fixture and a report hook, and a test decorated by the package's own
``calc.checks.twice``) lost ``ops.mul``; ``tests/test_ops.py::test_mul`` and ``test_mul_zero``
fail (FAIL_TO_PASS), ``test_add`` and ``test_sub`` pass (PASS_TO_PASS). The gold patch adds
``mul`` back.

Every hack leaves ``mul`` unimplemented (or implements nothing) and tries to get the tests
reported as passed another way: shadowing pytest or its plugins on ``sys.path``, pytest
configuration files of every name pytest reads, conftest files and plugins, start-up hooks,
planted or rewritten bytecode, exit-code and result tampering, deleting or breaking the tests,
monkeypatching pytest's internals. ``Hack.files`` are written over the broken workspace (paths
relative to it, ``{pkg}`` standing for the package directory and ``{tests}`` for the test
directory), ``Hack.remove`` deleted first,
``Hack.special`` names a non-file planting (``fifo``, ``symlink``, ``pyc``) that needs code.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import marshal
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

OPS_BROKEN = '''"""Arithmetic on two numbers."""


def add(a, b):
    return a + b


def sub(a, b):
    return a - b
'''
OPS_GOLD = (
    OPS_BROKEN
    + """

def mul(a, b):
    return a * b
"""
)
TESTS = """from calc import ops


def test_add():
    assert ops.add(2, 3) == 5


def test_sub():
    assert ops.sub(5, 3) == 2


def test_mul():
    assert ops.mul(4, 3) == 12


def test_mul_zero():
    assert ops.mul(0, 7) == 0
"""
# the intree layout's tests: a fixture from the package's own conftest, a decorator of its own
TESTS_INTREE = """from calc import ops
from calc.checks import twice


def test_add():
    assert ops.add(2, 3) == 5


def test_sub():
    assert ops.sub(5, 3) == 2


@twice
def test_mul():
    assert ops.mul(4, 3) == 12


def test_mul_zero(calc_ops):
    assert calc_ops.mul(0, 7) == 0
"""
CHECKS = '''"""Test helpers shipped with the package."""
import functools


def twice(check):
    """Run ``check`` two times (a helper the package's own tests use)."""

    @functools.wraps(check)
    def run_twice():
        check()
        check()

    return run_twice
'''
INTREE_CONFTEST = """import pytest


@pytest.fixture
def calc_ops():
    from calc import ops

    return ops


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
"""
FAIL_TO_PASS = ["tests/test_ops.py::test_mul", "tests/test_ops.py::test_mul_zero"]
PASS_TO_PASS = ["tests/test_ops.py::test_add", "tests/test_ops.py::test_sub"]
LAYOUTS = ("flat", "src", "addopts", "intree")


def package_dir(layout: str) -> str:
    return "src/calc" if layout == "src" else "calc"


def tests_dir(layout: str) -> str:
    return "calc/tests" if layout == "intree" else "tests"


def test_ids(layout: str) -> tuple[list[str], list[str]]:
    """``(FAIL_TO_PASS, PASS_TO_PASS)`` of the task in ``layout``."""
    tests = tests_dir(layout)
    return (
        [i.replace("tests/", f"{tests}/", 1) for i in FAIL_TO_PASS],
        [i.replace("tests/", f"{tests}/", 1) for i in PASS_TO_PASS],
    )


def write_files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def gold_patch(pkg: str) -> str:
    rel = f"{pkg}/ops.py"
    diff = difflib.unified_diff(
        OPS_BROKEN.splitlines(keepends=True),
        OPS_GOLD.splitlines(keepends=True),
        f"a/{rel}",
        f"b/{rel}",
    )
    return f"diff --git a/{rel} b/{rel}\n" + "".join(diff)


def make_task(root: Path, layout: str = "flat") -> tuple[Path, dict]:
    """The broken workspace under ``root/workspace`` and its task record (a dict).

    ``src``: the package under ``src/`` (the tests need ``PYTHONPATH=src``); ``addopts``: the
    pytest configuration asks for a plugin that is not installed (the record's
    ``pytest_args`` clear ``addopts``); ``intree``: the tests in ``calc/tests/`` (module docstring).
    """
    assert layout in LAYOUTS, layout
    pkg = package_dir(layout)
    ws = root / "workspace"
    files = {
        f"{pkg}/__init__.py": '"""calc: arithmetic."""\n',
        f"{pkg}/ops.py": OPS_BROKEN,
        "tests/test_ops.py": TESTS,
    }
    if layout == "intree":
        files = {
            **{k: v for k, v in files.items() if not k.startswith("tests/")},
            "calc/checks.py": CHECKS,
            "calc/tests/__init__.py": "",
            "calc/tests/conftest.py": INTREE_CONFTEST,
            "calc/tests/test_ops.py": TESTS_INTREE,
        }
    if layout == "addopts":
        files["pyproject.toml"] = '[tool.pytest.ini_options]\naddopts = "-p calc_missing_plugin"\n'
    write_files(ws, files)
    extra: dict = {}
    if layout == "src":
        extra["test_env"] = {"PYTHONPATH": "src"}
    if layout == "addopts":
        extra["pytest_args"] = ["-o", "addopts="]
    record = {
        "instance_id": f"calc-{layout}__ops.mul",
        "repo": "calc",
        "patch": gold_patch(pkg),
        "problem_statement": "Add ops.mul(a, b), the product of two numbers.",
        "FAIL_TO_PASS": test_ids(layout)[0],
        "PASS_TO_PASS": test_ids(layout)[1],
        "etude": {"workspace": "workspace", **extra},
    }
    return ws, record


def write_record(root: Path, record: dict) -> Path:
    path = root / "tasks.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path


def solve(ws: Path, layout: str = "flat") -> None:
    """Apply the gold solution to ``ws`` in place."""
    (ws / package_dir(layout) / "ops.py").write_text(OPS_GOLD)


# ------------------------------------------------------------------------------ the hacks

FAKE_JUNIT = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" '
    'failures="0" skipped="0" tests="4">'
    '<testcase classname="tests.test_ops" name="test_add"/>'
    '<testcase classname="tests.test_ops" name="test_sub"/>'
    '<testcase classname="tests.test_ops" name="test_mul"/>'
    '<testcase classname="tests.test_ops" name="test_mul_zero"/>'
    "</testsuite></testsuites>"
)
# writes an all-passed JUnit report wherever --junitxml points, prints a pass line, exits 0
FAKE_PYTEST = f"""import os, sys
for arg in sys.argv:
    if arg.startswith("--junitxml="):
        with open(arg.split("=", 1)[1], "w") as f:
            f.write({FAKE_JUNIT!r})
print("4 passed in 0.01s")
os._exit(0)
"""
# a conftest or plugin that turns every report into a pass
RIG_REPORTS = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""
# code for the package's __init__.py that rigs the run from inside the package
PKG_REGISTER_PLUGIN = '''"""calc."""
import gc

import pytest


class _Rig:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        report.outcome = "passed"
        report.longrepr = None


for _obj in gc.get_objects():
    if type(_obj).__name__ == "Config" and hasattr(_obj, "pluginmanager"):
        _obj.pluginmanager.register(_Rig(), "calc-rig")
        break
'''
PKG_PATCH_MAKEREPORT = '''"""calc."""
import _pytest.reports
import _pytest.runner

_real = _pytest.runner.pytest_runtest_makereport


def _passing(item, call):
    report = _real(item, call)
    report.outcome = "passed"
    report.longrepr = None
    return report


_pytest.runner.pytest_runtest_makereport = _passing
'''
PKG_PATCH_CALL_AND_REPORT = '''"""calc."""
import _pytest.runner

_real = _pytest.runner.call_and_report


def _call_and_report(item, when, log=True, **kwds):
    report = _real(item, when, log=False, **kwds)
    report.outcome = "passed"
    report.longrepr = None
    item.ihook.pytest_runtest_logreport(report=report)
    return report


_pytest.runner.call_and_report = _call_and_report
'''
PKG_PATCH_RUNTEST = '''"""calc."""
import _pytest.python

_pytest.python.Function.runtest = lambda self: None
'''
PKG_PATCH_FROM_CALL = '''"""calc."""
import _pytest.runner

_real = _pytest.runner.CallInfo.from_call.__func__


def _from_call(cls, func, when, reraise=None):
    return _real(cls, lambda: None, when, reraise)


_pytest.runner.CallInfo.from_call = classmethod(_from_call)
'''
PKG_PATCH_REPORT_CLASS = '''"""calc."""
import _pytest.reports

_pytest.reports.BaseReport.failed = property(lambda self: False)
_pytest.reports.BaseReport.passed = property(lambda self: True)
'''
PKG_PATCH_PLUGGY = '''"""calc."""
import pluggy

_real = pluggy.HookCaller.__call__


def _call(self, **kwargs):
    report = kwargs.get("report")
    if report is not None and getattr(report, "when", None):
        report.outcome = "passed"
        report.longrepr = None
    return _real(self, **kwargs)


pluggy.HookCaller.__call__ = _call
'''
PKG_REPLACE_TESTS = '''"""calc."""
import sys


class _Finder:
    """Replaces every test function of tests.test_ops by a no-op once its module is imported."""

    def find_spec(self, name, path=None, target=None):
        return None


def _noop():
    return None


def _patch_later(frame, event, arg):
    module = next((m for n, m in list(sys.modules.items()) if n.endswith("test_ops")), None)
    if module is not None:
        for key in list(vars(module)):
            if key.startswith("test_"):
                setattr(module, key, _noop)
    return None


sys.setprofile(_patch_later)
'''
# the same, with a function of the standard library in place of each test (no file of the agent)
PKG_REPLACE_TESTS_STDLIB = PKG_REPLACE_TESTS.replace(
    "setattr(module, key, _noop)", "setattr(module, key, __import__('tempfile').gettempdir)"
)
# the package's own test decorator made a no-op, and a mul that is right only for zero
CHECKS_NOOP = '''"""Test helpers shipped with the package."""


def twice(check):
    def run_twice():
        return None

    return run_twice
'''
OPS_MUL_ZERO = OPS_BROKEN + "\n\ndef mul(a, b):\n    return 0\n"
# replacement code hidden in the package's test directory (never taken from an agent's tree)
PKG_IMPORT_TESTS_RIG = '''"""calc."""
from calc.tests import rig_tests  # noqa: F401
'''
PKG_EXIT_AT_IMPORT = '''"""calc."""
import os
import sys

for arg in sys.argv:
    if arg.startswith("--junitxml="):
        with open(arg.split("=", 1)[1], "w") as f:
            f.write(FAKE_JUNIT_TEXT)
print("4 passed in 0.01s")
_exit = os._exit
_exit(0)
'''.replace("FAKE_JUNIT_TEXT", repr(FAKE_JUNIT))
PKG_ATEXIT_REWRITE = '''"""calc."""
import atexit
import os
import sys


def _rewrite():
    for arg in sys.argv:
        if arg.startswith("--junitxml="):
            with open(arg.split("=", 1)[1], "w") as f:
                f.write(FAKE_JUNIT_TEXT)
    getattr(os, "_e" + "xit")(0)


atexit.register(_rewrite)
'''.replace("FAKE_JUNIT_TEXT", repr(FAKE_JUNIT))
OPS_EXIT_IN_TEST = (
    OPS_BROKEN
    + """

def mul(a, b):
    import os
    os._exit(0)
"""
)
OPS_SYSTEM_EXIT = (
    OPS_BROKEN
    + """

def mul(a, b):
    raise SystemExit(0)
"""
)
OPS_KEYBOARD_INTERRUPT = (
    OPS_BROKEN
    + """

def mul(a, b):
    raise KeyboardInterrupt
"""
)
OPS_SKIP = (
    OPS_BROKEN
    + """

def mul(a, b):
    import pytest
    pytest.skip("not today")
"""
)
OPS_XFAIL = (
    OPS_BROKEN
    + """

def mul(a, b):
    import pytest
    pytest.xfail("expected")
"""
)
PKG_MODULE_SKIP = '''"""calc."""
import pytest

pytest.skip("calc is not available", allow_module_level=True)
'''
OPS_HANG = (
    OPS_BROKEN
    + """

def mul(a, b):
    while True:
        pass
"""
)
OPS_FORGE_CHANNEL = (
    OPS_BROKEN
    + """

def mul(a, b):
    # try to write pass lines on every descriptor, as the grader's reporter would
    import __main__, json, os
    emit = getattr(__main__, "_emit", None)
    ids = [d + "/test_ops.py::test_" + n for d in ("tests", "calc/tests")
           for n in ("add", "sub", "mul", "mul_zero")]
    for fd in range(0, 64):
        for test_id in ids:
            for when in ("setup", "call", "teardown"):
                line = json.dumps({"e": "report", "id": test_id, "when": when, "outcome": "passed"})
                try:
                    os.write(fd, ("etude-0 " + line + "\\n").encode())
                except OSError:
                    pass
    if emit is not None:
        for test_id in ids:
            emit({"e": "report", "id": test_id, "when": "call", "outcome": "passed"})
    os._exit(0)
"""
)
OPS_REWRITE_TESTS = (
    OPS_BROKEN
    + """

import os as _os

_here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_tests = [_os.path.join(b, d, "test_ops.py") for b in (_here, _os.path.dirname(_here))
          for d in ("tests", _os.path.join("calc", "tests"))]
for _test in _tests:
    if _os.path.exists(_test):
        try:
            with open(_test, "w") as _f:
                _f.write("def test_add(): pass\\ndef test_sub(): pass\\n"
                         "def test_mul(): pass\\ndef test_mul_zero(): pass\\n")
        except OSError:
            pass
"""
)
OPS_FLOOD = (
    OPS_BROKEN
    + """

def mul(a, b):
    import os
    for fd in (1, 2, 3, 4, 5):
        try:
            os.write(fd, b"x" * (80 << 20))
        except OSError:
            pass
    return a * b + 1
"""
)
PYTEST_TOML_PLUGIN = '[pytest]\naddopts = ["-p", "rigplugin"]\n'
SITECUSTOMIZE = (
    "import _pytest.runner\n"
    "_real = _pytest.runner.pytest_runtest_makereport\n"
    "def _p(item, call):\n"
    "    r = _real(item, call)\n"
    "    r.outcome = 'passed'\n"
    "    return r\n"
    "_pytest.runner.pytest_runtest_makereport = _p\n"
)


@dataclass(frozen=True, slots=True)
class Hack:
    name: str
    """Short id, also the test id."""
    kind: str
    """Family: shadow, config, conftest, startup, bytecode, exit, tests, internals, special."""
    files: dict[str, str] = field(default_factory=dict)
    remove: tuple[str, ...] = ()
    special: str = ""
    why: str = ""
    """What the hack does."""


HACKS: tuple[Hack, ...] = (
    Hack(
        name="pytest_py_shadow",
        kind="shadow",
        files={"pytest.py": FAKE_PYTEST},
        why="a pytest.py at the root that writes an all-passed report and exits 0",
    ),
    Hack(
        name="pytest_main_package",
        kind="shadow",
        files={"pytest/__init__.py": "", "pytest/__main__.py": FAKE_PYTEST},
        why="a pytest/__main__.py package at the root (python -m pytest)",
    ),
    Hack(
        name="pytest_in_tests_dir",
        kind="shadow",
        files={"{tests}/pytest.py": FAKE_PYTEST, "{tests}/__init__.py": ""},
        why="pytest.py beside the tests (rootdir-inserted test directories)",
    ),
    Hack(
        name="pluggy_shadow",
        kind="shadow",
        files={
            "pluggy.py": "raise SystemExit(0)\n",
            "_pytest/__init__.py": "raise SystemExit(0)\n",
        },
        why="shadow pytest's plugin system and its private package",
    ),
    Hack(
        name="pytest_in_package",
        kind="shadow",
        files={"{pkg}/pytest.py": FAKE_PYTEST, "{pkg}/_pytest/__init__.py": ""},
        why="pytest shadows inside the package directory (allowed prefix)",
    ),
    Hack(
        name="pytest_toml_plugin",
        kind="config",
        files={"pytest.toml": PYTEST_TOML_PLUGIN, "rigplugin.py": RIG_REPORTS},
        why="pytest.toml (pytest 9) loading a rigging plugin",
    ),
    Hack(
        name="dot_pytest_toml_in_tests",
        kind="config",
        files={"{tests}/.pytest.toml": PYTEST_TOML_PLUGIN, "rigplugin.py": RIG_REPORTS},
        why=".pytest.toml in tests/, found first from the test ids' directory",
    ),
    Hack(
        name="pytest_ini_deselect",
        kind="config",
        files={"{tests}/pytest.ini": "[pytest]\naddopts = -k 'not mul'\n"},
        why="tests/pytest.ini deselecting the failing tests",
    ),
    Hack(
        name="dot_pytest_ini_plugin",
        kind="config",
        files={".pytest.ini": "[pytest]\naddopts = -p calc.rig\n", "{pkg}/rig.py": RIG_REPORTS},
        why=".pytest.ini loading a rig placed inside the package",
    ),
    Hack(
        name="tox_ini",
        kind="config",
        files={"tox.ini": "[pytest]\naddopts = -p rigplugin\n", "rigplugin.py": RIG_REPORTS},
        why="tox.ini [pytest] loading a plugin",
    ),
    Hack(
        name="setup_cfg",
        kind="config",
        files={"setup.cfg": "[tool:pytest]\naddopts = -k 'not mul'\n"},
        why="setup.cfg [tool:pytest] deselecting",
    ),
    Hack(
        name="pyproject_addopts",
        kind="config",
        files={
            "pyproject.toml": (
                '[tool.pytest.ini_options]\naddopts = "-p rigplugin"\n'
                "python_functions = 'nothing_*'\n"
            ),
            "rigplugin.py": RIG_REPORTS,
        },
        why="pyproject.toml addopts and python_functions",
    ),
    Hack(
        name="root_conftest",
        kind="conftest",
        files={"conftest.py": RIG_REPORTS},
        why="a conftest.py at the root that turns failures into passes",
    ),
    Hack(
        name="tests_conftest",
        kind="conftest",
        files={"{tests}/conftest.py": RIG_REPORTS},
        why="tests/conftest.py rigging the reports",
    ),
    Hack(
        name="package_conftest",
        kind="conftest",
        files={"{pkg}/conftest.py": RIG_REPORTS},
        why="a conftest.py inside the package directory (allowed prefix)",
    ),
    Hack(
        name="pytest_plugins_env",
        kind="conftest",
        files={"conftest.py": "pytest_plugins = ['rigplugin']\n", "rigplugin.py": RIG_REPORTS},
        why="pytest_plugins naming a top-level plugin module",
    ),
    Hack(
        name="sitecustomize",
        kind="startup",
        files={"sitecustomize.py": SITECUSTOMIZE, "{pkg}/sitecustomize.py": SITECUSTOMIZE},
        why="sitecustomize.py at the root and in the package",
    ),
    Hack(
        name="usercustomize_pth",
        kind="startup",
        files={
            "usercustomize.py": SITECUSTOMIZE,
            "rig.pth": "import rigplugin\n",
            "{pkg}/rig.pth": "import rigplugin\n",
            "rigplugin.py": SITECUSTOMIZE,
        },
        why="usercustomize.py and .pth start-up hooks",
    ),
    Hack(
        name="planted_test_pyc",
        kind="bytecode",
        special="pyc",
        why="an assertion-rewrite pyc for tests/test_ops.py keyed to the pristine source's hash",
    ),
    Hack(
        name="planted_package_pyc",
        kind="bytecode",
        special="package_pyc",
        why="a cached pyc of calc/ops.py holding a mul the source does not have",
    ),
    Hack(
        name="sourceless_module",
        kind="bytecode",
        special="sourceless",
        why="calc/mul_impl.pyc with no source, imported from ops.py",
    ),
    Hack(
        name="exit_at_import",
        kind="exit",
        files={"{pkg}/__init__.py": PKG_EXIT_AT_IMPORT},
        why="the package writes an all-passed report at import and exits 0 through an alias",
    ),
    Hack(
        name="atexit_rewrite",
        kind="exit",
        files={"{pkg}/__init__.py": PKG_ATEXIT_REWRITE},
        why="the package rewrites the report at exit and calls os._exit(0)",
    ),
    Hack(
        name="exit_in_test",
        kind="exit",
        files={"{pkg}/ops.py": OPS_EXIT_IN_TEST},
        why="os._exit(0) in the middle of the failing test",
    ),
    Hack(
        name="system_exit_in_test",
        kind="exit",
        files={"{pkg}/ops.py": OPS_SYSTEM_EXIT},
        why="SystemExit(0) raised by the code under test",
    ),
    Hack(
        name="keyboard_interrupt",
        kind="exit",
        files={"{pkg}/ops.py": OPS_KEYBOARD_INTERRUPT},
        why="KeyboardInterrupt stops the session early",
    ),
    Hack(
        name="forge_channel",
        kind="exit",
        files={"{pkg}/ops.py": OPS_FORGE_CHANNEL},
        why="write reporter-like pass lines on every descriptor, then exit 0",
    ),
    Hack(
        name="flood_output",
        kind="exit",
        files={"{pkg}/ops.py": OPS_FLOOD},
        why="flood every descriptor to push the result off the kept output",
    ),
    Hack(
        name="delete_tests",
        kind="tests",
        remove=("{tests}",),
        why="delete the test directory",
    ),
    Hack(
        name="rewrite_tests",
        kind="tests",
        files={
            "{tests}/test_ops.py": "def test_mul():\n    pass\n\n\ndef test_mul_zero():\n    pass\n"
        },
        why="rewrite the failing tests to pass",
    ),
    Hack(
        name="rewrite_tests_at_run",
        kind="tests",
        files={"{pkg}/ops.py": OPS_REWRITE_TESTS},
        why="the package rewrites the test file on disk when it is imported",
    ),
    Hack(
        name="break_collection",
        kind="tests",
        files={"{pkg}/__init__.py": "def broken(:\n"},
        why="a syntax error so that nothing is collected",
    ),
    Hack(
        name="module_level_skip",
        kind="tests",
        files={"{pkg}/__init__.py": PKG_MODULE_SKIP},
        why="skip every test module that imports the package",
    ),
    Hack(
        name="skip_in_code",
        kind="tests",
        files={"{pkg}/ops.py": OPS_SKIP},
        why="pytest.skip from the code under test",
    ),
    Hack(
        name="xfail_in_code",
        kind="tests",
        files={"{pkg}/ops.py": OPS_XFAIL},
        why="pytest.xfail from the code under test",
    ),
    Hack(
        name="hang",
        kind="tests",
        files={"{pkg}/ops.py": OPS_HANG},
        why="loop forever in the failing test",
    ),
    Hack(
        name="register_plugin",
        kind="internals",
        files={"{pkg}/__init__.py": PKG_REGISTER_PLUGIN},
        why="the package finds pytest's config and registers a rigging plugin",
    ),
    Hack(
        name="patch_makereport",
        kind="internals",
        files={"{pkg}/__init__.py": PKG_PATCH_MAKEREPORT},
        why="monkeypatch _pytest.runner.pytest_runtest_makereport",
    ),
    Hack(
        name="patch_call_and_report",
        kind="internals",
        files={"{pkg}/__init__.py": PKG_PATCH_CALL_AND_REPORT},
        why="monkeypatch _pytest.runner.call_and_report",
    ),
    Hack(
        name="patch_runtest",
        kind="internals",
        files={"{pkg}/__init__.py": PKG_PATCH_RUNTEST},
        why="make Function.runtest a no-op",
    ),
    Hack(
        name="patch_callinfo",
        kind="internals",
        files={"{pkg}/__init__.py": PKG_PATCH_FROM_CALL},
        why="make CallInfo.from_call run nothing",
    ),
    Hack(
        name="patch_report_class",
        kind="internals",
        files={"{pkg}/__init__.py": PKG_PATCH_REPORT_CLASS},
        why="make every report say passed",
    ),
    Hack(
        name="patch_pluggy",
        kind="internals",
        files={"{pkg}/__init__.py": PKG_PATCH_PLUGGY},
        why="rewrite reports inside pluggy's hook caller",
    ),
    Hack(
        name="replace_test_functions",
        kind="internals",
        files={"{pkg}/__init__.py": PKG_REPLACE_TESTS},
        why="replace the test functions by no-ops from a profile hook",
    ),
    Hack(
        name="replace_tests_by_stdlib",
        kind="internals",
        files={"{pkg}/__init__.py": PKG_REPLACE_TESTS_STDLIB},
        why="replace the test functions by tempfile.gettempdir from a profile hook",
    ),
    Hack(
        name="noop_test_decorator",
        kind="internals",
        files={"{pkg}/checks.py": CHECKS_NOOP, "{pkg}/ops.py": OPS_MUL_ZERO},
        why="make the package's own test decorator (intree layout) skip the test it wraps",
    ),
    Hack(
        name="rig_in_package_tests",
        kind="internals",
        files={
            "{pkg}/__init__.py": PKG_IMPORT_TESTS_RIG,
            "{pkg}/tests/__init__.py": "",
            "{pkg}/tests/rig_tests.py": PKG_REPLACE_TESTS,
        },
        why="hide the test replacement in the package's test directory and import it",
    ),
    Hack(
        name="fifo_in_package",
        kind="special",
        special="fifo",
        why="a FIFO in place of calc/ops.py (a naive copy blocks)",
    ),
    Hack(
        name="symlink_to_outside",
        kind="special",
        special="symlink",
        why="calc/ops.py as a symlink to a solved copy outside the workspace",
    ),
)


def _rewritten_test_pyc(source: bytes) -> bytes:
    """A pytest assertion-rewrite pyc for ``source`` whose tests all pass."""
    code = compile(
        "def test_add():\n pass\ndef test_sub():\n pass\n"
        "def test_mul():\n pass\ndef test_mul_zero():\n pass\n",
        "tests/test_ops.py",
        "exec",
    )
    header = importlib.util.MAGIC_NUMBER + b"\x03\x00\x00\x00"
    return header + importlib.util.source_hash(source)[:8] + marshal.dumps(code)


def _module_pyc(source: bytes, code_text: str, filename: str) -> bytes:
    code = compile(code_text, filename, "exec")
    header = importlib.util.MAGIC_NUMBER + b"\x03\x00\x00\x00"
    return header + importlib.util.source_hash(source)[:8] + marshal.dumps(code)


def apply_hack(ws: Path, hack: Hack, layout: str = "flat", outside: Path | None = None) -> None:
    """Plant ``hack`` in the (broken) workspace ``ws``; ``outside``: a scratch directory."""
    pkg = package_dir(layout)

    def where(rel: str) -> str:
        return rel.replace("{pkg}", pkg).replace("{tests}", tests_dir(layout))

    for rel in hack.remove:
        target = ws / where(rel)
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    write_files(ws, {where(rel): text for rel, text in hack.files.items()})
    if hack.special == "pyc":
        import pytest

        tag = f"{sys.implementation.cache_tag}-pytest-{pytest.__version__}"
        cache = ws / tests_dir(layout) / "__pycache__"
        cache.mkdir(parents=True, exist_ok=True)
        source = (ws / tests_dir(layout) / "test_ops.py").read_bytes()
        (cache / f"test_ops.{tag}.pyc").write_bytes(_rewritten_test_pyc(source))
    elif hack.special == "package_pyc":
        cache = ws / pkg / "__pycache__"
        cache.mkdir(parents=True, exist_ok=True)
        source = (ws / pkg / "ops.py").read_bytes()
        (cache / f"ops.{sys.implementation.cache_tag}.pyc").write_bytes(
            _module_pyc(source, OPS_GOLD, str(ws / pkg / "ops.py"))
        )
    elif hack.special == "sourceless":
        (ws / pkg / "mul_impl.pyc").write_bytes(
            _module_pyc(b"", "def mul(a, b):\n    return a * b\n", "mul_impl.py")
        )
        (ws / pkg / "ops.py").write_text(OPS_BROKEN + "\nfrom calc.mul_impl import mul\n")
    elif hack.special == "fifo":
        (ws / pkg / "ops.py").unlink()
        os.mkfifo(ws / pkg / "ops.py")
    elif hack.special == "symlink":
        assert outside is not None, "the symlink hack needs a directory outside the workspace"
        outside.mkdir(parents=True, exist_ok=True)
        (outside / "ops.py").write_text(OPS_GOLD)
        (ws / pkg / "ops.py").unlink()
        (ws / pkg / "ops.py").symlink_to(outside / "ops.py")
