"""The set-up of one recorded command: ``bwrap`` held at its gate while its mounts are marked.

The fanotify recorder (``etude.sandbox.recorder``) must have its marks in place before the
command's first file call, and the marks must be on the sandbox's own mounts, which exist only
once ``bwrap`` has built them. This module holds the command at that moment:

1. ``bwrap`` starts with ``--info-fd`` (it writes the sandbox's first pid) and ``--block-fd``
   (after building the sandbox's mounts it waits to read a byte before it runs anything of the
   command): ``Gate``. The recorder waits until that pid is blocked in that read
   (``/proc/PID/syscall``: ``Gate.wait_blocked``), and sets the command's limits on it
   (``prlimit(2)``, inherited by every process of the command: no ``prlimit`` program in the
   sandbox).
2. Marks go on every mount of the sandbox, reached through ``/proc/PID/root``
   (``mark_mounts``): the sandbox's own mounts (binds and tmpfs made by ``bwrap`` in its mount
   namespace), so an event on them is the sandbox's and no other process's. Group A
   (notification class, file handles and names: ``FAN_REPORT_DFID_NAME | FAN_REPORT_FID``) gets
   opens, reads, writes, closes and executions; every directory of the workspace gets an inode
   mark in A for creations, deletions and renames (a mount mark cannot carry those) and for
   changes of its files that reach the inode without a mount (``truncate(2)`` by path:
   ``mark_workspace``). Group B (content class) gets ``FAN_OPEN_EXEC_PERM``: the kernel holds
   each ``execve`` at the open of its program until B answers, and the answer waits until the
   argv has been read from the caller's memory (``/proc/PID/syscall`` gives the pointer,
   ``/proc/PID/mem`` the strings). procfs has no file handles and refuses permission events:
   group C (notification class, a descriptor per event) gets the opens under ``/proc``, whose
   path is read from the descriptor the kernel reopens for the reader.

Then the recorder writes the byte (``Gate.let_through``) and the command runs. A mount or a
workspace directory that cannot be marked makes the record incomplete (the functions say so);
a ``bwrap`` that ends or does not block within ``BLOCK_TIMEOUT_S`` is killed (``kill``) before
its command runs. The programs ``bwrap`` runs before the command (``setpriv``, ``prlimit``)
are set up here too (``Wrappers``): group B may ignore their files until the command's first
program start, and their events are told from the command's.

What this module does not do: make or read the groups (``etude.sandbox.fanotify``), decide what
an event of the command means, or set the limits (the recorder does, between the two steps); it
marks what exists when the command starts (a directory made later is marked as its creation is
read: ``etude.sandbox.dirpaths``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import struct
import time
from collections.abc import Sequence

from etude.sandbox.fanotify import (
    DIR_EVENTS,
    FAN_MARK_INODE,
    FAN_MARK_MOUNT,
    FAN_ONDIR,
    FAN_OPEN,
    FAN_OPEN_EXEC,
    FAN_OPEN_EXEC_PERM,
    MOUNT_EVENTS,
    MOUNT_FD_FLAGS,
    dir_handle,
    elf_interpreter,
    fanotify_mark,
    set_ignored,
)
from etude.sandbox.runner import Leader

ELF_INTERPRETERS = (b"ld-linux", b"ld.so", b"ld-musl", b"ld64.so")
"""Names of dynamic loaders: the kernel opens them for exec too (not a program of their own)."""
BLOCK_TIMEOUT_S = 30.0
"""How long ``bwrap`` may take to build the sandbox before the command is released (at most the
command's own timeout)."""
UNMARKED_FS = frozenset(["sysfs", "devpts", "mqueue", "devtmpfs", "cgroup", "cgroup2"])
"""File systems not marked in group A: sysfs and cgroup file systems have no file handles (and
the sandbox does not mount them); the device nodes of /dev and its pseudo terminals say nothing
about the task. procfs has group C."""
_setup_s = 0.0
"""How long ``bwrap`` lately took from its info line to the block pipe (a running mean)."""
MAX_DIRS = 20_000
"""Workspace directories marked per command; past it the record is incomplete."""


class Gate:
    """The two pipes of ``bwrap``'s ``--info-fd`` and ``--block-fd``, one command's."""

    def __init__(self) -> None:
        self.info_r, self.info_w = os.pipe2(os.O_CLOEXEC)
        self.block_r, self.block_w = os.pipe2(os.O_CLOEXEC)
        self.block_fd = self.block_r  # its number in bwrap too (passed at the same number)

    def bwrap_args(self) -> list[str]:
        return ["--info-fd", str(self.info_w), "--block-fd", str(self.block_r)]

    def bwrap_fds(self) -> list[int]:
        """The descriptors ``bwrap`` must be passed (at their numbers: ``bwrap_args``)."""
        return [self.info_w, self.block_r]

    def handed_over(self) -> None:
        """``bwrap`` holds its ends now: close them here (EOF on ``info_r`` if it dies)."""
        os.close(self.info_w)
        os.close(self.block_r)
        self.info_w = self.block_r = -1

    def wait_blocked(self, leader: Leader, timeout_s: float) -> int | None:
        """The sandbox's first pid once it waits on the block pipe; None if ``bwrap`` ended, or
        has not blocked within ``min(BLOCK_TIMEOUT_S, timeout_s)``."""
        info = b""
        while True:
            chunk = os.read(self.info_r, 4096)
            if not chunk:
                return None  # bwrap ended before it made the sandbox
            info += chunk
            with contextlib.suppress(ValueError):
                child = int(json.loads(info)["child-pid"])
                break
        blocked = f"0 {hex(self.block_fd)} ".encode()  # read(block_fd, ...)
        deadline = time.monotonic() + min(BLOCK_TIMEOUT_S, timeout_s)
        try:
            fd = os.open(f"/proc/{child}/syscall", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        global _setup_s
        start = time.monotonic()
        try:
            # bwrap takes a few ms to build the mounts: sleep most of the time it took lately,
            # then look every 50 us (each look is a few us of CPU the 2 cores could use)
            time.sleep(0.8 * _setup_s)
            while time.monotonic() < deadline:
                if os.pread(fd, 64, 0).startswith(blocked):
                    _setup_s = min(0.5 * _setup_s + 0.5 * (time.monotonic() - start), 0.05)
                    return child
                if leader.exited():
                    return None
                time.sleep(0.00005)
        except OSError:
            return None
        finally:
            os.close(fd)
        return None

    def let_through(self) -> None:
        """Write the byte (the command runs; no error if ``bwrap`` is gone) and close the rest."""
        with contextlib.suppress(OSError):
            os.write(self.block_w, b"x")
        self.close()

    def close(self) -> None:
        """Close what is still open (once: a number closed twice may be another's by then)."""
        for name in ("info_r", "info_w", "block_r", "block_w"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


class Wrappers:
    """The programs ``bwrap`` runs before the command (``setpriv``, ``prlimit``): their events
    are not the command's.

    ``execs``: how many, ``bwrap`` included (its own start comes before the marks and is not
    seen). ``programs``: their programs (host paths, as ``bwrap`` and the wrappers find them),
    given when none of them, nor their loader, can be the command's program (a shell command).
    Their files are then ignored by group B (``ignore``) until the first program start it
    holds, which is the command's own (``stop_ignoring``): the wrappers' starts are not held at
    all (``setpriv``: two holds per command), and from the command on every program is held
    again. Without them, group B holds the wrappers' starts and passes over the first
    ``skip_execs`` of them.
    """

    def __init__(self, group_b: int, execs: int, programs: Sequence[str]) -> None:
        self.group_b = group_b
        self.execs = execs
        self.skip_execs = max(0, execs - 1)
        self._files = with_loaders(tuple(programs))
        self._ignoring: list[str] = []  # files group B ignores until the command's first start
        self._a_root_pid = -1
        self.a_execs = 0  # program execs of the first process: setpriv, prlimit, the command

    def ignore(self) -> None:
        """Group B ignores the wrappers' files until the command's first program start; their
        starts are then not held, so none of them is skipped by count."""
        for path in self._files:
            try:
                set_ignored(self.group_b, FAN_OPEN_EXEC_PERM, path, ignored=True)
            except OSError:
                self.stop_ignoring()  # held and skipped by count, as without the list
                return
            self._ignoring.append(path)
        if self._ignoring:
            self.skip_execs = 0

    def stop_ignoring(self) -> None:
        """Hold every program start again (before the command's first one goes on)."""
        for path in self._ignoring:
            with contextlib.suppress(OSError):
                set_ignored(self.group_b, FAN_OPEN_EXEC_PERM, path, ignored=False)
        self._ignoring = []

    def event(self, pid: int, mask: int, name: bytes) -> bool:
        """Whether a group A event (of process ``pid``, on entry ``name``) is the wrappers', up
        to the command's own ``execve``: events of the first process until its program
        executions reach ``execs``."""
        if self._a_root_pid < 0:
            self._a_root_pid = pid  # the first process after bwrap's: it execs the wrappers
        if pid != self._a_root_pid or self.a_execs >= self.execs:
            return False
        if mask & FAN_OPEN_EXEC and name and not name.startswith(ELF_INTERPRETERS):
            self.a_execs += 1  # the wrappers', then the command's program
        return self.a_execs < self.execs


def mark_workspace(group_a: int, workspace: str, dirs: dict[bytes, str]) -> bool:
    """Inode marks in ``group_a`` on every directory of ``workspace`` (creations, deletions,
    renames in it), and their handles (fsid + handle) in ``dirs``, so that a path is the one the
    directory had at the event even when the command renames or removes it afterwards. False
    when past ``MAX_DIRS`` directories (the record is then incomplete)."""
    fsid = struct.pack("=Q", os.statvfs(workspace).f_fsid)
    for num, (dirpath, _, _) in enumerate(os.walk(workspace)):
        if num == MAX_DIRS:
            return False
        with contextlib.suppress(OSError):
            fanotify_mark(group_a, FAN_MARK_INODE, DIR_EVENTS, dirpath)
            handle = dir_handle(dirpath)
            if handle is not None:
                dirs[fsid + handle] = dirpath
    return True


def mark_mounts(pid: int, groups: tuple[int, int, int], mount_fds: dict[bytes, int]) -> bool:
    """Marks of groups A, B and C on every mount of the sandbox whose first process is ``pid``,
    and in ``mount_fds`` a descriptor per file system (by fsid) to turn the directory handles of
    its events into paths. Paths are looked up from the sandbox's root directory (opened once
    through ``/proc/PID/root``); a file system is asked its id once (``major:minor`` names one
    live file system). False when a mount could not be marked (the record is then
    incomplete)."""
    group_a, group_b, group_c = groups
    complete = True
    with open(f"/proc/{pid}/mountinfo", "rb") as f:
        lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    host_dev, host_fsid = host_fs()
    root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    fsids: dict[str, bytes] = {host_dev: host_fsid}  # major:minor -> fsid
    try:
        for line in lines:
            fields = line.split()
            # relative to the sandbox's root; "." is the root itself
            rel = fields[4].replace("\\040", " ").lstrip("/") or "."
            fstype = fields[fields.index("-") + 1]
            if fstype == "proc":
                with contextlib.suppress(OSError):
                    fanotify_mark(group_c, FAN_MARK_MOUNT, FAN_OPEN | FAN_ONDIR, rel, root)
                continue
            if fstype in UNMARKED_FS:
                continue
            try:
                fanotify_mark(group_a, FAN_MARK_MOUNT, MOUNT_EVENTS, rel, root)
                fanotify_mark(group_b, FAN_MARK_MOUNT, FAN_OPEN_EXEC_PERM, rel, root)
            except OSError:
                complete = False  # a mount of the sandbox that cannot be watched
                continue
            if fields[2] in fsids:
                fsid = fsids[fields[2]]
                if fsid == host_fsid and fsid not in mount_fds:
                    # the host's file system: its handles open as host paths
                    mount_fds[fsid] = os.open("/", MOUNT_FD_FLAGS)
                continue
            fd = os.open(rel, MOUNT_FD_FLAGS, dir_fd=root)
            fsids[fields[2]] = fsid = struct.pack("=Q", os.fstatvfs(fd).f_fsid)
            if fsid in mount_fds:
                os.close(fd)
            else:
                mount_fds[fsid] = fd
    finally:
        os.close(root)
    return complete


def kill(leader: Leader) -> None:
    """SIGKILL the command's process group (``bwrap`` and whatever it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader.pid, signal.SIGKILL)


@functools.lru_cache(maxsize=1)
def host_fs() -> tuple[str, bytes]:
    """``major:minor`` (as ``mountinfo`` writes it) and fsid of the host's root file system."""
    dev = os.stat("/").st_dev
    return f"{os.major(dev)}:{os.minor(dev)}", struct.pack("=Q", os.statvfs("/").f_fsid)


@functools.lru_cache(maxsize=16)
def with_loaders(programs: tuple[str, ...]) -> tuple[str, ...]:
    """``programs`` and the dynamic loaders they name, one path per file (by device and inode)."""
    files: dict[tuple[int, int], str] = {}
    for program in programs:
        loader = elf_interpreter(program)
        for path in (program, loader) if loader else (program,):
            with contextlib.suppress(OSError):
                st = os.stat(path)
                files.setdefault((st.st_dev, st.st_ino), os.path.realpath(path))
    return tuple(files.values())
