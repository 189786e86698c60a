"""Rebuild task workspaces without leak channels: copy only wanted files, give them a new history.

A feature-deletion task is only worth its reward if the deleted code cannot be recovered from the
workspace. A policy trained at scale finds every leftover: a type-checker cache holding the
deleted signature, bytecode of the deleted module, the original in VCS history, an installed copy.
So the workspace is **rebuilt, not cleaned**: ``export_tree`` copies only wanted regular files into
a new directory, ``fresh_git_repo`` gives it a history of one reproducible commit, and the leak
scan (``etude.tasks.leaks.leak_scan``) then reads every file of the result (hidden and binary ones
too, and every git object) looking for the deleted code.

What ``export_tree`` leaves out (each skipped path is reported with its channel):
VCS directories (``.git``, ``.hg``, ``.svn``, ``.bzr``); bytecode (``__pycache__``, ``*.pyc``,
``*.pyo``); type-checker and tool caches (``.mypy_cache``, ``.dmypy.json``, ``.pytype``,
``.pyre``, ``.ruff_cache``, ``.pytest_cache``, ``.hypothesis``, ``.cache``, ``.benchmarks``);
coverage data (``.coverage*``, ``coverage.xml``, ``htmlcov``); packaging metadata and installed
copies (``*.egg-info``, ``*.dist-info``, ``.eggs``, ``*.egg``, ``*.whl``, virtualenvs: any
directory holding ``pyvenv.cfg``); build output (``build/`` and ``dist/`` at the root, ``.tox``,
``.nox``); built documentation (``_build``, ``site`` and ``_site`` at the root); editor and
backup files (``*~``, ``*.swp``, ``*.bak``, ``*.orig``, ``*.rej``, ``.#*``, ``.idea``,
``.vscode``...); compiled extensions and objects (``*.so``, ``*.pyd``, ``*.dylib``, ``*.dll``,
``*.o``, ``*.a``), which could have been built from deleted sources; symlinks that leave the tree;
sockets, fifos and devices.

Outside the workspace, ``find_installed_copies`` (which the factory runs before building) reports
the modules a sandboxed interpreter imports from elsewhere: an installed copy of the package would
hold the deleted code.

What this module does not do: it judges paths, not content. A file that is not on the lists above
is copied whatever it holds (documentation quoting the deleted code, a vendored copy of it); the
leak scan (``etude.tasks.leaks``) and the copy search (``etude.tasks.copies``) look at content. It
removes nothing outside the workspace: an installed copy is reported, not uninstalled.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------
# export: which paths never reach a workspace, and why

_DIR_CHANNELS: dict[str, str] = {
    ".git": "vcs",
    ".hg": "vcs",
    ".svn": "vcs",
    ".bzr": "vcs",
    "_darcs": "vcs",
    "__pycache__": "bytecode",
    ".mypy_cache": "type-checker cache",
    ".pytype": "type-checker cache",
    ".pyre": "type-checker cache",
    ".pyright": "type-checker cache",
    ".ruff_cache": "tool cache",
    ".pytest_cache": "tool cache",
    ".hypothesis": "tool cache",
    ".cache": "tool cache",
    ".benchmarks": "tool cache",
    ".ipynb_checkpoints": "tool cache",
    "htmlcov": "coverage data",
    ".eggs": "packaging metadata",
    "pip-wheel-metadata": "packaging metadata",
    "__pypackages__": "installed copy",
    ".tox": "build output",
    ".nox": "build output",
    "_build": "built docs",
    ".idea": "editor file",
    ".vscode": "editor file",
}
_ROOT_DIR_CHANNELS: dict[str, str] = {
    "build": "build output",
    "dist": "build output",
    "wheelhouse": "build output",
    "site": "built docs",
    "_site": "built docs",
}
_DIR_SUFFIX_CHANNELS: tuple[tuple[str, str], ...] = (
    (".egg-info", "packaging metadata"),
    (".dist-info", "packaging metadata"),
    (".egg", "installed copy"),
)
_FILE_CHANNELS: tuple[tuple[str, str], ...] = (
    ("*.pyc", "bytecode"),
    ("*.pyo", "bytecode"),
    ("*.so", "compiled extension"),
    ("*.so.*", "compiled extension"),
    ("*.pyd", "compiled extension"),
    ("*.dylib", "compiled extension"),
    ("*.dll", "compiled extension"),
    ("*.o", "compiled extension"),
    ("*.obj", "compiled extension"),
    ("*.a", "compiled extension"),
    ("*.lib", "compiled extension"),
    (".coverage", "coverage data"),
    (".coverage.*", "coverage data"),
    ("coverage.xml", "coverage data"),
    ("coverage.json", "coverage data"),
    ("coverage.lcov", "coverage data"),
    (".dmypy.json", "type-checker cache"),
    ("dmypy.json", "type-checker cache"),
    ("*.egg", "installed copy"),
    ("*.whl", "installed copy"),
    ("*~", "backup file"),
    ("*.bak", "backup file"),
    ("*.orig", "backup file"),
    ("*.rej", "backup file"),
    ("*.swp", "editor file"),
    ("*.swo", "editor file"),
    (".#*", "editor file"),
    ("#*#", "editor file"),
    (".DS_Store", "editor file"),
)


def skip_reason(rel: str, *, is_dir: bool, directory: Path | None = None) -> str | None:
    """The leak channel that keeps workspace-relative path ``rel`` out of a workspace, or None.

    ``directory`` (the path on disk) lets a virtualenv be recognized by its ``pyvenv.cfg``.
    """
    name = rel.rsplit("/", 1)[-1]
    if is_dir:
        if name in _DIR_CHANNELS:
            return _DIR_CHANNELS[name]
        if "/" not in rel and name in _ROOT_DIR_CHANNELS:
            return _ROOT_DIR_CHANNELS[name]
        for suffix, channel in _DIR_SUFFIX_CHANNELS:
            if name.endswith(suffix):
                return channel
        if directory is not None and (directory / "pyvenv.cfg").exists():
            return "installed copy"
        return None
    for pattern, channel in _FILE_CHANNELS:
        if fnmatch.fnmatchcase(name, pattern):
            return channel
    return None


@dataclass(kw_only=True, slots=True)
class ExportReport:
    """What ``export_tree`` copied and what it left out."""

    copied: list[str] = field(default_factory=list)
    """Relative POSIX paths of the regular files written to the destination."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Relative path (a directory stands for everything under it) -> the channel it belongs to."""


