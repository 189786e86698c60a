"""Narrow what the sandbox shows of installed Python code, and find copies of a task's package
in the rest, so that they can be masked.

The sandbox shows the host's ``/usr`` and the interpreter's installation read-only. Of the Python
package directories in there (``site-packages``, ``dist-packages``, Debian's
``/usr/share/python-wheels``) it needs only those the task's interpreter imports from (its
``sys.path``: the environment's packages); ``foreign_package_dirs`` lists the others (the base
interpreter's ``site-packages`` under a virtual environment, the system Python's
``dist-packages``), and the bubblewrap backend mounts an empty directory over each. A copy of a
task's package anywhere in there (an installed distribution, a vendored folder of another
package, a stray checkout) holds the code the task deleted: an agent could read it with
``bash``, and code under test could import it while graded. ``find_package_copies(pristine,
allowed, roots)`` walks ``roots`` (default: what the bubblewrap backend binds, `visible_roots`;
the foreign package directories are skipped, masked whole) and returns the absolute paths that
look like a copy of a package of ``allowed``:

- for a package directory ``pkg/`` (or ``src/pkg/``): a directory named ``pkg`` holding an
  ``__init__.py`` and at least half of the pristine package's module paths (``pkg/a.py``,
  ``pkg/sub/b.py`` ...);
- for a single-module package ``mod.py``: a file named ``mod.py`` that shares at least half of
  the pristine module's distinct non-blank lines.

Sandboxes mask the paths with ``SandboxConfig.masked_paths`` (an empty read-only mount over
each). The walk reads directory listings only, plus the candidate files of single modules;
results are cached per process by package shape and roots (a walk of ``/usr`` takes seconds).

What this does not find: a copy under another name, one inside an archive (a wheel, an egg, a
zip on ``sys.path``; wheels outside `WHEEL_DIRS` stay visible), or one that differs in most of its
files; code of the package copied into other modules (``etude.tasks.copies`` searches the deleted
definitions themselves). Nor does narrowing hide anything outside the package directories: the
rest of ``/usr`` (tools, data, documentation) stays readable.
"""

from __future__ import annotations

import functools
import glob
import os
import sys
from collections.abc import Sequence
from pathlib import Path

MIN_SHARED = 0.5
"""Share of the pristine package's module paths (or lines) a copy must have."""
SKIP_DIRS = frozenset({"/proc", "/sys", "/dev"})
# where Python package directories live under a prefix (/usr, /usr/local, an installation)
PACKAGE_DIR_GLOBS = ("lib*/python*/*-packages", "local/lib*/python*/*-packages")
WHEEL_DIRS = ("/usr/share/python-wheels",)
"""Wheels a system Python keeps for new virtual environments (copies of packages, zipped)."""


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def foreign_package_dirs(extra: Sequence[str] = ()) -> list[str]:
    """Package directories the sandbox would show that the task's interpreter does not import
    from (sorted real paths): ``site-packages``/``dist-packages`` under ``/usr``, the interpreter's
    prefixes and their ``local/``, not on ``sys.path`` and holding no entry of it, plus
    `WHEEL_DIRS`. A directory inside an ``extra`` path (``extra_ro_paths``: shown on purpose) or
    holding one is left out."""
    return list(_foreign_package_dirs(tuple(sys.path), tuple(extra)))


