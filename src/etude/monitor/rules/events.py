"""Events: a trajectory cut into the pieces rules read (calls, paths, shell, scripts, code, output).

See the package docstring for the target kinds. Shell parsing here is a best effort over text
(segments split outside quotes, ``sh -c`` bodies, here-documents, ``python -c``); what a command
really did is in its provenance (``etude.sandbox.provenance``), cut into ``prov_*`` events here.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from etude.env.trajectory import ToolCall, Trajectory
from etude.monitor.rules.base import LIBRARY_PY, TESTS_PATH, _compile
from etude.sandbox.provenance import Provenance


@dataclass(slots=True)
class Event:
    """One thing a rule can look at, with the turn it came from."""

    turn: int
    target: str
    text: str
    tool: str = ""
    paths: tuple[str, ...] = ()
    call: ToolCall | None = None
    """For observations: the call that produced them (None when it cannot be paired)."""
    programs: tuple[str, ...] = ()
    """For provenance events: the programs the call ran (``process_names``)."""
    call_reads: frozenset[str] = frozenset()
    """For provenance events: every file the same call read."""
    call_lists: frozenset[str] = frozenset()
    """For provenance events: every directory the same call listed."""


_PATH_KEYS = ("path", "file", "file_path", "filename", "dir", "directory")
_PATH_TOKEN = re.compile(r"[^\s'\"<>|;&()=,`{}\[\]]+")
_HEREDOC = re.compile(r"<<-?\s*['\"]?([A-Za-z_]\w*)['\"]?")
_PY_C = re.compile(
    r"\bpython[\d.]*\s+(?:-[A-Za-z]+\s+)*-c\s*(?:\"((?:[^\"\\]|\\.)*)\"|'([^']*)')", re.S
)
_PY_HEREDOC = re.compile(r"\bpython[\d.]*\s+(?:-[A-Za-z]+\s+)*(?:-\s+)?<<")
_REDIRECT = re.compile(r"(?:^|[^<>&\d-])(?:&)?>{1,2}\s*([^\s;&|<>()]+)")
_WRITE_CMDS = (
    re.compile(r"\btee\s+(?:-a\s+)?([^\s;&|<>]+)"),
    re.compile(
        r"\bsed\s+(?:-[^i\s]\S*\s+)*-i\S*\s+(?:-e\s+)?(?:'[^']*'|\"[^\"]*\"|\S+)\s+([^\s;&|<>]+)"
    ),
    re.compile(r"\bperl\s+-\w*i\w*\s+(?:-e\s+)?(?:'[^']*'|\"[^\"]*\")\s+([^\s;&|<>]+)"),
    re.compile(r"\b(?:cp|mv)\s+(?:-\w+\s+)*\S+\s+([^\s;&|<>]+)\s*$"),
    re.compile(r"\bopen\(\s*['\"]([^'\"]+)['\"]\s*,\s*['\"][wax]"),
    re.compile(r"\bPath\(\s*['\"]([^'\"]+)['\"]\s*\)\.write_(?:text|bytes)\("),
)


def normalize_path(path: str) -> str:
    """``./a//b/`` -> ``a/b``; absolute paths stay absolute."""
    path = path.strip().strip("'\"")
    path = re.sub(r"/{2,}", "/", path)
    while path.startswith("./"):
        path = path[2:]
    if len(path) > 1:
        path = path.rstrip("/")
    return path


def shell_lines(command: str) -> list[tuple[str, bool]]:
    """Lines of a shell command, each marked True when it is a here-document body line."""
    out, terminator = [], None
    for line in command.split("\n"):
        if terminator is not None:
            if line.strip() == terminator:
                terminator = None
                out.append((line, True))
                continue
            out.append((line, True))
            continue
        out.append((line, False))
        m = _HEREDOC.search(line)
        if m:
            terminator = m.group(1)
    return out


_SHELL_SPECIAL = set("|;&()<>`")
_NESTED_SHELL = re.compile(
    r"\b(?:ba|z|da)?sh\s+(?:-\w+\s+)*-c\s+(?:'([^']*)'|\"((?:[^\"\\]|\\.)*)\")"
)


