"""The clean room: a pristine copy of a task's workspace plus the agent's allowed changes only.

Grading never runs in the tree an agent worked in. ``build_graded_tree(pristine, final, allowed,
dest)`` copies the task's untouched workspace to ``dest`` and applies, from the agent's final
tree, only changes to files the task allows: regular ``.py`` files under the ``allowed`` prefixes
(the package's source tree, e.g. ``textkit/`` or ``src/pkg/``, or one module file such as
``inflection.py``). New files inside an allowed package directory count (a deleted module may have
to be written again); a file of the pristine tree under a prefix that is missing (or is no longer
a regular file) in the final tree is removed.

Never taken from the final tree, even under an allowed prefix (`is_gradable_change`): anything
but a ``.py`` file; tests (``test_*.py``, ``*_test.py``, files under ``tests``/``test``/``testing``
directories); ``conftest.py``; pytest and packaging configuration (``pytest.ini``, ``pytest.toml``,
``pyproject.toml``, ``setup.cfg`` ...); startup hooks (``sitecustomize.py``, ``usercustomize.py``,
``*.pth``); bytecode and native modules (``*.pyc``, ``*.so``, ``__pycache__``); modules named like
pytest or its plugin machinery (``pytest.py``, ``_pytest``, ``pluggy``, ``py.py``); dotfiles;
symlinks, FIFOs and devices (files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked to be
regular before a byte is read, so a planted FIFO cannot block the grader). Top-level files of the
tree are never allowed unless a prefix names that exact file.

The pristine copy itself leaves out ``__pycache__`` directories, bytecode files and special files:
nothing compiled is ever read from the tree that is graded.

What this does not do: judge whether a change to allowed source is a hack (code that detects the
test run, hard-coded answers): that is the monitor's job. Nor does it run anything.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath

TEST_DIR_NAMES = frozenset({"tests", "test", "testing"})
TEST_FILE_PATTERNS = ("test_*.py", "*_test.py")
CONFIG_NAMES = frozenset(
    {
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "pyproject.toml",
        "tox.ini",
        "setup.cfg",
        "setup.py",
        "conftest.py",
        "noxfile.py",
    }
)
# module names that would shadow the test runner, its plugin system or interpreter start-up
SHADOW_NAMES = frozenset(
    {
        "pytest.py",
        "_pytest",
        "pluggy",
        "pluggy.py",
        "py.py",
        "sitecustomize.py",
        "usercustomize.py",
        "__pycache__",
    }
)
BYTECODE_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd", ".dll", ".dylib", ".pth")
MAX_FILE_BYTES = 16 << 20
"""Largest single source file taken from the final tree (a larger one counts as deleted)."""
MAX_TOTAL_BYTES = 128 << 20
"""Most bytes of source taken from the final tree in all (beyond: the change is refused)."""


def _norm_prefix(prefix: str) -> str:
    p = PurePosixPath(prefix)
    if not prefix or p.is_absolute() or ".." in p.parts or p == PurePosixPath("."):
        raise ValueError(
            f"allowed path {prefix!r} must be a relative path inside the workspace, without "
            "'..' (e.g. 'textkit/' or 'src/pkg/' or 'inflection.py')"
        )
    return p.as_posix() + ("/" if prefix.endswith("/") else "")


def allowed_from_paths(paths: Iterable[str]) -> list[str]:
    """The package prefixes a task may change, from the files its gold patch touches.

    ``pkg/a/b.py`` -> ``pkg/``; ``src/pkg/a.py`` -> ``src/pkg/``; a top-level module
    ``inflection.py`` (or ``src/inflection.py``) -> that file alone. Test files and
    configuration in ``paths`` are skipped (a gold patch never needs them).
    """
    out: list[str] = []
    for raw in paths:
        parts = PurePosixPath(raw).parts
        if not parts or not is_gradable_change(raw, [raw]):
            continue
        if parts[0] == "src" and len(parts) > 2:
            prefix = f"src/{parts[1]}/"
        elif len(parts) > 1 and parts[0] != "src":
            prefix = f"{parts[0]}/"
        else:
            prefix = "/".join(parts)
        if prefix not in out:
            out.append(prefix)
    return sorted(out)


def allowed_from_tree(root: str | os.PathLike[str]) -> list[str]:
    """The package directories of a tree, for a record whose patch names none: every top-level
    directory (or ``src/`` directory) holding an ``__init__.py``, test directories left out."""
    root = Path(root)
    out = []
    for base in ("", "src/"):
        directory = root / base if base else root
        if not directory.is_dir() or directory.is_symlink():
            continue
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            name = entry.name
            if (
                entry.is_dir(follow_symlinks=False)
                and name not in TEST_DIR_NAMES
                and name not in SHADOW_NAMES
                and not name.startswith(".")
                and (Path(entry.path) / "__init__.py").is_file()
            ):
                out.append(f"{base}{name}/")
    return out


def _under(rel: str, prefix: str) -> bool:
    if prefix.endswith("/"):
        return rel.startswith(prefix)
    return rel == prefix


def is_gradable_change(rel: str, allowed: Sequence[str]) -> bool:
    """Whether a change to workspace-relative ``rel`` may be taken from the agent's tree."""
    if not any(_under(rel, _norm_prefix(p)) for p in allowed):
        return False
    parts = PurePosixPath(rel).parts
    name = parts[-1]
    if not name.endswith(".py") or name.startswith("."):
        return False
    if any(part in TEST_DIR_NAMES or part.startswith(".") for part in parts[:-1]):
        return False
    if any(part in SHADOW_NAMES for part in parts):
        return False
    if name in CONFIG_NAMES or any(fnmatch.fnmatchcase(name, p) for p in TEST_FILE_PATTERNS):
        return False
    return not name.endswith(BYTECODE_SUFFIXES)


