"""Provenance by fanotify (``sandbox.provenance_mechanism = "fanotify"``), attacked live.

Each test runs real commands under bubblewrap with the fanotify recorder and checks one
property against what the command really did: spellings that hide a path, other names of a
file (symlinks, hard links, ``/proc/self/fd``, renamed directories, directory descriptors),
processes that try to outlive the command or run between records, program arguments however the
program was started, and a flood that overflows the kernel's queue (recorded as lost events and
flagged, never as a record of less).
"""

import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

import etude.sandbox.fanotify as fanotify
import etude.sandbox.recorder as recorder
import etude.sandbox.runner as runner
from etude.env.trajectory import ToolCall, Trajectory, Turn
from etude.monitor.rules import BUILTIN_RULES, scan
from etude.monitor.rules.events import normalize_argv
from etude.sandbox import SandboxConfig
from etude.sandbox.bwrap import BwrapSandbox, bwrap_unavailable_reason
from etude.sandbox.provenance import Provenance

PROVENANCE_RULES = tuple(r for r in BUILTIN_RULES if r.is_provenance)
_reason = bwrap_unavailable_reason() or fanotify.fanotify_unavailable_reason()
needs_fanotify = pytest.mark.skipif(_reason is not None, reason=f"bwrap/fanotify: {_reason}")


@pytest.fixture
def workspace():
    ws = Path(tempfile.mkdtemp(prefix="etude-fan-test-"))
    (ws / "sub").mkdir()
    (ws / "sub" / "x.py").write_text("print(1)\n")
    (ws / "a.txt").write_text("a\n")
    (ws / ".mypy_cache").mkdir()
    (ws / ".mypy_cache" / "m.data.json").write_text("{}")
    yield ws
    shutil.rmtree(ws, ignore_errors=True)


@pytest.fixture
def sandbox():
    return BwrapSandbox(
        SandboxConfig(backend="bwrap", provenance=True, provenance_mechanism="fanotify")
    )


def record(sandbox: BwrapSandbox, cmd: str | list[str], ws: Path) -> Provenance:
    result = sandbox.run(cmd, ws)
    assert result.exit_code == 0, result.stderr
    assert result.provenance is not None
    return result.provenance


@needs_fanotify
def test_spellings_do_not_hide_reads_writes_deletions_or_programs(sandbox, workspace):
    prov = record(
        sandbox,
        "D=su; cat ${D}b/x.py >/dev/null; P=.mypy_; cat ${P}cache/m.data.json >/dev/null; "
        "python3 -c \"import os; os.remove('a'+'.txt'); open('o'+'ut','w').write('x')\"; "
        "echo Z2l0IC0tdmVyc2lvbg== | base64 -d | sh >/dev/null; ls sub >/dev/null",
        workspace,
    )
    assert prov.complete and not prov.overflow
    assert {"sub/x.py", ".mypy_cache/m.data.json"} <= set(prov.read)
    assert "a.txt" in prov.deleted and "out" in prov.written and "out" not in prov.read
    assert ["git", "--version"] in prov.processes  # decoded and piped to a shell
    assert ["python3", "-c", "import os; os.remove('a'+'.txt'); open('o'+'ut','w').write('x')"] in (
        prov.processes
    )
    assert "sub" in prov.listed
    # the wrappers bwrap runs first (setpriv, prlimit) are not the command's
    assert prov.processes[0][0] == "/bin/bash"
    assert not any(p[0] in ("setpriv", "prlimit") for p in prov.processes)
    assert "/usr/bin" in prov.runtime_dirs and "/" not in prov.listed


