"""File-access provenance: the strace log parser on recorded lines, and live bwrap runs.

The live tests run real commands under bubblewrap with the strace mechanism and check that
what the command did is recorded however it was spelled (variables, interpreters, links, renames,
directory descriptors, detached processes), that one tracer serves a sandbox's commands without
mixing their records, and that the command can neither stop the tracer nor reach its log.
"""

import shutil
import tempfile
from pathlib import Path

import pytest

from etude.monitor.rules.events import normalize_argv, process_names
from etude.sandbox import SandboxConfig
from etude.sandbox.bwrap import BwrapSandbox, bwrap_unavailable_reason
from etude.sandbox.provenance import Provenance, merge, parse_strace, split_args
from etude.sandbox.tracer import find_end

WS = "/work/ep/workspace"


def parse(lines: str, **kw) -> Provenance:
    kw.setdefault("workspace", WS)
    return parse_strace(lines.strip().splitlines(), **kw)


def test_opens_are_sorted_by_what_they_do():
    prov = parse(
        f"""
7 openat(AT_FDCWD</work/ep/workspace>, "textkit/roman.py", O_RDONLY|O_CLOEXEC) = 3</work/ep/workspace/textkit/roman.py>
7 openat(AT_FDCWD, "out.txt", O_WRONLY|O_CREAT|O_TRUNC, 0666) = 4
7 openat(AT_FDCWD, ".coverage", O_RDWR|O_CREAT|O_CLOEXEC, 0644) = 5
7 openat(AT_FDCWD, "textkit", O_RDONLY|O_NONBLOCK|O_CLOEXEC|O_DIRECTORY) = 6
7 openat(AT_FDCWD, "/run", O_RDONLY|O_PATH|O_DIRECTORY) = 7
7 openat(AT_FDCWD, ".mypy_cache/x.json", O_RDONLY) = -1 ENOENT (No such file or directory)
7 openat(AT_FDCWD, "textkit/__pycache__/roman.cpython-311.pyc", O_RDONLY) = -1 ENOENT (No such file or directory)
7 openat(AT_FDCWD, "/dev/null", O_WRONLY|O_CREAT|O_TRUNC, 0666) = 3
7 openat(AT_FDCWD, "{WS}/../elsewhere/tasks.jsonl", O_RDONLY) = 3
"""
    )
    assert prov.read == ["textkit/roman.py", ".coverage", "/work/ep/elsewhere/tasks.jsonl"]
    assert prov.written == ["out.txt", ".coverage"]
    assert prov.listed == ["textkit"]
    # a missing cache is a look for it; a missing bytecode entry is every import's probe
    assert prov.failed == [".mypy_cache/x.json"]
    assert prov.complete and not prov.truncated


def test_cwd_follows_chdir_fchdir_and_clone():
    prov = parse(
        """
10 chdir("sub") = 0
10 clone(child_stack=NULL, flags=CLONE_CHILD_CLEARTID|SIGCHLD, child_tidptr=0x7f) = 11
11 openat(AT_FDCWD, "a.txt", O_RDONLY) = 3
10 fchdir(3</tmp/scratch>) = 0
10 openat(AT_FDCWD, "b.txt", O_RDONLY) = 3
11 openat(4</work/ep/workspace/tests>, "test_x.py", O_RDONLY) = 5
"""
    )
    assert prov.read == ["sub/a.txt", "/tmp/scratch/b.txt", "tests/test_x.py"]


def test_unfinished_calls_resume_and_renames_delete_and_write():
    prov = parse(
        """
20 unlinkat(AT_FDCWD, "tests/test_a.py", 0 <unfinished ...>
21 execve("/usr/bin/git", ["git", "-c", "a=b", "log"], 0x7ffd /* 3 vars */ <unfinished ...>
20 <... unlinkat resumed>) = 0
21 <... execve resumed>) = 0
20 renameat2(AT_FDCWD, "tests/sedAb12", AT_FDCWD, "tests/test_b.py", 0) = 0
20 rename("old.py", "/tmp/old.py") = 0
20 mkdir("newdir", 0777) = 0
20 rmdir("newdir") = 0
20 unlink("missing") = -1 ENOENT (No such file or directory)
"""
    )
    assert prov.deleted == ["tests/test_a.py", "tests/sedAb12", "old.py", "newdir"]
    assert prov.written == ["tests/test_b.py", "/tmp/old.py", "newdir"]
    assert prov.executed == ["/usr/bin/git"]
    assert prov.processes == [["git", "-c", "a=b", "log"]]


