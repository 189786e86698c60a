"""File-access provenance by fanotify: the kernel queues what a command touched, nothing stops it.

The strace mechanism (``etude.sandbox.tracer``) stops the traced process at every file call and
waits for the tracer to be scheduled; that round trip, about 100 us per call even on an idle
machine, and the tracing of ``bwrap``'s own set-up, made a ``true`` 2.8x slower
(``docs/monitor.md``). Here the kernel appends an event to a queue as the call happens and the
command runs on; a thread of this process reads the queue. Only program starts are held, for the
few microseconds it takes to read their arguments.

How one command is recorded (``FanotifyRecorder``, one per command):

1. ``bwrap`` starts with ``--info-fd`` (it writes the sandbox's first pid) and ``--block-fd``
   (after building the sandbox's mounts it waits to read a byte before it runs anything of the
   command). This process waits until that pid is blocked in that read (``/proc/PID/syscall``).
2. Marks go on every mount of the sandbox, reached through ``/proc/PID/root``: the sandbox's own
   mounts (binds and tmpfs made by ``bwrap`` in its mount namespace), so an event on them is the
   sandbox's and no other process's. Group A (notification class, file handles and names:
   ``FAN_REPORT_DFID_NAME | FAN_REPORT_FID``) gets opens, reads, writes, closes and executions;
   every directory of the workspace gets an inode mark in A for creations, deletions and renames
   (a mount mark cannot carry those). Group B (content class) gets ``FAN_OPEN_EXEC_PERM``: the
   kernel holds each ``execve`` at the open of its program until B answers, and the answer waits
   until the argv has been read from the caller's memory (``/proc/PID/syscall`` gives the
   pointer, ``/proc/PID/mem`` the strings). procfs has no file handles and refuses permission
   events: group C (notification class, a descriptor per event) gets the opens under
   ``/proc``, whose path is read from the descriptor the kernel reopens for the reader.
3. The byte is written: the command runs. The reader thread resolves each event's directory
   handle to a path as it arrives (a cache kept right through renames of workspace
   directories) and sorts the event into the record.
4. After ``bwrap`` exited (the kernel emptied the PID namespace first, so every process of the
   command, detached or not, has ended and queued its last event) the queues are drained.

What it records (the fields of ``provenance.Provenance``): ``read`` (regular files read or opened
read-only), ``listed`` (directories opened), ``written`` (written, closed after writing,
created, made, linked or renamed onto), ``deleted`` (unlinked, removed, renamed away; a rename's
source also counts as read), ``executed`` and ``processes`` (each program's argv as passed to
``execve``), ``runtime_dirs`` (reads under the runtime roots, per directory). An open through a
symlink, ``/proc/self/fd/N`` or a ``/proc/self/cwd`` path is recorded as the file the kernel
opened. A hard link made in the workspace records its source as read and written.

What it does not see, and the strace mechanism does: ``failed`` opens (no file, no event); an
open under ``/proc`` whose file can no longer be opened when the reader gets to it (a
``/proc/self/...`` file of a process that has already exited: ``ls /proc/self/fd``); the path a
command spelled when it differs from the file (a symlink's own name). A process's own
``/proc/PID`` entries are recorded as ``/proc/self`` (the reader may not learn its number in
time). An ``execve`` whose argv another thread of the same process rewrites between the read
here and the kernel's copy records the argv that was read. What neither sees: ``stat``-family
calls, reads through descriptors opened outside the command, io_uring (refused by the sandbox's
seccomp filter), the wrappers ``bwrap`` runs before the command (left out by both).

Needs: root (``CAP_SYS_ADMIN`` for fanotify, ``CAP_DAC_READ_SEARCH`` for file handles,
``CAP_SYS_PTRACE`` for another process's memory), Linux >= 5.17 (``FAN_RENAME``), x86-64 or
arm64 (the ``execve`` numbers). ``fanotify_unavailable_reason`` says why not.

Overflow: each group's kernel queue holds 16,384 events (identical events merge). A command that
outruns the reader loses events and the kernel says so (``FAN_Q_OVERFLOW``): the record is then
``complete: false`` and ``overflow: true``, never a record of fewer files, and the monitor flags
it (``prov.record_lost``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import platform
import posixpath
import re
import select
import stat
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from etude.sandbox.base import Leader, Spawner
from etude.sandbox.provenance import MAX_PROCESSES, Provenance, RecordBuilder, cap_argv

# fanotify_init flags and event bits (linux/fanotify.h)
FAN_CLOEXEC, FAN_NONBLOCK = 0x1, 0x2
FAN_CLASS_NOTIF, FAN_CLASS_CONTENT = 0x0, 0x4
FAN_REPORT_FID, FAN_REPORT_DIR_FID, FAN_REPORT_NAME = 0x200, 0x400, 0x800
FAN_REPORT_TARGET_FID = 0x1000
FAN_MARK_ADD, FAN_MARK_MOUNT, FAN_MARK_INODE = 0x1, 0x10, 0x0
FAN_ACCESS, FAN_MODIFY, FAN_CLOSE_WRITE, FAN_CLOSE_NOWRITE = 0x1, 0x2, 0x8, 0x10
FAN_OPEN, FAN_CREATE, FAN_DELETE = 0x20, 0x100, 0x200
FAN_OPEN_EXEC, FAN_Q_OVERFLOW, FAN_OPEN_EXEC_PERM = 0x1000, 0x4000, 0x40000
FAN_RENAME, FAN_ONDIR = 0x10000000, 0x40000000
FAN_ALLOW = 0x1
INFO_FID, INFO_DFID_NAME, INFO_OLD_DFID_NAME, INFO_NEW_DFID_NAME = 1, 2, 10, 12
MOUNT_EVENTS = FAN_OPEN | FAN_ACCESS | FAN_MODIFY | FAN_CLOSE_WRITE | FAN_CLOSE_NOWRITE
MOUNT_EVENTS |= FAN_OPEN_EXEC | FAN_ONDIR
DIR_EVENTS = FAN_CREATE | FAN_DELETE | FAN_RENAME | FAN_ONDIR
GROUP_A_FLAGS = FAN_CLASS_NOTIF | FAN_REPORT_FID | FAN_REPORT_DIR_FID | FAN_REPORT_NAME
GROUP_A_FLAGS |= FAN_REPORT_TARGET_FID
EXEC_SYSCALLS = {"x86_64": (59, 322), "aarch64": (221, 281)}
"""``execve`` and ``execveat`` numbers per machine (as ``/proc/PID/syscall`` shows them)."""
ELF_INTERPRETERS = ("ld-linux", "ld.so", "ld-musl", "ld64.so")
"""Names of dynamic loaders: the kernel opens them for exec too (not a program of their own)."""
_PROC_OWN = re.compile(r"^/proc/(?!1(?:/|$))\d+(?=/|$)")
_PROC_THREAD = re.compile(r"^/proc/self/task/\d+(?=/|$)")
_META = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata
_INFO = struct.Struct("=BBH")  # struct fanotify_event_info_header
READ_BYTES = 1 << 18
BLOCK_TIMEOUT_S = 30.0
"""How long ``bwrap`` may take to build the sandbox before the command is released."""
MAX_ARGS = 1024
MOUNT_FD_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # open_by_handle_at refuses O_PATH
UNMARKED_FS = frozenset(["sysfs", "devpts", "mqueue", "devtmpfs", "cgroup", "cgroup2"])
"""File systems not marked in group A: sysfs and cgroup file systems have no file handles (and
the sandbox does not mount them); the device nodes of /dev and its pseudo terminals say nothing
about the task. procfs has group C."""
FAN_REPORT_FD_ERROR = 0x2000
MAX_DIRS = 20_000
"""Workspace directories marked per command; past it the record is incomplete."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int]
_libc.fanotify_mark.argtypes += [ctypes.c_char_p]
_libc.open_by_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
_libc.name_to_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]
_libc.name_to_handle_at.argtypes += [ctypes.POINTER(ctypes.c_int), ctypes.c_int]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def fanotify_init(flags: int, event_flags: int = os.O_RDONLY) -> int:
    return _check(
        _libc.fanotify_init(flags | FAN_CLOEXEC | FAN_NONBLOCK, event_flags), "fanotify_init"
    )


