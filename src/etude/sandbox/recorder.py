"""File-access provenance by fanotify: the kernel queues what a command touched, nothing stops it.

The strace mechanism (``etude.sandbox.tracer``) stops the traced process at every file call and
waits for the tracer to be scheduled; that round trip, about 100 us per call even on an idle
machine, and the tracing of ``bwrap``'s own set-up, made a ``true`` 2.8x slower
(``docs/monitor.md``). Here the kernel appends an event to a queue as the call happens and the
command runs on; the loop that waits for the command's output reads the queues too. Only
program starts are held, for the few microseconds it takes to read their arguments.

How one command is recorded (``FanotifyRecorder``, one per command, through the sandbox's
groups; the kernel interface is ``etude.sandbox.fanotify``):

1. Set-up (``etude.sandbox.gate``): ``bwrap`` waits on its block pipe while marks go on.
2. The byte is written: the command runs. ``run_process_tree`` serves the queues while it
   waits (``watches``): held program starts first, group A at most every ``A_EVERY_S`` (in
   batches), a slice of ``MAX_EVENTS_PER_CALL`` events or ``SLICE_S`` per call so that the
   runner keeps its deadline under a flood: each event's directory handle becomes a
   path as it arrives (``etude.sandbox.dirpaths``: kept right through renames) and the
   event is sorted into the record.
3. After ``bwrap`` exited (the kernel emptied the PID namespace first, so every process of the
   command, detached or not, has ended and queued its last event) the queues are drained,
   within ``DRAIN_BUDGET_S``. A reader the runner's watchdog left behind (stuck past the
   deadline) is not waited for: the record is incomplete (``abandoned``).

What it records (the fields of ``provenance.Provenance``): ``read`` (regular files read or opened
read-only), ``listed`` (directories opened), ``written`` (written, closed after writing,
created, made, linked or renamed onto), ``deleted`` (unlinked, removed, renamed away; a rename's
source also counts as read), ``executed`` and ``processes`` (each program's argv as passed to
``execve``, ``argv[0]`` naming the program that ran), ``runtime_dirs`` (reads under the runtime roots, per directory). An open through a
symlink, ``/proc/self/fd/N`` or a ``/proc/self/cwd`` path is recorded as the file the kernel
opened. A hard link made in the workspace records its source as read and written.

What it does not see, and the strace mechanism does: ``failed`` opens (no file, no event); an
open under ``/proc`` whose file can no longer be opened when the reader gets to it (a
``/proc/self/...`` file of a process that has already exited: ``ls /proc/self/fd``); the path a
command spelled when it differs from the file (a symlink's own name). A process's own
``/proc/PID`` entries are recorded as ``/proc/self`` (the reader may not learn its number in
time). An ``execve`` whose argv another thread of the same process rewrites between the read
here and the kernel's copy is caught at the program's first open in its new image
(``/proc/PID/cmdline`` is the kernel's copy: both argvs are recorded) unless the program opens
nothing or has ended before the reader gets to that open. A statically linked program started
from a file no mark covers (a ``memfd``) holds no open of a marked program or loader: it runs
unrecorded in ``processes`` (its file accesses are recorded as any other's). What neither
sees: ``stat``-family calls, reads through descriptors opened outside the command, io_uring
(refused by the sandbox's seccomp filter), the wrappers ``bwrap`` runs before the command
(left out by both).

Needs: root (``CAP_SYS_ADMIN`` for fanotify, ``CAP_DAC_READ_SEARCH`` for file handles,
``CAP_SYS_PTRACE`` for another process's memory), Linux >= 5.17 (``FAN_RENAME``), x86-64 or
arm64 (the ``execve`` numbers). ``fanotify_unavailable_reason`` says why not.

Overflow: each group's kernel queue holds 16,384 events (identical events merge). A command that
outruns the reader loses events and the kernel says so (``FAN_Q_OVERFLOW``): the record is then
``complete: false`` and ``overflow: true``, never a record of fewer files, and the monitor flags
it (``prov.record_lost``).
"""

from __future__ import annotations