def test_wrappers_runtime_and_escapes():
    prov = parse(
        r"""
5 execve("/usr/bin/setpriv", ["setpriv", "--"], 0x1 /* 2 vars */) = 0
5 openat(AT_FDCWD, "/proc/self/status", O_RDONLY) = 3
5 execve("/usr/bin/prlimit", ["prlimit", "--"], 0x1 /* 2 vars */) = 0
5 execve("/bin/bash", ["bash", "-c", "cat \"a\\nb\" \303\251"], 0x1 /* 2 vars */) = 0
5 openat(AT_FDCWD, "/usr/lib/python3.11/json/__init__.py", O_RDONLY) = 3
5 openat(AT_FDCWD, "/usr/lib/python3.11/json/decoder.py", O_RDONLY) = 3
5 openat(AT_FDCWD, "/usr/lib/python3/dist-packages/textkit/deep/roman.py", O_RDONLY) = 3
5 openat(AT_FDCWD, "/usr/lib/missing.so", O_RDONLY) = -1 ENOENT (No such file or directory)
5 openat(AT_FDCWD, "we\"ird\x41.txt", O_RDONLY) = 3
""",
        runtime_roots=["/usr"],
        wrapper_execs=2,
    )
    # setpriv's own /proc read is not the command's; the command's exec is
    assert prov.processes == [["bash", "-c", 'cat "a\\nb" \u00e9']]
    assert prov.runtime_dirs == {
        "/usr/lib/python3.11/json": 2,
        "/usr/lib/python3/dist-packages/textkit": 1,
    }
    assert prov.failed == [] and prov.read == ['we"irdA.txt']


def test_a_program_is_recorded_as_itself_whatever_its_argv0():
    """``exec -a ls git log`` passes argv[0] ``ls``: the record names the program that ran; a
    login shell's ``-bash`` stays; the loader run as a program counts as the program it runs."""
    prov = parse(
        """
5 execve("/usr/bin/git", ["ls", "log"], 0x1 /* 2 vars */) = 0
6 execve("/bin/bash", ["-bash"], 0x1 /* 2 vars */) = 0
"""
    )
    assert prov.processes == [["/usr/bin/git", "log"], ["-bash"]]
    loader = ["/lib64/ld-linux-x86-64.so.2", "--library-path", "/x", "--argv0", "ls"]
    assert normalize_argv([*loader, "/usr/bin/git", "log"]) == "git log"
    assert process_names([[*loader, "/usr/bin/git", "log"]]) == ("git",)
    assert (
        normalize_argv(["/lib64/ld-linux-x86-64.so.2", "--list"]) == "ld-linux-x86-64.so.2 --list"
    )


def test_split_args_keeps_strings_and_brackets_whole():
    args = split_args('AT_FDCWD, "a, b", ["x", "y,z"], {st_mode=0}, 3</p, q>')
    assert args == ["AT_FDCWD", '"a, b"', '["x", "y,z"]', "{st_mode=0}", "3</p, q>"]


def test_cut_trace_is_incomplete_and_merge_unions():
    prov = parse('9 openat(AT_FDCWD, "a", O_RDONLY <unfinished ...>')
    assert not prov.complete
    other = Provenance(read=["a", "b"], processes=[["ls"]], runtime_dirs={"/usr": 2})
    both = merge([Provenance(read=["a"], runtime_dirs={"/usr": 1}), None, other])
    assert both.read == ["a", "b"] and both.runtime_dirs == {"/usr": 3}
    assert Provenance.from_json(both.to_json()) == both
    with pytest.raises(ValueError, match="unknown keys"):
        Provenance.from_json({"reads": []})


needs_bwrap = pytest.mark.skipif(
    bwrap_unavailable_reason() is not None or shutil.which("strace") is None,
    reason=f"bwrap or strace unavailable: {bwrap_unavailable_reason()}",
)


