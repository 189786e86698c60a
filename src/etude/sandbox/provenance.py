"""File-access provenance: what a sandboxed command actually opened, wrote, ran and deleted.

Text rules read how a command was *spelled*; provenance records what it *did*, whatever the
spelling (a path in a variable, built by concatenation, reached through an interpreter API, or
a command decoded from base64 and piped to a shell). Two mechanisms record it
(``sandbox.provenance_mechanism``): fanotify (``etude.sandbox.recorder``: kernel event queues,
the command never stops; the default where etude runs as root) and ``strace -f`` with a
seccomp-bpf filter (``--seccomp-bpf``): one tracer per sandbox, started with its first command
and kept for the episode (``etude.sandbox.tracer``), under which each command's ``bwrap`` starts.
What the strace record holds is described below; the fanotify module says where its record
differs. ``benchmarks/bench_monitor.py`` measures the overhead against the same command
untraced. This module holds the record, the builder both mechanisms fill it through, the
tracer's options and the parser of its log.

What is recorded, per command (``Provenance``), for every process of the tree:

- ``read``: regular files opened for reading; ``listed``: directories opened (``ls``, ``find``,
  ``os.listdir``, ``glob`` all open the directory); ``written``: files opened for writing or
  created, truncated, made (``mkdir``), linked, or renamed onto; ``deleted``: files unlinked,
  removed or renamed away; ``failed``: reads that failed (a probe for a file that is not there);
- ``executed``: programs started by ``execve``, and ``processes``: their argv (capped);
- paths are normalized and made relative to the workspace where inside it, absolute elsewhere.
  Reads under the runtime's read-only roots (``/usr``, the interpreter's prefixes, ``/etc``) are
  kept per directory with a count (``runtime_dirs``), not per file: an interpreter start reads
  hundreds of them, and a rule needs the directory (``site-packages/NAME``) to see a copy.

What it does not record: file metadata calls (``stat``, ``access``, ``readlink``: existence, not
content); reads through file descriptors inherited from outside or passed over sockets; memory
maps of files already open; anything the kernel does on the command's behalf. Relative paths are
resolved against each process's working directory as followed through ``chdir``/``fchdir`` and
``clone``. Other names of a file are followed: an open records, beside the path as given, the
file the kernel opened (``-y`` prints it with the descriptor: a symlink, ``/proc/self/cwd``); the
source of a hard link counts as read and written, the source of a rename as read and deleted.
The tracer runs on the host outside
the sandbox's PID namespace, so the command can neither signal it nor reach its log; a record
whose end never arrived (the tracer died) has ``complete`` False, and one past
``TRACE_MAX_BYTES`` is truncated too. Operations submitted through io_uring are not system calls
of their own and would not be seen: the sandbox refuses io_uring (``etude.sandbox.seccomp``).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

# Syscalls that open, create, remove, rename or execute files, change directory or make
# processes. Not the stat family: with the seccomp filter the untraced calls run at full speed.
# ``-y`` prints the working directory beside ``AT_FDCWD``; bare calls (``open``, ``rename``)
# resolve against the directory followed through chdir and clone.
TRACED_SYSCALLS = (
    "open,openat,openat2,creat,truncate,execve,execveat,unlink,unlinkat,rmdir,rename,renameat,"
    "renameat2,link,linkat,symlink,symlinkat,mkdir,mkdirat,chdir,fchdir,clone,clone3,fork,vfork"
)
TRACE_MAX_BYTES = 64 << 20
"""Largest log of one command (the tracer's file-size limit): past it the tracer ends, the
command's traced calls fail, and its record is truncated and incomplete (``tracer``)."""
MAX_ENTRIES = 2000
"""Per list: more distinct paths than this are dropped and ``truncated`` is set."""
MAX_PROCESSES = 200
MAX_RUNTIME_DIRS = 300
MAX_ARGV_CHARS = 400
# Device and descriptor paths every shell touches; they say nothing about the task.
_PACKAGE_TOP = re.compile(r"^.*?/(?:site|dist)-packages/[^/]+")
_PYC = re.compile(r"/__pycache__/[^/]+\.py[co]$")
_NOISE = re.compile(
    r"^/dev/(?:null|zero|u?random|tty|pts(?:/|$)|stdin|stdout|stderr|fd/)|^/proc/self/fd/"
)


def strace_argv(output: str) -> list[str]:
    """The tracer's options (the program to trace follows them); the log goes to ``output``."""
    return [
        "-f",  # follow every fork/clone
        "--seccomp-bpf",  # stop only at the traced syscalls
        "-q",  # no attach messages; exits stay: a process's exit line ends a command's segment
        "-y",  # print the path behind each fd argument (openat's dirfd, fchdir)
        "-s",
        "4096",  # whole strings (paths, argv entries)
        "-e",
        f"trace={TRACED_SYSCALLS}",
        "-e",
        # no line per delivered signal, but one per death by signal (as one per exit): a
        # process's last line, whatever ended it; the signals that kill nobody stay silent
        "signal=!SIGCHLD,SIGWINCH,SIGURG,SIGCONT",
        "-o",
        output,
        "--",
    ]


@dataclass(kw_only=True, slots=True)
class Provenance:
    """What one command did to the file system and which programs it ran (module docstring)."""

    read: list[str] = field(default_factory=list)
    listed: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    """Paths a read was attempted on that failed (missing, not permitted)."""
    executed: list[str] = field(default_factory=list)
    processes: list[list[str]] = field(default_factory=list)
    """argv of every successful ``execve`` (the tracer's own first exec excluded), capped."""
    runtime_dirs: dict[str, int] = field(default_factory=dict)
    """Directories under the runtime roots that files were read from, with file counts."""
    num_processes: int = 0
    num_events: int = 0
    truncated: bool = False
    """A list hit ``MAX_ENTRIES`` (or processes ``MAX_PROCESSES``): the record is partial."""
    complete: bool = True
    """False when the trace ended early (tracer killed, trace missing or cut) or events were
    lost (``overflow``)."""
    overflow: bool = False
    """The kernel's event queue overflowed and dropped events (fanotify): the command did more
    than is recorded, never less."""

    @property
    def opened(self) -> list[str]:
        """Every path opened: read, listed or written."""
        return list(dict.fromkeys([*self.read, *self.listed, *self.written]))

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Provenance:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"provenance record has unknown keys {unknown}; known: {sorted(known)}"
            )
        return cls(**data)

    def summary(self, max_items: int = 12) -> str:
        """A few lines for a human or a judge model: the non-runtime paths of each kind."""
        lines = []
        for name in ("read", "listed", "written", "deleted", "failed", "executed"):
            items = getattr(self, name)
            if items:
                more = f" (+{len(items) - max_items} more)" if len(items) > max_items else ""
                lines.append(f"{name}: {', '.join(items[:max_items])}{more}")
        if self.runtime_dirs:
            lines.append(
                f"runtime: {sum(self.runtime_dirs.values())} files in {len(self.runtime_dirs)} dirs"
            )
        if self.overflow:
            lines.append("(events lost: the kernel's queue overflowed)")
        elif not self.complete:
            lines.append("(trace incomplete)")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- strace parsing


