"""The agent's view of its workspace: relative paths resolved, escapes and hidden entries refused.

``WorkspacePaths(root, hidden_paths).resolve(raw)`` maps a path a model wrote onto the workspace
or raises `ToolFailure` (``path_escape``): an absolute path, a ``..`` component, a path that
resolves through symlinks outside the root, or one under a hidden path of the task. Hidden
entries are also known by device and inode, so that ``mv tests tests_moved`` does not carry them
out from under their names. ``regular_file`` refuses directories, FIFOs and devices before a
file tool touches them; ``split_lines`` splits at ``"\n"`` only, as editors and ``sed`` do.

What this module does not do: read or write files (``etude.env.tools``), or hide anything from
commands (the sandbox masks hidden paths for those).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from etude.env.tool_interface import ToolFailure


def _is_under(rel: str, prefix: str) -> bool:
    return rel == prefix or rel.startswith(prefix.rstrip("/") + "/")


class WorkspacePaths:
    """Maps the agent's relative paths onto the workspace, refusing escapes and hidden paths."""

    def __init__(self, root: str | os.PathLike[str], hidden_paths: Sequence[str] = ()) -> None:
        self.root = Path(os.path.realpath(root))
        self.hidden = tuple(PurePosixPath(p).as_posix() for p in hidden_paths)
        # hidden entries by identity too, so that a rename (`mv tests tests_moved`) does not
        # carry them out from under their names
        self._hidden_inodes: set[tuple[int, int]] = set()
        for rel in self.hidden:
            try:
                st = os.lstat(self.root / rel)
            except OSError:
                continue
            self._hidden_inodes.add((st.st_dev, st.st_ino))

    def is_hidden(self, rel: str) -> bool:
        if any(_is_under(rel, h) for h in self.hidden):
            return True
        if not self._hidden_inodes or rel in ("", "."):
            return False
        current = self.root
        for part in PurePosixPath(rel).parts:
            current = current / part
            try:
                st = os.lstat(current)
            except OSError:
                return False
            if (st.st_dev, st.st_ino) in self._hidden_inodes:
                return True
        return False

    def resolve(self, raw: str) -> tuple[Path, str]:
        """``(resolved absolute path, normalized relative path)`` or ``ToolFailure(path_escape)``."""
        if "\x00" in raw:
            raise ToolFailure("tool_failed", f"Path {raw!r} contains a NUL character.")
        pure = PurePosixPath(raw or ".")
        if pure.is_absolute():
            inside = os.path.relpath(os.path.realpath(raw), self.root)
            hint = f" ('{inside}')" if not inside.startswith("..") else ""
            raise ToolFailure(
                "path_escape",
                f"Path '{raw}' is absolute; use a path relative to the repository root{hint}.",
            )
        if ".." in pure.parts:
            raise ToolFailure(
                "path_escape",
                f"Path '{raw}' contains '..'; paths must stay inside the repository root.",
            )
        rel = pure.as_posix()
        real = os.path.realpath(self.root / rel)
        if real != str(self.root) and not real.startswith(str(self.root) + "/"):
            raise ToolFailure(
                "path_escape",
                f"Path '{raw}' resolves through a symlink to a place outside the repository.",
            )
        real_rel = os.path.relpath(real, self.root)
        if self.is_hidden(rel) or self.is_hidden(real_rel):
            raise ToolFailure("path_escape", f"Path '{raw}' is hidden in this task.")
        return Path(real), rel

    def relative(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()


def regular_file(path: Path, rel: str) -> os.stat_result:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ToolFailure("tool_failed", f"No such file: '{rel}'.") from None
    if stat.S_ISDIR(st.st_mode):
        raise ToolFailure("tool_failed", f"'{rel}' is a directory; use list_files on it.")
    if not stat.S_ISREG(st.st_mode):
        raise ToolFailure("tool_failed", f"'{rel}' is not a regular file.")
    return st


def split_lines(text: str) -> list[str]:
    # "\n" only: str.splitlines also breaks at \f, \x1c, \u2028..., which editors and sed do not
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines
