"""The launcher the episode tracer runs under ``strace``: it starts each sandboxed command.

Run as a script (``python -I -S launcher.py FD``, standard library only, so its own start-up
under the tracer is short) with ``FD`` one end of a ``SOCK_SEQPACKET`` socket pair. The other
end belongs to ``etude.sandbox.tracer.EpisodeTracer`` in the etude process. Because the tracer
follows every fork, whatever the launcher starts is traced, for the whole episode, by one
``strace`` that started once.

Protocol, one JSON message each way per request:

- first, unasked: ``{"pid": LAUNCHER_PID}``;
- ``{"op": "spawn", "argv": [...], "env": {...}, "cwd": DIR}`` with descriptors attached
  (stdin, stdout, stderr, then the ones to pass on, which land at 3, 4...): starts ``argv`` in a
  new session and answers ``{"pid": PID}``, or ``{"errno": N}`` when it cannot be started;
- ``{"op": "reap", "pid": PID}``: waits for that child and answers ``{"status": CODE}`` (negative:
  killed by that signal). Children stay unreaped until asked, so their process group ids stay
  the caller's to kill.

The launcher ends when the socket closes (the etude process ended or closed the tracer). What
it does not do: limit, isolate or inspect the commands (the bwrap argv it is given does that).
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import socket
import sys

MAX_MESSAGE = 1 << 22
MAX_FDS = 16
_SAFE_FD = 16  # received descriptors are moved at or above it, clear of the targets 0, 1, 2, 3...


def _spawn(req: dict, fds: list[int]) -> dict:
    actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(fds)]
    os.chdir(req["cwd"])
    try:
        pid = os.posix_spawn(
            req["argv"][0], req["argv"], req["env"], file_actions=actions, setsid=True
        )
    except OSError as e:
        return {"errno": e.errno}
    return {"pid": pid}


def main() -> None:
    # the tracer runs with a lowered file-size limit (its log's cap); the commands get their own
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.set_inheritable(False)
    sock.send(json.dumps({"pid": os.getpid()}).encode())
    while True:
        msg, received, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
        if not msg:
            return
        # recv_fds leaves descriptors inheritable: move them up and mark them close-on-exec so
        # that a child gets exactly the ones its file actions place
        fds = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _SAFE_FD) for fd in received]
        for fd in received:
            os.close(fd)
        req = json.loads(msg)
        try:
            if req["op"] == "spawn":
                reply = _spawn(req, fds)
            else:
                _, status = os.waitpid(req["pid"], 0)
                reply = {"status": os.waitstatus_to_exitcode(status)}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(reply).encode())


if __name__ == "__main__":
    main()
