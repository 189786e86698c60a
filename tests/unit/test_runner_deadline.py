"""The deadline of ``run_process_tree`` holds whatever its ``watch`` callbacks do.

The fanotify recorder serves its event queues through those callbacks, in the loop that enforces
the command's timeout; each test here attacks that with a real command and the real runner: a
callback that never returns (a bug, or a read the kernel never completes), and one that waits
on the command itself (freed by the watchdog's kill). The flood a command can aim at the
recorder's own callbacks is attacked in ``test_provenance_fanotify.py``.
"""

import os
import signal
import threading
import time
from pathlib import Path

from etude.sandbox.runner import (
    ABANDON_GRACE_S,
    WATCHDOG_GRACE_S,
    popen_spawner,
    run_process_tree,
)

TIMEOUT_S = 1.0
RETURNS_BY_S = TIMEOUT_S + WATCHDOG_GRACE_S + ABANDON_GRACE_S + 5.0
"""Bound of a run that returned: the deadline, both graces and slack for a loaded machine (a
run held by its callback would take the 30 s of its ``sleep``)."""


def run_sleep(tmp_path: Path, watch, pass_fds=(), spawner=None):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    start = time.monotonic()
    result = run_process_tree(
        ["sleep", "30"],
        cwd=tmp_path,
        env=env,
        stdin=None,
        timeout_s=TIMEOUT_S,
        max_output_bytes=1024,
        pass_fds=pass_fds,
        spawner=spawner,
        watch=watch,
    )
    return result, time.monotonic() - start


def test_a_callback_that_never_returns_cannot_hold_the_deadline(tmp_path):
    ready_r, ready_w = os.pipe()
    os.write(ready_w, b"x")  # readable at once: the callback is called and stays
    entered, release = threading.Event(), threading.Event()

    def stuck() -> bool:
        entered.set()
        release.wait(60)
        return False

    try:
        result, elapsed = run_sleep(tmp_path, [(ready_r, stuck)])
    finally:
        release.set()
    os.close(ready_r)
    os.close(ready_w)
    assert entered.is_set()
    assert result.timed_out and result.exit_code == 128 + signal.SIGKILL
    assert elapsed < RETURNS_BY_S, elapsed


def test_a_callback_waiting_on_the_command_is_freed_by_the_watchdog(tmp_path):
    """A callback blocked in a read only the command can answer (as a read of a held
    process's memory): the watchdog's kill ends the command, the read returns, and the loop
    ends on its own (not left behind)."""
    ready_r, ready_w = os.pipe()
    os.write(ready_w, b"x")
    cmd_r, cmd_w = os.pipe()  # the command holds the write end and never writes
    returned = threading.Event()

    def waits_on_command() -> bool:
        os.read(cmd_r, 1)  # EOF once the command is killed
        returned.set()
        return False

    def spawn(*args):
        leader = popen_spawner()(*args)
        os.close(cmd_w)  # the command's alone now
        return leader

    try:
        result, elapsed = run_sleep(
            tmp_path, [(ready_r, waits_on_command)], pass_fds=(cmd_w,), spawner=spawn
        )
    finally:
        for fd in (ready_r, ready_w, cmd_r):
            os.close(fd)
    assert returned.is_set()
    assert result.timed_out and result.exit_code == 128 + signal.SIGKILL
    assert elapsed < RETURNS_BY_S, elapsed


def run_for(tmp_path: Path, seconds: float, watch):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return run_process_tree(
        ["sleep", str(seconds)],
        cwd=tmp_path,
        env=env,
        stdin=None,
        timeout_s=30,
        max_output_bytes=1024,
        watch=watch,
    )


def test_watches_are_served_in_the_order_given(tmp_path):
    """Held program starts (the recorder's first watch) must not wait behind a slice of another
    queue: of two descriptors readable at once, the first given is served first."""
    pipes = [os.pipe(), os.pipe()]
    for _, w in pipes:
        os.write(w, b"x")
    order: list[int] = []

    def reader(num: int, fd: int):
        def serve() -> bool:
            os.read(fd, 1)
            order.append(num)
            return False

        return serve

    try:
        # given second-first on purpose: the order comes from the list, not the descriptors
        run_for(
            tmp_path,
            0.2,
            [(pipes[1][0], reader(1, pipes[1][0])), (pipes[0][0], reader(0, pipes[0][0]))],
        )
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)
    assert order == [1, 0]


def test_a_deferrable_watch_is_served_at_most_once_per_period(tmp_path):
    """A queue whose events may wait (``(fd, serve, every_s)``: the recorder's group A) is read
    in batches: a descriptor that stays readable the whole run is served at most once per
    period (an upper bound that a loaded machine only lowers), and at least once."""
    r, w = os.pipe()
    os.write(w, b"x" * 4096)  # readable for the whole run: each call takes one byte
    calls: list[float] = []

    def serve() -> bool:
        os.read(r, 1)
        calls.append(time.monotonic())
        return False

    period, run_s = 0.1, 0.5
    try:
        start = time.monotonic()
        run_for(tmp_path, run_s, [(r, serve, period)])
        elapsed = time.monotonic() - start
    finally:
        os.close(r)
        os.close(w)
    assert 1 <= len(calls) <= elapsed / period + 1, (len(calls), elapsed)
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert all(gap >= period * 0.99 for gap in gaps), gaps
