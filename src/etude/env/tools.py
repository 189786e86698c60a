"""The agent's tools: OpenAI function schemas, argument checks, and their execution on a workspace.

A `Toolbox` owns one episode's workspace (a directory the agent may change) and the sandbox its
commands run in. ``Toolbox.call(name, arguments)`` checks the arguments against the tool's schema
and runs it; every outcome is text for the model (`ToolOutcome.observation`) plus, when the call
went wrong, a typed `ToolError` (kinds in ``etude.env.trajectory.ERROR_KINDS``). Nothing a model
can write makes ``call`` raise.

The tools (`TOOL_SCHEMAS`):

- ``list_files(path=".", max_depth=2)``: paths relative to the workspace root, directories with a
  trailing ``/``, depth-first in name order, capped at ``list_max_entries``;
- ``read_file(path, start_line=1, end_line=last)``: numbered lines (``cat -n`` style) under a
  header ``PATH (lines A-B of N)``, capped at ``read_max_lines`` lines and ``read_max_chars``
  characters with a footer that says where to continue;
- ``write_file(path, content)``: creates or overwrites a file (parent directories included);
- ``replace_in_file(path, old, new)``: replaces the one exact occurrence of ``old``; zero or
  several occurrences change nothing and say how many (and on which lines);
- ``search(pattern, path=".")``: a Python regular expression (``re`` syntax) searched line by line
  in the text files under ``path``; ``PATH:LINE: text`` results, capped. Matching runs inside the
  sandbox with a time limit, because a hostile pattern can backtrack for hours;
- ``run_tests(tests=None)``: the given node ids (default: the task's tests) graded exactly as the
  reward grades them (``etude.sandbox.grader``: the workspace's changes to the package source on
  a pristine copy, with the task's test environment and pytest arguments, hidden paths left
  out); a summary line, the ids that did not pass, the output's tail;
- ``bash(command)``: ``bash -c command`` in the sandbox; exit code, stdout, stderr;
- ``submit()``: ends the episode.

Paths: relative to the workspace root. An absolute path, a ``..`` component, or a path that
resolves (through symlinks) outside the workspace is refused with a ``path_escape`` error; so is
a path under one of the task's hidden paths (they are neither listed nor read; the sandbox
masks them for commands). File tools run in this process on the resolved path and open regular
files only, without following a final symlink and without blocking (a FIFO is refused before a
byte moves, for writes too); there is no concurrent process that could swap a path between
check and use, because the sandbox kills every process of a command when the command ends.

The tools' interface (schemas, argument checks, `ToolConfig`, `ToolOutcome`, `ToolFailure`) lives
in ``etude.env.tool_interface``, the path rules in ``etude.env.workspace_paths``; their public
names are importable from here too.

What this module does not do: parse tool calls from model text (``etude.env.protocol``), limit
the episode (``etude.env.coding``), or contain commands itself (``etude.sandbox`` does).
``list_files``, ``read_file`` and ``search`` do not follow symlinks to directories while walking;
``search`` skips symlinked files and ``.git``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from etude.env.tool_interface import (
    SCHEMA_BY_NAME,
    TOOL_NAMES,
    TOOL_SCHEMAS,
    ToolConfig,
    ToolFailure,
    ToolOutcome,
    check_arguments,
    json_type_name,
    tool_schemas,
)
from etude.env.trajectory import ToolError
from etude.env.workspace_paths import WorkspacePaths, regular_file, split_lines
from etude.sandbox import Sandbox, grade
from etude.sandbox.cleanroom import read_regular
from etude.sandbox.grader import grading_sandbox

__all__ = [
    "TOOL_NAMES",
    "TOOL_SCHEMAS",
    "ToolConfig",
    "ToolFailure",
    "ToolOutcome",
    "Toolbox",
    "WorkspacePaths",
    "cap_text",
    "check_arguments",
    "json_type_name",
    "tool_schemas",
]


def cap_text(text: str, max_chars: int) -> str:
    """``text`` if it fits, else its head and tail with a marker saying how much was cut."""
    if len(text) <= max_chars:
        return text
    # the marker's own length is bounded by ~60 chars; keep head and tail in the rest
    room = max(max_chars - 60, 2)
    head, tail = text[: room - room // 2], text[len(text) - room // 2 :]
    cut = len(text) - len(head) - len(tail)
    return f"{head}\n[... {cut} characters cut ...]\n{tail}"


# ---------------------------------------------------------------- search (runs in the sandbox)

# Executed with `python -I` (isolated: no cwd on sys.path, so the workspace cannot shadow `re`)
# inside the sandbox, which bounds its time; arguments come as JSON on stdin.
_SEARCH_SCRIPT = r"""
import json, os, re, sys
a = json.load(sys.stdin)
rx = re.compile(a["pattern"])
root = os.path.realpath(".")
hidden = a["hidden"]
def hidden_path(rel):
    return any(rel == h or rel.startswith(h + "/") for h in hidden)