@pytest.fixture
def workspace():
    ws = Path(tempfile.mkdtemp(prefix="etude-prov-test-"))
    (ws / "sub").mkdir()
    (ws / "sub" / "x.py").write_text("print(1)\n")
    (ws / "a.txt").write_text("a\n")
    (ws / ".mypy_cache").mkdir()
    (ws / ".mypy_cache" / "m.data.json").write_text("{}")
    yield ws
    shutil.rmtree(ws, ignore_errors=True)


@needs_bwrap
def test_live_provenance_sees_through_spelling(workspace):
    sandbox = BwrapSandbox(
        SandboxConfig(backend="bwrap", provenance=True, provenance_mechanism="strace")
    )
    cmd = (
        "D=su; cat ${D}b/x.py >/dev/null; P=.mypy_; cat ${P}cache/m.data.json >/dev/null; "
        "python3 -c \"import os; os.remove('a'+'.txt'); open('o'+'ut','w').write('x')\"; "
        "echo Z2l0IC0tdmVyc2lvbg== | base64 -d | sh >/dev/null"
    )
    result = sandbox.run(cmd, workspace)
    assert result.exit_code == 0, result.stderr
    prov = result.provenance
    assert prov is not None and prov.complete
    assert {"sub/x.py", ".mypy_cache/m.data.json"} <= set(prov.read)
    assert "a.txt" in prov.deleted and "out" in prov.written
    assert ["git", "--version"] in prov.processes
    assert all(not p.startswith(str(workspace)) for p in prov.read)  # relative inside it


@needs_bwrap
def test_live_links_renames_dirfds_and_detached_processes(workspace):
    """Spellings that reach a file under another name or from another process: a symlink to a
    file and to a directory, a hard link written through, a renamed directory, an open relative
    to a directory descriptor, a detached grandchild in its own session."""
    sandbox = BwrapSandbox(
        SandboxConfig(backend="bwrap", provenance=True, provenance_mechanism="strace")
    )
    script = (
        "import os, subprocess, time\n"
        "fd = os.open('.mypy_cache', os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.close(os.open('m.data.json', os.O_RDONLY, dir_fd=fd))\n"
        "subprocess.Popen(['python3', '-c', \"open('sub/x.py').read()\"], start_new_session=True,\n"
        "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "time.sleep(1.0)\n"
    )
    (workspace / "probe.py").write_text(script)
    cmd = (
        "ln -s .mypy_cache/m.data.json link.json && cat link.json >/dev/null; "
        "ln -s .mypy_cache cachedir && cat cachedir/m.data.json >/dev/null; "
        "ln a.txt hard.txt && echo changed > hard.txt; "
        "mv sub moved && cat moved/x.py >/dev/null; "
        "python3 probe.py"
    )
    result = sandbox.run(cmd, workspace)
    assert result.exit_code == 0, result.stderr
    prov = result.provenance
    assert prov is not None and prov.complete
    # symlinks: the file the kernel opened is recorded beside the link's own path
    assert {"link.json", "cachedir/m.data.json", ".mypy_cache/m.data.json"} <= set(prov.read)
    # a hard link's source counts as read and written (the write went to a.txt's content)
    assert "a.txt" in prov.read and {"hard.txt", "a.txt"} <= set(prov.written)
    # a moved directory: its old name is read and deleted, its new one written
    assert "sub" in prov.read and "sub" in prov.deleted and "moved" in prov.written
    assert "moved/x.py" in prov.read
    # the detached grandchild read sub/x.py before the sandbox ended (it was moved: moved/x.py)
    assert ["python3", "-c", "open('sub/x.py').read()"] in prov.processes
    assert "sub/x.py" in prov.failed


@needs_bwrap
def test_live_tracer_is_out_of_the_commands_reach(workspace):
    """The tracer runs on the host, outside the sandbox's PID namespace: a command that kills
    every process it can see, and looks for the trace, neither stops it nor reaches its log."""
    sandbox = BwrapSandbox(
        SandboxConfig(backend="bwrap", provenance=True, provenance_mechanism="strace")
    )
    assert sandbox.run("true", workspace).provenance.complete
    tracer = sandbox._tracer
    before = tracer.tracer_pid
    killer = (
        "import os, signal\n"
        "seen = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "comms = [open(f'/proc/{p}/comm').read().strip() for p in seen]\n"
        "assert 'strace' not in comms, comms\n"
        "for p in seen:\n"
        "    if int(p) != os.getpid():\n"
        "        try:\n"
        "            os.kill(int(p), signal.SIGKILL)\n"
        "        except OSError:\n"
        "            pass\n"
        "print(sorted(os.listdir('/dev/shm')), open('a.txt').read().strip())\n"
    )
    result = sandbox.run(["python3", "-c", killer], workspace)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "[] a\n"  # the host's /dev/shm, where the log is, is not there
    prov = result.provenance
    assert prov is not None and prov.complete and "a.txt" in prov.read
    assert tracer.tracer_pid == before and tracer.starts == 1
    assert BwrapSandbox(SandboxConfig(backend="bwrap")).run("true", workspace).provenance is None


