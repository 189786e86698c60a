"""A scripted agent that solves a task from its gold patch, through the tools, with optional mistakes.

Uses: tests of the environment and the reward (the oracle must earn 1.0 on every valid task),
benchmarks (episodes per minute), and warm-start data for RL (a tiny model learns the protocol
from oracle trajectories, and learns to follow hints from the injected mistakes).

The plan, one tool call per assistant turn, each with a one-line thought before it:

1. ``list_files()``; ``read_file`` of the first failing test file and of every file the patch
   changes;
2. the edits of the gold patch (``task.patch``, a unified diff, broken -> original): per hunk a
   ``replace_in_file(path, old, new)`` with the hunk's old and new lines (context included) when
   the old lines occur exactly once in the file at that point, else one ``write_file`` with the
   file's final content; ``write_file`` for new files, ``bash rm`` for deleted ones;
3. ``run_tests()`` (the task's tests), then ``submit()``.

Mistakes (`MISTAKE_KINDS`): before a planned turn, with probability ``mistake_rate`` (seeded per
task), the oracle writes a wrong turn instead:

- ``unknown_tool``: the planned arguments under a plausible wrong name (``open_file``, ``grep``...);
- ``malformed_json``: the planned call with broken JSON (a brace missing, single quotes, a
  trailing comma) or without its closing ``</tool_call>``;
- ``bad_arguments``: the planned call missing a required argument, with an extra one, or with a
  wrongly typed one;
- ``test_edit``: a hack attempt on a failing test file (overwritten with a trivial test, deleted,
  or an assertion replaced by ``assert True``); the next turn restores the file (at most once
  per episode);
- ``skip_tests``: at the ``run_tests`` step, ``submit`` right away (this ends the episode).

The turn after a mistake is never a mistake, so every mistake is followed by its correction.
`OracleTurn` records, per assistant turn, the mistake kind, ``corrected`` (the planned turn the
mistake replaced: what an SFT example puts after the hint) and the error kinds the environment
reported; ``episode_info()`` puts that list on the trajectory as ``info["oracle_turns"]``.

What the oracle does not do: read observations to decide what to edit (it knows the gold patch
and the broken files) or recover from a gold patch that does not apply (a ``ValueError`` at
construction).
"""

from __future__ import annotations

import json
import random
import re
import shlex
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from etude.env.coding import StepResult
from etude.env.reward import remove_tree
from etude.env.tools import TOOL_SCHEMAS
from etude.env.trajectory import ToolCall
from etude.model.tokenizer import TOOL_CALL_END, TOOL_CALL_START
from etude.tasks.record import TaskRecord, is_archive, resolve_workspace

MISTAKE_KINDS = ("unknown_tool", "malformed_json", "bad_arguments", "test_edit", "skip_tests")
WRONG_TOOL_NAMES = {
    "list_files": ("ls", "list_dir", "list_directory"),
    "read_file": ("open_file", "cat", "view_file"),
    "write_file": ("create_file", "save_file"),
    "replace_in_file": ("edit_file", "str_replace", "apply_edit"),
    "search": ("grep", "find_in_files"),
    "run_tests": ("pytest", "run_pytest", "test"),
    "bash": ("shell", "run_command"),
    "submit": ("finish", "done"),
}
_REQUIRED = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in TOOL_SCHEMAS}
_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


# ---------------------------------------------------------------- unified diffs


@dataclass(kw_only=True, slots=True)
class Hunk:
    """One ``@@`` block; lines keep their line endings."""

    old_start: int
    old_lines: list[str] = field(default_factory=list)
    new_lines: list[str] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class FilePatch:
    """The change to one file; a None path is ``/dev/null`` (file added or deleted)."""

    old_path: str | None
    new_path: str | None
    hunks: list[Hunk] = field(default_factory=list)


def _diff_path(field_text: str) -> str | None:
    path = field_text.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    return path[2:] if path[:2] in ("a/", "b/") else path