@needs_fanotify
def test_other_names_of_a_file_are_the_file(sandbox, workspace):
    """A symlink, a hard link, /proc/self/fd, /proc/self/cwd and a directory descriptor all
    reach the cache file: each read is recorded as the cache file."""
    script = (
        "import os\n"
        "fd = os.open('.mypy_cache', os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.close(os.open('m.data.json', os.O_RDONLY, dir_fd=fd))\n"
    )
    (workspace / "probe.py").write_text(script)
    cases = {
        "ln -s .mypy_cache/m.data.json link.json && cat link.json": [".mypy_cache/m.data.json"],
        "ln -s .mypy_cache d && cat d/m.data.json": [".mypy_cache/m.data.json"],
        "exec 3< .mypy_cache/m.data.json; cat /proc/self/fd/3": [".mypy_cache/m.data.json"],
        "cat /proc/self/cwd/.mypy_cache/m.data.json": [".mypy_cache/m.data.json"],
        "python3 probe.py": [".mypy_cache/m.data.json"],
        # the link itself counts as a read of its source, as with strace
        "ln .mypy_cache/m.data.json hard && echo changed > hard": [".mypy_cache/m.data.json"],
    }
    for cmd, want in cases.items():
        prov = record(sandbox, cmd + " > /dev/null", workspace)
        assert set(want) <= set(prov.read), (cmd, prov.read)
        for name in ("link.json", "d", "hard"):
            (workspace / name).unlink(missing_ok=True)
    prov = record(sandbox, "ln .mypy_cache/m.data.json h2 && echo more >> h2", workspace)
    assert {".mypy_cache/m.data.json", "h2"} <= set(prov.written)


@needs_fanotify
def test_writes_and_program_starts_that_avoid_the_usual_calls(sandbox, workspace):
    """A truncate by path (no open: the change reaches the inode, not a mount), an execve from
    a process that made itself undumpable, and an fexecve (execveat on a descriptor)."""
    prov = record(sandbox, "python3 -c \"import os; os.truncate('sub/'+'x.py', 0)\"", workspace)
    assert "sub/x.py" in prov.written
    undumpable = (
        "import ctypes, os; ctypes.CDLL(None).prctl(4, 0); "  # PR_SET_DUMPABLE 0
        "os.execv('/usr/bin/git', ['git', '--version'])"
    )
    prov = record(sandbox, ["python3", "-c", undumpable], workspace)
    assert ["git", "--version"] in prov.processes
    by_descriptor = (
        "import os; os.execve(os.open('/usr/bin/git', os.O_RDONLY), ['git', 'log', '--all'], {})"
    )
    result = sandbox.run(["python3", "-c", by_descriptor], workspace)
    assert ["git", "log", "--all"] in result.provenance.processes  # git fails: no repository


@needs_fanotify
def test_proc_probes_are_recorded_and_the_wrappers_are_not(sandbox, workspace):
    """procfs has no file handles: its opens come through a third group. A probe of the
    sandbox's first process and of the prober's own status is recorded (spelled through a
    variable and a concatenation); ``setpriv``'s read of /proc/sys/kernel/cap_last_cap before
    the command is not the command's."""
    quiet = record(sandbox, "true", workspace)
    assert not [p for p in quiet.read + quiet.listed if p.startswith("/proc")]
    prov = record(
        sandbox,
        "p=/proc/1; cat $p/mountinfo > /dev/null; "
        "python3 -c \"import time; open('/proc/'+'self/status').read(); time.sleep(0.2)\"",
        workspace,
    )
    assert {"/proc/1/mountinfo", "/proc/self/status"} <= set(prov.read)


@needs_fanotify
def test_renames_keep_the_name_a_file_had_when_it_was_read(sandbox, workspace):
    """Reading a cache and renaming it away right after: the read is of the cache (the path
    the directory had at the event), the rename reads and deletes the old name."""
    prov = record(
        sandbox,
        "cat .mypy_cache/m.data.json > /dev/null; mv .mypy_cache innocent; "
        "cat innocent/m.data.json > /dev/null; mv sub moved; rm moved/x.py",
        workspace,
    )
    assert {".mypy_cache/m.data.json", "innocent/m.data.json"} <= set(prov.read)
    assert ".mypy_cache" in prov.read and ".mypy_cache" in prov.deleted
    assert "innocent" in prov.written
    assert "sub" in prov.deleted and "moved/x.py" in prov.deleted


@needs_fanotify
def test_a_daemon_does_not_outlive_its_command_or_leak_into_the_next(sandbox, workspace):
    """A detached daemon (new session, ignored hangups, double fork) dies with its sandbox:
    nothing of it runs in the next command, whose record holds the next command's reads alone."""
    first = record(
        sandbox,
        "setsid nohup sh -c '(sleep 0.5; cat sub/x.py; touch late.txt) &' >/dev/null 2>&1 & "
        "cat a.txt > /dev/null",
        workspace,
    )
    time.sleep(1.0)
    second = record(sandbox, "cat .mypy_cache/m.data.json > /dev/null", workspace)
    assert not (workspace / "late.txt").exists()
    assert first.read == ["a.txt"] and second.read == [".mypy_cache/m.data.json"]
    assert ["sleep", "0.5"] not in second.processes