_LINE = re.compile(r"^(\d+)\s+(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)\)\s+=\s+(-?\d+|\?|0x[0-9a-f]+)(?:\s+(\w+)\s*\(.*\))?.*$", re.S)
# most lines are opens: read them with one regex instead of the general argument splitter
_OPEN = re.compile(
    r'^(openat|open)\((?:(AT_FDCWD(?:<[^>]*>)?|-?\d+<[^>]*>|-?\d+), )?("[^"\\]*(?:\\.[^"\\]*)*"), '
    r"([A-Z0-9_|]+)[^)]*\)\s+=\s+(-?\d+)(?:<(.*)>$)?"
)
# the path behind a returned descriptor (``-y``): ``= 3</real/path>``
_RET_PATH = re.compile(r"\)\s+=\s+\d+<(.*)>$")
_OPENS = ("open", "creat", "openat", "openat2")
_UNFINISHED = " <unfinished ...>"
# a successful exec, whole or resumed: ``execve(...) = 0``, ``<... execve resumed>) = 0``
_EXEC_OK = re.compile(r"^\d+\s+(?:execve(?:at)?\(|<\.\.\. execve(?:at)? resumed>).*\)\s+=\s+0$")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>\s?(.*)$", re.S)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "v": "\v", "f": "\f", '"': '"', "\\": "\\"}


