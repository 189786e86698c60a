"""Where a repository keeps its package, its stubs and its tests, and what the tests need.

``detect_layout`` finds the package's modules (flat or ``src/`` layout, single-module
distributions too), its ``.pyi`` stubs, its test files and the environment the tests need
(``PYTHONPATH=src`` for a src layout). ``is_test_path`` says which files are test code.

What this module does not do: import or run anything (it reads ``pyproject.toml``, PKG-INFO and
setup.cfg and lists files), or resolve test dependencies.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

_TEST_DIRS = ("tests", "test")
_NOT_PACKAGE_FILES = {
    "setup.py",
    "conftest.py",
    "noxfile.py",
    "tasks.py",
    "fabfile.py",
    "manage.py",
    "versioneer.py",
    "bootstrap.py",
    "runtests.py",
}
_NOT_PACKAGE_DIRS = {
    "tests",
    "test",
    "docs",
    "doc",
    "examples",
    "example",
    "benchmarks",
    "benchmark",
    "scripts",
    "tools",
    "build",
    "dist",
}


def is_test_path(rel: str) -> bool:
    """Whether a repository-relative path is test code (files pytest collects or configures)."""
    p = PurePosixPath(rel)
    name = p.name
    if name == "conftest.py" or re.fullmatch(r"test_.*\.py|.*_test\.py", name):
        return True
    return any(part in _TEST_DIRS for part in p.parts[:-1])


@dataclass(kw_only=True, slots=True)
class Layout:
    """Where a repository keeps its package and what its tests need."""

    name: str
    """Distribution name (``[project] name``) or the directory name."""
    version: str
    """Version from ``pyproject.toml`` or ``""``."""
    source_root: str
    """``""`` (flat layout) or ``"src"``."""
    packages: tuple[str, ...]
    """Top-level import names of the package(s)."""
    modules: dict[str, str]
    """Dotted module name -> relative path of its ``.py`` file (``pkg/__init__.py`` for pkg)."""
    stubs: tuple[str, ...]
    """Relative paths of ``.pyi`` files beside the package modules."""
    test_files: tuple[str, ...]
    """Relative paths of test modules and conftest files."""
    test_env: dict[str, str]
    """Environment the test runs need (``PYTHONPATH=src`` for a src layout)."""


def _pyproject(root: Path) -> dict[str, Any]:
    path = root / "pyproject.toml"
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}


def _metadata(root: Path, key: str) -> str:
    """``Name``/``Version`` from an sdist's PKG-INFO, else from setup.cfg; ``""`` if absent."""
    for name, pattern in (
        ("PKG-INFO", rf"(?im)^{key}:\s*(\S+)"),
        ("setup.cfg", rf"(?im)^{key}\s*=\s*(\S+)"),
    ):
        path = root / name
        if path.is_file():
            match = re.search(pattern, path.read_text(errors="replace"))
            if match:
                return match.group(1)
    return ""


def detect_layout(
    root: str | Path, packages: Iterable[str] = (), *, default_name: str | None = None
) -> Layout:
    """Find the package(s) of the repository at ``root``.

    ``packages`` (top-level import names) overrides the search. Otherwise: directories with an
    ``__init__.py`` directly under ``src/`` or the root (not tests, docs, examples...), else
    root-level modules that are not tests or tooling (single-module distributions). The name
    comes from ``pyproject.toml``, PKG-INFO or setup.cfg, else ``default_name``, else the
    directory's name.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"repository {str(root)!r} is not a directory")
    project = _pyproject(root).get("project", {})
    name = str(project.get("name") or _metadata(root, "name") or default_name or root.name)
    version = str(project.get("version") or _metadata(root, "version"))
    wanted = tuple(packages)
    source_root = ""
    tops: list[str] = []
    for candidate in ("src", ""):
        base = root / candidate if candidate else root
        if not base.is_dir():
            continue
        if wanted:
            found = [
                p
                for p in wanted
                if (base / p / "__init__.py").is_file() or (base / f"{p}.py").is_file()
            ]
            if len(found) == len(wanted):
                source_root, tops = candidate, list(wanted)
                break
            continue
        tops = sorted(
            d.name
            for d in base.iterdir()
            if d.is_dir()
            and (d / "__init__.py").is_file()
            and d.name not in _NOT_PACKAGE_DIRS
            and d.name.isidentifier()
        )
        if not tops:
            tops = sorted(
                f.stem
                for f in base.glob("*.py")
                if f.name not in _NOT_PACKAGE_FILES
                and not is_test_path(f.name)
                and f.stem.isidentifier()
                and f.stem not in ("setup", "conftest", "__init__")
            )
        if tops:
            source_root = candidate
            break
    if wanted and not tops:
        raise ValueError(
            f"packages {list(wanted)} not found under {str(root)!r} or its src/; set packages to "
            "the top-level import names of the repository"
        )
    base = root / source_root if source_root else root
    modules: dict[str, str] = {}
    stubs: list[str] = []
    prefix = f"{source_root}/" if source_root else ""
    for top in tops:
        if (base / f"{top}.py").is_file() and not (base / top).is_dir():
            modules[top] = f"{prefix}{top}.py"
            if (base / f"{top}.pyi").is_file():
                stubs.append(f"{prefix}{top}.pyi")
            continue
        for path in sorted((base / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            inner = path.relative_to(base)
            if is_test_path(inner.as_posix()) or not all(
                (base / Path(*inner.parts[:i]) / "__init__.py").is_file()
                for i in range(1, len(inner.parts))
            ):
                continue
            if not all(part.isidentifier() for part in inner.with_suffix("").parts):
                continue
            dotted = ".".join(inner.with_suffix("").parts)
            if dotted.endswith(".__init__"):
                dotted = dotted[: -len(".__init__")]
            modules[dotted] = rel
            if path.with_suffix(".pyi").is_file():
                stubs.append(path.with_suffix(".pyi").relative_to(root).as_posix())
    test_files = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if is_test_path(p.relative_to(root).as_posix())
        and not any(
            part.startswith(".") or part in ("build", "dist") for part in p.relative_to(root).parts
        )
    )
    test_env = {"PYTHONPATH": source_root} if source_root else {}
    return Layout(
        name=name,
        version=version,
        source_root=source_root,
        packages=tuple(tops),
        modules=modules,
        stubs=tuple(sorted(stubs)),
        test_files=tuple(test_files),
        test_env=test_env,
    )
