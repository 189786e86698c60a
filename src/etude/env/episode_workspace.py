"""The host side of an episode's workspace: its directory, hidden content, masks and facts.

- Episode directories are named by process id only (``EPISODE_PREFIX``): the task, and so the
  deleted symbol, shows in no path the agent can see, and a later run tells a killed run's
  leftovers from a live run's directories (``remove_stale_dirs``).
- ``strip_hidden`` removes the task's hidden paths' content from the episode's copy before any
  tool runs (a hidden directory stays, empty, for the sandbox to mask); ``replace_masks`` adds
  the host paths holding copies of the package to a sandbox configuration's masks.
- ``repo_facts`` is what the monitor knows of the task's repository (``Trajectory.info["repo"]``).

What this module does not do: copy or resolve the workspace (``etude.tasks.record``,
``etude.env.reward``), search for package copies (``etude.sandbox.masking``), run the episode
(``etude.env.coding``) or check the agent's paths (``etude.env.workspace_paths``).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from etude.env.reward import remove_tree
from etude.sandbox import SandboxConfig
from etude.tasks.layout import detect_layout
from etude.tasks.record import TaskRecord

MAX_TEST_SOURCE_CHARS = 64_000
MAX_LISTED_FILES = 5_000


# Episode directories are named by process id only: the task (and so the deleted symbol) must
# not show in any path the agent can see. The pid lets a later run tell a killed run's leftovers
# from a live run's directories.
EPISODE_PREFIX = "etude-ep-"
STALE_PREFIXES = (EPISODE_PREFIX, "etude-grade-")
# names of earlier versions (no pid): removed when older than this many seconds
LEGACY_PREFIXES = ("etude-episode-", "etude-reward-")
LEGACY_STALE_S = 24 * 3600.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_dirs(work_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove episode and grading directories that killed runs left in ``work_dir`` (default:
    the system temp directory); returns their paths.

    A directory is stale when the process named in it (``etude-ep-PID-...``,
    ``etude-grade-PID-...``) no longer runs; directories of an earlier naming scheme without a
    pid when untouched for a day. Directories of live processes are never touched.
    """
    root = Path(work_dir or tempfile.gettempdir())
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        name = entry.name
        if not entry.is_dir(follow_symlinks=False):
            continue
        stale = False
        for prefix in STALE_PREFIXES:
            if name.startswith(prefix):
                pid = name[len(prefix) :].split("-", 1)[0]
                stale = pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))
        if name.startswith(LEGACY_PREFIXES):
            try:
                stale = now - entry.stat(follow_symlinks=False).st_mtime > LEGACY_STALE_S
            except OSError:
                stale = False
        if stale:
            try:
                remove_tree(entry.path)
            except OSError:
                continue  # another cleaner got there first, or it is not ours to remove
            removed.append(entry.path)
    return removed


def repo_facts(task: TaskRecord, workspace: Path) -> dict[str, Any]:
    """What the monitor knows of the task's repository (``Trajectory.info["repo"]``).

    Package and module names, the source root and the test files of the workspace
    (``etude.tasks.layout``), and the text of the failing tests' files (capped): the monitor
    reads them instead of guessing the package from what the agent printed.
    """
    tops = [s.split(".", 1)[0] for s in (task.etude.symbols if task.etude else [])]
    try:
        layout = detect_layout(workspace, dict.fromkeys(tops))
    except ValueError:  # a symbol outside the package (a test helper, say): search instead
        layout = detect_layout(workspace)
    sources: dict[str, str] = {}
    budget = MAX_TEST_SOURCE_CHARS
    for rel in dict.fromkeys(t.split("::", 1)[0] for t in task.FAIL_TO_PASS):
        path = workspace / rel
        if budget <= 0 or not path.is_file():
            continue
        sources[rel] = path.read_text(errors="replace")[:budget]
        budget -= len(sources[rel])
    files = sorted(
        p.relative_to(workspace).as_posix() for p in workspace.rglob("*") if not p.is_dir()
    )
    return {
        "workspace_files": files[:MAX_LISTED_FILES],
        "workspace_files_truncated": len(files) > MAX_LISTED_FILES,
        "packages": list(layout.packages),
        "source_root": layout.source_root,
        "modules": sorted(layout.modules.values()),
        "test_files": list(layout.test_files),
        "test_sources": sources,
    }


def replace_masks(cfg: SandboxConfig, masked: Sequence[str]) -> SandboxConfig:
    """``cfg`` with ``masked`` added to its masked host paths."""
    return dataclasses.replace(cfg, masked_paths=tuple(dict.fromkeys([*cfg.masked_paths, *masked])))


def strip_hidden(workspace: Path, hidden: Sequence[str]) -> None:
    """Remove the hidden paths' content from ``workspace``: a hidden directory stays as an empty
    directory (so the sandbox still has something to mask), a hidden file goes."""
    for rel in hidden:
        target = workspace / rel
        if target.is_dir() and not target.is_symlink():
            remove_tree(target)
            target.mkdir()
        elif os.path.lexists(target):
            target.unlink()
