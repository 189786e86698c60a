"""The bubblewrap backend: each command in fresh namespaces with only the workspace writable.

One ``bwrap`` invocation per command builds a new mount, PID, IPC, UTS, cgroup and (unless
``network``) network namespace over an empty tmpfs root, then shows in it:

- ``/usr`` and the merged-usr links (``/bin``, ``/lib``...), read-only; an ``/etc`` holding only
  what programs need (loader cache, alternatives, passwd/group, TLS roots), read-only: a copy of
  those world-readable host files, built once per content and bound with one mount;
- the running interpreter's installation, read-only at its own paths: ``sys.prefix`` (the venv),
  ``sys.base_prefix`` (its base Python), plus ``extra_ro_paths``; of the Python package
  directories in all that, only those on the interpreter's ``sys.path`` (the environment's
  packages): an empty read-only mount goes over each other one
  (``etude.sandbox.masking.foreign_package_dirs``: the base Python's ``site-packages`` under a
  venv, the system Python's ``dist-packages``, ``/usr/share/python-wheels``);
- ``/proc`` of the new PID namespace, a minimal ``/dev``, a private ``/tmp`` and ``/dev/shm``
  (size-capped tmpfs);
- the workspace, read-write, **at its own host path** (not a fixed ``/workspace``), so paths in
  tracebacks, pytest node ids and tool output agree inside and outside the sandbox;
- over each existing ``hidden_paths`` entry an empty read-only mount: a tmpfs for a directory,
  ``/dev/null`` for a file; an entry once seen under a hidden name stays masked after a rename
  (``mv tests tests_moved``: it is found again by device and inode). The same empty mounts go
  over each ``masked_paths`` host path (an installed copy of a task's package), and
  ``readonly_paths`` entries of the workspace are bound read-only. Mounts copied into a nested
  user namespace are locked by the kernel, so a command cannot unmount a mask to look
  underneath.

Every run gets a seccomp filter (``bwrap --seccomp``, ``etude.sandbox.seccomp``) that refuses the
io_uring calls with ``ENOSYS``: an operation submitted through a ring is not a system call of the
process, so the strace provenance tracer would not see it. With ``provenance`` on and the
``strace`` mechanism, ``bwrap`` is started by the sandbox's tracer (``etude.sandbox.tracer``: one
``strace`` for the sandbox's life, started by its first command, stopped by ``close``) instead of
from this process; with ``fanotify``, ``bwrap`` waits on ``--block-fd`` after building the
sandbox until its mounts are marked (``etude.sandbox.gate``).

Limits are set inside the sandbox by ``prlimit`` (CPU seconds, address space, processes, file
size, open files, no core files). Root ignores RLIMIT_NPROC, also inside a user namespace that
maps back to root, so when etude runs as root the command is started by ``setpriv`` as an
unprivileged uid leased for the run from ``uid_range`` (one uid per concurrent run, so the process
limit counts that run alone). For that uid to write, the workspace is chowned to it for the run
and back to the owner of the workspace directory afterwards: the workspace must be a dedicated
episode directory, and runs on one workspace are serialized. Started as a normal user, bwrap
makes a user namespace itself (nested ones are disabled), and the kernel counts the processes of
the limit per namespace; set outside bwrap, RLIMIT_NPROC would count all of the user's processes.

``--die-with-parent`` and the PID namespace tie every process to the run: when the command ends
(or is killed on the deadline) the namespace's init exits and the kernel kills the rest.

The state this backend keeps on the host (the ``/etc`` copy, the uid leases, the workspace locks)
and the chown of the workspace are ``etude.sandbox.bwrap_host``'s.

What this backend does not contain: total disk use in the workspace (only each file's size is
capped); memory of the whole tree (the limit is address space per process); CPU time of the whole
tree (per process; the wall-clock timeout bounds the sum); the host kernel's attack surface.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from etude.sandbox import seccomp
from etude.sandbox.base import (
    Result,
    SandboxConfig,
    prlimit_argv,
    python_bin_dir,
    resolve_timeout,
    resolve_workspace,
    rlimits,
    sandbox_env,
    shell_argv,
)
from etude.sandbox.bwrap_host import (
    ETC_FILES,
    NETWORK_ETC_FILES,
    chown_tree,
    lease_uid,
    private_etc,
    workspace_lock,
)
from etude.sandbox.fanotify import FanotifyGroups, fanotify_unavailable_reason
from etude.sandbox.masking import foreign_package_dirs
from etude.sandbox.recorder import FanotifyRecorder
from etude.sandbox.runner import popen_spawner, run_process_tree
from etude.sandbox.tracer import EpisodeTracer

MERGED_USR_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# never a workspace: the sandbox may write there and, as root, the tree is chowned for the run
SHARED_DIRS = frozenset(
    ["/", "/tmp", "/var", "/var/tmp", "/home", "/root", "/usr", "/etc", "/opt", "/srv", "/mnt"]
    + ["/media", "/run", "/boot", "/sys", "/proc", "/dev", "/dev/shm"]
)


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _ancestors(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/a", "/a/b"]``."""
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