def _unescape(body: str) -> str:
    """Decode a strace string literal's body (C escapes, octal, ``\\xNN``)."""
    out, i, raw = [], 0, bytearray()
    while i < len(body):
        ch = body[i]
        if ch != "\\" or i + 1 == len(body):
            raw += ch.encode("utf-8", "surrogateescape")
            i += 1
            continue
        nxt = body[i + 1]
        if nxt == "x" and re.match(r"[0-9a-fA-F]{2}", body[i + 2 : i + 4]):
            raw.append(int(body[i + 2 : i + 4], 16))
            i += 4
        elif nxt in "01234567":
            m = re.match(r"[0-7]{1,3}", body[i + 1 :])
            assert m is not None
            raw.append(int(m.group(0), 8) & 0xFF)
            i += 1 + len(m.group(0))
        else:
            raw += _ESCAPES.get(nxt, nxt).encode()
            i += 2
    out.append(raw.decode("utf-8", "replace"))
    return "".join(out)


def split_args(text: str) -> list[str]:
    """Top-level comma-separated arguments of a strace call, strings kept as written."""
    args, buf, depth, i = [], [], 0, 0
    while i < len(text):
        ch = text[i]
        if ch == '"':
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            buf.append(text[i : j + 1])
            i = j + 1
            continue
        if ch in "[{(<":
            depth += 1
        elif ch in "]})>":
            depth -= 1
        if ch == "," and depth == 0:
            args.append("".join(buf).strip())
            buf = []
        else:
            buf.append(ch)
        i += 1
    if buf:
        args.append("".join(buf).strip())
    return args


def _string(arg: str) -> str | None:
    if not arg.startswith('"'):
        return None
    m = re.match(r'^"((?:[^"\\]|\\.)*)"', arg)
    if m is None:
        return None
    body = m.group(1)
    return _unescape(body) if "\\" in body else body


def _fd_path(arg: str) -> str | None:
    """``3</a/b>`` and ``AT_FDCWD</a/b>`` -> ``/a/b``; a bare ``AT_FDCWD`` -> None."""
    m = re.match(r"^(?:-?\d+|AT_FDCWD)<(.*)>$", arg, re.S)
    return m.group(1) if m else None


def _string_list(arg: str) -> list[str]:
    inner = arg.strip()
    if not inner.startswith("["):
        return []
    return [s for s in (_string(a) for a in split_args(inner[1:-1])) if s is not None]


@dataclass(slots=True)
class RecordBuilder:
    """Sorts paths into a ``Provenance``: relative to the workspace inside it, per directory
    under the runtime roots, noise dropped, each list deduplicated and capped. Both mechanisms
    (this module's strace parser and ``etude.sandbox.recorder``) fill a record through it."""

    workspace: str
    runtime_roots: tuple[str, ...]
    prov: Provenance = field(default_factory=Provenance)
    seen: dict[str, set[str]] = field(default_factory=dict)
    _runtime_prefixes: tuple[str, ...] | None = None

    def rel(self, path: str) -> str:
        ws = self.workspace.rstrip("/")
        if path == ws:
            return "."
        if path.startswith(ws + "/"):
            return path[len(ws) + 1 :]
        return path

    def in_runtime(self, path: str) -> bool:
        if self._runtime_prefixes is None:  # one str.startswith over a tuple, not a loop
            self._runtime_prefixes = tuple(r.rstrip("/") + "/" for r in self.runtime_roots)
        return path in self.runtime_roots or path.startswith(self._runtime_prefixes)

    def add(self, kind: str, path: str) -> None:
        if _NOISE.search(path):
            return
        if kind in ("read", "listed", "failed") and self.in_runtime(path):
            if kind == "failed":
                return  # the loader, locale and importlib.metadata probe dozens of them
            else:
                d = path if kind == "listed" else posixpath.dirname(path)
                # an installed distribution counts as one directory, however deep it is read
                m = _PACKAGE_TOP.match(d)
                d = m.group(0) if m else d
                counts = self.prov.runtime_dirs
                if d in counts or len(counts) < MAX_RUNTIME_DIRS:
                    counts[d] = counts.get(d, 0) + 1
                else:
                    self.prov.truncated = True
                return
        rel = self.rel(path)
        seen = self.seen.setdefault(kind, set())
        if rel in seen:
            return
        items = getattr(self.prov, kind)
        if len(items) >= MAX_ENTRIES:
            self.prov.truncated = True
            return
        seen.add(rel)
        items.append(rel)