def export_tree(src: str | Path, dest: str | Path) -> ExportReport:
    """Copy the wanted regular files of ``src`` into the new directory ``dest``.

    Only regular files are copied (content and executable bit; no times, owners or xattrs), and
    symlinks whose target stays inside ``src`` are recreated; everything on the leak-channel lists
    of the module docstring is skipped. ``dest`` must not exist or be empty.
    """
    src = Path(src).resolve()
    dest = Path(dest)
    if not src.is_dir():
        raise ValueError(f"cannot export {str(src)!r}: not a directory")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"export destination {str(dest)!r} must be a new or empty directory")
    dest.mkdir(parents=True, exist_ok=True)
    report = ExportReport()
    for root, dirs, files in os.walk(src):
        root_path = Path(root)
        rel_root = root_path.relative_to(src).as_posix()
        rel_root = "" if rel_root == "." else rel_root + "/"
        kept = []
        for name in sorted(dirs):
            rel = rel_root + name
            path = root_path / name
            if path.is_symlink():
                _export_link(src, path, dest / rel, rel, report)
                continue
            reason = skip_reason(rel, is_dir=True, directory=path)
            if reason is not None:
                report.skipped[rel] = reason
                continue
            (dest / rel).mkdir()
            kept.append(name)
        dirs[:] = kept
        for name in sorted(files):
            rel = rel_root + name
            path = root_path / name
            if path.is_symlink():
                _export_link(src, path, dest / rel, rel, report)
                continue
            reason = skip_reason(rel, is_dir=False)
            mode = path.lstat().st_mode
            if reason is None and not stat.S_ISREG(mode):
                reason = "special file"
            if reason is not None:
                report.skipped[rel] = reason
                continue
            shutil.copyfile(path, dest / rel)
            os.chmod(dest / rel, 0o755 if mode & stat.S_IXUSR else 0o644)
            report.copied.append(rel)
    report.copied.sort()
    return report