class BwrapSandbox:
    """Runs each command under bubblewrap; see the module docstring for what is contained."""

    name = "bwrap"

    def __init__(self, cfg: SandboxConfig | None = None) -> None:
        self.config = cfg if cfg is not None else SandboxConfig(backend="bwrap")
        missing = [t for t in self._tools() if shutil.which(t) is None]
        if missing:
            raise ValueError(
                f"sandbox backend 'bwrap' needs {', '.join(missing)} on PATH; install bubblewrap "
                "and util-linux (`make system-deps`, or apt-get install bubblewrap) or set "
                "sandbox.backend='local'"
            )
        for path in self.config.extra_ro_paths:
            if not os.path.exists(path):
                raise ValueError(
                    f"sandbox.extra_ro_paths entry {path!r} does not exist on this host"
                )
        self._as_root = os.geteuid() == 0
        self._python_bin = python_bin_dir()
        self._ro_roots: list[str] = []
        self._dirs_made: set[str] = set()
        # (device, inode) of every hidden entry seen, per workspace (to follow renames)
        self._hidden_inodes: dict[str, set[tuple[int, int]]] = {}
        self._static_args = self._build_static_args()
        # strace: one provenance tracer for this sandbox's life (an episode), started by the
        # first run; fanotify: a recorder per command
        mechanism = self.config.resolved_provenance_mechanism() if self.config.provenance else None
        self._tracer = EpisodeTracer() if mechanism == "strace" else None
        self._fanotify = FanotifyGroups() if mechanism == "fanotify" else None
        if self._fanotify and (reason := fanotify_unavailable_reason()) is not None:
            raise ValueError(
                f"sandbox.provenance_mechanism='fanotify': {reason}; use "
                "sandbox.provenance_mechanism='strace' or run etude as root"
            )
        self.not_isolated = (
            "disk use in the workspace (only each file's size is capped, by max_file_bytes)",
            "memory of the whole process tree (the limit is address space per process)",
            "CPU time of the whole tree (per process; the wall-clock timeout bounds the sum)",
            "the host kernel (shared; a kernel exploit escapes any namespace)",
        ) + (
            (
                "nested user namespaces (as root the sandbox uid may create them: more kernel "
                "surface, though mounts stay locked)",
            )
            if self._as_root
            else ()
        )

    def _tools(self) -> tuple[str, ...]:
        tools = ("bwrap", "prlimit", "setpriv") if os.geteuid() == 0 else ("bwrap", "prlimit")
        cfg = self.config
        strace = cfg.provenance and cfg.resolved_provenance_mechanism() == "strace"
        return tools + (("strace",) if strace else ())

    def _mkdirs_for(self, dest: str, made: set[str]) -> list[str]:
        """``--dir`` arguments (mode 0755) for the parents of ``dest`` not in ``made`` (updated).

        bwrap would create them mode 0700 owned by root, which the sandbox uid cannot traverse.
        """
        args: list[str] = []
        for parent in _ancestors(dest):
            if parent in made or any(_is_within(parent, r) for r in self._ro_roots):
                continue
            made.add(parent)
            args += ["--perms", "0755", "--dir", parent]
        return args

    def _ro_bind(self, src: str, dest: str) -> list[str]:
        if any(_is_within(dest, r) for r in self._ro_roots):
            return []  # already visible through a bound parent
        args = self._mkdirs_for(dest, self._dirs_made) + ["--ro-bind", src, dest]
        self._ro_roots.append(dest)
        return args

    def _build_static_args(self) -> list[str]:
        cfg = self.config
        args = ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if not cfg.network:
            args.append("--unshare-net")
        if not self._as_root:
            # unprivileged bwrap always makes a user namespace; forbid nested ones inside it
            args += ["--unshare-user", "--disable-userns"]
        args += ["--hostname", "sandbox", "--die-with-parent", "--new-session"]
        args += self._ro_bind("/usr", "/usr")
        for d in MERGED_USR_DIRS:
            if os.path.islink(d):
                args += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                args += self._ro_bind(d, d)
        etc = private_etc(ETC_FILES + (NETWORK_ETC_FILES if cfg.network else ()))
        self._etc = str(etc)
        args += self._ro_bind(str(etc), "/etc")
        args += ["--proc", "/proc", "--dev", "/dev"]
        for tmp in ("/tmp", "/dev/shm"):
            args += ["--perms", "1777", "--size", str(cfg.tmp_bytes), "--tmpfs", tmp]
        self._dirs_made.update({"/tmp", "/dev", "/proc"})
        prefixes = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
        for path in dict.fromkeys([*prefixes, *cfg.extra_ro_paths]):
            dest = os.path.abspath(path)
            args += self._ro_bind(os.path.realpath(dest), dest)
        # only the package directories the interpreter imports from: the others (the base
        # Python's site-packages under a venv, the system Python's dist-packages) are emptied
        self.foreign_package_dirs = [
            d
            for d in foreign_package_dirs(cfg.extra_ro_paths)
            if any(_is_within(d, r) for r in self._ro_roots)
        ]
        for path in self.foreign_package_dirs:
            args += ["--perms", "0555", "--tmpfs", path, "--remount-ro", path]
        return args

    def _runtime_roots(self) -> list[str]:
        """The system and interpreter roots (not ``extra_ro_paths``): provenance counts reads
        under them per directory."""
        extra = {os.path.abspath(p) for p in self.config.extra_ro_paths}
        return [r for r in self._ro_roots if r not in extra] + list(MERGED_USR_DIRS)

    def _check_workspace(self, ws: Path) -> None:
        path = str(ws)
        if path in SHARED_DIRS or path == os.path.expanduser("~"):
            raise ValueError(
                f"sandbox workspace {path!r} is a shared system directory; it would be writable "
                "by (and, as root, chowned to) the sandbox: use a dedicated episode directory"
            )
        for root in self._ro_roots + ["/proc", "/dev"]:
            if _is_within(path, root) or _is_within(root, path):
                raise ValueError(
                    f"sandbox workspace {path!r} overlaps the read-only system path {root!r}; "
                    "use a dedicated episode directory (e.g. under /tmp)"
                )

    def _hidden_targets(self, ws: Path) -> list[str]:
        """Real paths of the hidden entries of ``ws``: where they are by name, and where an entry
        first seen under a hidden name is now (found by device and inode after a rename)."""
        seen = self._hidden_inodes.setdefault(str(ws), set())
        found: list[str] = []
        missing = False
        for rel in self.config.hidden_paths:
            target = ws / rel
            if not os.path.lexists(target):
                missing = True
                continue
            real = os.path.realpath(target)
            if not _is_within(real, str(ws)):
                continue  # a link leading out of the workspace: nothing of the workspace is there
            st = os.stat(real)
            seen.add((st.st_dev, st.st_ino))
            found.append(real)
        if missing and seen:
            # `mv tests tests_moved` carries a hidden entry out from under its name: look for it
            for dirpath, dirnames, filenames in os.walk(ws):
                for name in dirnames + filenames:
                    path = os.path.join(dirpath, name)
                    try:
                        st = os.lstat(path)
                    except FileNotFoundError:
                        continue
                    if (st.st_dev, st.st_ino) in seen and path not in found:
                        found.append(path)
                dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in found]
        return found

    def _masks(self, ws: Path) -> list[str]:
        """Read-only binds over the readonly paths, then empty read-only mounts over the hidden
        paths and the masked host paths."""
        args: list[str] = []
        for rel in self.config.readonly_paths:
            target = ws / rel
            if os.path.lexists(target):
                real = os.path.realpath(target)
                if _is_within(real, str(ws)) and real != str(ws):
                    args += ["--ro-bind", real, real]
        for real in self._hidden_targets(ws):
            if os.path.isdir(real):
                args += ["--perms", "0555", "--tmpfs", real, "--remount-ro", real]
            else:
                args += ["--ro-bind", "/dev/null", real]
        for path in self.config.masked_paths:
            if not os.path.lexists(path) or os.path.islink(path):
                continue
            if not any(_is_within(path, r) for r in self._ro_roots):
                continue  # not visible in the sandbox anyway
            if os.path.isdir(path):
                args += ["--perms", "0555", "--tmpfs", path, "--remount-ro", path]
            else:
                args += ["--ro-bind", "/dev/null", path]
        return args

    def command(
        self,
        argv: list[str],
        ws: Path,
        uid: int | None,
        *,
        seccomp_fd: int | None = None,
        bwrap_extra: Sequence[str] = (),
        limits: bool = True,
    ) -> list[str]:
        """The full bwrap argv for ``argv`` in workspace ``ws`` (as ``uid`` when given).

        ``seccomp_fd``: a descriptor the bwrap process inherits holding ``seccomp.filter_program``
        (io_uring refused); None leaves it out (only for callers that do not run the argv).
        ``bwrap_extra``: more bwrap options (the fanotify recorder's ``--info-fd``/``--block-fd``).
        ``limits=False`` leaves ``prlimit`` out: the caller sets the limits on the sandbox's first
        process itself (the fanotify recorder, while ``bwrap`` waits on its block pipe).
        """
        args = [*self._static_args, *self._mkdirs_for(str(ws), set(self._dirs_made))]
        args += ["--bind", str(ws), str(ws), *self._masks(ws), "--chdir", str(ws)]
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        args += [*bwrap_extra, "--"]
        if uid is not None:
            args += [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={uid}",
                "--clear-groups",
                "--no-new-privs",
                "--bounding-set=-all",
                "--",
            ]
        if not limits:
            return args + argv
        return args + prlimit_argv(self.config, self.config.max_processes) + argv

    def close(self) -> None:
        """Stop this sandbox's provenance tracer or release its fanotify groups, if it has them
        (a later command starts or makes new ones)."""
        if self._tracer is not None:
            self._tracer.close()
        if self._fanotify is not None:
            self._fanotify.close()

    def run(
        self,
        cmd: Sequence[str] | str,
        cwd: str | os.PathLike[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
    ) -> Result:
        """Run ``cmd`` in workspace ``cwd`` under bubblewrap (see the module docstring)."""
        argv = shell_argv(cmd)
        ws = resolve_workspace(cwd)
        self._check_workspace(ws)
        timeout_s = resolve_timeout(timeout, self.config)
        run_env = sandbox_env(self.config, env, tmp_dir="/tmp", python_bin=self._python_bin)
        filter_fd = seccomp.filter_fd()
        try:
            # the tracer's launcher places passed descriptors at 3, 4...; Popen keeps their number
            seccomp_at = 3 if self._tracer is not None else filter_fd
            run = functools.partial(
                run_process_tree,
                cwd=ws,
                env=run_env,
                stdin=stdin,
                timeout_s=timeout_s,
                max_output_bytes=self.config.max_output_bytes,
                pass_fds=(filter_fd,),
            )

            # bwrap, then setpriv when root, then prlimit, then the command
            wrapper_execs = 3 if self._as_root else 2

            def run_as(uid: int | None) -> Result:
                if self._fanotify is not None:
                    # the recorder sets the limits itself: no prlimit in the sandbox
                    return self._run_recorded(
                        run, argv, ws, uid, filter_fd, wrapper_execs - 1, timeout_s, run_env["PATH"]
                    )
                full = self.command(argv, ws, uid, seccomp_fd=seccomp_at)
                if self._tracer is None:
                    return run(full)
                return self._tracer.run(
                    functools.partial(run, full),
                    workspace=str(ws),
                    runtime_roots=self._runtime_roots(),
                    wrapper_execs=wrapper_execs,
                )

            if not self._as_root:
                return run_as(None)
            with workspace_lock(ws), lease_uid(*self.config.uid_range) as uid:
                owner = os.stat(ws)
                chown_tree(ws, uid, uid)
                try:
                    return run_as(uid)
                finally:
                    chown_tree(ws, owner.st_uid, owner.st_gid)
        finally:
            os.close(filter_fd)

    def _wrapper_programs(self, argv: list[str], uid: int | None, path: str) -> list[str]:
        """The wrappers' programs (``setpriv`` as root) as ``bwrap`` finds them on ``path``, for
        the recorder to leave their starts unheld: only for a shell command (its program,
        ``bash`` or ``sh``, is neither a wrapper nor a loader) and where they resolve under
        ``/usr`` (the same files inside the sandbox); else none."""
        if argv[0] not in ("/bin/bash", "/bin/sh"):
            return []
        found = [shutil.which("setpriv", path=path)] if uid is not None else []
        if not all(p and os.path.realpath(p).startswith("/usr/") for p in found):
            return []
        return [p for p in found if p]

    def _run_recorded(
        self,
        run: Callable[..., Result],
        argv: list[str],
        ws: Path,
        uid: int | None,
        seccomp_fd: int,
        wrapper_execs: int,
        timeout_s: float,
        path: str,
    ) -> Result:
        """``run`` the command with a fanotify recorder (``etude.sandbox.recorder``) watching
        it; the sandbox's commands take turns on its event queues."""
        groups = self._fanotify
        assert groups is not None
        with groups.lock:
            recorder = FanotifyRecorder(
                groups.get(),
                workspace=str(ws),
                runtime_roots=self._runtime_roots(),
                wrapper_execs=wrapper_execs,
                host_roots=[(self._etc, "/etc")],
                timeout_s=timeout_s,
                wrapper_programs=self._wrapper_programs(argv, uid, path),
                limits=rlimits(self.config, self.config.max_processes),
                dir_cache=groups.dirs,
            )
            gate = recorder.bwrap_args()
            full = self.command(
                argv, ws, uid, seccomp_fd=seccomp_fd, bwrap_extra=gate, limits=False
            )
            try:
                spawner = recorder.spawner(popen_spawner())
                result = run(full, spawner=spawner, watch=recorder.watches())
            finally:
                prov = recorder.finish()
                if recorder.abandoned:  # its reader still holds the queues: new ones next
                    groups.forget()
        if recorder.started:
            result.provenance = prov
        return result


def bwrap_unavailable_reason() -> str | None:
    """None when a bwrap sandbox runs a command on this host, else why it cannot.

    A transient failure (timeout, signal) is a reason too here, after the retries of
    ``etude.sandbox.probe.bwrap_probe``; ``make_sandbox`` tells the two apart.
    """
    from etude.sandbox.probe import bwrap_probe

    return bwrap_probe().reason