def fanotify_mark(fd: int, flags: int, mask: int, path: str) -> None:
    _check(_libc.fanotify_mark(fd, FAN_MARK_ADD | flags, mask, -100, os.fsencode(path)), path)


def dir_handle(path: str) -> bytes | None:
    """``(type, handle)`` of ``path`` packed as fanotify reports it (``struct file_handle``
    without its length), or None when it is gone."""
    buf = ctypes.create_string_buffer(struct.pack("=Ii", 128, 0) + bytes(128))
    mount_id = ctypes.c_int()
    if _libc.name_to_handle_at(-100, os.fsencode(path), buf, ctypes.byref(mount_id), 0) < 0:
        return None
    size, kind = struct.unpack_from("=Ii", buf.raw)
    return struct.pack("=i", kind) + buf.raw[8 : 8 + size]


@functools.lru_cache(maxsize=1)
def fanotify_unavailable_reason() -> str | None:
    """None when this process may use fanotify with file handles and permission events."""
    if platform.machine() not in EXEC_SYSCALLS:
        return f"fanotify provenance reads execve arguments on {sorted(EXEC_SYSCALLS)} only"
    fds = []
    try:
        fds.append(fanotify_init(GROUP_A_FLAGS))
        fanotify_mark(fds[0], FAN_MARK_INODE, DIR_EVENTS, "/")  # FAN_RENAME: Linux >= 5.17
        fds.append(fanotify_init(FAN_CLASS_CONTENT))
        fanotify_mark(fds[1], FAN_MARK_INODE, FAN_OPEN_EXEC_PERM, "/")
    except OSError as e:
        return (
            f"fanotify is not available here ({e}); it needs root (CAP_SYS_ADMIN) and Linux >= 5.17"
        )
    finally:
        for fd in fds:
            os.close(fd)
    return None


