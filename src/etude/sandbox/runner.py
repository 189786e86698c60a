"""The process-tree runner under both backends: start a command, read its output, hold its deadline.

``run_process_tree`` (what ``bwrap.py`` and ``local.py`` call with their argv)

- starts the command in its own session (process group) with a clean environment,
- reads stdout and stderr without deadlock (one selector over both pipes and a pidfd),
- keeps at most ``max_output_bytes`` per stream (head and tail, with a visible marker between),
- on the wall-clock deadline SIGKILLs the whole process group, and after a normal exit SIGKILLs
  what is left of it (orphaned background jobs), always before the leader is reaped so that the
  group id cannot have been reused by an unrelated process,
- serves ``watch`` descriptors (the fanotify recorder's event queues) in the same loop, and holds
  the deadline whatever their callbacks do: a callback does a bounded slice of work per call and
  says whether it has more (the loop comes back to the clock between slices); with callbacks the
  loop runs on a thread of its own and the caller is its watchdog: at the deadline plus
  ``WATCHDOG_GRACE_S`` it kills the group (which frees a callback waiting on the command), and
  ``ABANDON_GRACE_S`` later it returns without the loop (a callback stuck on anything else), the
  result timed out. A callback's owner learns that it was left behind from its own state (the
  recorder marks its record incomplete).

What this module does not do: decide what is isolated (``etude.sandbox``), or what a callback
records.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from etude.sandbox.base import Result

# After the leader exits (or is killed), how long to keep reading pipes that a process which
# escaped the kill still holds open; only the local backend can have such a process.
DRAIN_GRACE_S = 0.5
WATCHDOG_GRACE_S = 1.0
"""With ``watch`` callbacks: how long past the deadline the loop may take to end (it kills the
group at the deadline and then reads pipes for ``DRAIN_GRACE_S`` at most) before the watchdog
kills the group itself."""
ABANDON_GRACE_S = 1.0
"""After the watchdog's kill, how long the loop has to come back from a callback before the run
returns without it (timed out)."""
READ_CHUNK = 1 << 16

Watch = Callable[[], object]
"""A callback for a readable descriptor: one bounded slice of work; a true return says it has
more to do without waiting for the descriptor (it is called again after the clock is checked)."""
Watched = tuple[int, Watch] | tuple[int, Watch, float]
"""``(descriptor, callback)``, or ``(descriptor, callback, every_s)``: a descriptor whose events
may wait, served at most once per ``every_s`` (what it queued meanwhile is read in one go).
Callbacks are called in the order given, the first ones first in each turn of the loop."""


class _CappedStream:
    """Keeps the first and last bytes of a stream within ``cap`` and counts the rest."""

    __slots__ = ("head", "tail", "total", "head_cap", "tail_cap")

    def __init__(self, cap: int) -> None:
        self.tail_cap = cap // 2
        self.head_cap = cap - self.tail_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            # trim lazily (amortized O(1) per byte); only the last tail_cap bytes survive
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.head_cap + self.tail_cap

    def text(self, name: str) -> str:
        if not self.truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace")
        tail = bytes(self.tail[len(self.tail) - self.tail_cap :]) if self.tail_cap else b""
        dropped = self.total - len(self.head) - len(tail)
        marker = (
            f"\n[... {dropped} bytes of {name} truncated by the sandbox "
            f"(max_output_bytes={self.head_cap + self.tail_cap}) ...]\n"
        )
        return self.head.decode("utf-8", "replace") + marker + tail.decode("utf-8", "replace")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _leader_exited(pid: int) -> bool:
    """Whether ``pid`` has exited, without reaping it (it stays a zombie, its pgid stays ours)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


class Leader(Protocol):
    """The first process of a command, started in its own session (its pid is the group id)."""

    pid: int

    def exited(self) -> bool:
        """Whether it has exited; it must stay unreaped (a zombie) until ``reap``."""
        ...

    def reap(self) -> int:
        """Wait for it and release it; its exit code (negative: killed by that signal)."""
        ...


Spawner = Callable[[list[str], Path, dict[str, str], tuple[int, int, int], Sequence[int]], Leader]
"""Starts ``argv`` in ``cwd`` with ``env``, the given stdin/stdout/stderr descriptors and the
descriptors to pass on, in a new session; raises ``OSError`` when it cannot be started."""


class _PopenLeader:
    __slots__ = ("pid", "proc")

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid = proc.pid

    def exited(self) -> bool:
        return _leader_exited(self.pid)

    def reap(self) -> int:
        return self.proc.wait()


def popen_spawner(preexec_fn: Callable[[], None] | None = None) -> Spawner:
    """The default spawner: ``subprocess.Popen`` from this process."""

    def spawn(
        argv: list[str],
        cwd: Path,
        env: dict[str, str],
        stdio: tuple[int, int, int],
        pass_fds: Sequence[int],
    ) -> Leader:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=stdio[0],
            stdout=stdio[1],
            stderr=stdio[2],
            start_new_session=True,
            preexec_fn=preexec_fn,
            close_fds=True,
            pass_fds=tuple(pass_fds),
        )
        return _PopenLeader(proc)

    return spawn


