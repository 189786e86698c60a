"""fanotify through ctypes: the calls, the layout of events, a sandbox's groups, and the
arguments of an ``execve`` the kernel holds.

The kernel side of ``etude.sandbox.recorder`` (``etude.sandbox.gate`` says what is marked, when
and why): thin wrappers over ``fanotify_init``, ``fanotify_mark``, ``name_to_handle_at`` and
``open_by_handle_at``; the parsing of ``struct fanotify_event_metadata`` and its information
records; reading a held process's ``execve`` call from ``/proc/PID/syscall`` and
``/proc/PID/mem``. What it does not do: decide what an event means for a record.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import platform
import queue
import struct
import threading
import time
import weakref
from collections.abc import Iterable, Iterator

# fanotify_init flags and event bits (linux/fanotify.h)
FAN_CLOEXEC, FAN_NONBLOCK = 0x1, 0x2
FAN_CLASS_NOTIF, FAN_CLASS_CONTENT = 0x0, 0x4
FAN_REPORT_FID, FAN_REPORT_DIR_FID, FAN_REPORT_NAME = 0x200, 0x400, 0x800
FAN_REPORT_TARGET_FID, FAN_REPORT_FD_ERROR = 0x1000, 0x2000
FAN_MARK_ADD, FAN_MARK_REMOVE, FAN_MARK_MOUNT, FAN_MARK_INODE = 0x1, 0x2, 0x10, 0x0
FAN_MARK_IGNORED_MASK, FAN_MARK_IGNORED_SURV_MODIFY = 0x20, 0x40
FAN_ACCESS, FAN_MODIFY, FAN_CLOSE_WRITE, FAN_CLOSE_NOWRITE = 0x1, 0x2, 0x8, 0x10
FAN_OPEN, FAN_CREATE, FAN_DELETE = 0x20, 0x100, 0x200
FAN_OPEN_EXEC, FAN_Q_OVERFLOW, FAN_OPEN_EXEC_PERM = 0x1000, 0x4000, 0x40000
FAN_EVENT_ON_CHILD, FAN_RENAME, FAN_ONDIR = 0x08000000, 0x10000000, 0x40000000
FAN_ALLOW = 0x1
INFO_FID, INFO_DFID_NAME, INFO_OLD_DFID_NAME, INFO_NEW_DFID_NAME = 1, 2, 10, 12
MOUNT_EVENTS = FAN_OPEN | FAN_ACCESS | FAN_MODIFY | FAN_CLOSE_WRITE | FAN_CLOSE_NOWRITE
MOUNT_EVENTS |= FAN_OPEN_EXEC | FAN_ONDIR
DIRENT_EVENTS = FAN_CREATE | FAN_DELETE | FAN_RENAME
# on workspace directories: entries made, removed, renamed, and changes of their files that no
# mount mark sees (truncate(2) by path reaches the inode, not a mount)
DIR_EVENTS = DIRENT_EVENTS | FAN_MODIFY | FAN_ONDIR | FAN_EVENT_ON_CHILD
GROUP_A_FLAGS = FAN_CLASS_NOTIF | FAN_REPORT_FID | FAN_REPORT_DIR_FID | FAN_REPORT_NAME
GROUP_A_FLAGS |= FAN_REPORT_TARGET_FID
EXEC_SYSCALLS = {"x86_64": (59, 322), "aarch64": (221, 281)}
"""``execve`` and ``execveat`` numbers per machine (as ``/proc/PID/syscall`` shows them)."""
_MACHINE = platform.machine()
META = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata
_INFO = struct.Struct("=BBH")  # struct fanotify_event_info_header
_U32 = struct.Struct("=I")
MAX_ARGS = 1024
_O_PATH = os.O_PATH | os.O_CLOEXEC
MOUNT_FD_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # open_by_handle_at refuses O_PATH

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int]
_libc.fanotify_mark.argtypes += [ctypes.c_char_p]
_libc.open_by_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
_libc.name_to_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]
_libc.name_to_handle_at.argtypes += [ctypes.POINTER(ctypes.c_int), ctypes.c_int]


def handle_path(mount_fd: int, handle: bytes) -> str | None:
    """The path of the object behind ``handle`` (``fsid + type + bytes``, as events report it)
    opened through ``mount_fd`` (a directory on its file system), as this process sees it; None
    when it is gone."""
    kind = struct.unpack_from("=i", handle, 8)[0]
    body = handle[12:]
    fd = _libc.open_by_handle_at(mount_fd, struct.pack("=Ii", len(body), kind) + body, _O_PATH)
    if fd < 0:
        return None
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def fanotify_init(flags: int, event_flags: int = os.O_RDONLY) -> int:
    return _check(
        _libc.fanotify_init(flags | FAN_CLOEXEC | FAN_NONBLOCK, event_flags), "fanotify_init"
    )


def fanotify_mark(fd: int, flags: int, mask: int, path: str, dir_fd: int = -100) -> None:
    """Add a mark on ``path`` (relative to ``dir_fd`` when given)."""
    ret = _libc.fanotify_mark(fd, FAN_MARK_ADD | flags, mask, dir_fd, os.fsencode(path))
    _check(ret, path)


def set_ignored(fd: int, mask: int, path: str, *, ignored: bool) -> None:
    """Add ``mask`` to (or remove it from) the ignore mask of the inode at ``path``: the group
    then gets no such event on that file, whatever mount mark it came through."""
    flags = FAN_MARK_ADD | FAN_MARK_IGNORED_SURV_MODIFY if ignored else FAN_MARK_REMOVE
    ret = _libc.fanotify_mark(fd, flags | FAN_MARK_IGNORED_MASK, mask, -100, os.fsencode(path))
    _check(ret, path)


def elf_interpreter(path: str) -> str | None:
    """The dynamic loader an ELF64 program names (``PT_INTERP``); None for anything else."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return None  # not a little-endian ELF64 file
            (phoff,) = struct.unpack_from("<Q", head, 32)
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for at in range(0, len(table) - 39, phentsize):
                if struct.unpack_from("<I", table, at)[0] == 3:  # PT_INTERP
                    (offset,) = struct.unpack_from("<Q", table, at + 8)
                    (size,) = struct.unpack_from("<Q", table, at + 32)
                    f.seek(offset)
                    return os.fsdecode(f.read(min(size, 4096)).split(b"\0", 1)[0]) or None
    except OSError:
        return None
    return None


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
    if _MACHINE not in EXEC_SYSCALLS:
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