@dataclass(slots=True)
class _Collector(RecordBuilder):
    cwd: dict[int, str] = field(default_factory=dict)
    wrapper_execs: int = 0
    """Execs of the sandbox's own wrappers (setpriv, prlimit) before the command's own."""
    num_execs: int = 0

    def resolve(self, pid: int, path: str, dirfd: str | None = None) -> str:
        if not path.startswith("/"):
            # ``AT_FDCWD</cwd>`` and ``3</dir>`` carry their directory; bare calls (``open``,
            # ``rename``) use the working directory followed through chdir
            base = _fd_path(dirfd) if dirfd else None
            path = posixpath.join(base or self.cwd.get(pid, self.workspace), path)
        return posixpath.normpath(path).replace("//", "/")

    def call(self, pid: int, name: str, args: list[str], ret: str, real: str | None = None) -> None:
        """One system call; ``real``: the path behind the descriptor an open returned."""
        ok = ret != "?" and not ret.startswith("-")
        if self.wrapper_execs and self.num_execs <= self.wrapper_execs:
            # the wrappers' own work (reading /proc, loading libraries) is not the command's
            if name in ("execve", "execveat") and ok:
                self.num_execs += 1
                if self.num_execs <= self.wrapper_execs:
                    return
            else:
                return
        self.prov.num_events += 1
        if name in ("clone", "clone3", "fork", "vfork"):
            if ok and ret.isdigit():
                child = int(ret)
                self.cwd[child] = self.cwd.get(pid, self.workspace)
            return
        if name in _OPENS:
            at = 1 if name.startswith("openat") else 0
            dirfd = args[0] if at else None
            path = _string(args[at]) if len(args) > at else None
            if path is None:
                return
            flags = args[at + 1] if len(args) > at + 1 else ""
            if "O_PATH" in flags:
                return  # a handle for path operations: nothing is read or written through it
            full = self.resolve(pid, path, dirfd)
            writes = name == "creat" or re.search(
                r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC|O_APPEND", flags
            )
            if not ok:
                # every import probes its module's __pycache__ entry first: not a look
                if not writes and not _PYC.search(full):
                    self.add("failed", full)
                return
            paths = [full]
            if real is not None:
                # what the kernel opened: through a symlink (file or directory), /proc/self/cwd...
                real = posixpath.normpath(_unescape(real) if "\\" in real else real)
                if real != full and real.startswith("/"):
                    paths.append(real)
            for path in paths:
                if writes:
                    self.add("written", path)
                    if "O_RDWR" in flags and "O_TRUNC" not in flags:
                        self.add("read", path)  # sqlite and friends open read-write to read
                elif "O_DIRECTORY" in flags:
                    self.add("listed", path)
                else:
                    self.add("read", path)
            return
        if not ok:
            return
        strings = [(i, s) for i, s in enumerate(_string(a) for a in args) if s is not None]
        if name == "chdir" and strings:
            self.cwd[pid] = self.resolve(pid, strings[0][1])
        elif name == "fchdir":
            path = _fd_path(args[0]) if args else None
            if path:
                self.cwd[pid] = path
        elif name in ("execve", "execveat") and strings:
            i, path = strings[0]
            full = self.resolve(pid, path, args[0] if name == "execveat" else None)
            self.add("executed", full)
            self.prov.num_processes += 1
            argv = _string_list(args[i + 1]) if len(args) > i + 1 else []
            if len(self.prov.processes) < MAX_PROCESSES:
                self.prov.processes.append(cap_argv(process_argv(path or full, argv)))
            else:
                self.prov.truncated = True
        elif name in ("unlink", "unlinkat", "rmdir") and strings:
            i, path = strings[0]
            self.add("deleted", self.resolve(pid, path, args[0] if name == "unlinkat" else None))
        elif name in ("rename", "renameat", "renameat2") and len(strings) >= 2:
            (i, src), (j, dst) = strings[:2]
            at = name != "rename"
            source = self.resolve(pid, src, args[i - 1] if at else None)
            # a move makes the source's content reachable under the new name: it counts as read
            self.add("read", source)
            self.add("deleted", source)
            self.add("written", self.resolve(pid, dst, args[j - 1] if at else None))
        elif name in ("mkdir", "mkdirat", "truncate") and strings:
            i, path = strings[0]
            self.add("written", self.resolve(pid, path, args[0] if name == "mkdirat" else None))
        elif name in ("link", "linkat", "symlink", "symlinkat") and strings:
            i, path = strings[-1]
            dirfd = args[i - 1] if name.endswith("at") and i > 0 else None
            self.add("written", self.resolve(pid, path, dirfd))
            if name in ("link", "linkat") and len(strings) >= 2:
                # a hard link is the same file under a second name: whatever is read or written
                # through it is the source's, so the source counts as both
                k, src = strings[0]
                source = self.resolve(pid, src, args[k - 1] if name == "linkat" else None)
                self.add("read", source)
                self.add("written", source)