class _Tree:
    """A started command, shared by the loop that serves it and the watchdog that may leave the
    loop behind. ``lock`` orders the two: the loop reads pipes, kills and reaps under it, and
    stops at its next step once ``abandoned``; the watchdog kills, reaps and reads the streams
    under it."""

    def __init__(self, leader: Leader, out_fd: int, err_fd: int, cap: int) -> None:
        self.leader = leader
        self.out_fd, self.err_fd = out_fd, err_fd
        self.streams = {out_fd: _CappedStream(cap), err_fd: _CappedStream(cap)}
        self.lock = threading.Lock()
        self.returncode: int | None = None
        self.timed_out = False
        self.abandoned = False
        self.done = threading.Event()
        self.error: BaseException | None = None

    def kill(self) -> None:
        """The watchdog's SIGKILL of the group, past the deadline: the run timed out (unless
        the loop reaped the leader first; after that its id may be another's)."""
        with self.lock:
            if self.returncode is None:
                self.timed_out = True
                _kill_group(self.leader.pid)

    def abandon(self) -> None:
        """Give up on the loop: kill the group, reap the leader, keep the output read so far."""
        with self.lock:
            if self.returncode is not None:
                return  # the loop ended in the meantime
            self.abandoned = self.timed_out = True
            _kill_group(self.leader.pid)
            self.returncode = self.leader.reap()


def _serve(tree: _Tree, deadline: float, watch: Sequence[Watched]) -> None:
    """The loop: pipes, the leader's exit, the deadline and the ``watch`` callbacks, until the
    leader is reaped (or the watchdog abandoned the loop). Owns and closes the descriptors."""
    streams, leader = tree.streams, tree.leader
    sel = selectors.DefaultSelector()
    for fd in streams:
        sel.register(fd, selectors.EVENT_READ)
    rank: dict[Watch, int] = {}  # callbacks in the order given: the first served first
    every: dict[Watch, tuple[int, float]] = {}  # a deferrable one -> (descriptor, period)
    for entry in watch:
        fd, serve = entry[0], entry[1]
        sel.register(fd, selectors.EVENT_READ, serve)
        rank[serve] = len(rank)
        if len(entry) > 2 and entry[2] > 0:
            every[serve] = (fd, entry[2])
    # deferrable callbacks: when each was last served, and those whose descriptor is out of the
    # selector until a time (readable, but served at most once per period)
    served_at: dict[Watch, float] = {}
    resting: dict[Watch, float] = {}
    # a pidfd turns "the leader exited" into a selectable event (Linux >= 5.3); else poll
    pidfd = os.pidfd_open(leader.pid) if hasattr(os, "pidfd_open") else None
    if pidfd is not None:
        sel.register(pidfd, selectors.EVENT_READ)
    open_fds = set(streams)
    busy: dict[Watch, None] = {}  # callbacks with work left (ordered: each in turn)
    exited = False
    drain_until: float | None = None
    try:
        while open_fds or not exited:
            now = time.monotonic()
            limit = drain_until if drain_until is not None else deadline
            if now >= limit:
                if drain_until is not None:
                    break  # a process that escaped the kill still holds a pipe: stop reading
                with tree.lock:
                    if tree.abandoned:
                        return
                    tree.timed_out = True
                    _kill_group(leader.pid)
                drain_until = now + DRAIN_GRACE_S
                continue
            for serve, due in list(resting.items()):
                if now >= due:
                    del resting[serve]
                    sel.register(every[serve][0], selectors.EVENT_READ, serve)
            if busy:
                wait = 0.0
            else:
                wait = limit - now if pidfd is not None or exited else min(limit - now, 0.005)
                if resting:
                    wait = max(0.0, min(wait, min(resting.values()) - now))
            ready = sel.select(wait)
            leader_done = pidfd is None  # without a pidfd the leader is polled every turn
            with tree.lock:
                if tree.abandoned:
                    return
                for key, _ in ready:
                    if key.data is not None:
                        period = every.get(key.data)
                        if period is not None and not exited:
                            due = served_at.get(key.data, -period[1]) + period[1]
                            if now < due:  # served lately: its events wait, the fd rests
                                sel.unregister(key.fd)
                                resting[key.data] = due
                                continue
                        busy[key.data] = None
                    elif key.fd == pidfd:
                        leader_done = True
                    else:
                        data = os.read(key.fd, READ_CHUNK)
                        if data:
                            streams[key.fd].feed(data)
                        else:
                            sel.unregister(key.fd)
                            open_fds.discard(key.fd)
            # outside the lock: the watchdog must be able to take it
            for serve in sorted(busy, key=rank.__getitem__):
                if serve in every:
                    served_at[serve] = time.monotonic()
                if not serve():
                    del busy[serve]
            with tree.lock:
                if tree.abandoned:
                    return
                if not exited and leader_done and leader.exited():
                    exited = True
                    if pidfd is not None:
                        sel.unregister(pidfd)
                    _kill_group(leader.pid)  # orphans left in the group
                    if drain_until is None:
                        drain_until = time.monotonic() + DRAIN_GRACE_S
        with tree.lock:
            if tree.abandoned:
                return
            if not exited:
                _kill_group(leader.pid)
            tree.returncode = leader.reap()
    finally:
        with tree.lock:
            if tree.returncode is None and not tree.abandoned:  # an exception on the way
                _kill_group(leader.pid)
                tree.returncode = leader.reap()
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
        for fd in streams:
            os.close(fd)