def _ignore_compiled(directory: str, names: list[str]) -> list[str]:
    """``copytree`` hook: no bytecode, no ``__pycache__``, no FIFOs, sockets or devices."""
    skipped = []
    for name in names:
        mode = os.lstat(os.path.join(directory, name)).st_mode
        if name == "__pycache__" or name.endswith((".pyc", ".pyo")):
            skipped.append(name)
        elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            skipped.append(name)
    return skipped


def read_regular(path: Path, max_bytes: int = MAX_FILE_BYTES) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a symlink) of at most ``max_bytes``.

    Opened without following links and without blocking (a FIFO opens at once and is refused).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return None
        chunks = []
        total = 0
        while True:
            data = os.read(fd, 1 << 20)
            if not data:
                break
            total += len(data)
            if total > max_bytes:
                return None
            chunks.append(data)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _allowed_files(root: Path, allowed: Sequence[str]) -> Iterable[str]:
    """Relative paths of the gradable regular files of ``root`` under the allowed prefixes."""
    for prefix in allowed:
        prefix = _norm_prefix(prefix)
        start = root / prefix.rstrip("/")
        if not prefix.endswith("/"):
            if is_gradable_change(prefix, allowed) and os.path.lexists(start):
                yield prefix
            continue
        if start.is_symlink() or not start.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(start):
            # a symlinked directory is not descended into (os.walk does not follow links)
            dirnames[:] = sorted(
                d
                for d in dirnames
                if d not in TEST_DIR_NAMES and d not in SHADOW_NAMES and not d.startswith(".")
            )
            for name in sorted(filenames):
                rel = (Path(dirpath) / name).relative_to(root).as_posix()
                if is_gradable_change(rel, allowed):
                    yield rel