@needs_fanotify
def test_work_on_the_host_between_commands_is_no_commands(sandbox, workspace):
    """The sandbox keeps its queues (and the marks on workspace directories) between commands:
    what another process does in the workspace in between is not the next command's."""
    record(sandbox, "true", workspace)
    subprocess.run(
        ["sh", "-c", "touch host.txt && mkdir hostdir && mv host.txt hostdir/ && rm -r hostdir"],
        cwd=workspace,
        check=True,
    )
    prov = record(sandbox, "cat a.txt > /dev/null", workspace)
    assert prov.read == ["a.txt"] and prov.written == [] and prov.deleted == []


@needs_fanotify
def test_a_detached_grandchild_is_recorded_while_the_command_lives(sandbox, workspace):
    script = (
        "import subprocess, time\n"
        "subprocess.Popen(['python3', '-c', \"open('sub/x.py').read()\"], start_new_session=True,\n"
        "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "time.sleep(1.0)\n"
    )
    (workspace / "probe.py").write_text(script)
    prov = record(sandbox, "python3 probe.py", workspace)
    assert ["python3", "-c", "open('sub/x.py').read()"] in prov.processes
    assert "sub/x.py" in prov.read


@needs_fanotify
def test_commands_get_no_descriptor_of_the_recorder(sandbox, workspace):
    """The gate pipes and fanotify groups stay outside: a recorded command holds the same
    descriptors as an unrecorded one (a group would let it read or answer events)."""
    fds = "import os; print(sorted(os.listdir('/proc/self/fd')))"
    plain = BwrapSandbox(SandboxConfig(backend="bwrap"))
    outs = [sb.run(["python3", "-c", fds], workspace).stdout for sb in (sandbox, plain, sandbox)]
    assert outs == ["['0', '1', '2', '3']\n"] * 3


@needs_fanotify
def test_a_queue_overflow_is_recorded_and_flagged_never_a_smaller_record(
    sandbox, workspace, monkeypatch
):
    """A flood of events past the kernel's queue (16,384), with a reader slowed down to make
    it certain: the record says events were lost, and the monitor flags the turn."""
    read_a = recorder.FanotifyRecorder._read_a

    def slow_read_a(self):
        time.sleep(0.01)
        return read_a(self)

    monkeypatch.setattr(recorder, "READ_BYTES", 4096)
    monkeypatch.setattr(recorder.FanotifyRecorder, "_read_a", slow_read_a)
    flood = (
        "import os\n"
        "for i in range(30000):\n"
        "    os.close(os.open(f'/tmp/f{i}', os.O_CREAT | os.O_WRONLY))\n"
        "open('.mypy_cache/m.data.json').read()\n"
    )
    result = sandbox.run(["python3", "-c", flood], workspace, timeout=120)
    assert result.exit_code == 0, result.stderr
    prov = result.provenance
    assert prov.overflow and not prov.complete
    traj = Trajectory(task_id="t")
    call = ToolCall(name="bash", arguments={"command": "python3 flood.py"})
    traj.turns.append(Turn(role="assistant", text="", tool_calls=[call]))
    traj.turns.append(Turn(role="tool", text="", tool_name="bash", provenance=prov.to_json()))
    assert "prov.record_lost" in {f.rule for f in scan(traj, PROVENANCE_RULES) if f.severity >= 3}
    monkeypatch.undo()
    after = record(sandbox, "cat a.txt", workspace)
    assert after.complete and not after.overflow and after.read == ["a.txt"]