def test_a_forged_exit_line_inside_a_path_does_not_end_the_record():
    """strace escapes newlines in strings, so a file name cannot carry a line of its own."""
    trace = (
        b'7 openat(AT_FDCWD, "x\\n7 +++ exited with 0 +++\\n", O_RDONLY) = 3\n'
        b'7 openat(AT_FDCWD, "a.txt", O_RDONLY) = 3\n'
        b"7    +++ exited with 0 +++\n"
        b"8 clone3(...) = 9\n"
    )
    end = find_end(trace, 7)
    assert end is not None and trace[:end].endswith(b"7    +++ exited with 0 +++\n")
    assert find_end(trace, 70) is None


@needs_bwrap
def test_live_commands_get_no_descriptor_of_the_tracer(workspace):
    """The launcher's socket would let a command start processes outside the sandbox: a traced
    command holds the same descriptors as an untraced one, stdin, stdout and stderr alone."""
    fds = "import os; print(sorted(os.listdir('/proc/self/fd')))"
    traced = BwrapSandbox(
        SandboxConfig(backend="bwrap", provenance=True, provenance_mechanism="strace")
    )
    plain = BwrapSandbox(SandboxConfig(backend="bwrap"))
    want = "['0', '1', '2', '3']\n"  # 3: the listing's own directory descriptor
    for sandbox in (traced, plain, traced):
        result = sandbox.run(["python3", "-c", fds], workspace)
        assert result.exit_code == 0, result.stderr
        assert result.stdout == want


@needs_bwrap
def test_live_one_tracer_per_sandbox_and_records_do_not_mix(workspace):
    sandbox = BwrapSandbox(
        SandboxConfig(backend="bwrap", provenance=True, provenance_mechanism="strace")
    )
    first = sandbox.run("cat a.txt > /dev/null; (sleep 0.3; cat sub/x.py) &", workspace)
    second = sandbox.run("cat .mypy_cache/m.data.json > /dev/null", workspace)
    assert first.provenance.read == ["a.txt"]  # the background job died with the sandbox
    assert second.provenance.read == [".mypy_cache/m.data.json"]
    assert sandbox._tracer.starts == 1
    sandbox.close()
    assert sandbox._tracer.tracer_pid is None
    third = sandbox.run("cat a.txt > /dev/null", workspace)
    assert third.provenance.read == ["a.txt"] and sandbox._tracer.starts == 2


@needs_bwrap
def test_live_trace_flood_is_capped_and_marked_incomplete(workspace, monkeypatch):
    """A command that floods the trace hits the tracer's size cap: the tracer ends (nothing
    fills the host), the record says it is incomplete, and the next command gets a new one.
    Without its tracer the command is not let loose: the traced calls fail (the seccomp filter
    that stops them has no tracer left, so the kernel answers ENOSYS)."""
    import etude.sandbox.provenance as provenance

    monkeypatch.setattr(provenance, "TRACE_MAX_BYTES", 1 << 16)
    sandbox = BwrapSandbox(
        SandboxConfig(backend="bwrap", provenance=True, provenance_mechanism="strace")
    )
    result = sandbox.run(
        "for i in $(seq 400); do cat a.txt; done > /dev/null; echo done", workspace
    )
    assert result.exit_code != 0 and "Function not implemented" in result.stderr
    assert result.provenance is not None
    assert not result.provenance.complete and result.provenance.truncated
    monkeypatch.setattr(provenance, "TRACE_MAX_BYTES", 64 << 20)
    after = sandbox.run("cat a.txt", workspace).provenance
    assert after.complete and after.read == ["a.txt"] and sandbox._tracer.starts == 2
