"""Say why a baseline does not run: one line per problem, each with its fix.

Real repositories fail in the sandbox for a few recurring reasons, and a build that reports only
"no test passes" leaves the user to rerun pytest by hand. ``diagnose`` reads the baseline's
pytest output (the short test summary and the error lines) and returns ``Diagnosis`` items:

- **missing module**: tests (or the package) import a module that is not installed
  (``ModuleNotFoundError: No module named 'freezegun'``, at collection or inside tests): names
  the modules, how many test files and tests they cost, and the fix: install them into the
  interpreter the tasks run with, or set ``tasks.install_test_deps = true`` so the factory
  installs the repository's test requirements from the package index into the build's
  environment (``etude.tasks.testdeps``);
- **pytest usage error**: pytest refused its command line, typically because the repository's
  ``addopts`` name a plugin that is not installed (``unrecognized arguments: --cov=pkg``): shows
  pytest's own error line and suggests ``tasks.pytest_args = ["-o", "addopts="]`` or the plugin
  that provides the option;
- **conftest error**: a ``conftest.py`` does not load (suggests ``--noconftest``);
- **collection errors**: other test files that do not import, with pytest's reason.

What this module does not do: run anything, or fix the repository; the factory prints the lines,
puts them in ``build_report.json`` and, for a baseline with no passing test, in its error.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_MISSING_RE = re.compile(r"No module named '([A-Za-z0-9_.]+)'")
_SUMMARY_RE = re.compile(r"^(ERROR|FAILED) (\S+?)(?:::\S+)? - (.*)$", re.M)
_USAGE_RE = re.compile(r"^(?:[^\n]*?: )?error: (.+)$", re.M)
_CONFTEST_RE = re.compile(r"ImportError while loading conftest '([^']+)'")
_IMPORTING_RE = re.compile(
    r"ImportError while importing test module '([^']+)'.*?No module named '([A-Za-z0-9_.]+)'",
    re.S,
)
_OPTION_RE = re.compile(r"(--?[A-Za-z][\w-]*)")

# options pytest rejects when the plugin that adds them is missing
PLUGIN_OF_OPTION = {
    "--cov": "pytest-cov",
    "--cov-report": "pytest-cov",
    "--cov-fail-under": "pytest-cov",
    "--cov-config": "pytest-cov",
    "--cov-append": "pytest-cov",
    "--no-cov": "pytest-cov",
    "-n": "pytest-xdist",
    "--numprocesses": "pytest-xdist",
    "--dist": "pytest-xdist",
    "--timeout": "pytest-timeout",
    "--reruns": "pytest-rerunfailures",
    "--benchmark-skip": "pytest-benchmark",
    "--benchmark-disable": "pytest-benchmark",
    "--mypy": "pytest-mypy",
    "--flake8": "pytest-flake8",
    "--html": "pytest-html",
    "--asyncio-mode": "pytest-asyncio",
    "--doctest-rst": "pytest-doctestplus",
    "--doctest-plus": "pytest-doctestplus",
    "--hypothesis-profile": "hypothesis",
    "--black": "pytest-black",
    "--isort": "pytest-isort",
    "--randomly-seed": "pytest-randomly",
    "--mpl": "pytest-mpl",
}

# import names whose distribution is called something else
DISTRIBUTION_OF_MODULE = {
    "yaml": "PyYAML",
    "dateutil": "python-dateutil",
    "PIL": "Pillow",
    "sklearn": "scikit-learn",
    "attr": "attrs",
    "bs4": "beautifulsoup4",
    "cv2": "opencv-python",
    "Crypto": "pycryptodome",
    "jwt": "PyJWT",
    "dotenv": "python-dotenv",
    "magic": "python-magic",
    "serial": "pyserial",
    "google.protobuf": "protobuf",
    "OpenSSL": "pyOpenSSL",
    "git": "GitPython",
    "docx": "python-docx",
}


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """One problem of a baseline and its fix."""

    kind: str
    """``missing module``, ``pytest usage error``, ``conftest error`` or ``collection error``."""
    line: str
    """The one-line explanation, with the fix."""
    modules: tuple[str, ...] = ()
    """For ``missing module``: the top-level import names."""


def distribution_for(module: str) -> str:
    """The distribution to install for a missing import name (a guess for unknown names)."""
    top = module.split(".")[0]
    return DISTRIBUTION_OF_MODULE.get(module, DISTRIBUTION_OF_MODULE.get(top, top))


def missing_modules(output: str, own: Iterable[str] = ()) -> dict[str, set[str]]:
    """Top-level modules reported missing -> the test files or ids that hit it.

    Modules of the repository's own packages (``own``) are left out: a missing own module is a
    layout problem, not a dependency.
    """
    own = set(own)
    out: dict[str, set[str]] = {}
    for _kind, where, message in _SUMMARY_RE.findall(output):
        for name in _MISSING_RE.findall(message):
            top = name.split(".")[0]
            if top not in own:
                out.setdefault(top, set()).add(where)
    # a collection error's traceback names the test module before the missing import
    for where, name in _IMPORTING_RE.findall(output):
        top = name.split(".")[0]
        if top not in own:
            out.setdefault(top, set()).add(where.rsplit("/", 1)[-1])
    for name in _MISSING_RE.findall(output):
        top = name.split(".")[0]
        if top not in own:
            out.setdefault(top, set())
    return out


def usage_error(output: str) -> str | None:
    """pytest's own usage-error line (``error: unrecognized arguments: --cov=pkg``), or None."""
    matches = _USAGE_RE.findall(output)
    return matches[-1].strip() if matches else None