@needs_fanotify
def test_a_flood_cannot_hold_the_deadline_and_its_record_says_it_is_incomplete(
    sandbox, workspace, monkeypatch
):
    """A command that floods the recorder in an endless loop: distinct opens (past the
    kernel's queue; the reader slowed down to make that certain, as above) and hard links in a
    workspace of 1,000 files (each link once cost a walk of the workspace, in the loop that
    holds the deadline and in the drain after it). The run returns by its timeout plus the
    runner's graces and the drain's budget, timed out, its record incomplete; the next
    command's record is whole."""
    for i in range(1000):
        (workspace / f"seed{i}.txt").write_text("x")
    read_a = recorder.FanotifyRecorder._read_a

    def slow_read_a(self):
        time.sleep(0.005)
        return read_a(self)

    monkeypatch.setattr(recorder, "READ_BYTES", 4096)
    monkeypatch.setattr(recorder.FanotifyRecorder, "_read_a", slow_read_a)
    flood = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    for i in range(5000):\n"
        "        os.link('a.txt', f'l{i}')\n"
        "i = 0\n"
        "while True:\n"
        "    os.close(os.open(f'/tmp/f{i}', os.O_CREAT | os.O_WRONLY))\n"
        "    i += 1\n"
    )
    # long enough that python is flooding before the deadline on a loaded host (at 1 s a busy
    # machine killed it before its first open: a complete, empty record)
    timeout = 3.0
    start = time.monotonic()
    result = sandbox.run(["python3", "-c", flood], workspace, timeout=timeout)
    elapsed = time.monotonic() - start
    bound = timeout + runner.WATCHDOG_GRACE_S + runner.ABANDON_GRACE_S + recorder.DRAIN_BUDGET_S
    assert result.timed_out
    # slack for bwrap and the workspace's chown of 6,000 files on a loaded host; the recorder
    # this guards against held the run for minutes
    assert elapsed < bound + 10.0, elapsed
    prov = result.provenance
    assert not prov.complete and prov.overflow
    monkeypatch.undo()
    after = record(sandbox, "cat a.txt", workspace)
    assert after.complete and not after.overflow and after.read == ["a.txt"]


@needs_fanotify
def test_the_wrappers_programs_are_held_again_once_the_command_runs(sandbox, workspace):
    """The wrappers' program starts (``setpriv``, ``prlimit`` and their loader) are not held
    before the command; the command's own starts of the same files are held and recorded,
    from a shell command and as the command itself (an argv list, where nothing is ignored)."""
    loader = fanotify.elf_interpreter(shutil.which("setpriv"))
    assert loader
    cmd = (
        "setpriv --reuid=61999 --regid=61999 --clear-groups true; "
        "prlimit --nofile=64:64 cat a.txt; "
        f"{loader} /usr/bin/cat sub/x.py"
    )
    prov = record(sandbox, cmd, workspace)
    processes = [normalize_argv(p) for p in prov.processes]
    assert "setpriv --reuid=61999 --regid=61999 --clear-groups true" in processes
    assert "prlimit --nofile=64:64 cat a.txt" in processes
    assert "cat a.txt" in processes and "cat sub/x.py" in processes
    assert {"a.txt", "sub/x.py"} <= set(prov.read)
    as_command = record(sandbox, ["prlimit", "--nofile=64:64", "cat", "a.txt"], workspace)
    assert [normalize_argv(p) for p in as_command.processes] == [
        "prlimit --nofile=64:64 cat a.txt",
        "cat a.txt",
    ]
    assert len(record(sandbox, "true", workspace).processes) == 1  # bash alone, no wrapper


@needs_fanotify
def test_the_limits_hold_without_a_prlimit_program_in_the_sandbox(workspace):
    """With fanotify the limits are set on the sandbox's first process while it waits on the
    block pipe: the command and its children have them, and no prlimit runs."""
    sandbox = BwrapSandbox(
        SandboxConfig(
            backend="bwrap",
            provenance=True,
            provenance_mechanism="fanotify",
            cpu_seconds=7,
            memory_bytes=300 << 20,
            max_file_bytes=5 << 20,
            max_processes=40,
        )
    )
    result = sandbox.run("ulimit -t -v -f -n -c -u; bash -c 'ulimit -v'", workspace)
    values = [line.split()[-1] for line in result.stdout.splitlines()]
    assert values == ["7", str(300 << 10), str(5 << 10), "1024", "0", "40", str(300 << 10)]
    assert not any("prlimit" in " ".join(p) for p in result.provenance.processes)
    hog = sandbox.run(["python3", "-c", "b = bytearray(1 << 30)"], workspace)
    assert "MemoryError" in hog.stderr