@functools.lru_cache(maxsize=8)
def _foreign_package_dirs(path: tuple[str, ...], extra: tuple[str, ...]) -> tuple[str, ...]:
    on_path = {os.path.realpath(p) for p in path if p and os.path.isdir(p)}
    shown = [os.path.realpath(e) for e in extra]
    prefixes = ["/usr", sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    candidates = [*WHEEL_DIRS]
    for prefix in dict.fromkeys(os.path.realpath(p) for p in prefixes):
        for pattern in PACKAGE_DIR_GLOBS:
            candidates += glob.glob(os.path.join(glob.escape(prefix), pattern))
    out = set()
    for candidate in candidates:
        real = os.path.realpath(candidate)
        if not os.path.isdir(real) or any(_is_within(p, real) for p in on_path):
            continue  # the interpreter imports from it (or from inside it)
        if any(_is_within(real, e) or _is_within(e, real) for e in shown):
            continue
        out.add(real)
    return tuple(sorted(out))


def visible_roots(extra: Sequence[str] = ()) -> list[str]:
    """What the bubblewrap backend shows read-only: ``/usr``, the merged-usr directories that are
    real directories, the interpreter's prefixes, and ``extra`` (``extra_ro_paths``)."""
    roots = ["/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.isdir(d) and not os.path.islink(d):
            roots.append(d)
    roots += [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, *extra]
    out: list[str] = []
    for root in dict.fromkeys(os.path.realpath(r) for r in roots):
        if not any(root == o or root.startswith(o.rstrip("/") + "/") for o in out):
            out = [o for o in out if not o.startswith(root.rstrip("/") + "/")] + [root]
    return sorted(out)


def _package_shape(pristine: Path, prefix: str) -> tuple[str, frozenset[str]] | None:
    """``(name, module paths relative to the package's parent)`` of a package directory."""
    directory = pristine / prefix.rstrip("/")
    if not (directory / "__init__.py").is_file():
        return None
    modules = set()
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                modules.add((Path(dirpath) / name).relative_to(directory.parent).as_posix())
    return directory.name, frozenset(modules)


def _module_lines(path: Path) -> frozenset[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return frozenset()
    return frozenset(line.strip() for line in text.splitlines() if len(line.strip()) > 3)


def find_package_copies(
    pristine: str | os.PathLike[str],
    allowed: Sequence[str],
    roots: Sequence[str] | None = None,
    skip: Sequence[str] | None = None,
) -> list[str]:
    """Absolute paths under ``roots`` that hold a copy of a package of ``allowed`` (sorted).

    ``skip``: directories not searched, masked as a whole anyway (default:
    `foreign_package_dirs`)."""
    pristine = Path(pristine)
    packages = []
    modules = []
    for prefix in allowed:
        if prefix.endswith("/"):
            shape = _package_shape(pristine, prefix)
            if shape is not None:
                packages.append(shape)
        elif prefix.endswith(".py") and (pristine / prefix).is_file():
            modules.append((Path(prefix).name, _module_lines(pristine / prefix)))
    if not packages and not modules:
        return []
    return list(
        _search(
            tuple(sorted(packages)),
            tuple(sorted(modules)),
            tuple(roots if roots is not None else visible_roots()),
            tuple(skip if skip is not None else foreign_package_dirs()),
        )
    )


@functools.lru_cache(maxsize=64)
def _search(
    packages: tuple[tuple[str, frozenset[str]], ...],
    modules: tuple[tuple[str, frozenset[str]], ...],
    roots: tuple[str, ...],
    skip: tuple[str, ...],
) -> tuple[str, ...]:
    names = {name: files for name, files in packages}
    skipped = SKIP_DIRS | set(skip)
    module_names = {name: lines for name, lines in modules}
    found: list[str] = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            if dirpath in skipped:
                dirnames[:] = []
                continue
            keep = []
            for d in dirnames:
                files = names.get(d)
                path = os.path.join(dirpath, d)
                if files is not None and _is_package_copy(path, files):
                    found.append(path)
                else:
                    keep.append(d)
            dirnames[:] = keep
            for name in filenames:
                lines = module_names.get(name)
                if lines:
                    path = os.path.join(dirpath, name)
                    shared = len(lines & _module_lines(Path(path))) / len(lines)
                    if shared >= MIN_SHARED:
                        found.append(path)
    return tuple(sorted(set(found)))


def _is_package_copy(path: str, modules: frozenset[str]) -> bool:
    if not os.path.isfile(os.path.join(path, "__init__.py")) or not modules:
        return False
    parent = os.path.dirname(path)
    present = sum(os.path.isfile(os.path.join(parent, rel)) for rel in modules)
    return present / len(modules) >= MIN_SHARED
