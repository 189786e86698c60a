"""A repository's test requirements, installed from the package index into the build's tree.

Many real test suites import packages beyond pytest (``freezegun``, ``pretend``, ``hypothesis``).
With ``tasks.install_test_deps = true`` the factory reads what the repository declares for its
tests (``test_requirements``), drops what the task interpreter already has and build tooling
nobody imports from a test (``tox``, ``coverage``, linters), and installs the rest with
``pip install --target`` into ``DEPS_DIR`` (``.etude-deps``) **inside the exported tree**. Every
workspace then carries its own test dependencies, ``PYTHONPATH`` names the directory, pytest is
told to ``--ignore`` it, and the record lists the requirements (``environment``), so the grader
and any other harness run the tests in the same environment without a network.

Where requirements are read from, in order: ``pyproject.toml`` (``[project.optional-dependencies]``
and ``[dependency-groups]`` named test/tests/testing/dev, ``[project] dependencies``, Poetry's
dev and test groups, names only),
``setup.cfg`` (``extras_require`` of those names, ``install_requires``), PKG-INFO
(``Requires-Dist``, with extras of those names), and requirement files
(``requirements/tests.in``, ``requirements-test.txt``...; ``.in`` before pinned ``.txt``).
Environment markers are evaluated for the running interpreter.

What this module does not do: build packages with compiled code offline (pip may need a
compiler for an sdist-only dependency), resolve conflicts with the interpreter's own packages
(installed distributions win: they are never replaced), or install anything into the
interpreter itself.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

DEPS_DIR = ".etude-deps"
TEST_GROUPS = ("test", "tests", "testing", "dev", "develop", "development")
REQUIREMENT_FILES = (
    "requirements/tests.in",
    "requirements/test.in",
    "requirements/tests.txt",
    "requirements/test.txt",
    "requirements-test.txt",
    "requirements-tests.txt",
    "requirements_test.txt",
    "test-requirements.txt",
    "test_requirements.txt",
    "tests/requirements.txt",
    "requirements-dev.txt",
    "dev-requirements.txt",
    "requirements/dev.in",
    "requirements/development.txt",
)
# tooling a test never imports: installing it costs time and can fail for no gain
NOT_TEST_IMPORTS = {
    canonicalize_name(n)
    for n in (
        "tox nox coverage pytest-cov codecov pre-commit flake8 black isort mypy ruff pylint "
        "sphinx twine build wheel setuptools pip pip-tools bump2version check-manifest "
        "docutils readme-renderer furo pytest-runner types-setuptools pyright"
    ).split()
}


def _from_pyproject(root: Path) -> list[str]:
    path = root / "pyproject.toml"
    if not path.is_file():
        return []
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return []
    project = data.get("project", {})
    out = [str(r) for r in project.get("dependencies", [])]
    # Poetry: [tool.poetry.dev-dependencies] and [tool.poetry.group.NAME.dependencies] tables
    poetry = data.get("tool", {}).get("poetry", {})
    tables = [poetry.get("dev-dependencies", {})]
    tables += [
        g.get("dependencies", {})
        for name, g in poetry.get("group", {}).items()
        if name.lower() in TEST_GROUPS and isinstance(g, dict)
    ]
    for table in tables:
        out += [n for n in table if isinstance(n, str) and n.lower() != "python"]
    for table in (project.get("optional-dependencies", {}), data.get("dependency-groups", {})):
        for name, reqs in table.items():
            if name.lower() in TEST_GROUPS:
                out += [r for r in reqs if isinstance(r, str)]
    return out


def _from_setup_cfg(root: Path) -> list[str]:
    path = root / "setup.cfg"
    if not path.is_file():
        return []
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(path.read_text(encoding="utf-8", errors="replace"))
    except configparser.Error:
        return []
    out = []
    if parser.has_option("options", "install_requires"):
        out += parser.get("options", "install_requires").splitlines()
    if parser.has_section("options.extras_require"):
        for name, value in parser.items("options.extras_require"):
            if name.lower() in TEST_GROUPS:
                out += value.splitlines()
    return out


def _from_pkg_info(root: Path) -> list[str]:
    path = root / "PKG-INFO"
    if not path.is_file():
        return []
    out = []
    for value in re.findall(r"(?m)^Requires-Dist:\s*(.+)$", path.read_text(errors="replace")):
        extras = re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", value)
        if not extras or any(e.lower() in TEST_GROUPS for e in extras):
            out.append(re.sub(r";.*$", "", value) if extras else value)
    return out


def _from_files(root: Path) -> list[str]:
    out: list[str] = []
    seen_dirs: set[str] = set()
    for rel in REQUIREMENT_FILES:
        path = root / rel
        stem_key = str(Path(rel).with_suffix(""))
        if not path.is_file() or stem_key in seen_dirs:
            continue
        seen_dirs.add(stem_key)  # tests.in wins over tests.txt
        for line in path.read_text(errors="replace").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith(("#", "-")):
                out.append(line)
    return out


def declared_requirements(root: str | Path) -> list[str]:
    """Every requirement the repository at ``root`` declares for its tests (module docstring),
    markers evaluated, duplicates (by distribution) removed, in the order found."""
    root = Path(root)
    env = default_environment()
    out: dict[str, str] = {}
    for text in [
        *_from_pyproject(root),
        *_from_setup_cfg(root),
        *_from_pkg_info(root),
        *_from_files(root),
    ]:
        text = text.strip()
        if not text:
            continue
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        if req.url:
            continue
        req.marker = None
        out.setdefault(canonicalize_name(req.name), str(req))
    return list(out.values())


def installed(name: str) -> bool:
    """Whether the running interpreter has a distribution called ``name``."""
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def to_install(requirements: Iterable[str], own: Iterable[str] = ()) -> list[str]:
    """The requirements worth installing: not tooling, not the repository itself, not installed
    already (an installed distribution is kept whatever its version)."""
    own_names = {canonicalize_name(n) for n in own}
    out = []
    for text in requirements:
        try:
            name = canonicalize_name(Requirement(text).name)
        except InvalidRequirement:
            if Path(text).exists():  # a local wheel, sdist or directory
                out.append(text)
            continue
        if name in NOT_TEST_IMPORTS or name in own_names or installed(name):
            continue
        out.append(text)
    return out


def install(
    requirements: list[str], target: Path, *, timeout: float = 600.0, index_url: str = ""
) -> None:
    """``pip install --target`` of ``requirements`` (nothing if empty); a failure raises
    ``ValueError`` with pip's last lines and the setting to change."""
    if not requirements:
        return
    target.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input", "--target"]
    argv += [str(target), "--no-compile", "--disable-pip-version-check", "--no-warn-conflicts"]
    if index_url:
        argv += ["--index-url", index_url]
    try:
        proc = subprocess.run(
            [*argv, *requirements], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"installing the test requirements {requirements} took over {timeout:.0f}s; install "
            "them into the task interpreter instead and set tasks.install_test_deps = false"
        ) from None
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise ValueError(
            f"pip could not install the test requirements {requirements}: {tail}; fix "
            "tasks.test_requirements or set tasks.install_test_deps = false"
        )
    # the interpreter's own copies win: drop what pip put there again (e.g. a newer pytest)
    for info in sorted(target.glob("*.dist-info")):
        name = info.name.split("-", 1)[0]
        if installed(name) and canonicalize_name(name) not in _names(requirements):
            _remove_distribution(target, info)


def _names(requirements: Iterable[str]) -> set[str]:
    out = set()
    for text in requirements:
        try:
            out.add(canonicalize_name(Requirement(text).name))
        except InvalidRequirement:
            out.add(canonicalize_name(Path(text).name.split("-", 1)[0]))
    return out


def _remove_distribution(target: Path, info: Path) -> None:
    import shutil

    record = info / "RECORD"
    tops = set()
    if record.is_file():
        for line in record.read_text(errors="replace").splitlines():
            first = line.split(",", 1)[0].split("/", 1)[0]
            if first and not first.endswith(".dist-info") and first != "..":
                tops.add(first)
    for top in tops:
        path = target / top
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
    shutil.rmtree(info, ignore_errors=True)
