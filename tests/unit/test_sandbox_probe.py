"""The bwrap probe behind ``make_sandbox("auto")``: a busy host must not buy an unisolated sandbox.

Attacks: the real probe timing out, the real probe's command killed by SIGTERM or SIGKILL (what
a loaded host or an OOM killer does), each of which must raise, not yield a ``LocalSandbox``;
a transient answer must not stick; bwrap missing or refusing still falls back with the warning
unless ``require_isolation`` is set, and an explicit ``backend='local'`` is always honoured.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest

from etude.sandbox import (
    BwrapSandbox,
    LocalSandbox,
    SandboxConfig,
    SandboxUnavailableError,
    make_sandbox,
)
from etude.sandbox import probe as probe_mod
from etude.sandbox.bwrap import bwrap_unavailable_reason

HAVE_BWRAP = bwrap_unavailable_reason() is None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason=f"bwrap: {bwrap_unavailable_reason()}")


@pytest.fixture(autouse=True)
def fresh_probe() -> Iterator[None]:
    """Each test probes from scratch; the process's cached answer is restored afterwards."""
    probe_mod.forget_probe()
    yield
    probe_mod.forget_probe()


def run_local(cmd: list[str], timeout: float = 30.0):  # noqa: ANN201 - a Result
    with tempfile.TemporaryDirectory() as tmp, pytest.warns(RuntimeWarning):
        return LocalSandbox(SandboxConfig(backend="local")).run(cmd, tmp, timeout=timeout)


def test_classify_timeout_and_signals_as_transient() -> None:
    timed_out = run_local(["sleep", "5"], timeout=0.3)
    assert timed_out.timed_out
    assert probe_mod.classify(timed_out)[0] == "transient"
    for sig, code in (("TERM", 143), ("KILL", 137)):
        killed = run_local(["sh", "-c", f"kill -{sig} $$"])
        assert killed.exit_code == code
        assert probe_mod.classify(killed)[0] == "transient"


def test_classify_refusal_as_unavailable() -> None:
    refused = run_local(
        ["sh", "-c", "echo 'bwrap: No permissions to create new namespace' >&2; exit 1"]
    )
    verdict, reason = probe_mod.classify(refused)
    assert verdict == "unavailable"
    assert reason is not None and "No permissions" in reason
    assert probe_mod.classify(run_local(["true"]))[0] == "available"


@needs_bwrap
def test_probe_that_times_out_never_yields_a_local_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe_mod, "PROBE_TIMEOUTS_S", (0.001, 0.001))
    with pytest.raises(SandboxUnavailableError, match="overloaded") as err:
        make_sandbox("auto")
    assert "2 tries" in str(err.value) and "timed out" in str(err.value)
    with pytest.raises(SandboxUnavailableError):
        make_sandbox(None, SandboxConfig())  # the default backend is auto


@needs_bwrap
@pytest.mark.parametrize("signal", ["TERM", "KILL"])
def test_probe_killed_by_a_signal_never_yields_a_local_sandbox(
    monkeypatch: pytest.MonkeyPatch, signal: str
) -> None:
    monkeypatch.setattr(probe_mod, "PROBE_COMMAND", ("sh", "-c", f"kill -{signal} $$"))
    monkeypatch.setattr(probe_mod, "PROBE_TIMEOUTS_S", (30.0, 30.0))
    with pytest.raises(SandboxUnavailableError, match="signal"):
        make_sandbox("auto")


@needs_bwrap
def test_transient_answer_is_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        m.setattr(probe_mod, "PROBE_TIMEOUTS_S", (0.001,))
        assert probe_mod.bwrap_probe().verdict == "transient"
    assert isinstance(make_sandbox("auto"), BwrapSandbox)


@needs_bwrap
def test_transient_then_success_uses_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first try that times out and a second that answers: bwrap, after two tries."""
    monkeypatch.setattr(probe_mod, "PROBE_TIMEOUTS_S", (0.001, 60.0))
    probe = probe_mod.bwrap_probe()
    assert probe.verdict == "available" and probe.tries == 2
    assert isinstance(make_sandbox("auto"), BwrapSandbox)


@needs_bwrap
def test_refusing_bwrap_falls_back_with_warning_unless_isolation_is_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A definite refusal (exit 1 with bwrap's message) is the documented fallback."""
    monkeypatch.setattr(
        probe_mod,
        "PROBE_COMMAND",
        ("sh", "-c", "echo 'bwrap: setting up uid map: denied' >&2; exit 1"),
    )
    with pytest.warns(RuntimeWarning, match="NOT isolated"):
        assert isinstance(make_sandbox("auto"), LocalSandbox)
    with pytest.raises(SandboxUnavailableError, match="require_isolation"):
        make_sandbox("auto", SandboxConfig(require_isolation=True))


def test_missing_bwrap_falls_back_unless_isolation_is_required(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # noqa: ANN001
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap, prlimit or setpriv
    probe = probe_mod.bwrap_probe()
    assert probe.verdict == "unavailable" and "on PATH" in (probe.reason or "")
    with pytest.warns(RuntimeWarning, match="bubblewrap is not usable"):
        assert isinstance(make_sandbox("auto"), LocalSandbox)
    with pytest.raises(SandboxUnavailableError, match="require_isolation"):
        make_sandbox(None, SandboxConfig(require_isolation=True))


def test_explicit_local_is_honoured_with_isolation_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(probe_mod, "PROBE_TIMEOUTS_S", (0.001,))
    with pytest.warns(RuntimeWarning, match="NOT isolated"):
        sandbox = make_sandbox(None, SandboxConfig(backend="local", require_isolation=True))
    assert isinstance(sandbox, LocalSandbox)
