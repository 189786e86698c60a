"""The sandbox contract: configuration, result record, protocol, and the helpers both backends use.

Every command an agent or a reward run executes goes through a ``Sandbox``:
``run(cmd, cwd, timeout=, env=, stdin=) -> Result``. ``cwd`` is the episode's workspace, the only
place the command may write. The two backends (``bwrap.py``, ``local.py``) differ in how much of
the host they wall off; both run the command through ``etude.sandbox.runner`` (its own process
group, output capped, the deadline held).

What this module does not do: decide what is isolated. See the package docstring for the
per-backend list of what is and is not contained.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal, Protocol, runtime_checkable

from etude.sandbox.provenance import Provenance

Backend = Literal["auto", "bwrap", "local"]

PROVENANCE_MECHANISMS = ("auto", "strace", "fanotify")


@dataclass(kw_only=True, slots=True)
class SandboxConfig:
    """Limits and visibility of sandboxed commands (TOML section ``[sandbox]``)."""

    backend: Backend = "auto"
    """``bwrap`` (bubblewrap), ``local`` (plain subprocess), or ``auto`` (bwrap when it works)."""
    timeout_s: float = 60.0
    """Wall-clock limit of one command in seconds; the whole process tree is killed after it."""
    cpu_seconds: int = 60
    """CPU-time limit per process (RLIMIT_CPU soft limit; SIGXCPU, then SIGKILL one second later)."""
    memory_bytes: int = 4 << 30
    """Address-space limit per process (RLIMIT_AS); allocations beyond it fail."""
    max_processes: int = 128
    """Processes and threads the command may have at once (RLIMIT_NPROC for the sandbox uid)."""
    max_file_bytes: int = 256 << 20
    """Largest file a process may write (RLIMIT_FSIZE)."""
    max_open_files: int = 1024
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_output_bytes: int = 256 << 10
    """Bytes kept per stream (stdout, stderr): the head and tail, with a marker where cut."""
    tmp_bytes: int = 256 << 20
    """Size of the private /tmp and /dev/shm (tmpfs, bwrap only); it is host memory when used."""
    hidden_paths: tuple[str, ...] = ()
    """Workspace-relative paths the command must not read: masked by an empty read-only mount."""
    readonly_paths: tuple[str, ...] = ()
    """Workspace-relative paths the command may read but not change (bwrap: read-only binds;
    the grader makes the tests and configuration of a graded copy read-only this way)."""
    masked_paths: tuple[str, ...] = ()
    """Absolute host paths the command must not see (e.g. an installed copy of a task's
    package): an empty read-only mount over each (bwrap)."""
    extra_ro_paths: tuple[str, ...] = ()
    """Absolute host paths to show read-only at the same path (bwrap), e.g. another interpreter."""
    network: bool = False
    """Allow network access (bwrap keeps the host network namespace and binds resolv.conf)."""
    env_passthrough: tuple[str, ...] = ()
    """Names of host environment variables copied into the command's otherwise clean environment."""
    env: dict[str, str] | None = None
    """Fixed environment variables for every command (per-call ``env`` overrides them)."""
    uid_range: tuple[int, int] = (61000, 61512)
    """Unprivileged uids [start, stop) leased one per concurrent bwrap run when started as root."""
    provenance: bool = False
    """Record the files each command opened, wrote, ran and deleted (bwrap only)."""
    provenance_mechanism: str = "auto"
    """How provenance is recorded: ``"fanotify"`` (kernel event queues, the command never
    stops; needs root), ``"strace"`` (one tracer per sandbox; needs strace), or ``"auto"``:
    fanotify where this process may use it, else strace. What each sees and costs:
    docs/monitor.md."""
    require_isolation: bool = False
    """With ``backend = "auto"``: bwrap or an error, never the local fallback (an explicit
    ``backend = "local"`` still runs unisolated)."""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "bwrap", "local"):
            raise ValueError(
                f"sandbox.backend={self.backend!r} is not a backend; use 'auto', 'bwrap' or 'local'"
            )
        if self.provenance_mechanism not in PROVENANCE_MECHANISMS:
            raise ValueError(
                f"sandbox.provenance_mechanism={self.provenance_mechanism!r} is not a mechanism; "
                f"use one of {', '.join(map(repr, PROVENANCE_MECHANISMS))}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"sandbox.timeout_s={self.timeout_s} must be > 0 (seconds)")
        if self.cpu_seconds < 1:
            raise ValueError(f"sandbox.cpu_seconds={self.cpu_seconds} must be >= 1")
        if self.memory_bytes < 32 << 20:
            raise ValueError(
                f"sandbox.memory_bytes={self.memory_bytes} is below 32 MiB, less than a Python "
                "interpreter needs to start; raise it (e.g. 4294967296 for 4 GiB)"
            )
        if self.max_processes < 1:
            raise ValueError(f"sandbox.max_processes={self.max_processes} must be >= 1")
        if self.max_file_bytes < 1:
            raise ValueError(f"sandbox.max_file_bytes={self.max_file_bytes} must be >= 1")
        if self.max_open_files < 16:
            raise ValueError(
                f"sandbox.max_open_files={self.max_open_files} is too small to start a program; "
                "use at least 16"
            )
        if self.max_output_bytes < 256:
            raise ValueError(f"sandbox.max_output_bytes={self.max_output_bytes} must be >= 256")
        if self.tmp_bytes < 1 << 20:
            raise ValueError(f"sandbox.tmp_bytes={self.tmp_bytes} must be >= 1 MiB (1048576)")
        for rel in self.hidden_paths:
            p = PurePosixPath(rel)
            if not rel or p.is_absolute() or ".." in p.parts or p == PurePosixPath("."):
                raise ValueError(
                    f"sandbox.hidden_paths entry {rel!r} must be a path inside the workspace, "
                    "relative and without '..' (e.g. 'tests/hidden')"
                )
        for rel in self.readonly_paths:
            p = PurePosixPath(rel)
            if not rel or p.is_absolute() or ".." in p.parts or p == PurePosixPath("."):
                raise ValueError(
                    f"sandbox.readonly_paths entry {rel!r} must be a path inside the workspace, "
                    "relative and without '..' (e.g. 'tests')"
                )
        for path in self.masked_paths:
            if not PurePosixPath(path).is_absolute() or path == "/":
                raise ValueError(
                    f"sandbox.masked_paths entry {path!r} must be an absolute host path below /"
                )
        for path in self.extra_ro_paths:
            if not PurePosixPath(path).is_absolute():
                raise ValueError(
                    f"sandbox.extra_ro_paths entry {path!r} must be an absolute host path"
                )
        for name in self.env_passthrough:
            if not name or "=" in name:
                raise ValueError(
                    f"sandbox.env_passthrough entry {name!r} must be a variable name (no '=')"
                )
        lo, hi = self.uid_range
        if not 0 < lo < hi:
            raise ValueError(
                f"sandbox.uid_range={self.uid_range} must be [start, stop) with 0 < start < stop"
            )

    def resolved_provenance_mechanism(self) -> str:
        """``provenance_mechanism`` with ``"auto"`` decided for this process."""
        if self.provenance_mechanism != "auto":
            return self.provenance_mechanism
        from etude.sandbox.fanotify import fanotify_unavailable_reason

        return "fanotify" if fanotify_unavailable_reason() is None else "strace"


@dataclass(kw_only=True, slots=True)
class Result:
    """What one sandboxed command did."""

    stdout: str
    """Standard output (decoded as UTF-8 with replacement), possibly truncated with a marker."""
    stderr: str
    """Standard error, same treatment as ``stdout``."""
    exit_code: int
    """Exit status; a command ended by signal N reports 128 + N (the shell convention)."""
    timed_out: bool
    """The wall-clock limit was reached and the process tree was killed."""
    duration: float
    """Wall-clock seconds from start to the reaped exit."""
    truncated: bool
    """Either stream exceeded ``max_output_bytes`` and was cut."""
    provenance: Provenance | None = None
    """What the command touched (``sandbox.provenance``); None when not recorded."""

    @property
    def ok(self) -> bool:
        """Exited 0 within the time limit."""
        return self.exit_code == 0 and not self.timed_out


@runtime_checkable
class Sandbox(Protocol):
    """Runs commands with the workspace ``cwd`` as the only writable place."""

    config: SandboxConfig
    name: str
    """Backend name, ``bwrap`` or ``local``."""
    not_isolated: tuple[str, ...]
    """What this backend, as configured on this host, does not contain (for warnings and docs)."""

    def run(
        self,
        cmd: Sequence[str] | str,
        cwd: str | os.PathLike[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
    ) -> Result:
        """Run ``cmd`` (argv list, or a string for ``bash -c``) in workspace ``cwd``."""
        ...


def shell_argv(cmd: Sequence[str] | str) -> list[str]:
    """An argv for ``cmd``: a string runs under bash (sh where bash is missing)."""
    if isinstance(cmd, str):
        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        return [shell, "-c", cmd]
    argv = list(cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"command {cmd!r} must be a non-empty list of strings or a shell string")
    return argv


def resolve_workspace(cwd: str | os.PathLike[str]) -> Path:
    """The workspace as a resolved absolute path; it must be an existing directory."""
    path = Path(cwd)
    if not path.is_dir():
        raise ValueError(f"sandbox workspace {str(path)!r} is not a directory; create it first")
    return path.resolve()


def resolve_timeout(timeout: float | None, cfg: SandboxConfig) -> float:
    if timeout is None:
        return cfg.timeout_s
    if not timeout > 0:
        raise ValueError(f"timeout={timeout} must be > 0 seconds (or None for sandbox.timeout_s)")
    return float(timeout)


def sandbox_env(
    cfg: SandboxConfig, extra: Mapping[str, str] | None, *, tmp_dir: str, python_bin: str
) -> dict[str, str]:
    """The command's environment: a clean base, passthrough names, ``cfg.env``, then ``extra``.

    ``python_bin`` (the interpreter's bin directory) leads PATH so ``python`` and ``pytest`` are the
    project's. Bytecode writing is off so that runs leave no ``__pycache__`` in the workspace.
    """
    env = {
        "PATH": f"{python_bin}:/usr/local/bin:/usr/bin:/bin",
        "HOME": tmp_dir,
        "TMPDIR": tmp_dir,
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        # glibc's own spelling of the directory (/usr/lib/locale/C.utf8): "C.UTF-8" first
        # misses once per locale category in every program that starts (13 failed opens each)
        "LANG": "C.utf8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
    }
    for name in cfg.env_passthrough:
        if name in os.environ:
            env[name] = os.environ[name]
    env.update(cfg.env or {})
    env.update(extra or {})
    bad = [k for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise ValueError(f"sandbox environment variable {bad[0]!r} must map a str to a str")
    return env


def prlimit_argv(cfg: SandboxConfig, nproc: int | None) -> list[str]:
    """The limits of ``cfg`` as a ``prlimit`` (util-linux) prefix for a command.

    Cheaper than a preexec function (which forces fork instead of vfork) and safe in threaded
    callers. ``nproc`` is the RLIMIT_NPROC value, or None to leave it alone.
    """
    argv = [
        "prlimit",
        f"--cpu={cfg.cpu_seconds}:{cfg.cpu_seconds + 1}",
        f"--as={cfg.memory_bytes}:{cfg.memory_bytes}",
        f"--fsize={cfg.max_file_bytes}:{cfg.max_file_bytes}",
        f"--nofile={cfg.max_open_files}:{cfg.max_open_files}",
        "--core=0:0",
    ]
    if nproc is not None:
        argv.append(f"--nproc={nproc}:{nproc}")
    return argv + ["--"]


def rlimits(cfg: SandboxConfig, nproc: int | None) -> list[tuple[int, tuple[int, int]]]:
    """The limits of ``prlimit_argv`` as ``(resource, (soft, hard))`` pairs."""
    limits = [
        (resource.RLIMIT_CPU, (cfg.cpu_seconds, cfg.cpu_seconds + 1)),
        (resource.RLIMIT_AS, (cfg.memory_bytes, cfg.memory_bytes)),
        (resource.RLIMIT_FSIZE, (cfg.max_file_bytes, cfg.max_file_bytes)),
        (resource.RLIMIT_NOFILE, (cfg.max_open_files, cfg.max_open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if nproc is not None:
        limits.append((resource.RLIMIT_NPROC, (nproc, nproc)))
    return limits


def apply_rlimits(cfg: SandboxConfig, nproc: int | None) -> None:
    """Set the same limits as ``prlimit_argv`` from a preexec function (where prlimit is missing).

    Only setrlimit calls between fork and exec, as a preexec function must.
    """
    for which, limit in rlimits(cfg, nproc):
        resource.setrlimit(which, limit)


def python_bin_dir() -> str:
    """Directory of the running interpreter's ``python`` (the venv's ``bin`` in a venv)."""
    return os.path.dirname(os.path.abspath(sys.executable))
