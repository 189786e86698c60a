"""The local backend: a plain subprocess with the limits the OS grants without namespaces.

For hosts without bubblewrap (or when chosen explicitly, e.g. to debug a task). It runs the
command as the caller, in the workspace, in a new session, with:

- rlimits (CPU seconds, address space, file size, open files, no core files; processes too,
  except as root, which the kernel exempts from RLIMIT_NPROC), set by ``prlimit`` where it exists
  (Linux) and else by a preexec function in the child;
- a clean environment whose HOME and TMPDIR are a private directory removed after the run;
- the wall-clock timeout and the output cap of the shared runner, and a SIGKILL to the command's
  process group on the deadline and after it exits, so ``sleep 1000 &`` does not outlive the call.

It does NOT contain: the network; the filesystem outside the workspace (everything the caller can
read or write, the command can too, including the Python installation); hidden paths (they stay
readable), read-only and masked paths; the process namespace (a process that calls ``setsid()`` leaves the group and survives
the kill); the process count as root. Constructing it warns with that list.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from etude.sandbox.base import (
    Result,
    SandboxConfig,
    apply_rlimits,
    prlimit_argv,
    python_bin_dir,
    resolve_timeout,
    resolve_workspace,
    sandbox_env,
    shell_argv,
)
from etude.sandbox.runner import run_process_tree


def _user_task_count(uid: int) -> int | None:
    """Tasks (threads) whose real uid is ``uid``, as RLIMIT_NPROC counts them; None without /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                status = f.read()
        except OSError:  # the process ended while we looked
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1 ").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


class LocalSandbox:
    """Runs each command as a plain subprocess; see the module docstring for what is NOT contained."""

    name = "local"

    def __init__(self, cfg: SandboxConfig | None = None, *, reason: str | None = None) -> None:
        """``reason``: why bubblewrap is not used (when ``auto`` fell back), for the warning."""
        self.config = cfg if cfg is not None else SandboxConfig(backend="local")
        self._as_root = os.geteuid() == 0
        self._python_bin = python_bin_dir()
        self._prlimit = shutil.which("prlimit")
        gaps = [
            "network (commands can open connections)",
            "filesystem outside the workspace (readable and writable with the caller's rights, "
            "the Python installation included)",
            "hidden paths (no masks: the command can read them)",
            "readonly and masked paths (no binds: the command can change and read them)",
            "process namespace (commands see the host's processes; one that calls setsid() "
            "survives the kill)",
            "/tmp (shared with the host; only HOME and TMPDIR are private)",
        ]
        if self._as_root:
            gaps.append("process count (root ignores RLIMIT_NPROC; a fork bomb is not stopped)")
        self.not_isolated = tuple(gaps)
        why = f" (bubblewrap is not usable: {reason})" if reason else ""
        warnings.warn(
            f"sandbox backend 'local'{why}: commands are NOT isolated from: "
            + "; ".join(self.not_isolated),
            RuntimeWarning,
            stacklevel=2,
        )

    def _nproc_limit(self) -> int | None:
        """RLIMIT_NPROC for the child: counts every task of the user, so add those running now."""
        if self._as_root:
            return None
        running = _user_task_count(os.getuid())
        return None if running is None else running + self.config.max_processes

    def run(
        self,
        cmd: Sequence[str] | str,
        cwd: str | os.PathLike[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
    ) -> Result:
        """Run ``cmd`` in workspace ``cwd`` as a limited subprocess (see the module docstring)."""
        argv = shell_argv(cmd)
        ws: Path = resolve_workspace(cwd)
        timeout_s = resolve_timeout(timeout, self.config)
        nproc = self._nproc_limit()
        preexec = None
        if self._prlimit is not None:
            argv = [self._prlimit, *prlimit_argv(self.config, nproc)[1:], *argv]
        else:
            preexec = functools.partial(apply_rlimits, self.config, nproc)
        with tempfile.TemporaryDirectory(prefix="etude-local-", ignore_cleanup_errors=True) as tmp:
            run_env = sandbox_env(self.config, env, tmp_dir=tmp, python_bin=self._python_bin)
            return run_process_tree(
                argv,
                cwd=ws,
                env=run_env,
                stdin=stdin,
                timeout_s=timeout_s,
                max_output_bytes=self.config.max_output_bytes,
                preexec_fn=preexec,
            )
