"""One provenance tracer per sandbox (per episode), started once, that every command runs under.

Starting ``strace`` for each command cost more than most commands (a ``true`` in the sandbox
took 7 ms, traced 20 ms; docs/monitor.md has the measurements). ``EpisodeTracer`` starts one
``strace -f --seccomp-bpf`` (``provenance.strace_argv``) over a small launcher
(``etude.sandbox.launcher``) when the sandbox's first command runs, and keeps it for the
sandbox's life. Each command's ``bwrap`` is started by the launcher, so it and everything under
it are traced from their first system call, and no tracer starts per command.

Attribution: commands on one tracer run one at a time (a lock), so the trace lines between the
start of a command and the tracer's line for the exit of its ``bwrap`` are that command's. Every
process the command made lived in the sandbox's PID namespace, which the kernel empties before
``bwrap`` can exit, so background processes, detached or not, have no later lines: what they did
is in the command's segment. The launcher's own lines are dropped by pid.

The tracer runs on the host as etude's user, outside the sandbox's PID namespace: a sandboxed
command can neither see nor signal it. Its log is a file in a private (0700) host directory,
under ``/dev/shm`` where there is one, which the sandbox does not show; it is read once per
command, after the command ended (no wake-up of this process per line), and emptied before the
next. The tracer's file-size limit is ``provenance.TRACE_MAX_BYTES``: a command whose log
passes it ends the tracer, and then its traced calls fail with ``ENOSYS`` (the seccomp filter
that stops them has no tracer left), so nothing it does afterwards goes unrecorded; its record
is incomplete and truncated, and the next command starts a fresh tracer. So does a command
whose log never ended (the tracer died otherwise).

What it does not do: trace commands of other sandboxes (each has its own tracer), or survive a
``fork`` of the etude process (the child starts its own tracer on first use).
"""

from __future__ import annotations

import json
import os
import re
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from etude.sandbox import provenance
from etude.sandbox.base import Result
from etude.sandbox.runner import Leader

LAUNCHER = Path(__file__).with_name("launcher.py")
START_TIMEOUT_S = 60.0
END_GRACE_S = 10.0
"""How long after a command ended the tracer's line about its exit may take to arrive."""
REPLY_MAX = 1 << 16


def find_end(trace: bytes, root: int) -> int | None:
    """Offset just past the tracer's line about the exit of process ``root`` (``ROOT +++ exited
    ...`` or ``ROOT +++ killed ...``; strace pads short pids), or None when it is not there."""
    m = re.search(rb"(?:^|\n)%d +\+\+\+ [^\n]*\n" % root, trace)
    return None if m is None else m.end()


class _LauncherLeader:
    """A command's ``bwrap``, a child of the launcher (not of this process)."""

    def __init__(self, tracer: EpisodeTracer, pid: int) -> None:
        self.tracer = tracer
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)

    def exited(self) -> bool:
        return bool(select.select([self.pidfd], [], [], 0)[0])

    def reap(self) -> int:
        os.close(self.pidfd)
        reply = self.tracer._request({"op": "reap", "pid": self.pid})
        return int(reply.get("status", -signal.SIGKILL))


def _shutdown(proc: subprocess.Popen[bytes], sock: socket.socket, trace_fd: int, dir_: str) -> None:
    sock.close()  # the launcher reads EOF and ends; strace ends with its last tracee
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    os.close(trace_fd)
    shutil.rmtree(dir_, ignore_errors=True)


