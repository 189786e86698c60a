"""Gold patches and trivial implementations: the two ways validation fills a broken tree back in.

After ``etude.tasks.delete`` removed a feature, a task is validated against two fillings of the
hole: the **gold patch**, which restores the original (its FAIL_TO_PASS tests must pass), and the
**trivial implementation**, which must fail them (a test that a stub passes is dropped).

- ``unified_patch`` writes the gold patch (broken -> original) as a ``git apply``-able unified
  diff; ``patch_added_text`` and ``patch_paths`` read back the lines it adds and the paths it
  touches; ``apply_patch`` applies it to a directory with ``git apply``;
- ``stub_definitions`` makes the trivial implementation: the bodies of the named functions (or
  every method of a named class, or all functions) replaced by ``raise NotImplementedError`` or
  ``pass``, docstrings kept.

What it does not do: delete anything (``etude.tasks.delete``), judge whether the fillings pass or
fail (``etude.tasks.validate`` runs the tests), or parse diffs beyond what ``unified_patch``
writes (``patch_paths`` reads ``diff --git`` headers only).
"""

from __future__ import annotations

import difflib
import os
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

import libcst as cst

from etude.tasks.delete import is_docstring

# ---------------------------------------------------------------------------------------------
# trivial implementations

StubKind = Literal["raise", "pass"]


class _Stubber(cst.CSTTransformer):
    def __init__(self, qualnames: Iterable[str] | None, kind: StubKind) -> None:
        super().__init__()
        self.wanted = None if qualnames is None else set(qualnames)
        self.kind = kind
        self.stack: list[str] = []
        self.stubbed: set[str] = set()

    def _selected(self) -> bool:
        if self.wanted is None:
            return True
        return any(".".join(self.stack[:i]) in self.wanted for i in range(1, len(self.stack) + 1))

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self.stack.append(node.name.value)
        return True

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        self.stack.pop()
        return updated

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.stack.append(node.name.value)
        return False

    def leave_FunctionDef(
        self, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.FunctionDef:
        selected = self._selected()
        name = ".".join(self.stack)
        self.stack.pop()
        if not selected:
            return updated
        self.stubbed.add(name)
        trivial = (
            cst.Raise(exc=cst.Name("NotImplementedError")) if self.kind == "raise" else cst.Pass()
        )
        body: list[cst.BaseStatement] = []
        if isinstance(updated.body, cst.IndentedBlock) and updated.body.body:
            if is_docstring(updated.body.body[0]):
                body.append(updated.body.body[0])
        body.append(cst.SimpleStatementLine([trivial]))
        return updated.with_changes(body=cst.IndentedBlock(body=body))


def stub_definitions(source: str, qualnames: Iterable[str] | None, kind: StubKind) -> str:
    """``source`` with the bodies of ``qualnames`` (and every method of a named class; all
    functions when None) replaced by ``raise NotImplementedError`` or ``pass``."""
    stubber = _Stubber(qualnames, kind)
    return cst.parse_module(source).visit(stubber).code


# ---------------------------------------------------------------------------------------------
# the gold patch


def unified_patch(
    before: Mapping[str, str | None], after: Mapping[str, str | None], *, context: int = 3
) -> str:
    """A ``git apply``-able diff taking ``before`` to ``after`` (path -> text, None: no file)."""
    out: list[str] = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        a_lines = [] if old is None else old.splitlines(keepends=True)
        b_lines = [] if new is None else new.splitlines(keepends=True)
        out.append(f"diff --git a/{path} b/{path}\n")
        if old is None:
            out.append("new file mode 100644\n")
        elif new is None:
            out.append("deleted file mode 100644\n")
        from_file = "/dev/null" if old is None else f"a/{path}"
        to_file = "/dev/null" if new is None else f"b/{path}"
        diff = difflib.unified_diff(a_lines, b_lines, from_file, to_file, n=context)
        for line in diff:
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def patch_added_text(patch: str) -> str:
    """The lines a unified diff adds (without the ``+``), joined by newlines."""
    lines = []
    for line in patch.splitlines():
        if line.startswith("+") and not line.startswith("+++ "):
            lines.append(line[1:])
    return "\n".join(lines)


def patch_paths(patch: str) -> list[str]:
    """Paths a unified diff touches (from its ``diff --git`` headers)."""
    out = []
    for line in patch.splitlines():
        if line.startswith("diff --git a/"):
            out.append(line[len("diff --git a/") :].split(" b/", 1)[0])
    return out


def apply_patch(directory: str | Path, patch: str) -> None:
    """Apply ``patch`` to the files of ``directory`` with ``git apply`` (worktree only).

    Raises ``ValueError`` with git's message when it does not apply cleanly. Git does not look
    for a repository above ``directory``.
    """
    directory = Path(directory).resolve()
    with tempfile.NamedTemporaryFile("w", suffix=".patch", delete=False) as f:
        f.write(patch)
        patch_file = f.name
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": tempfile.gettempdir(),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CEILING_DIRECTORIES": str(directory.parent),
    }
    try:
        proc = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", "-p1", patch_file],
            cwd=directory,
            env=env,
            capture_output=True,
            check=False,
        )
    finally:
        os.unlink(patch_file)
    if proc.returncode != 0:
        raise ValueError(
            f"gold patch does not apply: {proc.stderr.decode(errors='replace')[:2000]}"
        )