@needs_fanotify
def test_a_command_whose_limits_cannot_be_set_does_not_run(sandbox, workspace, monkeypatch):
    def refuse(*args):
        raise PermissionError(1, "prlimit refused")

    monkeypatch.setattr(recorder.resource, "prlimit", refuse)
    workspace.chmod(0o777)  # writable by the sandbox's uid even once the call has returned
    result = sandbox.run("touch ran", workspace)
    time.sleep(0.5)  # a command let loose would have run by now
    assert result.exit_code != 0 and not (workspace / "ran").exists()
    monkeypatch.undo()
    assert sandbox.run("touch ran", workspace).ok and (workspace / "ran").exists()


def test_an_overflowed_record_says_so_in_its_summary_and_merge():
    lost = Provenance(read=["a"], overflow=True, complete=False)
    assert "events lost" in lost.summary()
    from etude.sandbox.provenance import merge

    merged = merge([Provenance(read=["b"]), lost])
    assert merged.overflow and not merged.complete
    assert Provenance.from_json(lost.to_json()) == lost


def test_mechanism_setting_is_validated():
    with pytest.raises(ValueError, match="provenance_mechanism"):
        SandboxConfig(provenance_mechanism="ptrace")


@needs_fanotify
def test_a_program_is_recorded_as_itself_whatever_name_or_loader_starts_it(sandbox, workspace):
    """``exec -a NAME`` gives a program another argv[0]; the dynamic loader run as a program
    starts one without an execve of it: the monitor reads the program that ran."""
    prov = record(
        sandbox,
        "(exec -a ls git log -1) 2> /dev/null; "
        "/lib64/ld-linux-x86-64.so.2 --argv0 cat /usr/bin/git log -1 2> /dev/null; true",
        workspace,
    )
    assert [normalize_argv(argv) for argv in prov.processes[1:]] == ["git log -1"] * 2


@needs_fanotify
def test_arguments_changed_after_they_were_read_are_recorded_as_run(
    sandbox, workspace, monkeypatch
):
    """The argv is read from the caller's memory while its execve is held; another thread of
    the caller could rewrite it before the kernel copies it. Such a race (made certain here by
    a reader that sees other arguments) still leaves the arguments that ran in the record: the
    program's first open in its new image checks /proc/PID/cmdline."""
    real = recorder.read_argv

    def stale(pid, call):
        given, argv = real(pid, call)
        return given, [a.replace("time.sleep(0.5)", "pass") for a in argv]

    monkeypatch.setattr(recorder, "read_argv", stale)
    prov = record(sandbox, ["python3", "-c", "import time; time.sleep(0.5)"], workspace)
    args = [argv[1:] for argv in prov.processes]
    assert ["-c", "import time; pass"] in args  # what the (stale) read saw
    assert ["-c", "import time; time.sleep(0.5)"] in args  # what ran


@needs_fanotify
def test_closing_the_sandbox_during_a_command_waits_for_its_record(sandbox, workspace):
    """``close`` (the episode ends) from another thread while a command runs: the command's
    record is whole, the groups go after it, and a later command makes new ones."""
    results = []
    runner = threading.Thread(
        target=lambda: results.append(sandbox.run("sleep 0.5; cat a.txt", workspace))
    )
    runner.start()
    time.sleep(0.2)
    sandbox.close()
    runner.join()
    assert results[0].exit_code == 0 and results[0].provenance.complete
    assert results[0].provenance.read == ["a.txt"]
    assert record(sandbox, "cat sub/x.py > /dev/null", workspace).read == ["sub/x.py"]


@needs_fanotify
def test_sandboxes_in_threads_keep_their_own_queues(workspace):
    """Episodes run side by side in threads (the env pool), each sandbox with its groups: a
    descriptor closed twice by one would be another's by then (a group read as garbage, a
    command that never ends). Every record is whole and each holds its own command's read."""

    def episode(i: int) -> None:
        ws = Path(tempfile.mkdtemp(prefix=f"etude-fan-pool-{i}-"))
        (ws / f"f{i}.txt").write_text("x")
        sandbox = BwrapSandbox(
            SandboxConfig(backend="bwrap", provenance=True, provenance_mechanism="fanotify")
        )
        try:
            for _ in range(8):
                prov = sandbox.run(f"cat f{i}.txt > /dev/null", ws).provenance
                outcomes.append(prov.complete and prov.read == [f"f{i}.txt"])
        finally:
            sandbox.close()
            shutil.rmtree(ws, ignore_errors=True)

    outcomes: list[bool] = []
    threads = [threading.Thread(target=episode, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a recorder never finished"
    assert outcomes == [True] * 32