def files(start):
    if os.path.isfile(start):
        yield start
        return
    for d, dirs, names in os.walk(start):
        dirs[:] = sorted(x for x in dirs if x != ".git" and not hidden_path(os.path.relpath(os.path.join(d, x), root)))
        for n in sorted(names):
            yield os.path.join(d, n)
out, more = [], False
for p in files(a["start"]):
    rel = os.path.relpath(p, root)
    if hidden_path(rel) or os.path.islink(p) or not os.path.isfile(p):
        continue
    if os.path.getsize(p) > a["max_file_bytes"]:
        continue
    with open(p, "rb") as f:
        data = f.read()
    if b"\0" in data[:8192]:
        continue
    for i, line in enumerate(data.decode("utf-8", "replace").split("\n"), 1):
        if rx.search(line):
            if len(out) == a["max_results"]:
                more = True
                break
            line = line.rstrip("\r")
            if len(line) > a["line_chars"]:
                line = line[: a["line_chars"]] + " [...]"
            out.append(f"{rel}:{i}: {line}")
    if more:
        break
print(json.dumps({"matches": out, "more": more}))
"""


# ---------------------------------------------------------------- the toolbox

_SUMMARY_ORDER = ("passed", "failed", "error", "skipped")


class Toolbox:
    """The tools of one episode, bound to its workspace and sandbox.

    ``test_ids`` are what ``run_tests()`` runs without arguments (the task's tests; empty: the
    whole suite). ``hidden_paths`` are workspace-relative paths the agent may not see; the
    sandbox should mask the same paths (``SandboxConfig.hidden_paths``). ``pristine``,
    ``allowed``, ``test_env`` and ``pytest_args`` are the task's grading arguments
    (``etude.sandbox.grader``); without ``pristine`` run_tests grades the workspace as it is.
    """

    def __init__(
        self,
        workspace: str | os.PathLike[str],
        *,
        sandbox: Sandbox,
        cfg: ToolConfig | None = None,
        test_ids: Sequence[str] = (),
        hidden_paths: Sequence[str] = (),
        pristine: str | os.PathLike[str] | None = None,
        allowed: Sequence[str] = (),
        test_env: Mapping[str, str] | None = None,
        pytest_args: Sequence[str] = (),
        work_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.paths = WorkspacePaths(workspace, hidden_paths)
        if not self.paths.root.is_dir():
            raise ValueError(f"tool workspace {str(workspace)!r} is not a directory")
        unmasked = sorted(set(self.paths.hidden) - set(sandbox.config.hidden_paths))
        if unmasked:
            raise ValueError(
                f"the sandbox does not mask the hidden paths {unmasked}; build it with "
                "SandboxConfig(hidden_paths=...) holding every hidden path of the toolbox"
            )
        self.sandbox = sandbox
        self.cfg = cfg if cfg is not None else ToolConfig()
        self.test_ids = tuple(test_ids)
        self.pristine = Path(pristine) if pristine is not None else None
        self.allowed = tuple(allowed)
        self.test_env = dict(test_env or {})
        self.pytest_args = tuple(pytest_args)
        self.work_dir = work_dir
        self._grader: Sandbox | None = None
        self._tools: dict[str, Callable[..., ToolOutcome]] = {
            "list_files": self.list_files,
            "read_file": self.read_file,
            "write_file": self.write_file,
            "replace_in_file": self.replace_in_file,
            "search": self.search,
            "run_tests": self.run_tests,
            "bash": self.bash,
            "submit": self.submit,
        }
        assert tuple(self._tools) == TOOL_NAMES

    @property
    def names(self) -> tuple[str, ...]:
        return TOOL_NAMES

    @property
    def workspace(self) -> Path:
        return self.paths.root

    def call(
        self, name: str, arguments: Mapping[str, Any], *, time_left: float | None = None
    ) -> ToolOutcome:
        """Check ``arguments`` and run tool ``name``; ``time_left`` (seconds) caps its timeout.

        ``name`` must be one of `TOOL_NAMES` (the protocol answers unknown names itself).
        """
        assert name in self._tools, name
        try:
            checked = check_arguments(name, arguments)
            if name in ("search", "run_tests", "bash"):
                checked["time_left"] = time_left
            outcome = self._tools[name](**checked)
        except ToolFailure as failure:
            outcome = ToolOutcome(
                observation=failure.message,
                error=ToolError(kind=failure.kind, message=failure.message, tool=name),
            )
        except (OSError, UnicodeError) as e:  # the file system said no: the model can adapt
            reason = getattr(e, "strerror", None) or str(e)
            message = f"{name} failed: {reason}."
            outcome = ToolOutcome(
                observation=message,
                error=ToolError(kind="tool_failed", message=message, tool=name),
            )
        if len(outcome.observation) > self.cfg.max_observation_chars:
            outcome.observation = cap_text(outcome.observation, self.cfg.max_observation_chars)
        return outcome

    def _timeout(self, limit: float, time_left: float | None) -> float:
        timeout = limit if time_left is None else min(limit, time_left)
        return max(timeout, 0.1)

    # ------------------------------------------------------------ file tools

    def list_files(self, path: str = ".", max_depth: int = 2) -> ToolOutcome:
        start, rel = self.paths.resolve(path)
        if not start.exists():
            raise ToolFailure("tool_failed", f"No such directory: '{rel}'.")
        if not start.is_dir():
            return ToolOutcome(observation=self.paths.relative(start))
        entries: list[str] = []
        limit = self.cfg.list_max_entries
        cut = self._walk(start, max_depth, entries, limit)
        if not entries:
            return ToolOutcome(observation=f"'{rel}' is an empty directory.")
        if cut:
            entries.append(
                f"[listing cut at {limit} entries; list a subdirectory or use a smaller max_depth]"
            )
        return ToolOutcome(observation="\n".join(entries))

    def _walk(self, directory: Path, depth: int, out: list[str], limit: int) -> bool:
        """Depth-first, name-ordered entries under ``directory``; True when cut at ``limit``."""
        with os.scandir(directory) as it:
            children = sorted(it, key=lambda e: e.name)
        for entry in children:
            rel = self.paths.relative(Path(entry.path))
            if self.paths.is_hidden(rel):
                continue
            if len(out) >= limit:
                return True
            if entry.is_symlink():
                out.append(f"{rel} -> {os.readlink(entry.path)}")
            elif entry.is_dir(follow_symlinks=False):
                out.append(rel + "/")
                if depth > 1 and self._walk(Path(entry.path), depth - 1, out, limit):
                    return True
            else:
                out.append(rel)
        return False

    def _read_text(self, path: Path, rel: str) -> str:
        st = regular_file(path, rel)
        if st.st_size > self.cfg.read_max_file_bytes:
            raise ToolFailure(
                "tool_failed",
                f"'{rel}' is {st.st_size} bytes, more than the {self.cfg.read_max_file_bytes} "
                "bytes this tool opens; use bash (head, sed -n) to look at parts of it.",
            )
        data = read_regular(path, self.cfg.read_max_file_bytes)
        if data is None:  # swapped for something else since the check
            raise ToolFailure("tool_failed", f"'{rel}' is not a regular file.")
        if b"\0" in data:
            raise ToolFailure(
                "tool_failed", f"'{rel}' is a binary file ({len(data)} bytes); it holds no text."
            )
        return data.decode("utf-8", "replace")

    def read_file(
        self, path: str, start_line: int | None = None, end_line: int | None = None
    ) -> ToolOutcome:
        real, rel = self.paths.resolve(path)
        lines = split_lines(self._read_text(real, rel))
        total = len(lines)
        if total == 0:
            return ToolOutcome(observation=f"{rel} (empty file)")
        first = start_line or 1
        last = min(end_line or total, total)
        if first > total:
            raise ToolFailure(
                "tool_failed", f"start_line {first} is past the end of '{rel}' ({total} lines)."
            )
        if end_line is not None and end_line < first:
            raise ToolFailure("tool_failed", f"end_line {end_line} is before start_line {first}.")
        shown: list[str] = []
        chars = 0
        for number in range(first, last + 1):
            line = f"{number:6d}\t{lines[number - 1]}"
            if shown and (
                len(shown) >= self.cfg.read_max_lines or chars + len(line) > self.cfg.read_max_chars
            ):
                break
            shown.append(line)
            chars += len(line) + 1
        shown_last = first + len(shown) - 1
        header = f"{rel} (lines {first}-{shown_last} of {total})"
        body = "\n".join([header, *shown])
        if shown_last < last:
            body += (
                f"\n[output cut after line {shown_last}; call read_file with "
                f"start_line={shown_last + 1} to read on]"
            )
        return ToolOutcome(observation=body)

    def _write(self, real: Path, rel: str, content: str) -> int:
        data = content.encode("utf-8", "surrogatepass")
        if len(data) > self.cfg.write_max_bytes:
            raise ToolFailure(
                "tool_failed",
                f"Content for '{rel}' is {len(data)} bytes, over the {self.cfg.write_max_bytes} "
                "byte limit of one write.",
            )
        if real.is_dir():
            raise ToolFailure("tool_failed", f"'{rel}' is a directory; give a file path.")
        real.parent.mkdir(parents=True, exist_ok=True)
        # no final symlink, no blocking: a FIFO (or device) in the file's place is refused
        # before a byte is written, instead of hanging this thread until a reader comes
        try:
            fd = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            if e.errno in (errno.ENXIO, errno.ELOOP):
                raise ToolFailure("tool_failed", f"'{rel}' is not a regular file.") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ToolFailure("tool_failed", f"'{rel}' is not a regular file.")
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        return len(data)

    def write_file(self, path: str, content: str) -> ToolOutcome:
        real, rel = self.paths.resolve(path)
        if rel == "." or path.endswith("/"):
            raise ToolFailure("tool_failed", f"'{path}' names a directory; give a file path.")
        existed = real.exists()
        size = self._write(real, rel, content)
        verb = "Overwrote" if existed else "Created"
        return ToolOutcome(
            observation=f"{verb} {rel} ({size} bytes, {len(split_lines(content))} lines)."
        )

    def replace_in_file(self, path: str, old: str, new: str) -> ToolOutcome:
        real, rel = self.paths.resolve(path)
        content = self._read_text(real, rel)
        positions: list[int] = []
        at = content.find(old)
        while at != -1 and len(positions) < 1000:
            positions.append(at)
            at = content.find(old, at + 1)
        if not positions:
            raise ToolFailure(
                "tool_failed",
                f"No match: `old` occurs 0 times in '{rel}'. It must match the file exactly, "
                "indentation and line breaks included; read the file and copy the text.",
            )
        if len(positions) > 1:
            line_numbers = [content.count("\n", 0, p) + 1 for p in positions[:10]]
            more = ", ..." if len(positions) > 10 else ""
            raise ToolFailure(
                "tool_failed",
                f"Ambiguous: `old` occurs {len(positions)} times in '{rel}' (starting on lines "
                f"{', '.join(map(str, line_numbers))}{more}); nothing was replaced. Include more "
                "surrounding lines so that it occurs exactly once.",
            )
        at = positions[0]
        self._write(real, rel, content[:at] + new + content[at + len(old) :])
        first = content.count("\n", 0, at) + 1
        old_lines = old.count("\n") + 1
        new_lines = new.count("\n") + 1
        return ToolOutcome(
            observation=(
                f"Replaced lines {first}-{first + old_lines - 1} of {rel} with {new_lines} "
                f"line{'s' if new_lines != 1 else ''}."
            )
        )

    # ------------------------------------------------------------ sandboxed tools

    def search(self, pattern: str, path: str = ".", time_left: float | None = None) -> ToolOutcome:
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError, ValueError) as e:
            raise ToolFailure(
                "bad_arguments",
                f"Bad arguments for search: argument 'pattern' is not a valid Python regular "
                f"expression ({e}). Parameters schema: {json.dumps(SCHEMA_BY_NAME['search'])}",
            ) from None
        real, rel = self.paths.resolve(path)
        if not real.exists():
            raise ToolFailure("tool_failed", f"No such file or directory: '{rel}'.")
        request = {
            "pattern": pattern,
            "start": self.paths.relative(real) if real != self.paths.root else ".",
            "hidden": list(self.paths.hidden),
            "max_results": self.cfg.search_max_results,
            "max_file_bytes": self.cfg.search_max_file_bytes,
            "line_chars": self.cfg.line_max_chars,
        }
        timeout = self._timeout(self.cfg.search_timeout_s, time_left)
        result = self.sandbox.run(
            [sys.executable, "-I", "-c", _SEARCH_SCRIPT],
            self.paths.root,
            timeout=timeout,
            stdin=json.dumps(request),
        )
        if result.timed_out:
            raise ToolFailure(
                "tool_failed",
                f"search timed out after {timeout:.0f} s; use a simpler pattern or a narrower path.",
            )
        try:
            found = json.loads(result.stdout)
        except json.JSONDecodeError:
            found = None
        if result.exit_code != 0 or not isinstance(found, dict):
            raise ToolFailure(
                "tool_failed",
                f"search failed (exit code {result.exit_code}): {result.stderr.strip()[-500:]}",
            )
        matches = found["matches"]
        if not matches:
            return ToolOutcome(observation=f"No matches for /{pattern}/ in '{rel}'.")
        lines = list(matches)
        if found["more"]:
            lines.append(
                f"[only the first {len(matches)} matches are shown; narrow the pattern or path]"
            )
        return ToolOutcome(observation="\n".join(lines))

    def run_tests(
        self, tests: list[str] | None = None, time_left: float | None = None
    ) -> ToolOutcome:
        if tests is None:
            ids = list(self.test_ids)
        else:
            ids = []
            for test_id in tests:
                if test_id.startswith("-"):
                    raise ToolFailure(
                        "bad_arguments",
                        f"Bad arguments for run_tests: '{test_id}' is an option, not a test id; "
                        "give node ids such as tests/test_x.py::test_y. Parameters schema: "
                        f"{json.dumps(SCHEMA_BY_NAME['run_tests'])}",
                    )
                self.paths.resolve(test_id.split("::", 1)[0])
                if test_id not in ids:
                    ids.append(test_id)
        timeout = self._timeout(self.cfg.test_timeout_s, time_left)
        if self._grader is None:
            self._grader = grading_sandbox(self.sandbox.config)
        if self.pristine is not None:
            pristine, final = self.pristine, self.paths.root
        else:
            pristine, final = self.paths.root, None
        run = grade(
            pristine,
            final,
            self.allowed,
            ids,
            self.test_env,
            self.pytest_args,
            sandbox=self._grader,
            timeout=timeout,
            work_dir=self.work_dir,
            exclude=self.paths.hidden,
        )
        results = dict(run.outcomes)
        for test_id in run.failed_ids:  # asked for and never reported: it did not pass
            group = test_id.rstrip("/")
            if not any(i == test_id or i.startswith((group + "::", group + "/")) for i in results):
                results[test_id] = "error"
        counts: dict[str, int] = {}
        for outcome in results.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        summary = ", ".join(f"{counts[o]} {o}" for o in _SUMMARY_ORDER if o in counts)
        if run.status == "passed":
            return ToolOutcome(
                observation=f"pytest: all {len(run.passed_ids)} passed ({run.seconds:.1f} s)."
            )
        if run.timed_out:
            head = f"pytest timed out after {timeout:.0f} s and was killed."
        elif run.status == "error":
            head = (
                f"pytest could not collect or run the tests ({run.reason}); none of them "
                "counts as passed."
            )
        elif run.status == "infra":
            head = f"the tests could not be run here ({run.reason}); try again."
        else:
            head = f"pytest: {summary} ({run.seconds:.1f} s)."
        if self.pristine is not None:
            head += (
                " (Graded like the final reward: only your changes to the package source count; "
                "edits to tests or configuration are ignored.)"
            )
        not_passed = [f"  {o} {i}" for i, o in sorted(results.items()) if o != "passed"]
        parts = [head]
        if not_passed:
            shown = not_passed[:30]
            if len(not_passed) > len(shown):
                shown.append(f"  ... and {len(not_passed) - len(shown)} more")
            parts.append("Not passed:\n" + "\n".join(shown))
        tail = run.output[-self.cfg.test_output_chars :].strip()
        if tail:
            parts.append("--- pytest output (tail) ---\n" + tail)
        return ToolOutcome(observation="\n".join(parts))

    def bash(self, command: str, time_left: float | None = None) -> ToolOutcome:
        timeout = self._timeout(self.cfg.bash_timeout_s, time_left)
        result = self.sandbox.run(command, self.paths.root, timeout=timeout)
        if result.timed_out:
            head = f"timed out after {timeout:.0f} s; the command was killed"
        else:
            head = f"exit code: {result.exit_code}"
        parts = [head]
        if result.stdout:
            parts.append("--- stdout ---\n" + result.stdout.rstrip("\n"))
        if result.stderr:
            parts.append("--- stderr ---\n" + result.stderr.rstrip("\n"))
        if not result.stdout and not result.stderr:
            parts.append("(no output)")
        prov = result.provenance.to_json() if result.provenance is not None else None
        return ToolOutcome(observation="\n".join(parts), provenance=prov)

    def submit(self) -> ToolOutcome:
        return ToolOutcome(
            observation="Submitted. The episode is over; your work will be tested.",
            submitted=True,
        )