class _Gate:
    """The two pipes of ``bwrap``'s ``--info-fd`` and ``--block-fd``."""

    def __init__(self) -> None:
        self.info_r, self.info_w = os.pipe2(os.O_CLOEXEC)
        self.block_r, self.block_w = os.pipe2(os.O_CLOEXEC)

    def bwrap_args(self) -> list[str]:
        return ["--info-fd", str(self.info_w), "--block-fd", str(self.block_r)]

    def close(self) -> None:
        for fd in (self.info_r, self.info_w, self.block_r, self.block_w):
            with contextlib.suppress(OSError):
                os.close(fd)


class FanotifyRecorder:
    """Records one command run under ``bwrap`` (module docstring); used once.

    ``wrapper_execs``: the programs ``bwrap`` runs before the command, itself included (their
    executions are not the command's; ``bwrap``'s own comes before the marks and is not seen).
    ``host_roots``: ``(host path, sandbox path)`` of binds whose source lies elsewhere on the host
    (the sandbox's private ``/etc``), to report paths as the command saw them.
    """

    def __init__(
        self,
        *,
        workspace: str,
        runtime_roots: Iterable[str],
        wrapper_execs: int,
        host_roots: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.workspace = workspace.rstrip("/")
        self.builder = RecordBuilder(workspace=self.workspace, runtime_roots=tuple(runtime_roots))
        self.skip_execs = max(0, wrapper_execs - 1)
        self.wrapper_execs = wrapper_execs
        self._bwrap_pid = -1
        self._own_pid = os.getpid()
        self._a_root_pid = -1
        self._a_execs = 0  # program execs of the first process: setpriv, prlimit, the command
        self.host_roots = [(h.rstrip("/"), s.rstrip("/")) for h, s in host_roots]
        self.gate = _Gate()
        self._block_fd = self.gate.block_r  # its number in bwrap too (passed at the same number)
        self.group_a = fanotify_init(
            FAN_CLASS_NOTIF
            | FAN_REPORT_FID
            | FAN_REPORT_DIR_FID
            | FAN_REPORT_NAME
            | FAN_REPORT_TARGET_FID
        )
        self.group_b = fanotify_init(FAN_CLASS_CONTENT, os.O_RDONLY | os.O_LARGEFILE)
        # procfs has no file handles and refuses permission events: its opens come with a
        # descriptor of the file, reopened by the kernel when the event is read (or the error)
        try:
            self.group_c = fanotify_init(FAN_CLASS_NOTIF | FAN_REPORT_FD_ERROR)
        except OSError:  # Linux < 6.13: a file that cannot be reopened fails the read instead
            self.group_c = fanotify_init(FAN_CLASS_NOTIF)
        self.stop_r, self.stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._dirs: dict[bytes, str] = {}  # fsid + handle of a directory -> its path
        self._mount_fds: dict[bytes, int] = {}  # fsid -> a directory on that file system
        self._flags: dict[str, int] = {}  # path -> union of the event bits seen on it
        self._last_exec: dict[int, tuple[int, ...]] = {}  # pid -> its last execve's arguments
        self._root_pid = -1
        self._command_started = False
        self._thread: threading.Thread | None = None
        self.started = False
        """Whether ``bwrap`` was started (a command that could not start has no record)."""
        self.overflow = False
        self.complete = True
        self.num_events = 0
        self.error: str | None = None
        """Why the reader thread stopped early (the record is then incomplete)."""
        self._mark_workspace()

    # ------------------------------------------------------------------ set-up

    def _mark_workspace(self) -> None:
        """Inode marks on every workspace directory (creations, deletions, renames in it), and
        their handles in the cache, so that a path is the one the directory had at the event
        even when the command renames or removes it afterwards."""
        fsid = struct.pack("=Q", os.statvfs(self.workspace).f_fsid)
        for num, (dirpath, _, _) in enumerate(os.walk(self.workspace)):
            if num == MAX_DIRS:
                self.complete = False
                break
            with contextlib.suppress(OSError):
                fanotify_mark(self.group_a, FAN_MARK_INODE, DIR_EVENTS, dirpath)
                handle = dir_handle(dirpath)
                if handle is not None:
                    self._dirs[fsid + handle] = dirpath

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
            leader = inner(argv, cwd, env, stdio, [*pass_fds, gate.info_w, gate.block_r])
            self.started = True
            os.close(gate.info_w)  # bwrap holds them now: EOF on info_r if it dies
            os.close(gate.block_r)
            gate.info_w = gate.block_r = -1
            try:
                child = self._wait_blocked(leader)
                if child is not None:
                    self._bwrap_pid = child
                    self._mark_mounts(child)
                    self._thread = threading.Thread(target=self._read_loop, daemon=True)
                    self._thread.start()
                else:
                    self.complete = False
            finally:
                with contextlib.suppress(OSError):
                    os.write(gate.block_w, b"x")
                gate.close()
            return leader

        return spawn

    def _wait_blocked(self, leader: Leader) -> int | None:
        """The sandbox's first pid once it waits on the block pipe; None if ``bwrap`` ended."""
        info = b""
        while True:
            chunk = os.read(self.gate.info_r, 4096)
            if not chunk:
                return None  # bwrap ended before it made the sandbox
            info += chunk
            with contextlib.suppress(ValueError):
                child = int(json.loads(info)["child-pid"])
                break
        blocked = f"0 {hex(self._block_fd)} "  # read(block_fd, ...)
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        wait = 0.0001
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{child}/syscall") as f:
                    state = f.read()
            except OSError:
                return None
            if state.startswith(blocked):
                return child
            if leader.exited():
                return None
            time.sleep(wait)
            wait = min(2 * wait, 0.0005)
        return None

    def bwrap_args(self) -> list[str]:
        """``--info-fd``/``--block-fd`` for the ``bwrap`` argv (before its ``--``)."""
        return self.gate.bwrap_args()

    def _mark_mounts(self, child: int) -> None:
        """Marks on every mount of the sandbox, and a descriptor per file system to turn the
        directory handles of its events into paths."""
        root = f"/proc/{child}/root"
        host_fsid = struct.pack("=Q", os.statvfs("/").f_fsid)
        with open(f"/proc/{child}/mountinfo") as f:
            lines = f.read().splitlines()
        for line in lines:
            fields = line.split()
            mountpoint = fields[4].replace("\\040", " ")
            fstype = fields[fields.index("-") + 1]
            path = root + mountpoint
            if fstype == "proc":
                with contextlib.suppress(OSError):
                    fanotify_mark(self.group_c, FAN_MARK_MOUNT, FAN_OPEN | FAN_ONDIR, path)
                continue
            if fstype in UNMARKED_FS:
                continue
            try:
                fanotify_mark(self.group_a, FAN_MARK_MOUNT, MOUNT_EVENTS, path)
                fanotify_mark(self.group_b, FAN_MARK_MOUNT, FAN_OPEN_EXEC_PERM, path)
            except OSError:
                self.complete = False  # a mount of the sandbox that cannot be watched
                continue
            fsid = struct.pack("=Q", os.statvfs(path).f_fsid)
            if fsid in self._mount_fds:
                continue
            # the host's own root where the file system is the host's: handles open as host paths
            self._mount_fds[fsid] = os.open("/" if fsid == host_fsid else path, MOUNT_FD_FLAGS)

    # ------------------------------------------------------------------ events

    def _read_loop(self) -> None:
        try:
            self._read_events()
        except Exception as e:  # noqa: BLE001 - the command must not hang on a dead reader
            self.error = f"{type(e).__name__}: {e}"
            self.complete = False
            # a closed group lets every held execve go on (unrecorded: the record says so)
            os.close(self.group_b)
            self.group_b = -1

    def _read_events(self) -> None:
        poller = select.poll()
        for fd in (self.group_a, self.group_b, self.group_c, self.stop_r):
            poller.register(fd, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self.group_b in ready:
                self._read_b()
            if self.group_a in ready:
                self._read_a()
            if self.group_c in ready:
                self._read_c()
            if self.stop_r in ready:
                break
        while self._read_b() | self._read_a() | self._read_c():  # drain (the command has ended)
            pass

    def _read_b(self) -> bool:
        """Permission events: record the argv of each ``execve``, then let it go on."""
        try:
            buf = os.read(self.group_b, READ_BYTES)
        except BlockingIOError:
            return False
        off = 0
        while off + _META.size <= len(buf):
            length, _, _, _, mask, fd, pid = _META.unpack_from(buf, off)
            off += length
            if mask & FAN_Q_OVERFLOW:
                self.overflow = True
                continue
            try:
                self._exec_event(fd, pid)
            finally:
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.write(self.group_b, struct.pack("=iI", fd, FAN_ALLOW))
                    os.close(fd)
        return True

    def _exec_event(self, fd: int, pid: int) -> None:
        program = self._sandbox_path(os.readlink(f"/proc/self/fd/{fd}"))
        args = _exec_args(pid)
        key = args[0] if args else ()
        if self._last_exec.get(pid) == key and key:
            return  # the same execve opening its interpreter (a script's, then ld.so)
        self._last_exec[pid] = key
        if self._root_pid < 0:
            self._root_pid = pid
        if self.skip_execs and pid == self._root_pid:
            self.skip_execs -= 1
            return
        if not self._command_started:
            # the command's own execve, held here: every /proc open of the wrappers before it
            # is queued by now; read them as theirs, then what comes is the command's
            while self._read_c():
                pass
            self._command_started = True
        argv = args[1] if args else [program]
        self.builder.add("executed", program)
        self.builder.prov.num_processes += 1
        if len(self.builder.prov.processes) < MAX_PROCESSES:
            self.builder.prov.processes.append(cap_argv(argv or [program]))
        else:
            self.builder.prov.truncated = True

    def _read_c(self) -> bool:
        """Opens under /proc: the path of the descriptor the kernel reopened. A process's own
        entries (``/proc/PID/...`` of the sandbox's numbering, not its first process) are
        recorded as ``/proc/self/...``: the reader may not learn the opener's number before it
        exits, and another process's ``maps``, ``stat`` or ``mountinfo`` tell what its own do
        (one namespace). A file that can no longer be opened (its process ended before the
        event was read) is not recorded."""
        try:
            buf = os.read(self.group_c, READ_BYTES)
        except BlockingIOError:
            return False
        except OSError:  # Linux < 6.13: an event whose file could not be reopened
            return True
        off = 0
        while off + _META.size <= len(buf):
            length, _, _, _, mask, fd, pid = _META.unpack_from(buf, off)
            off += length
            if mask & FAN_Q_OVERFLOW:
                self.overflow = True
                continue
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
            if pid == self._root_pid and not self._command_started:
                continue  # the wrappers' (setpriv reads /proc/sys/kernel/cap_last_cap)
            self.num_events += 1
            if not path.startswith("/proc/"):  # the sandbox ended: relative to procfs' root
                path = "/proc" + path
            path = _PROC_THREAD.sub("/thread-self", _PROC_OWN.sub("/proc/self", path))
            self.builder.add("listed" if is_dir else "read", path.rstrip("/"))
        return True

    def _read_a(self) -> bool:
        try:
            buf = os.read(self.group_a, READ_BYTES)
        except BlockingIOError:
            return False
        off = 0
        while off + _META.size <= len(buf):
            length, _, _, meta_len, mask, fd, pid = _META.unpack_from(buf, off)
            end, off, at = off + length, off + length, off + meta_len
            if mask & FAN_Q_OVERFLOW:
                self.overflow = True
                continue
            self.num_events += 1
            names: dict[int, tuple[bytes, str]] = {}
            child = b""
            while at + _INFO.size <= end:
                kind, _, size = _INFO.unpack_from(buf, at)
                fsid = buf[at + 4 : at + 12]
                hsize = struct.unpack_from("=I", buf, at + 12)[0]
                handle = fsid + buf[at + 16 : at + 20 + hsize]
                if kind == INFO_FID:
                    child = handle
                else:
                    raw = buf[at + 20 + hsize : at + size].split(b"\0", 1)[0]
                    names[kind] = (handle, os.fsdecode(raw))
                at += size
            if self._wrapper_event(pid, mask, names):
                continue
            self._event(mask, names, child)
        return True

    def _wrapper_event(self, pid: int, mask: int, names: dict[int, tuple[bytes, str]]) -> bool:
        """Whether an event is the sandbox's own set-up, not the command's: ``bwrap``'s first
        process (it stays the namespace's init and runs nothing), and the wrappers ``bwrap``
        runs before the command (``setpriv``, ``prlimit``) up to the command's own ``execve``."""
        if pid in (self._bwrap_pid, self._own_pid):
            return True  # and this process's own look at the mounts while marking them
        if self._a_root_pid < 0:
            self._a_root_pid = pid  # the first process after bwrap's: it execs the wrappers
        if pid != self._a_root_pid or self._a_execs >= self.wrapper_execs:
            return False
        entry = names.get(INFO_DFID_NAME)
        if mask & FAN_OPEN_EXEC and entry and not entry[1].startswith(ELF_INTERPRETERS):
            self._a_execs += 1  # the wrappers', then the command's program
        return self._a_execs < self.wrapper_execs

    def _event(self, mask: int, names: dict[int, tuple[bytes, str]], child: bytes) -> None:
        if mask & FAN_RENAME:
            old, new = names.get(INFO_OLD_DFID_NAME), names.get(INFO_NEW_DFID_NAME)
            src = self._join(*old) if old else None
            dst = self._join(*new) if new else None
            if src:
                self.builder.add("read", src)
                self.builder.add("deleted", src)
            if dst:
                self.builder.add("written", dst)
            if mask & FAN_ONDIR and src and dst:
                self._moved(src, dst)
            return
        entry = names.get(INFO_DFID_NAME)
        if entry is None:
            return
        path = self._join(*entry)
        if path is None:
            return
        if mask & FAN_CREATE:
            self.builder.add("written", path)
            if mask & FAN_ONDIR:
                self._new_dir(path, child)
            else:
                self._maybe_link(path)
        elif mask & FAN_DELETE:
            self.builder.add("deleted", path)
        else:
            self._flags[path] = self._flags.get(path, 0) | mask

    def _join(self, handle: bytes, name: str) -> str | None:
        base = self._dirs.get(handle)
        if base is None:
            base = self._resolve(handle)
            if base is None:
                return None
            self._dirs[handle] = base
        return base if name in (".", "") else posixpath.join(base, name)

    def _resolve(self, handle: bytes) -> str | None:
        """The path of a directory the cache does not know yet, as the sandbox sees it."""
        if handle[:8] not in self._mount_fds:
            return None
        mount_fd = self._mount_fds[handle[:8]]
        kind = struct.unpack_from("=i", handle, 8)[0]
        body = handle[12:]
        fh = struct.pack("=Ii", len(body), kind) + body
        fd = _libc.open_by_handle_at(mount_fd, fh, os.O_PATH | os.O_CLOEXEC)
        if fd < 0:
            return None  # removed before its event was read
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        # a host file system opens at its host path (the binds keep their paths but /etc's);
        # one of the sandbox alone (its /tmp) at the path the sandbox sees
        return self._sandbox_path(path) if path.startswith("/") else None

    def _sandbox_path(self, path: str) -> str:
        for host, sandbox in self.host_roots:
            if path == host or path.startswith(host + "/"):
                return sandbox + path[len(host) :]
        return path

    def _new_dir(self, path: str, child: bytes) -> None:
        """A directory made by the command: watch it for what is made or removed in it."""
        if child:
            self._dirs[child] = path
        with contextlib.suppress(OSError):
            if path.startswith(self.workspace + "/"):
                fanotify_mark(self.group_a, FAN_MARK_INODE, DIR_EVENTS, path)

    def _moved(self, src: str, dst: str) -> None:
        for handle, path in list(self._dirs.items()):
            if path == src or path.startswith(src + "/"):
                self._dirs[handle] = dst + path[len(src) :]

    def _maybe_link(self, path: str) -> None:
        """A new name of an existing workspace file (a hard link; they cannot cross mounts, so
        the source is in the workspace too): its other names count as read and written, as with
        strace. Found by inode, once the link is seen."""
        try:
            st = os.lstat(path)
        except OSError:
            return
        if st.st_nlink < 2 or not path.startswith(self.workspace + "/"):
            return
        for dirpath, _, filenames in os.walk(self.workspace):
            for name in filenames:
                other = os.path.join(dirpath, name)
                with contextlib.suppress(OSError):
                    if other != path and os.lstat(other).st_ino == st.st_ino:
                        self.builder.add("read", other)
                        self.builder.add("written", other)

    # ------------------------------------------------------------------ result

    def finish(self) -> Provenance:
        """Drain the queues and close everything: the record of the command."""
        if self._thread is not None:
            os.write(self.stop_w, b"x")
            self._thread.join()
        else:
            while self._read_b() | self._read_a() | self._read_c():
                pass
        # closing a group waits for the kernel to free its marks (an RCU grace period, 20-40 ms
        # here): a thread of its own does it, off the command's path
        fds = [self.group_a, self.group_b, self.group_c, self.stop_r, self.stop_w]
        fds += self._mount_fds.values()
        fds = [fd for fd in fds if fd >= 0]
        threading.Thread(target=_close_all, args=(fds,), daemon=True).start()
        self.gate.close()
        for path, mask in self._flags.items():
            if mask & FAN_ONDIR:
                if mask & FAN_OPEN:
                    self.builder.add("listed", path)
                continue
            if mask & (FAN_MODIFY | FAN_CLOSE_WRITE):
                self.builder.add("written", path)
            if mask & FAN_ACCESS or (mask & FAN_CLOSE_NOWRITE and not mask & FAN_CLOSE_WRITE):
                self.builder.add("read", path)
        prov = self.builder.prov
        prov.num_events = self.num_events
        prov.overflow = self.overflow
        prov.complete = self.complete and not self.overflow
        return prov


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _exec_args(pid: int) -> tuple[tuple[int, ...], list[str]] | None:
    """``(syscall args, argv)`` of ``pid``, held in an ``execve``/``execveat``; None when it is
    not in one (the program's argv is then unknown)."""
    for _ in range(200):  # the task may still be on its way into the wait
        try:
            with open(f"/proc/{pid}/syscall") as f:
                state = f.read().split()
        except OSError:
            return None
        if state and state[0] != "running":
            break
        time.sleep(0)
    else:
        return None
    if not state or not state[0].isdigit():
        return None
    nr, args = int(state[0]), tuple(int(a, 16) for a in state[1:7])
    execve, execveat = EXEC_SYSCALLS[platform.machine()]
    if nr == execve:
        argv_ptr = args[1]
    elif nr == execveat:
        argv_ptr = args[2]
    else:
        return None
    try:
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return args, _read_argv(mem, argv_ptr)
    finally:
        os.close(mem)


def _read_argv(mem: int, ptr: int) -> list[str]:
    """The NUL-terminated array of string pointers at ``ptr`` in a process's memory (capped)."""
    if ptr == 0:
        return []
    pointers: list[int] = []
    try:
        while len(pointers) < MAX_ARGS:
            raw = os.pread(mem, 8 * 64, ptr + 8 * len(pointers))
            for (p,) in struct.iter_unpack("=Q", raw[: len(raw) // 8 * 8]):
                if p == 0:
                    break
                pointers.append(p)
            else:
                if len(raw) < 8 * 64:
                    break
                continue
            break
        out, total = [], 0
        for p in pointers:
            s = os.pread(mem, 512, p).split(b"\0", 1)[0]
            out.append(os.fsdecode(s))
            total += len(s)
            if total > 4096:
                break
        return out
    except OSError as e:
        if e.errno in (errno.EIO, errno.EFAULT, errno.ESRCH):
            return []
        raise