def _serve_in_thread(tree: _Tree, deadline: float, watch: Sequence[Watched]) -> None:
    try:
        _serve(tree, deadline, watch)
    except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
        tree.error = e
    finally:
        tree.done.set()


def _watchdog(tree: _Tree, deadline: float) -> None:
    """Wait for the loop's thread; past the deadline and its grace kill the group, and when even
    that does not bring the loop back, leave it (``module docstring``)."""
    try:
        if tree.done.wait(max(0.0, deadline + WATCHDOG_GRACE_S - time.monotonic())):
            return
        tree.kill()
        if not tree.done.wait(ABANDON_GRACE_S):
            tree.abandon()
    except BaseException:
        tree.abandon()  # interrupted (KeyboardInterrupt): no command outlives its caller
        raise
    if tree.error is not None:
        raise tree.error


def run_process_tree(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    stdin: str | None,
    timeout_s: float,
    max_output_bytes: int,
    preexec_fn: Callable[[], None] | None = None,
    pass_fds: Sequence[int] = (),
    spawner: Spawner | None = None,
    watch: Sequence[Watched] = (),
) -> Result:
    """Run ``argv`` in a new session; kill its process group on the deadline and after it exits.

    The leader is reaped only at the very end, so every ``killpg`` targets our group: a group id
    stays allocated while its leader is an unreaped zombie. ``spawner`` starts the leader
    (default: ``Popen`` here). ``watch``: descriptors to serve while the command runs, each with
    the function called when it is readable (``Watch``; the fanotify recorder's event queues).
    Without them the loop runs in the calling thread; with them on a thread of its own, the
    caller its watchdog: the call returns by the deadline plus ``WATCHDOG_GRACE_S`` plus
    ``ABANDON_GRACE_S`` whatever the callbacks do (counted from the call, the start included).
    """
    start = time.monotonic()
    deadline = start + timeout_s
    if any("\0" in arg for arg in argv):
        # exec can not pass a NUL (Popen raises ValueError); a model's command may hold one, and
        # that is a failed command for it to read, not a crash of the caller
        return Result(
            stdout="",
            stderr="the command holds a NUL character, which no program can receive\n",
            exit_code=126,
            timed_out=False,
            duration=time.monotonic() - start,
            truncated=False,
        )
    spawn = spawner if spawner is not None else popen_spawner(preexec_fn)
    out_fd, out_w = os.pipe()
    err_fd, err_w = os.pipe()
    if stdin is not None:  # a file, not a pipe: no writer thread, no deadlock on large input
        with tempfile.TemporaryFile() as f:
            f.write(stdin.encode())
            f.seek(0)
            in_fd = os.dup(f.fileno())
    else:
        in_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        leader = spawn(argv, cwd, env, (in_fd, out_w, err_w), pass_fds)
    except OSError as e:  # the program is missing or not executable: report it as a shell would
        for fd in (out_fd, err_fd):
            os.close(fd)
        return Result(
            stdout="",
            stderr=f"{argv[0]}: {e.strerror}\n",
            exit_code=127 if isinstance(e, FileNotFoundError) else 126,
            timed_out=False,
            duration=time.monotonic() - start,
            truncated=False,
        )
    finally:
        for fd in (in_fd, out_w, err_w):
            os.close(fd)
    tree = _Tree(leader, out_fd, err_fd, max_output_bytes)
    if not watch:
        _serve(tree, deadline, ())
    else:
        thread = threading.Thread(
            target=_serve_in_thread, args=(tree, deadline, watch), name="etude-sandbox-loop"
        )
        thread.daemon = True  # a thread left behind in a stuck callback must not block exit
        thread.start()
        _watchdog(tree, deadline)
    returncode = tree.returncode
    assert returncode is not None
    with tree.lock:
        out, err = tree.streams[out_fd], tree.streams[err_fd]
        return Result(
            stdout=out.text("stdout"),
            stderr=err.text("stderr"),
            exit_code=returncode if returncode >= 0 else 128 - returncode,
            timed_out=tree.timed_out,
            duration=time.monotonic() - start,
            truncated=out.truncated or err.truncated,
        )
