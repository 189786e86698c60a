"""Whether bubblewrap works on this host, told apart from a host too busy to answer.

``make_sandbox("auto")`` asks ``bwrap_probe()`` before it picks a backend. The probe runs ``true``
under a real ``BwrapSandbox`` and sorts the outcome into one of three answers:

- **available**: the command ran; ``auto`` uses bwrap.
- **unavailable**: bwrap is missing (not on ``PATH``), or it ran and refused (a non-zero exit
  below 128: no user namespaces, a mount not permitted, a missing tool). This is a property of
  the host, so ``auto`` falls back to the local backend with its warning, as documented, unless
  the configuration requires isolation (``SandboxConfig.require_isolation``).
- **transient**: the probe timed out, was ended by a signal (exit 128 + N: 137 SIGKILL, 143
  SIGTERM), or could not be started for lack of processes or memory. That says the host was
  busy, not that bwrap is unusable, so the probe is retried with longer time limits
  (``PROBE_TIMEOUTS_S``) and, if every try fails that way, ``SandboxUnavailableError`` is raised:
  an RL run never drops to an unisolated sandbox because the machine was loaded.

Definite answers are cached for the process; transient ones are not (the next sandbox probes
again). What this does not do: notice that bwrap stops working after a definite answer (each
command's own result says so), or tell a bwrap that hangs forever from a slow host beyond the
last time limit.
"""

from __future__ import annotations

import errno
import tempfile
import threading
from dataclasses import dataclass
from typing import Literal

from etude.sandbox.base import Result, SandboxConfig

PROBE_COMMAND: tuple[str, ...] = ("true",)
"""What the probe runs inside the sandbox."""
PROBE_TIMEOUTS_S: tuple[float, ...] = (30.0, 60.0, 120.0)
"""One try per entry, with that wall-clock limit; transient failures move to the next."""

_TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EINTR, errno.ENOSPC})

Verdict = Literal["available", "unavailable", "transient"]


class SandboxUnavailableError(RuntimeError):
    """bwrap could not be confirmed usable and falling back to the local backend is not safe."""


@dataclass(frozen=True)
class BwrapProbe:
    """The answer of ``bwrap_probe``."""

    verdict: Verdict
    reason: str | None = None
    """Why bwrap is not used (None when available); for transient answers, every try's failure."""
    tries: int = 1


def classify(result: Result) -> tuple[Verdict, str | None]:
    """One probe run's answer: a timeout or a signal is transient, another failure is definite."""
    if result.timed_out:
        return "transient", f"probe `bwrap ... true` timed out after {result.duration:.1f} s"
    if result.exit_code == 0:
        return "available", None
    detail = result.stderr.strip()[:300]
    if result.exit_code >= 128 or result.exit_code < 0:
        return (
            "transient",
            f"probe `bwrap ... true` ended by a signal (exit {result.exit_code}): {detail}",
        )
    return "unavailable", f"probe `bwrap ... true` exited {result.exit_code}: {detail}"


def _try_once(timeout: float) -> tuple[Verdict, str | None]:
    from etude.sandbox.bwrap import BwrapSandbox  # bwrap.py imports this module

    try:
        sandbox = BwrapSandbox(SandboxConfig(backend="bwrap"))
    except ValueError as e:
        return "unavailable", str(e)
    try:
        with tempfile.TemporaryDirectory(prefix="etude-bwrap-probe-") as tmp:
            result = sandbox.run(list(PROBE_COMMAND), tmp, timeout=timeout)
    except OSError as e:
        verdict: Verdict = "transient" if e.errno in _TRANSIENT_ERRNOS else "unavailable"
        return verdict, f"probe `bwrap ... true` could not start: {e}"
    finally:
        sandbox.close()
    return classify(result)


_lock = threading.Lock()
_cached: BwrapProbe | None = None


def bwrap_probe() -> BwrapProbe:
    """Probe bwrap (see the module docstring); definite answers are cached for the process."""
    global _cached
    with _lock:
        if _cached is not None:
            return _cached
        failures: list[str] = []
        for tries, timeout in enumerate(PROBE_TIMEOUTS_S, start=1):
            verdict, reason = _try_once(timeout)
            if verdict != "transient":
                _cached = BwrapProbe(verdict, reason, tries)
                return _cached
            failures.append(f"try {tries}: {reason}")
        return BwrapProbe("transient", "; ".join(failures), len(PROBE_TIMEOUTS_S))


def forget_probe() -> None:
    """Drop the cached answer (the next ``bwrap_probe`` runs the probe again)."""
    global _cached
    with _lock:
        _cached = None


def transient_error(probe: BwrapProbe) -> SandboxUnavailableError:
    """The error ``auto`` raises when every try failed transiently."""
    return SandboxUnavailableError(
        f"sandbox.backend='auto': bubblewrap did not answer a probe in {probe.tries} tries "
        f"({probe.reason}); the host looks overloaded rather than without bwrap, so the "
        "unisolated local backend is not used; retry when the load drops, set "
        "sandbox.backend='bwrap' to fail on each command instead, or sandbox.backend='local' "
        "to run without isolation on purpose"
    )