class FanotifyGroups:
    """The three fanotify groups of one sandbox (an episode), made by its first command and
    kept: closing a group waits for the kernel to free its marks (an RCU grace period, 20-40 ms
    here), so it happens once, off the commands' path (a thread of its own). The marks on a
    command's mounts go with the mounts; those on workspace directories stay (marking one again
    costs nothing)."""

    def __init__(self) -> None:
        self._fds: tuple[int, int, int] | None = None
        self._owner = -1
        self._finalizer: weakref.finalize | None = None
        self.lock = threading.Lock()
        """Held for each command: the queues are the sandbox's, so its commands run one at a
        time (as on one strace tracer)."""
        self.dirs: dict[bytes, str] = {}
        """Paths of directories outside the workspace on the host's file system (the runtime's
        read-only binds), by handle, as earlier commands resolved them: the same in every
        command of the sandbox."""

    def get(self) -> tuple[int, int, int]:
        """Groups A, B and C (``etude.sandbox.recorder``), made on first use and after a fork
        (the child must not share its parent's queues)."""
        if self._fds is None or self._owner != os.getpid():
            group_a = fanotify_init(GROUP_A_FLAGS)
            group_b = fanotify_init(FAN_CLASS_CONTENT, os.O_RDONLY | os.O_LARGEFILE)
            # procfs has no file handles and refuses permission events: its opens come with a
            # descriptor of the file, reopened by the kernel when the event is read (or an error)
            try:
                group_c = fanotify_init(FAN_CLASS_NOTIF | FAN_REPORT_FD_ERROR)
            except OSError:  # Linux < 6.13: a file that cannot be reopened fails the read
                group_c = fanotify_init(FAN_CLASS_NOTIF)
            self._fds = (group_a, group_b, group_c)
            self._owner = os.getpid()
            self._finalizer = weakref.finalize(self, close_later, self._fds)
        return self._fds

    def forget(self) -> None:
        """Drop the groups without closing them (held by the lock's owner): a recorder's reader
        left behind in them closes them when it returns (``FanotifyRecorder.abandoned``); the
        next command makes new ones."""
        if self._finalizer is not None:
            self._finalizer.detach()
        self._fds = self._finalizer = None

    def close(self) -> None:
        """Release the groups (after the command that holds them, if one runs)."""
        with self.lock:
            if self._finalizer is not None and self._owner == os.getpid():
                self._finalizer()
            self._fds = self._finalizer = None