def parse_unified_diff(patch: str) -> list[FilePatch]:
    """The files and hunks of a (git-style) unified diff; ``ValueError`` when it is malformed."""
    lines = re.split(r"(?<=\n)", patch)
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            files.append(
                FilePatch(old_path=_diff_path(line[4:]), new_path=_diff_path(lines[i + 1][4:]))
            )
            i += 2
            continue
        found = _HUNK_RE.match(line)
        if not found:
            i += 1  # diff --git, index, mode and rename lines carry nothing the oracle needs
            continue
        if not files:
            raise ValueError(f"patch line {i + 1}: a hunk before any ---/+++ file header")
        old_left = int(found.group(2) or "1")
        new_left = int(found.group(4) or "1")
        hunk = Hunk(old_start=int(found.group(1)))
        i += 1
        last: list[list[str]] = []
        while (old_left > 0 or new_left > 0) and i < len(lines):
            line = lines[i]
            tag, text = (line[0], line[1:]) if line not in ("\n", "") else (" ", "\n")
            if tag == "\\":  # "\ No newline at end of file" belongs to the line before
                for target in last:
                    target[-1] = target[-1].rstrip("\n")
                i += 1
                continue
            if tag == " ":
                hunk.old_lines.append(text)
                hunk.new_lines.append(text)
                last = [hunk.old_lines, hunk.new_lines]
                old_left, new_left = old_left - 1, new_left - 1
            elif tag == "-":
                hunk.old_lines.append(text)
                last = [hunk.old_lines]
                old_left -= 1
            elif tag == "+":
                hunk.new_lines.append(text)
                last = [hunk.new_lines]
                new_left -= 1
            else:
                raise ValueError(f"patch line {i + 1}: unexpected line in a hunk: {line[:60]!r}")
            i += 1
        if i < len(lines) and lines[i].startswith("\\"):
            for target in last:
                target[-1] = target[-1].rstrip("\n")
            i += 1
        if old_left or new_left:
            raise ValueError(f"patch ends inside a hunk of {files[-1].new_path}")
        files[-1].hunks.append(hunk)
    return files


def _occurrences(text: str, sub: str) -> list[int]:
    """Start offsets of every (also overlapping) occurrence of ``sub``."""
    out, at = [], text.find(sub)
    while at != -1:
        out.append(at)
        at = text.find(sub, at + 1)
    return out


def apply_hunks(content: str, hunks: Sequence[Hunk], path: str) -> str:
    """``content`` with ``hunks`` applied at their lines (or, when moved, where they match once)."""
    lines = re.split(r"(?<=\n)", content)
    if lines and lines[-1] == "":
        lines.pop()
    delta = 0
    for number, hunk in enumerate(hunks, 1):
        size = len(hunk.old_lines)
        at = max(hunk.old_start - 1, 0) + delta if size else hunk.old_start + delta
        if lines[at : at + size] != hunk.old_lines:
            matches = [
                k for k in range(len(lines) - size + 1) if lines[k : k + size] == hunk.old_lines
            ]
            if len(matches) != 1:
                raise ValueError(f"gold patch hunk {number} does not apply to {path}")
            at = matches[0]
        lines[at : at + size] = hunk.new_lines
        delta += len(hunk.new_lines) - size
    return "".join(lines)


# ---------------------------------------------------------------- the plan


@dataclass(kw_only=True, slots=True)
class PlanStep:
    """One planned assistant turn: a short thought and the call that follows it."""

    thought: str
    call: ToolCall


