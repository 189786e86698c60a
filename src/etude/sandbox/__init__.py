"""Sandboxed command execution for agent tools and test-based rewards.

``make_sandbox(backend, cfg).run(cmd, cwd, timeout=, env=, stdin=) -> Result`` runs untrusted
code (an agent's shell command, a task's test suite) with the workspace ``cwd`` as the only
writable place; ``run_pytest`` runs test ids in it and parses per-test outcomes; ``grade`` is the
one grader (clean room, isolated interpreter, a result channel, cross-checks) behind every
reward and task check (``etude.sandbox.grader``).

What IS contained, per backend:

================================  =====================  =================================
property                          ``bwrap`` (default)    ``local`` (fallback)
================================  =====================  =================================
network                           own net namespace      NOT isolated
writes outside the workspace      read-only / absent     NOT isolated
reads outside the workspace       only system + Python   NOT isolated
hidden paths in the workspace     empty read-only mask   NOT isolated
/tmp                              private tmpfs          shared (HOME, TMPDIR private)
processes                         own PID namespace      own session (setsid escapes)
orphans after the call            killed (namespace)     killed (process group)
wall-clock timeout                kills the tree         kills the process group
process count (RLIMIT_NPROC)      per run (leased uid)   yes, but NOT as root
CPU, address space, file size,    per process rlimits    per process rlimits
open files
output                            capped per stream      capped per stream
================================  =====================  =================================

What is NOT contained by either: total disk use in the workspace (only each file is capped);
resident memory of the whole process tree (the limit is address space per process); total CPU
time of the tree (per process; the wall-clock timeout bounds it); the host kernel itself.
``Sandbox.not_isolated`` lists the gaps of a backend as configured on this host, and the local
backend warns with that list when constructed.
"""

from __future__ import annotations

from etude.sandbox.base import Backend, Result, Sandbox, SandboxConfig
from etude.sandbox.bwrap import BwrapSandbox, bwrap_unavailable_reason
from etude.sandbox.grader import Outcome, Status, grade
from etude.sandbox.local import LocalSandbox
from etude.sandbox.probe import SandboxUnavailableError, bwrap_probe, transient_error
from etude.sandbox.pytest import TestOutcome, TestRun, run_pytest

__all__ = [
    "Backend",
    "BwrapSandbox",
    "LocalSandbox",
    "Outcome",
    "Result",
    "Sandbox",
    "SandboxConfig",
    "SandboxUnavailableError",
    "Status",
    "TestOutcome",
    "TestRun",
    "bwrap_unavailable_reason",
    "grade",
    "make_sandbox",
    "run_pytest",
]


def make_sandbox(backend: Backend | None = None, cfg: SandboxConfig | None = None) -> Sandbox:
    """A sandbox for ``backend`` (default ``cfg.backend``): ``auto`` is bwrap where it works.

    When ``auto`` finds bubblewrap missing or not permitted it returns the local backend, which
    warns with the reason and everything that is then no longer isolated; with
    ``cfg.require_isolation`` it raises ``SandboxUnavailableError`` instead. A probe that only
    times out or is killed (a loaded host) is retried and then raises the same error: that is
    never a reason to run unisolated (``etude.sandbox.probe``).
    """
    cfg = cfg if cfg is not None else SandboxConfig()
    choice = backend if backend is not None else cfg.backend
    if choice == "bwrap":
        return BwrapSandbox(cfg)
    if choice == "local":
        return LocalSandbox(cfg)
    if choice != "auto":
        raise ValueError(f"sandbox backend {choice!r} is unknown; use 'auto', 'bwrap' or 'local'")
    probe = bwrap_probe()
    if probe.verdict == "available":
        return BwrapSandbox(cfg)
    if probe.verdict == "transient":
        raise transient_error(probe)
    if cfg.require_isolation:
        raise SandboxUnavailableError(
            f"sandbox.require_isolation is true but bubblewrap is not usable here "
            f"({probe.reason}); install bubblewrap and allow user namespaces "
            "(`make system-deps`), or set sandbox.backend='local' to run without isolation "
            "on purpose"
        )
    return LocalSandbox(cfg, reason=probe.reason)