def info_records(buf: bytes, at: int, end: int) -> tuple[dict[int, tuple[bytes, bytes]], bytes]:
    """The information records of one group-A event: ``{kind: (directory handle, name)}`` and
    the object's own handle (``b""`` when not reported). A handle is keyed with its file
    system's id (``fsid + type + bytes``)."""
    names: dict[int, tuple[bytes, bytes]] = {}
    child = b""
    while at + _INFO.size <= end:
        kind, _, size = _INFO.unpack_from(buf, at)
        assert size >= _INFO.size, "a malformed fanotify information record"
        hsize = _U32.unpack_from(buf, at + 12)[0]
        handle = buf[at + 4 : at + 12] + buf[at + 16 : at + 20 + hsize]
        if kind == INFO_FID:
            child = handle
        else:
            names[kind] = (handle, buf[at + 20 + hsize : at + size].split(b"\0", 1)[0])
        at += size
    return names, child


def events(buf: bytes) -> Iterator[tuple[int, int]]:
    """``(mask, fd)`` of each event in a read."""
    off = 0
    while off + META.size <= len(buf):
        length, _, _, _, mask, fd, _ = META.unpack_from(buf, off)
        assert length >= META.size, "not a fanotify event (a group's descriptor was lost)"
        off += length
        yield mask, fd


def allow(group_b: int, fd: int) -> None:
    """Let a held ``execve`` go on, and release its descriptor."""
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.write(group_b, struct.pack("=iI", fd, FAN_ALLOW))
        os.close(fd)


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


_closer: tuple[int, queue.SimpleQueue[tuple[int, ...]]] | None = None  # (owner pid, its queue)
_closer_lock = threading.Lock()


def close_later(fds: Iterable[int]) -> None:
    """Close descriptors on a thread of their own (one for the process, started on first use):
    a fanotify group's close waits for the kernel to free its marks, a mount's last one
    unmounts it; neither should hold up a command."""
    global _closer
    fds = tuple(fds)
    if not fds:
        return
    with _closer_lock:
        if _closer is None or _closer[0] != os.getpid():  # none yet, or a fork's copy
            todo: queue.SimpleQueue[tuple[int, ...]] = queue.SimpleQueue()
            try:
                threading.Thread(target=_close_queued, args=(todo,), daemon=True).start()
            except RuntimeError:  # the interpreter is shutting down: no new threads
                _close_all(fds)
                return
            _closer = (os.getpid(), todo)
        _closer[1].put(fds)


def _close_queued(todo: queue.SimpleQueue[tuple[int, ...]]) -> None:
    while True:
        _close_all(todo.get())


def exec_call(pid: int) -> tuple[int, ...] | None:
    """``(number, args...)`` of the ``execve``/``execveat`` ``pid`` is held in; None when it is
    not in one (its argv is then unknown)."""
    try:
        fd = os.open(f"/proc/{pid}/syscall", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for _ in range(200):  # the task may still be on its way into the wait
            state = os.pread(fd, 256, 0).split()
            if state and state[0] != b"running":
                break
            time.sleep(0)
        else:
            return None
    except OSError:
        return None
    finally:
        os.close(fd)
    if not state or not state[0].isdigit() or int(state[0]) not in EXEC_SYSCALLS[_MACHINE]:
        return None
    return (int(state[0]), *(int(a, 16) for a in state[1:7]))


def read_argv(pid: int, call: tuple[int, ...]) -> tuple[str, list[str]]:
    """The path and argv an ``execve``/``execveat`` was called with, from the caller's memory:
    a string, and a NUL-terminated array of string pointers (capped at ``MAX_ARGS`` entries,
    4 KiB of text)."""
    execve = call[0] == EXEC_SYSCALLS[_MACHINE][0]
    path_ptr, ptr = (call[1], call[2]) if execve else (call[2], call[3])
    try:
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return "", []
    try:
        given = os.fsdecode(os.pread(mem, 4096, path_ptr).split(b"\0", 1)[0]) if path_ptr else ""
        return given, _read_strings(mem, ptr) if ptr else []
    except OSError as e:
        if e.errno in (errno.EIO, errno.EFAULT, errno.ESRCH):
            return "", []
        raise
    finally:
        os.close(mem)


def _read_strings(mem: int, ptr: int) -> list[str]:
    """The NUL-terminated array of string pointers at ``ptr`` in a process's memory."""
    pointers: list[int] = []
    while len(pointers) < MAX_ARGS:
        raw = os.pread(mem, 8 * 64, ptr + 8 * len(pointers))
        words = [w for (w,) in struct.iter_unpack("=Q", raw[: len(raw) // 8 * 8])]
        if 0 in words:
            pointers += words[: words.index(0)]
            break
        pointers += words
        if len(raw) < 8 * 64:
            break
    out, total, page, page_at = [], 0, b"", -1
    for p in pointers:
        if not page_at <= p < page_at + len(page) - 512:  # strings lie together: one read
            page, page_at = os.pread(mem, 4096, p), p
        text = page[p - page_at :].split(b"\0", 1)[0]
        out.append(os.fsdecode(text))
        total += len(text)
        if total > 4096:
            break
    return out