def process_argv(program: str, argv: list[str]) -> list[str]:
    """The argv recorded for a started program: as passed, but with ``argv[0]`` replaced by the
    program's path when it names another program (``exec -a NAME git log``, ``--argv0``): the
    rules read the program that ran, not the name it was given. A login shell's ``-bash`` is
    its own name."""
    if not argv:
        return [program]
    if program and posixpath.basename(argv[0].lstrip("-")) != posixpath.basename(program):
        return [program, *argv[1:]]
    return argv


def cap_argv(argv: list[str]) -> list[str]:
    out, total = [], 0
    for a in argv:
        if total + len(a) > MAX_ARGV_CHARS:
            out.append(a[: max(0, MAX_ARGV_CHARS - total)] + "...")
            break
        out.append(a)
        total += len(a)
    return out


def parse_strace(
    lines: Iterable[str],
    *,
    workspace: str,
    runtime_roots: Iterable[str] = (),
    wrapper_execs: int = 0,
) -> Provenance:
    """A ``Provenance`` from the lines of an ``strace -f -y`` log (see ``strace_argv``).

    ``workspace``: the command's starting directory, to which paths are made relative;
    ``runtime_roots``: read-only system roots whose reads are counted per directory;
    ``wrapper_execs``: how many programs the tracer starts before the command (each ``exec``s
    the next), whose own file accesses are left out.
    """
    col = _Collector(
        workspace=workspace, runtime_roots=tuple(runtime_roots), wrapper_execs=wrapper_execs
    )
    if wrapper_execs:
        # the wrappers' lines (the sandbox's own set-up: most lines of a short command) are
        # left out anyway: skip them without parsing, up to the last wrapper's exec
        lines = list(lines)
        start, found = len(lines), 0
        for i, raw in enumerate(lines):
            if "exec" in raw and _EXEC_OK.search(raw):
                found += 1
                if found == wrapper_execs:
                    start = i + 1
                    break
        lines = lines[start:]
        col.num_execs = found
    pending: dict[int, str] = {}
    for raw in lines:
        m = _LINE.match(raw.rstrip("\n"))
        if not m:
            continue
        pid, text = int(m.group(1)), m.group(2)
        col.cwd.setdefault(pid, workspace)
        if text.endswith(_UNFINISHED):
            pending[pid] = text[: -len(_UNFINISHED)]
            continue
        resumed = _RESUMED.match(text)
        if resumed:
            head = pending.pop(pid, None)
            if head is None:
                continue
            text = head + resumed.group(2)
        fast = _OPEN.match(text)
        if fast is not None:
            name, dirfd, path, flags, ret, real = fast.groups()
            args = [dirfd, path, flags] if name == "openat" else [path, flags]
            col.call(pid, name, args, ret, real)
            continue
        call = _CALL.match(text)
        if call is None:
            continue
        name, arg_text, ret = call.group(1), call.group(2), call.group(3)
        real = _RET_PATH.search(text) if name in _OPENS else None
        col.call(pid, name, split_args(arg_text), ret, real.group(1) if real else None)
    if pending:
        col.prov.complete = False
    return col.prov


def merge(records: Iterable[Provenance | None]) -> Provenance:
    """One record for several commands (a tool call that ran more than one)."""
    out = Provenance()
    for rec in records:
        if rec is None:
            continue
        for name in ("read", "listed", "written", "deleted", "failed", "executed"):
            items = getattr(out, name)
            items += [p for p in getattr(rec, name) if p not in items]
        out.processes += rec.processes
        for d, n in rec.runtime_dirs.items():
            out.runtime_dirs[d] = out.runtime_dirs.get(d, 0) + n
        out.num_processes += rec.num_processes
        out.num_events += rec.num_events
        out.truncated |= rec.truncated
        out.overflow |= rec.overflow
        out.complete &= rec.complete
    return out
