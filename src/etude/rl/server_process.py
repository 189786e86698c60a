"""``etude serve`` as a child process on a loopback port: what a trainer (or a benchmark) starts
when it rolls out through a server on the same machine.

``ServerProcess(run_dir)`` picks a free port on 127.0.0.1, starts ``python -m etude serve RUN_DIR
--no-auth`` with one OpenMP thread, and waits for ``/health``; ``close()`` terminates it (kill
after a grace period). Its output goes to ``log_path`` so a failed start can say why.

What this does not do: supervise or restart the server, or serve on a non-loopback address
(start ``etude serve`` yourself for that, with API keys).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A running ``etude serve`` on 127.0.0.1 (see the module docstring)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        name: str = "policy",
        max_batch_size: int = 8,
        startup_timeout_s: float = 180.0,
        log_path: str | Path | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        if log_path is None:
            fd, log = tempfile.mkstemp(prefix="etude-serve-", suffix=".log")
            os.close(fd)
            log_path = log
        self.log_path = Path(log_path)
        ledger = self.log_path.with_suffix(".sqlite")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "etude", "serve", str(run_dir), "--no-auth",
                 "--name", name, "--port", str(self.port), "--ledger", str(ledger),
                 "--max-batch-size", str(max_batch_size)],
                env=env, stdout=log_file, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + startup_timeout_s
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"etude serve exited on start: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(
                    f"etude serve was not healthy after {startup_timeout_s:.0f} s: {self.log_tail()}"
                )
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