def split_segments(command: str) -> list[str]:
    """Shell commands of ``command`` outside here-document bodies, split outside quotes.

    Shell operators inside quotes or escaped (``grep "a|curl"``, ``-exec ... \\;``) are masked
    with spaces, so patterns anchored at a command start see only real commands; ``$(...)``
    inside double quotes stays live. The bodies of ``sh -c '...'`` are split as segments too.
    """
    segments: list[str] = []
    for line, is_body in shell_lines(command):
        if is_body:
            continue
        buf, quote, i = [], None, 0
        while i < len(line):
            ch = line[i]
            if ch == "\\" and quote != "'" and i + 1 < len(line):
                nxt = line[i + 1]
                buf.append("\\" + (" " if nxt in _SHELL_SPECIAL else nxt))
                i += 2
                continue
            if quote:
                if quote == '"' and line.startswith("$(", i):
                    buf.append("$(")
                    i += 2
                    continue
                if ch == quote:
                    quote = None
                buf.append(" " if ch in _SHELL_SPECIAL else ch)
                i += 1
                continue
            if ch in "'\"":
                quote = ch
            elif ch == ";" or line.startswith(("&&", "||"), i):
                segments.append("".join(buf))
                buf = []
                i += 1 if ch == ";" else 2
                continue
            buf.append(ch)
            i += 1
        segments.append("".join(buf))
        for m in _NESTED_SHELL.finditer(line):
            segments += split_segments(m.group(1) or m.group(2))
    return [s.strip() for s in segments if s.strip()]


def python_scripts(command: str) -> list[str]:
    """Python source run by ``command``: ``python -c`` strings and heredoc bodies fed to python."""
    scripts = [a or b for a, b in _PY_C.findall(command)]
    lines = shell_lines(command)
    i = 0
    while i < len(lines):
        line, is_body = lines[i]
        i += 1
        if is_body or not _PY_HEREDOC.search(line):
            continue
        m = _HEREDOC.search(line)
        body = []
        while i < len(lines) and lines[i][1]:
            body.append(lines[i][0])
            i += 1
        if body and m and body[-1].strip() == m.group(1):
            body.pop()
        scripts.append("\n".join(body))
    return [s for s in scripts if s.strip()]


def path_tokens(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(normalize_path(t) for t in _PATH_TOKEN.findall(text)))


def shell_write_targets(command: str) -> tuple[str, ...]:
    """Files a shell command writes: redirections, ``tee``, ``sed -i``, ``cp``/``mv`` targets..."""
    targets = []
    for segment in split_segments(command):
        # strip quoted strings so that `echo "a > b"` is not a redirection
        bare = re.sub(r"'[^']*'|\"(?:[^\"\\]|\\.)*\"", "''", segment)
        targets += _REDIRECT.findall(bare)
        targets += [m for rx in _WRITE_CMDS[:4] for m in rx.findall(segment)]
    targets += [m for rx in _WRITE_CMDS[4:] for m in rx.findall(command)]
    out = [normalize_path(t) for t in targets]
    return tuple(dict.fromkeys(t for t in out if t and not t.startswith("/dev/") and t != "&1"))


def extract_events(traj: Trajectory, packages: tuple[str, ...] = ()) -> list[Event]:
    """All events of a trajectory in conversation order.

    Python written to a file outside the library (``LIBRARY_PY``) and the tests is a scratch
    script the agent means to run: it is also emitted as a ``script`` event.
    """
    library, tests = _compile(LIBRARY_PY, packages), _compile(TESTS_PATH, ())
    events: list[Event] = []
    pending: list[ToolCall] = []
    for i, turn in enumerate(traj.turns):
        if turn.role == "assistant":
            pending = list(turn.tool_calls)
            for call in turn.tool_calls:
                for ev in _call_events(i, call):
                    events.append(ev)
                    p = ev.paths[0] if ev.target == "code" else ""
                    if p.endswith(".py") and not library.search(p) and not tests.search(p):
                        events.append(Event(i, "script", ev.text, ev.tool, path_tokens(ev.text)))
        elif turn.role == "tool":
            # one tool message per <tool_call> segment, but only parsed calls are in tool_calls:
            # the answer to a malformed segment (no tool name) pairs with no call
            call = pending.pop(0) if pending and turn.tool_name == pending[0].name else None
            paths = _call_paths(call) if call else ()
            events.append(Event(i, "observation", turn.text, turn.tool_name or "", paths, call))
            if turn.provenance is not None:
                events += provenance_events(i, turn.tool_name or "", turn.provenance)
    return events


_PROV_LISTS = (
    ("read", "prov_read"),
    ("listed", "prov_list"),
    ("written", "prov_write"),
    ("deleted", "prov_delete"),
    ("failed", "prov_failed"),
)
# git options that take a separate value (``git -C dir log``); the rest stand alone
_GIT_VALUE_OPTS = frozenset(
    ["-C", "-c", "--git-dir", "--work-tree", "--namespace", "--config-env", "--super-prefix"]
    + ["--exec-path", "--list-cmds", "--attr-source"]
)
_SHELLS = frozenset(["sh", "bash", "dash", "zsh", "ksh", "busybox"])
# the dynamic loader run as a program (``ld-linux-x86-64.so.2 [OPTIONS] PROGRAM ARGS``) runs
# PROGRAM without an execve of it: the rules read PROGRAM
_LOADER = re.compile(r"^ld(?:-linux[\w-]*|-musl[\w-]*|64)?\.so(?:\.\d+)*$")
_LOADER_VALUE_OPTS = frozenset(
    ["--library-path", "--inhibit-rpath", "--audit", "--preload", "--argv0"]
    + ["--glibc-hwcaps-prepend", "--glibc-hwcaps-mask"]
)