def _export_link(src: Path, path: Path, target: Path, rel: str, report: ExportReport) -> None:
    resolved = path.resolve()
    if resolved != src and src not in resolved.parents:
        report.skipped[rel] = "symlink outside the tree"
        return
    reason = skip_reason(rel, is_dir=resolved.is_dir())
    if reason is not None:
        report.skipped[rel] = reason
        return
    os.symlink(os.readlink(path), target)


# ---------------------------------------------------------------------------------------------
# a fresh repository of one reproducible commit

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "etude",
    "GIT_AUTHOR_EMAIL": "etude@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "etude",
    "GIT_COMMITTER_EMAIL": "etude@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
COMMIT_MESSAGE = "Initial commit"


def git_env(home: str) -> dict[str, str]:
    """An environment for git that reads no system or user configuration (no hooks, no signing)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": home,
        "LANG": "C",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
    }
    env.update(GIT_IDENTITY)
    return env


def run_git(args: Sequence[str], cwd: str | Path, *, input_bytes: bytes | None = None) -> bytes:
    """Run ``git ARGS`` in ``cwd`` with ``git_env``; a failure raises ``RuntimeError`` with stderr."""
    with tempfile.TemporaryDirectory(prefix="etude-git-home-") as home:
        proc = subprocess.run(
            ["git", "-c", "core.hooksPath=/dev/null", "-c", "commit.gpgsign=false", *args],
            cwd=cwd,
            env=git_env(home),
            input=input_bytes,
            capture_output=True,
            check=False,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {proc.stderr.decode(errors='replace')}")
    return proc.stdout


def fresh_git_repo(workspace: str | Path) -> str:
    """Make ``workspace`` a git repository whose history is one commit of all its files.

    No template (so no sample hooks or description), every file added (ignored ones too: the tree
    is exactly what was exported), fixed identity and dates: the same tree always gives the same
    commit id, which is returned. ``workspace`` must not be a repository already.
    """
    workspace = Path(workspace)
    if (workspace / ".git").exists():
        raise ValueError(f"{str(workspace)!r} already has a .git; export the tree first")
    with tempfile.TemporaryDirectory(prefix="etude-git-template-") as template:
        run_git(["init", "-q", f"--template={template}", "-b", "main"], workspace)
    run_git(["add", "-A", "-f"], workspace)
    run_git(["commit", "-q", "--allow-empty", "--no-verify", "-m", COMMIT_MESSAGE], workspace)
    return run_git(["rev-parse", "HEAD"], workspace).decode().strip()


def workspace_head(workspace: str | Path) -> tuple[str, bool]:
    """``(commit id of HEAD, whether the worktree matches it)`` of a workspace repository."""
    head = run_git(["rev-parse", "HEAD"], workspace).decode().strip()
    status = run_git(["status", "--porcelain", "--untracked-files=all"], workspace)
    return head, not status.strip()


# ---------------------------------------------------------------------------------------------
# installed copies: the deleted code must not be importable from outside the workspace

_FIND_SPECS = """
import importlib.util, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        spec = None
    if spec is not None:
        out[name] = spec.origin or ",".join(spec.submodule_search_locations or [])
print(json.dumps(out))
"""


def find_installed_copies(sandbox: Any, names: Iterable[str]) -> dict[str, str]:
    """Top-level module names the sandboxed interpreter imports from outside a workspace.

    Runs ``importlib.util.find_spec`` in ``sandbox`` with an empty directory as the workspace, so
    only installed copies (site-packages, ``.pth`` paths the sandbox can see) are found. Returns
    ``{name: where}``; an empty dict means the package can only come from the task workspace.
    """
    names = sorted(set(names))
    if not names:
        return {}
    with tempfile.TemporaryDirectory(prefix="etude-empty-") as empty:
        result = sandbox.run(["python", "-I", "-c", _FIND_SPECS, *names], empty, timeout=60)
    if result.exit_code != 0:
        raise RuntimeError(f"installed-copy probe failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