def plugin_for(error: str) -> str | None:
    """The plugin that provides an option named in a usage error, if known."""
    for option in _OPTION_RE.findall(error):
        name = option.split("=", 1)[0]
        if name in PLUGIN_OF_OPTION:
            return PLUGIN_OF_OPTION[name]
    return None


def diagnose(
    output: str,
    *,
    exit_code: int | None = None,
    own_packages: Iterable[str] = (),
    failing: int = 0,
    install_test_deps: bool = False,
) -> list[Diagnosis]:
    """Every problem the baseline output shows (module docstring), most blocking first.

    ``exit_code``: pytest's exit code of the run (4 is a usage error); ``failing``: how many
    baseline tests failed (for the message); ``install_test_deps``: whether the build already
    installed the repository's test requirements (the fix then names the packages to add).
    """
    out: list[Diagnosis] = []
    error = usage_error(output)
    if exit_code == 4 or (exit_code is None and error is not None and "usage:" in output):
        tail = [ln.strip() for ln in output.splitlines() if ln.strip()]
        line = error or (tail[-1] if tail else "pytest exited with a usage error (exit code 4)")
        plugin = plugin_for(line)
        fix = 'set tasks.pytest_args = ["-o", "addopts="] to drop the repository\'s addopts'
        if plugin:
            fix += f", or install {plugin} into the interpreter the tasks run with"
        out.append(Diagnosis(kind="pytest usage error", line=f"pytest said: {line}; {fix}"))
    conftest = _CONFTEST_RE.findall(output)
    if conftest:
        out.append(
            Diagnosis(
                kind="conftest error",
                line=(
                    f"{conftest[0]} does not load; add --noconftest to tasks.pytest_args, or "
                    "install what it imports"
                ),
            )
        )
    missing = missing_modules(output, own_packages)
    if missing:
        names = sorted(missing)
        where = sorted({w for ws in missing.values() for w in ws})
        dists = sorted({distribution_for(n) for n in names})
        cost = f"{len(where)} test files or tests" if where else "the test run"
        if failing:
            cost += f" ({failing} baseline tests fail)"
        fix = (
            f"pip install {' '.join(dists)} into the interpreter the tasks run with, or add "
            f"them to tasks.test_requirements"
            if install_test_deps
            else f"set tasks.install_test_deps = true to install the repository's test "
            f"requirements into the build's environment, or pip install {' '.join(dists)}"
        )
        out.append(
            Diagnosis(
                kind="missing module",
                line=f"tests import modules that are not installed: {', '.join(names)} "
                f"(costs {cost}); {fix}",
                modules=tuple(names),
            )
        )
    other = [
        (where, message)
        for kind, where, message in _SUMMARY_RE.findall(output)
        if kind == "ERROR" and not _MISSING_RE.search(message)
    ]
    if other:
        where, message = other[0]
        out.append(
            Diagnosis(
                kind="collection error",
                line=f"{len(other)} test files or tests error at collection, e.g. {where}: "
                f"{message[:200]}",
            )
        )
    return out