def program_argv(argv: Sequence[str]) -> Sequence[str]:
    """``argv`` of the program that ran: for the dynamic loader run as a program, the program
    it was given (its options skipped); else ``argv`` itself."""
    if argv and _LOADER.match(posixpath.basename(argv[0])):
        i = 1
        while i < len(argv) and argv[i].startswith("--"):
            i += 2 if argv[i] in _LOADER_VALUE_OPTS else 1
        if i < len(argv):
            return argv[i:]
    return argv


def normalize_argv(argv: Sequence[str]) -> str:
    """One line for a started program: ``argv[0]``'s base name, then the arguments.

    The dynamic loader run as a program counts as the program it runs (``program_argv``).
    ``git``'s global options (``-C dir``, ``-c k=v``, ``--no-pager``, ``-P``...) are dropped so
    that the subcommand follows ``git`` directly, however the call was spelled.
    """
    argv = program_argv(argv)
    if not argv:
        return ""
    name, args = posixpath.basename(argv[0]), list(argv[1:])
    if name == "git":
        i = 0
        while i < len(args) and args[i].startswith("-"):
            i += 2 if args[i] in _GIT_VALUE_OPTS else 1
        args = args[i:]
    # plain spaces, not shell quoting: rules match HEAD~1 as written, not 'HEAD~1'
    return " ".join([name, *args])


def process_names(processes: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """Program names of a call's processes; ``python -m X`` also counts as ``X``."""
    names: dict[str, None] = {}
    for argv in map(program_argv, processes):
        if not argv:
            continue
        name = posixpath.basename(argv[0])
        names[name] = None
        if re.match(r"python[\d.]*$", name):
            for a, b in zip(argv, argv[1:]):
                if a == "-m":
                    names[b.split(".", 1)[0]] = None
                    break
    return tuple(names)


def provenance_events(turn: int, tool: str, record: dict[str, Any]) -> list[Event]:
    """``prov_*`` and ``process`` events of one tool result's provenance record."""
    prov = Provenance.from_json(record)
    programs = process_names(prov.processes)
    reads, lists = frozenset(prov.read), frozenset(prov.listed)
    out = []
    for name, target in _PROV_LISTS:
        for path in getattr(prov, name):
            ev = Event(turn, target, path, tool, (path,), programs=programs, call_reads=reads)
            ev.call_lists = lists
            out.append(ev)
    for d in prov.runtime_dirs:
        out.append(Event(turn, "prov_runtime", d, tool, (d,), programs=programs))
    for argv in prov.processes:
        if argv and posixpath.basename(argv[0]) not in _SHELLS:
            out.append(Event(turn, "process", normalize_argv(argv), tool, (), programs=programs))
    if prov.overflow:  # the kernel dropped events: the command did more than is recorded
        out.append(Event(turn, "prov_lost", "overflow", tool, (), programs=programs))
    return out


def _call_paths(call: ToolCall) -> tuple[str, ...]:
    args = call.arguments if isinstance(call.arguments, dict) else {}
    paths = tuple(normalize_path(args[k]) for k in _PATH_KEYS if isinstance(args.get(k), str))
    if call.name == "bash" and isinstance(args.get("command"), str):
        paths += path_tokens(args["command"])
    return paths


def _call_events(i: int, call: ToolCall) -> list[Event]:
    name = call.name
    args = call.arguments if isinstance(call.arguments, dict) else {}
    out = [Event(i, "tool", name, name)]
    paths = [normalize_path(args[k]) for k in _PATH_KEYS if isinstance(args.get(k), str)]
    for p in paths:
        out.append(Event(i, "path", p, name, (p,)))
    written = None
    if isinstance(args.get("content"), str):
        written = args["content"]
    elif isinstance(args.get("new"), str):
        written = args["new"]
    if written is not None and paths:
        out.append(Event(i, "code", written, name, (paths[0],)))
    command = args.get("command") if isinstance(args.get("command"), str) else None
    if command is not None:
        out.append(Event(i, "command", command, name, path_tokens(command)))
        for segment in split_segments(command):
            out.append(Event(i, "segment", segment, name, path_tokens(segment)))
        for script in python_scripts(command):
            out.append(Event(i, "script", script, name, path_tokens(script)))
        for target in shell_write_targets(command):
            out.append(Event(i, "code", command, name, (target,)))
    return out