class EpisodeTracer:
    """A long-lived ``strace`` and launcher that run a sandbox's commands (module docstring)."""

    def __init__(self, strace: str = "strace") -> None:
        path = shutil.which(strace)
        if path is None:
            raise ValueError(
                "sandbox.provenance needs strace on PATH; install it (`make system-deps`, or "
                "apt-get install strace) or set sandbox.provenance=false"
            )
        self.strace = path
        self._lock = threading.Lock()
        self._owner = -1  # pid of the process that started the tracer
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._trace_fd = -1
        self._launcher_pid = -1
        self._finalizer: weakref.finalize | None = None
        self.starts = 0
        """How many tracers this object has started (one, unless a tracer died or the process
        forked)."""

    # ------------------------------------------------------------------ lifecycle

    def _alive(self) -> bool:
        return self._proc is not None and self._owner == os.getpid() and self._proc.poll() is None

    def _start(self) -> None:
        if self._owner == os.getpid():
            self.close()
        else:  # a forked child holds copies of the parent's handles: leave the parent's tracer
            self._proc = self._sock = self._finalizer = None
        # the log goes to a file (tmpfs where there is one), read once per command after it
        # ended: no wake-up of this process per line; strace appends (-A), so emptying the file
        # between commands starts the next command's log at offset 0
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        dir_ = tempfile.mkdtemp(prefix="etude-trace-", dir=base)
        path = os.path.join(dir_, "trace")
        trace_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [self.strace, "-A", *provenance.strace_argv(path)]
        argv += [sys.executable, "-I", "-S", str(LAUNCHER), str(theirs.fileno())]
        cap = provenance.TRACE_MAX_BYTES
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        with tempfile.TemporaryFile() as errors:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=errors,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                # past the cap strace dies of SIGXFSZ (the record ends incomplete); only the
                # soft limit, so that the launcher can lift it again for the commands
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (cap, hard)),
            )
            theirs.close()
            ours.settimeout(START_TIMEOUT_S)
            try:
                hello = ours.recv(REPLY_MAX)
            except TimeoutError:
                hello = b""
            ours.settimeout(None)
            if not hello:
                proc.kill()
                proc.wait()
                ours.close()
                os.close(trace_fd)
                shutil.rmtree(dir_, ignore_errors=True)
                errors.seek(0)
                raise RuntimeError(
                    "the provenance tracer did not start: "
                    + errors.read()[-600:].decode("utf-8", "replace")
                )
        self._proc, self._sock, self._trace_fd = proc, ours, trace_fd
        self._launcher_pid = int(json.loads(hello)["pid"])
        self._owner = os.getpid()
        self._finalizer = weakref.finalize(self, _shutdown, proc, ours, trace_fd, dir_)
        self.starts += 1

    def close(self) -> None:
        """Stop the tracer (the next command starts a new one)."""
        if self._finalizer is not None and self._owner == os.getpid():
            self._finalizer()
        self._proc = self._sock = self._finalizer = None

    @property
    def tracer_pid(self) -> int | None:
        """The running strace's pid (None before the first command)."""
        return self._proc.pid if self._alive() else None

    # ------------------------------------------------------------------ commands

    def _request(self, req: dict, fds: Sequence[int] = ()) -> dict:
        assert self._sock is not None
        try:
            socket.send_fds(self._sock, [json.dumps(req).encode()], list(fds))
            reply = self._sock.recv(REPLY_MAX)
        except OSError:
            reply = b""
        if not reply:
            raise ChildProcessError("the provenance tracer's launcher ended")
        return json.loads(reply)

    def _read_segment(self, root: int) -> tuple[bytes, bool]:
        """The log of the command whose ``bwrap`` was ``root``, and whether its end arrived.

        The tracer writes the line about ``root``'s exit as it releases it to the launcher, so
        the line can trail the launcher's answer by a moment: poll briefly for it.
        """
        wait = 0.0002
        deadline = time.monotonic() + END_GRACE_S
        while True:
            size = os.fstat(self._trace_fd).st_size
            data = os.pread(self._trace_fd, size, 0)
            end = find_end(data, root)
            if end is not None:
                return data[:end], True
            if time.monotonic() >= deadline or self._proc is None or self._proc.poll() is not None:
                return data, False
            time.sleep(wait)
            wait = min(2 * wait, 0.002)

    def run(
        self,
        run: Callable[..., Result],
        *,
        workspace: str,
        runtime_roots: Iterable[str],
        wrapper_execs: int,
    ) -> Result:
        """Call ``run`` (``run_process_tree`` with everything but the spawner bound) with the
        command started by the launcher, and attach its provenance.

        ``wrapper_execs``: programs ``bwrap`` runs before the command (their accesses are not
        the command's; see ``provenance.parse_strace``).
        """
        with self._lock:
            if not self._alive():
                self._start()
            os.ftruncate(self._trace_fd, 0)
            roots: list[int] = []

            def spawn(
                argv: list[str],
                cwd: Path,
                env: dict[str, str],
                stdio: tuple[int, int, int],
                pass_fds: Sequence[int],
            ) -> Leader:
                program = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=env.get("PATH"))
                if program is None:
                    raise FileNotFoundError(2, os.strerror(2), argv[0])
                req = {"op": "spawn", "argv": [program, *argv[1:]], "env": env, "cwd": str(cwd)}
                try:
                    reply = self._request(req, [*stdio, *pass_fds])
                except ChildProcessError as e:
                    raise OSError(f"provenance tracer: {e}") from e
                if "errno" in reply:
                    raise OSError(reply["errno"], os.strerror(reply["errno"]))
                roots.append(int(reply["pid"]))
                return _LauncherLeader(self, roots[-1])

            try:
                result = run(spawner=spawn)
            except ChildProcessError:
                self.close()
                raise
            if not roots:  # the command could not be started: nothing ran
                return result
            data, ended = self._read_segment(roots[0])
            if not ended:
                self.close()  # the tracer died (or hit its size cap): the next command starts anew
            launcher = f"{self._launcher_pid} "
            lines = [
                line
                for line in data.decode("utf-8", "surrogateescape").splitlines()
                if not line.startswith(launcher)
            ]
            prov = provenance.parse_strace(
                lines,
                workspace=workspace,
                runtime_roots=runtime_roots,
                wrapper_execs=wrapper_execs,
            )
            if not ended:
                prov.complete = False
                prov.truncated |= len(data) >= provenance.TRACE_MAX_BYTES
            result.provenance = prov
            return result