import errno
import functools
import os
import posixpath
import re
import resource
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from etude.sandbox.dirpaths import DirPaths
from etude.sandbox.fanotify import (
    DIRENT_EVENTS,
    FAN_ACCESS,
    FAN_CLOSE_NOWRITE,
    FAN_CLOSE_WRITE,
    FAN_CREATE,
    FAN_DELETE,
    FAN_MODIFY,
    FAN_ONDIR,
    FAN_OPEN,
    FAN_OPEN_EXEC,
    FAN_Q_OVERFLOW,
    FAN_RENAME,
    INFO_DFID_NAME,
    INFO_NEW_DFID_NAME,
    INFO_OLD_DFID_NAME,
    META,
    allow,
    close_later,
    events,
    exec_call,
    info_records,
    read_argv,
)
from etude.sandbox.gate import BLOCK_TIMEOUT_S, Gate, Wrappers, kill, mark_mounts, mark_workspace
from etude.sandbox.provenance import (
    MAX_PROCESSES,
    Provenance,
    RecordBuilder,
    cap_argv,
    process_argv,
)
from etude.sandbox.runner import Leader, Spawner

_PROC_OWN = re.compile(r"^/proc/(?!1(?:/|$))\d+(?=/|$)")
_PROC_THREAD = re.compile(r"^/proc/self/task/\d+(?=/|$)")
READ_BYTES = 1 << 18
MAX_EVENTS_PER_CALL = 1024
SLICE_S = 0.02
"""One call of a queue's reader handles at most ``MAX_EVENTS_PER_CALL`` events and about
``SLICE_S`` seconds of them; the rest of its read waits for the next call, after the runner has
looked at the clock (a flood cannot keep the loop from the command's deadline)."""
A_EVERY_S = 0.002
"""Group A is read at most this often while the command runs: its events wait in the kernel's
queue and come in batches (a read per few events cost more than the events), while held program
starts (group B) and ``/proc`` opens (group C, whose files must still be open to be reopened)
are served as they come, first in each turn. A held program start reads group A up to itself
first (``ORDER_BUDGET_S``): the check of its arguments needs its process's earlier events read."""
ORDER_BUDGET_S = 0.05
"""How long a held program start may wait while group A's queue is read up to it (the events
before it are its old image's); past it the record is incomplete."""
DRAIN_BUDGET_S = 3.0
"""How long ``finish`` may read what is left in the queues after the command; past it the record
is incomplete (a flood that outran the reader, not a command that did less)."""
_NAME_INFO = struct.Struct("=2xH8xI")  # an information record's size and its handle's size