def pristine_sources(
    root: str | os.PathLike[str], allowed: Sequence[str], changed: Sequence[str] | None = None
) -> list[str]:
    """The ``.py`` files under the allowed prefixes of the graded tree ``root`` whose text is
    certainly the pristine tree's, as sorted workspace-relative paths.

    ``changed``: the paths `apply_allowed_changes` took from an agent's tree; every other file
    under the prefixes is the pristine one. ``None`` (a tree graded as it is, nothing known of
    who wrote it): only the files the clean room never takes from an agent (`is_gradable_change`
    refuses them: tests, ``conftest.py``, files under ``tests/`` or dot directories), such as
    the tests a package keeps inside itself (``toolz/tests/``).

    Code defined in these files is the task's, not the agent's: the reporter's tamper checks
    (a test function or report hook from the agent's files) exempt them.
    """
    root = Path(root)
    out: set[str] = set()
    for prefix in allowed:
        prefix = _norm_prefix(prefix)
        start = root / prefix.rstrip("/")
        if not prefix.endswith("/"):
            if changed is not None and start.is_file() and prefix not in changed:
                out.add(prefix)
            continue
        if start.is_symlink() or not start.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in filenames:
                rel = (Path(dirpath) / name).relative_to(root).as_posix()
                if not name.endswith(".py"):
                    continue
                if changed is None and is_gradable_change(rel, allowed):
                    continue
                if changed is None or rel not in changed:
                    out.add(rel)
    return sorted(out)


def copy_pristine(pristine: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """Copy the task's untouched workspace to ``dest`` (which must not exist), bytecode left out."""
    shutil.copytree(pristine, dest, symlinks=True, ignore=_ignore_compiled)
    return Path(dest)


def apply_allowed_changes(
    final: str | os.PathLike[str], graded: str | os.PathLike[str], allowed: Sequence[str]
) -> list[str]:
    """Make ``graded``'s allowed files equal to ``final``'s; returns the paths that changed.

    ``graded`` holds a pristine copy. Raises ValueError when the final tree's allowed source
    exceeds `MAX_TOTAL_BYTES` (the grader reports that as a failed run).
    """
    final, graded = Path(final), Path(graded)
    for prefix in allowed:
        _norm_prefix(prefix)
    wanted: dict[str, bytes] = {}
    total = 0
    for rel in _allowed_files(final, allowed):
        data = read_regular(final / rel)
        if data is None:
            continue  # not a regular file, unreadable, or too large: as if deleted
        total += len(data)
        if total > MAX_TOTAL_BYTES:
            raise ValueError(
                f"the changed source under {list(allowed)} exceeds {MAX_TOTAL_BYTES} bytes"
            )
        wanted[rel] = data
    changed = []
    for rel in list(_allowed_files(graded, allowed)):
        if rel not in wanted:
            (graded / rel).unlink()
            changed.append(rel)
    for rel, data in wanted.items():
        target = graded / rel
        if target.is_file() and not target.is_symlink():
            if target.read_bytes() == data:
                continue
        # every parent must be a real directory inside the graded tree (no link to follow out)
        current = graded
        for part in PurePosixPath(rel).parent.parts:
            current = current / part
            if current.is_symlink() or (current.exists() and not current.is_dir()):
                current.unlink()
            if not current.exists():
                current.mkdir()
        if target.is_symlink() or target.exists():
            target.unlink()
        target.write_bytes(data)
        changed.append(rel)
    return sorted(set(changed))


def build_graded_tree(
    pristine: str | os.PathLike[str],
    final: str | os.PathLike[str] | None,
    allowed: Sequence[str],
    dest: str | os.PathLike[str],
    *,
    exclude: Sequence[str] = (),
) -> list[str]:
    """A pristine copy at ``dest`` with ``final``'s allowed changes; the changed paths.

    ``final=None`` grades the pristine tree itself. ``exclude``: workspace-relative paths removed
    from the copy (the hidden paths, when the agent's own test runs must not see them).
    """
    graded = copy_pristine(pristine, dest)
    for rel in exclude:
        target = graded / _norm_prefix(rel).rstrip("/")
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif os.path.lexists(target):
            target.unlink()
    if final is None:
        return []
    return apply_allowed_changes(final, graded, allowed)