def _call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def render_turn(thought: str, name: str, arguments: dict[str, Any]) -> str:
    """Assistant text: the thought, then one tool call."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{thought}\n{TOOL_CALL_START}{body}{TOOL_CALL_END}"


def _edit_steps(patch: FilePatch, broken: dict[str, str]) -> list[PlanStep]:
    if patch.new_path is None:
        assert patch.old_path is not None
        path = patch.old_path
        return [
            PlanStep(
                thought=f"I remove {path}.",
                call=_call("bash", command=f"rm -- {shlex.quote(path)}"),
            )
        ]
    path = patch.new_path
    if patch.old_path is None:
        content = apply_hunks("", patch.hunks, path)
        return [
            PlanStep(
                thought=f"I create {path}.", call=_call("write_file", path=path, content=content)
            )
        ]
    original = broken[patch.old_path]
    final = apply_hunks(original, patch.hunks, path)
    steps = []
    if patch.old_path != path:  # a rename: write the new file, remove the old one
        steps.append(
            PlanStep(thought=f"I write {path}.", call=_call("write_file", path=path, content=final))
        )
        command = f"rm -- {shlex.quote(patch.old_path)}"
        steps.append(
            PlanStep(thought=f"I remove {patch.old_path}.", call=_call("bash", command=command))
        )
        return steps
    current = original
    for hunk in patch.hunks:
        old, new = "".join(hunk.old_lines), "".join(hunk.new_lines)
        if not old or len(_occurrences(current, old)) != 1:
            break
        current = current.replace(old, new, 1)
        steps.append(
            PlanStep(
                thought=f"I change {path}.",
                call=_call("replace_in_file", path=path, old=old, new=new),
            )
        )
    if current != final or len(steps) != len(patch.hunks):
        return [
            PlanStep(
                thought=f"I rewrite {path}.", call=_call("write_file", path=path, content=final)
            )
        ]
    return steps


def _test_files(task: TaskRecord) -> list[str]:
    return list(dict.fromkeys(i.split("::", 1)[0] for i in task.FAIL_TO_PASS))


# ---------------------------------------------------------------- the agent


@dataclass(kw_only=True, slots=True)
class OracleTurn:
    """One assistant turn the oracle wrote."""

    text: str
    mistake: str | None = None
    """The injected mistake kind (`MISTAKE_KINDS`), or None for a planned turn."""
    corrected: str | None = None
    """For a mistake: the planned turn it replaced (the right turn after a hint)."""
    errors: list[str] = field(default_factory=list)
    """Error kinds the environment recorded for this turn."""


class OracleAgent:
    """Solves ``task`` from its gold patch (see the module docstring); an `Agent`.

    ``workspace`` is the task's broken tree (default: the record's, resolved against
    ``base_dir``; an archive is extracted to a temp dir and removed again).
    """

    def __init__(
        self,
        task: TaskRecord,
        *,
        base_dir: str = ".",
        workspace: str | Path | None = None,
        mistake_rate: float = 0.0,
        mistakes: Sequence[str] = MISTAKE_KINDS,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= mistake_rate <= 1.0:
            raise ValueError(f"mistake_rate={mistake_rate} must lie in [0, 1]")
        unknown = sorted(set(mistakes) - set(MISTAKE_KINDS))
        if unknown:
            raise ValueError(f"unknown mistake kinds {unknown}; choose from {MISTAKE_KINDS}")
        if mistake_rate > 0 and not mistakes:
            raise ValueError("mistake_rate > 0 needs at least one kind in mistakes")
        if not task.patch.strip():
            raise ValueError(f"task {task.instance_id!r} has no gold patch to solve it from")
        self.task = task
        self.mistake_rate = mistake_rate
        self.mistakes = tuple(mistakes)
        self.seed = seed
        self._rng = random.Random(f"{seed}:{task.instance_id}")
        patches = parse_unified_diff(task.patch)
        if not patches:
            raise ValueError(f"the gold patch of task {task.instance_id!r} changes no file")
        self._test_files = _test_files(task)
        wanted = {p.old_path for p in patches if p.old_path is not None}
        wanted.update(self._test_files[:1])
        self._broken = self._read_files(task, base_dir, workspace, wanted)
        self._plan = deque(self._make_plan(patches))
        self._pending: deque[PlanStep] = deque()
        self._tested_edit = False
        self._tests_passed = False
        self.turns: list[OracleTurn] = []

    @staticmethod
    def _read_files(
        task: TaskRecord, base_dir: str, workspace: str | Path | None, wanted: set[str]
    ) -> dict[str, str]:
        scratch = None
        if workspace is None:
            assert task.etude is not None, "a task without etude.workspace"
            if is_archive(task.etude.workspace):
                scratch = Path(tempfile.mkdtemp(prefix="etude-oracle-"))
                workspace = resolve_workspace(task, base_dir, dest=scratch / "workspace")
            else:
                workspace = resolve_workspace(task, base_dir)
        try:
            root = Path(workspace)
            files = {}
            for rel in sorted(wanted):
                path = root / rel
                if not path.is_file():
                    raise ValueError(
                        f"task {task.instance_id!r}: {rel} is not in the workspace, but the gold "
                        "patch changes it or a test id names it"
                    )
                files[rel] = path.read_text(encoding="utf-8")
            return files
        finally:
            if scratch is not None:
                remove_tree(scratch)

    def _make_plan(self, patches: list[FilePatch]) -> list[PlanStep]:
        plan = [PlanStep(thought="Let me look at the repository layout.", call=_call("list_files"))]
        for path in self._test_files[:1]:
            plan.append(
                PlanStep(
                    thought=f"Let me read the failing tests in {path}.",
                    call=_call("read_file", path=path),
                )
            )
        for patch in patches:
            if patch.old_path is not None:
                plan.append(
                    PlanStep(
                        thought=f"Let me read {patch.old_path}.",
                        call=_call("read_file", path=patch.old_path),
                    )
                )
        for patch in patches:
            plan.extend(_edit_steps(patch, self._broken))
        plan.append(PlanStep(thought="Now let me run the tests.", call=_call("run_tests")))
        plan.append(PlanStep(thought="", call=_call("submit")))
        return plan

    # ------------------------------------------------------------ acting

    def act(self, last: StepResult | None) -> str:
        """The next assistant text; ``last`` is the environment's answer to the previous one."""
        if last is not None:
            if self.turns:
                self.turns[-1].errors = [e.kind for e in last.errors]
            for tool_call, observation in zip(last.tool_calls, last.observations):
                if tool_call.name == "run_tests":
                    self._tests_passed = observation.startswith("pytest: all")
            if last.done:
                raise ValueError("the episode is over; the oracle has nothing more to say")
        if not self._plan and not self._pending:
            raise ValueError("the oracle's plan is used up (it ends with submit)")
        after_mistake = bool(self.turns) and self.turns[-1].mistake is not None
        if self._pending:
            step = self._pending.popleft()
            return self._record(self._render(step), None, None)
        step = self._plan[0]
        kinds = self._applicable(step)
        if not after_mistake and kinds and self._rng.random() < self.mistake_rate:
            kind = self._rng.choice(kinds)
            planned = self._render(step)
            if kind == "skip_tests":
                self._plan.popleft()
                text = render_turn("The change is done; submitting.", "submit", {})
            else:
                text = self._mistake_text(kind, step)
            return self._record(text, kind, planned)
        self._plan.popleft()
        return self._record(self._render(step), None, None)

    def episode_info(self) -> dict[str, Any]:
        return {
            "oracle_turns": [asdict(turn) for turn in self.turns],
            "oracle_seed": self.seed,
            "oracle_mistake_rate": self.mistake_rate,
        }

    def _record(self, text: str, mistake: str | None, corrected: str | None) -> str:
        self.turns.append(OracleTurn(text=text, mistake=mistake, corrected=corrected))
        return text

    def _render(self, step: PlanStep) -> str:
        thought = step.thought
        if step.call.name == "submit" and not thought:
            if self._tests_passed:
                thought = "All tests pass; submitting."
            else:
                thought = "The change is complete; submitting."
        return render_turn(thought, step.call.name, dict(step.call.arguments))

    def _applicable(self, step: PlanStep) -> list[str]:
        kinds = []
        for kind in self.mistakes:
            if kind == "skip_tests" and step.call.name != "run_tests":
                continue
            if kind == "test_edit" and (self._tested_edit or not self._test_files):
                continue
            kinds.append(kind)
        return kinds

    def _mistake_text(self, kind: str, step: PlanStep) -> str:
        name, arguments = step.call.name, dict(step.call.arguments)
        rng = self._rng
        if kind == "unknown_tool":
            return render_turn(step.thought, rng.choice(WRONG_TOOL_NAMES[name]), arguments)
        if kind == "malformed_json":
            body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
            variant = rng.randrange(4)
            if variant == 3:
                return f"{step.thought}\n{TOOL_CALL_START}{body}"  # the closing tag is missing
            broken = (body[:-1], body.replace('"', "'"), body[:-1] + ",}")[variant]
            return f"{step.thought}\n{TOOL_CALL_START}{broken}{TOOL_CALL_END}"
        if kind == "bad_arguments":
            return render_turn(step.thought, name, self._bad_arguments(name, arguments))
        assert kind == "test_edit", kind
        return self._test_edit()

    def _bad_arguments(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        variants = ["extra"]
        if any(k in arguments for k in _REQUIRED[name]):
            variants.append("missing")
        if any(isinstance(v, str) for v in arguments.values()):
            variants.append("type")
        variant = self._rng.choice(variants)
        if variant == "missing":
            dropped = self._rng.choice([k for k in _REQUIRED[name] if k in arguments])
            return {k: v for k, v in arguments.items() if k != dropped}
        if variant == "type":
            key = self._rng.choice([k for k, v in arguments.items() if isinstance(v, str)])
            return {**arguments, key: [arguments[key]]}
        return {**arguments, "verbose": True}

    def _test_edit(self) -> str:
        self._tested_edit = True
        path = self._test_files[0]
        original = self._broken[path]
        thought = f"The tests in {path} are too strict; let me make them pass."
        restore = PlanStep(
            thought=f"Tests are the specification: I restore {path} and change the code instead.",
            call=_call("write_file", path=path, content=original),
        )
        self._pending.append(restore)
        variant = self._rng.randrange(3)
        if variant == 2:
            lines = original.split("\n")
            asserts = [
                line
                for line in lines
                if line.lstrip().startswith("assert ") and original.count(line) == 1
            ]
            if asserts:
                old = asserts[0]
                new = old[: len(old) - len(old.lstrip())] + "assert True"
                return render_turn(
                    thought, "replace_in_file", {"path": path, "old": old, "new": new}
                )
            variant = 0
        if variant == 1:
            return render_turn(thought, "bash", {"command": f"rm -- {shlex.quote(path)}"})
        trivial = "def test_placeholder():\n    assert True\n"
        return render_turn(thought, "write_file", {"path": path, "content": trivial})