class FanotifyRecorder:
    """Records one command run under ``bwrap`` (module docstring), through a sandbox's groups.

    ``wrapper_execs``, ``wrapper_programs``: the programs ``bwrap`` runs before the command,
    itself included, and their files (``etude.sandbox.gate.Wrappers``: not the command's).
    ``host_roots``: ``(host path, sandbox path)`` of binds whose source lies elsewhere on the host
    (the sandbox's private ``/etc``), to report paths as the command saw them. The command's
    runner serves the queues while it waits for the command (``watches``), then ``finish``
    drains them.

    ``dir_cache``: the sandbox's paths of directories on its read-only binds, by handle, kept
    from command to command.
    ``limits``: ``(resource, (soft, hard))`` set on the sandbox's first process while it waits
    on the block pipe (``prlimit(2)``; every process of the command inherits them), in place of
    a ``prlimit`` program in the sandbox; if they cannot be set, the command does not run.
    """

    def __init__(
        self,
        groups: tuple[int, int, int],
        *,
        workspace: str,
        runtime_roots: Iterable[str],
        wrapper_execs: int,
        host_roots: Sequence[tuple[str, str]] = (),
        timeout_s: float = BLOCK_TIMEOUT_S,
        wrapper_programs: Sequence[str] = (),
        limits: Sequence[tuple[int, tuple[int, int]]] = (),
        dir_cache: dict[bytes, str] | None = None,
    ) -> None:
        self.group_a, self.group_b, self.group_c = groups
        self.workspace = workspace.rstrip("/")
        self.builder = RecordBuilder(workspace=self.workspace, runtime_roots=tuple(runtime_roots))
        self._bwrap_pid = -1
        self._own_pid = os.getpid()
        self.gate = Gate()
        # directory handles -> paths; those of the runtime's read-only binds are kept by the
        # sandbox from command to command (``dir_cache``)
        self._paths = DirPaths(
            group_a=self.group_a,
            workspace=self.workspace,
            host_roots=host_roots,
            dir_cache=dir_cache if dir_cache is not None else {},
        )
        # (directory, name) -> union of the event bits seen on that entry
        self._flags: dict[tuple[str, bytes], int] = {}
        self._last_exec: dict[int, tuple[int, ...]] = {}  # pid -> its last execve's arguments
        # pid -> (program, argv recorded, its exec's opens seen) until checked (_verify_exec)
        self._unverified: dict[int, tuple[str, list[str], bool]] = {}
        self._root_pid = -1
        self._command_started = False
        self._timeout_s = timeout_s
        self._wrappers = Wrappers(self.group_b, wrapper_execs, wrapper_programs)
        self._limits = list(limits)
        self._pending: dict[int, tuple[bytes, int]] = {}  # group -> a read and where to go on
        # a reader in progress, and whether finish left it behind (the runner abandoned it)
        self._serving_lock = threading.Lock()
        self._serving = False
        self.abandoned = False
        """A queue reader had not come back when the record was taken (``finish``): the record
        is incomplete, and this recorder's groups are closed by that reader when it returns
        (the sandbox must make new ones)."""
        self.started = False
        """Whether ``bwrap`` was started (a command that could not start has no record)."""
        self.overflow = False
        self.complete = True
        self.num_events = 0
        self.error: str | None = None
        """Why events stopped being read (the record is then incomplete)."""

    def _discard_pending(self, reads: int | None = None, *, own: bool = True) -> None:
        """Drop what is queued, answering held executions: the events queued since the last
        command are not this one's (this process's own work in the workspace, a previous
        overflow: ``own=False``), and after a reader's error or past the drain's budget nothing
        more is recorded (an overflow among them still marks the record). ``reads``: at most
        that many reads per group (a command still running may queue as fast as this drops)."""
        for group in (self.group_a, self.group_b, self.group_c):
            buf, off = self._pending.pop(group, (b"", 0))
            num = 0
            while True:
                for mask, fd in events(buf[off:]):
                    if mask & FAN_Q_OVERFLOW and own:
                        self.overflow = True
                    if group == self.group_b:
                        allow(group, fd)
                    elif fd >= 0:
                        os.close(fd)
                if reads is not None and num == reads:
                    break
                if (buf := _read_queue(group)) is None:
                    break
                off, num = 0, num + 1

    # ------------------------------------------------------------------ set-up

    def spawner(self, inner: Spawner) -> Spawner:
        """``inner`` with the gate: start ``bwrap``, mark its mounts, then let the command run."""

        def spawn(
            argv: list[str],
            cwd: Path,
            env: dict[str, str],
            stdio: tuple[int, int, int],
            pass_fds: Sequence[int],
        ) -> Leader:
            gate = self.gate
            leader = inner(argv, cwd, env, stdio, [*pass_fds, *gate.bwrap_fds()])
            self.started = True
            gate.handed_over()
            groups = (self.group_a, self.group_b, self.group_c)
            try:
                # while bwrap builds the sandbox (nothing of the command runs before the byte)
                self._discard_pending(own=False)
                if not mark_workspace(self.group_a, self.workspace, self._paths.dirs):
                    self.complete = False
                self._wrappers.ignore()
                child = gate.wait_blocked(leader, self._timeout_s)
                if child is None:
                    # bwrap ended, or has not built the sandbox in time: no command without
                    # its limits and marks
                    self.complete = False
                    kill(leader)
                else:
                    self._bwrap_pid = child
                    for which, limit in self._limits:
                        resource.prlimit(child, which, limit)
                    if not mark_mounts(child, groups, self._paths.mount_fds):
                        self.complete = False
            except BaseException:
                kill(leader)  # the command must not run unlimited or unwatched
                leader.reap()
                raise
            finally:
                gate.let_through()
            return leader

        return spawn

    def bwrap_args(self) -> list[str]:
        """``--info-fd``/``--block-fd`` for the ``bwrap`` argv (before its ``--``)."""
        return self.gate.bwrap_args()

    # ------------------------------------------------------------------ events

    def watches(self) -> list[tuple[int, Callable[[], bool]]]:
        """The queues and their readers, for ``run_process_tree(watch=...)``: served by the
        loop that waits for the command anyway (no thread per queue, no hand-off), a slice
        per call (``MAX_EVENTS_PER_CALL``, ``SLICE_S``)."""
        return [
            (self.group_b, functools.partial(self._serve, self._read_b, self.group_b)),
            (self.group_c, functools.partial(self._serve, self._read_c, self.group_c)),
            (self.group_a, functools.partial(self._serve, self._read_a, self.group_a), A_EVERY_S),
        ]

    def _serve(self, read: Callable[[], bool], group: int) -> bool:
        """One slice of a queue; whether that queue has more already read (call again)."""
        with self._serving_lock:
            if self.abandoned:
                return False
            self._serving = True
        try:
            if self.error is not None:
                # keep the queues moving, a read per call; the record says it is incomplete
                self._discard_pending(reads=1)
                return False
            try:
                read()
            except Exception as e:  # noqa: BLE001 - the command must not hang on a broken reader
                self.error = f"{type(e).__name__}: {e}"
                self.complete = False
                self._discard_pending(reads=1)
            return group in self._pending
        finally:
            with self._serving_lock:
                self._serving = False
                if self.abandoned:  # finish left this reader behind: it releases what it used
                    self._release()

    def _slice(self, group: int) -> tuple[bytes, int] | None:
        """What to read next from ``group``: the rest of an earlier read, else a new read."""
        pending = self._pending.pop(group, None)
        if pending is not None:
            return pending
        buf = _read_queue(group)
        return None if buf is None else (buf, 0)

    def _events(self, group: int, buf: bytes, off: int) -> Iterator[tuple[int, int, int, int, int]]:
        """``(mask, fd, pid, info_start, end)`` of the events of ``buf`` from ``off``, offsets
        into it, one slice: the rest is kept for the next call. A queue overflow marks the
        record instead of being yielded."""
        num, until = 0, time.monotonic() + SLICE_S
        while off + META.size <= len(buf):
            num += 1
            if num > MAX_EVENTS_PER_CALL or (num & 63 == 0 and time.monotonic() > until):
                self._pending[group] = (buf, off)
                return
            length, _, _, meta_len, mask, fd, pid = META.unpack_from(buf, off)
            assert length >= META.size, "not a fanotify event (a group's descriptor was lost)"
            start, off = off, off + length
            if mask & FAN_Q_OVERFLOW:
                self.overflow = True
                continue
            yield mask, fd, pid, start + meta_len, off

    def _read_b(self) -> bool:
        """Permission events: record the argv of each ``execve``, then let it go on."""
        if (read := self._slice(self.group_b)) is None:
            return False
        for _, fd, pid, _, _ in self._events(self.group_b, *read):
            try:
                self._exec_event(fd, pid)
            except Exception as e:  # noqa: BLE001 - every held execve must be answered
                self.error = f"{type(e).__name__}: {e}"
                self.complete = False
            finally:
                allow(self.group_b, fd)
        return True

    def _exec_event(self, fd: int, pid: int) -> None:
        call = exec_call(pid)
        if call is not None and self._last_exec.get(pid) == call:
            return  # the same execve opening its interpreter (a script's, then ld.so)
        self._last_exec[pid] = call or ()
        if self._root_pid < 0:
            self._root_pid = pid
        if self._wrappers.skip_execs and pid == self._root_pid:
            self._wrappers.skip_execs -= 1
            return
        if not self._command_started:
            # the command's own execve, held here: every /proc open of the wrappers before it
            # is queued by now; read them as theirs, then what comes is the command's
            self._wrappers.stop_ignoring()
            while self._read_c():
                pass
            self._command_started = True
        program = self._paths.sandbox_path(os.readlink(f"/proc/self/fd/{fd}"))
        given, argv = read_argv(pid, call) if call is not None else ("", [])
        self.builder.add("executed", program)
        self.builder.prov.num_processes += 1
        # the program as the caller named it (a symlink's name), or as opened (fexecve)
        recorded = cap_argv(process_argv(given or program, argv))
        self._add_process(recorded)
        # the check of these arguments (_verify_exec) starts at this execve's own opens: every
        # event the process queued before it (its old image's, and the wrappers') must be read
        # first. They are all queued by now (the process is held), though group A is read in
        # batches; a flood that keeps the queue from emptying leaves the record incomplete
        if not self._read_a_until_empty():
            self.complete = False
        self._unverified[pid] = (given or program, recorded, False)

    def _read_a_until_empty(self) -> bool:
        """Read group A until its queue is empty; False past ``ORDER_BUDGET_S``."""
        until = time.monotonic() + ORDER_BUDGET_S
        while self._read_a():
            if time.monotonic() > until:
                return False
        return True

    def _add_process(self, argv: list[str]) -> None:
        if len(self.builder.prov.processes) < MAX_PROCESSES:
            self.builder.prov.processes.append(argv)
        else:
            self.builder.prov.truncated = True

    def _verify_exec(self, pid: int, mask: int) -> None:
        """The argv read at the hold came from the caller's memory before the kernel copied it:
        another thread could have changed it in between. At the program's first open in its
        new image (after the opens of the exec itself: the loader's first file), its
        ``/proc/PID/cmdline`` is the copy the kernel made; if the arguments differ, that argv
        is recorded too. A process already gone, or one that opens nothing, is not checked."""
        program, recorded, opened = self._unverified[pid]
        if mask & FAN_OPEN_EXEC:
            self._unverified[pid] = (program, recorded, True)
            return
        if not opened or not mask & FAN_OPEN:
            # before the exec's own opens, an event of the old image; after them, only an open
            # comes from the new image's code (a close may be the exec releasing old files
            # before the new argv is in place)
            return
        del self._unverified[pid]
        try:
            fd = os.open(f"/proc/{pid}/cmdline", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            raw = os.read(fd, 8192)
        except OSError:
            return
        finally:
            os.close(fd)
        args = [os.fsdecode(a) for a in raw.split(b"\0")[:-1]]
        # the arguments must agree (argv[0] is the program's path here; a script's interpreter
        # comes before the script's own argv)
        tail = args[len(args) - len(recorded) + 1 :] if len(args) >= len(recorded) else None
        if not args or (tail is not None and cap_argv([recorded[0], *tail]) == recorded):
            return
        self._add_process(cap_argv([program, *args[1:]]))

    def _read_c(self) -> bool:
        """Opens under /proc: the path of the descriptor the kernel reopened. A process's own
        entries (``/proc/PID/...`` of the sandbox's numbering, not its first process) are
        recorded as ``/proc/self/...``: the reader may not learn the opener's number before it
        exits, and another process's ``maps``, ``stat`` or ``mountinfo`` tell what its own do
        (one namespace). A file that can no longer be opened (its process ended before the
        event was read) is not recorded."""
        if (read := self._slice(self.group_c)) is None:
            return False
        for _, fd, pid, _, _ in self._events(self.group_c, *read):
            if fd < 0:
                continue
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
                is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            except OSError:
                continue
            finally:
                os.close(fd)
            if pid in (self._bwrap_pid, self._own_pid) or not path.startswith("/"):
                continue
            if not self._command_started and self._root_pid in (-1, pid):
                continue  # the wrappers' (setpriv reads /proc/sys/kernel/cap_last_cap)
            self.num_events += 1
            if not path.startswith("/proc/"):  # the sandbox ended: relative to procfs' root
                path = "/proc" + path
            path = _PROC_THREAD.sub("/thread-self", _PROC_OWN.sub("/proc/self", path))
            self.builder.add("listed" if is_dir else "read", path.rstrip("/"))
        return True

    def _read_a(self) -> bool:
        if (read := self._slice(self.group_a)) is None:
            return False
        buf = read[0]
        flags, skip, paths = self._flags, (self._bwrap_pid, self._own_pid), self._paths
        dirs = paths.dirs
        unverified, num, w = self._unverified, 0, self._wrappers
        wrappers = w.a_execs < w.execs  # still in the wrappers' events
        for mask, _, pid, at, end in self._events(self.group_a, *read):
            if pid in skip:
                continue  # bwrap's first process, and this one's look at the mounts
            num += 1
            if pid in unverified:
                self._verify_exec(pid, mask)
            if mask & DIRENT_EVENTS or buf[at] != INFO_DFID_NAME:
                names, child = info_records(buf, at, end)
                name = names.get(INFO_DFID_NAME, (b"", b""))[1]
                if not w.event(pid, mask, name):
                    self._event(mask, names, child)
                wrappers = w.a_execs < w.execs
                continue
            # the common case, an open, read, write or close of an entry of a directory:
            # DFID_NAME first (struct fanotify_event_info_fid: header, fsid, file_handle, name)
            size, hsize = _NAME_INFO.unpack_from(buf, at)
            name = buf[at + 20 + hsize : at + size].split(b"\0", 1)[0]
            if wrappers:
                skipped = w.event(pid, mask, name)
                wrappers = w.a_execs < w.execs
                if skipped:
                    continue
            handle = buf[at + 4 : at + 12] + buf[at + 16 : at + 20 + hsize]
            base = dirs.get(handle) or paths.resolve(handle)
            if base is not None:
                key = (base, name)
                flags[key] = flags.get(key, 0) | mask
        self.num_events += num
        return True

    def _event(self, mask: int, names: dict[int, tuple[bytes, bytes]], child: bytes) -> None:
        """A creation, deletion or rename in a workspace directory (or an event whose record
        is not the common one)."""
        if mask & FAN_RENAME:
            old, new = names.get(INFO_OLD_DFID_NAME), names.get(INFO_NEW_DFID_NAME)
            src = self._paths.join(*old) if old else None
            dst = self._paths.join(*new) if new else None
            if src:
                self.builder.add("read", src)
                self.builder.add("deleted", src)
            if dst:
                self.builder.add("written", dst)
            if mask & FAN_ONDIR and src and dst:
                self._paths.moved(src, dst)
            return
        entry = names.get(INFO_DFID_NAME)
        if entry is None:
            return
        path = self._paths.join(*entry)
        if path is None:
            return
        if mask & FAN_CREATE:
            self.builder.add("written", path)
            if mask & FAN_ONDIR:
                self._paths.new_dir(path, child)
            else:
                self._paths.maybe_link(path)
        elif mask & FAN_DELETE:
            self.builder.add("deleted", path)
        else:  # an access whose records came in another order
            name = entry[1] if entry[1] not in (b"", b".") else b"."
            key = (path if name == b"." else posixpath.dirname(path), name)
            self._flags[key] = self._flags.get(key, 0) | mask

    # ------------------------------------------------------------------ result

    def finish(self) -> Provenance:
        """Drain the queues (the command has ended: every event of it is queued) and release
        this command's descriptors: the record of the command. Takes ``DRAIN_BUDGET_S`` at
        most; a reader the runner left behind (stuck past the deadline) is not waited for:
        the record is then incomplete (``abandoned``)."""
        with self._serving_lock:
            self.abandoned = self._serving
        if self.abandoned:
            self.complete = False
            self.error = "a queue reader had not returned by the command's deadline"
            # the reader may go on when it returns: what it adds goes to a record nobody reads
            builder, flags = self.builder, self._flags
            self.builder = RecordBuilder(workspace=self.workspace, runtime_roots=())
            self._flags = {}
            return self._record(builder, list(flags.items()))
        self._wrappers.stop_ignoring()  # the command never started: the next one must find none
        until = time.monotonic() + DRAIN_BUDGET_S
        readers = (self._read_b, self._read_a, self._read_c)
        while self.error is None and any([read() for read in readers]):
            if time.monotonic() > until:
                self.error = f"the queues were not drained within {DRAIN_BUDGET_S} s"
                self.complete = False
        if self.error is not None:
            self._discard_pending()
        if self._paths.links and not self._paths.link_sources(self.builder, until):
            self.complete = False
        self._release()
        return self._record(self.builder, list(self._flags.items()))

    def _release(self) -> None:
        """Close this command's descriptors, and the groups when a reader was left behind.
        The mount descriptors close on a thread of their own: the last one of a sandbox's
        ``/tmp`` unmounts it, which frees every file the command left there (0.6 s after a
        flood of them)."""
        close_later(self._paths.mount_fds.values())
        self._paths.mount_fds = {}
        self.gate.close()
        if self.abandoned:
            close_later((self.group_a, self.group_b, self.group_c))

    def _record(
        self, builder: RecordBuilder, flags: list[tuple[tuple[str, bytes], int]]
    ) -> Provenance:
        """The record: each entry's event bits folded into what was done to it."""
        for (base, name), mask in flags:
            path = base if name == b"." else f"{base.rstrip('/')}/{os.fsdecode(name)}"
            if mask & FAN_ONDIR:
                if mask & FAN_OPEN:
                    builder.add("listed", path)
                continue
            if mask & (FAN_MODIFY | FAN_CLOSE_WRITE):
                builder.add("written", path)
            if mask & FAN_ACCESS or (mask & FAN_CLOSE_NOWRITE and not mask & FAN_CLOSE_WRITE):
                builder.add("read", path)
        prov = builder.prov
        prov.num_events = self.num_events
        prov.overflow = self.overflow
        prov.complete = self.complete and not self.overflow
        return prov


def _read_queue(group: int) -> bytes | None:
    """The next events of a group; None when none is queued. ``b""`` when the kernel could not
    reopen an event's file for the reader (Linux < 6.13 reports that as the read's error, and
    the event is gone): read again."""
    try:
        return os.read(group, READ_BYTES)
    except BlockingIOError:
        return None
    except OSError as e:
        if e.errno == errno.EBADF:
            raise  # the group itself is gone: not an event's error
        return b""
