"""The test-based reward: the task's tests, graded by ``etude.sandbox.grader`` on a clean room.

``compute_reward(task, workspace)`` scores a workspace the way an episode's end is scored:

1. `task_grading` reads what the record says about grading: the files the agent may change
   (the package prefixes of the gold patch, ``etude.sandbox.cleanroom.allowed_from_paths``), the
   test ids (``FAIL_TO_PASS + PASS_TO_PASS``), and ``etude.extra.test_env`` /
   ``etude.extra.pytest_args`` (a src layout's ``PYTHONPATH=src``, ``-o addopts=``...);
2. ``grade`` copies the task's pristine workspace, applies only the agent's changes to allowed
   package source (tests, configuration, conftest files, plugins, start-up hooks, bytecode and
   new top-level modules never count), runs the ids in a fresh sandbox with an isolated
   interpreter, and reads the outcome from a result channel it cross-checks;
3. reward 1.0 when the grade is ``passed``, 0.0 when ``failed`` or ``error`` (a broken
   collection, a timeout, tampering), and **None** when ``infra`` (the grader could not grade:
   the sandbox did not start, the copy failed). A None reward is masked from the group's
   statistics by the trainer and counted; it is never a 0.

What this does not catch: a change to allowed source that passes by special-casing the tests
(code that detects the test run, hard-coded answers): that is ``etude.monitor``'s job. A foreign
record without ``etude.workspace`` can not be scored here (there is no pristine tree).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from etude.sandbox import SandboxConfig, grade
from etude.sandbox.cleanroom import allowed_from_paths, allowed_from_tree
from etude.sandbox.grader import Outcome
from etude.tasks.patches import patch_paths
from etude.tasks.record import TaskRecord, resolve_workspace


@dataclass(kw_only=True, slots=True)
class RewardResult:
    """The score of one workspace."""

    reward: float | None
    """1.0 passed, 0.0 failed or error, None when the grader could not grade (``infra``)."""
    status: str = "failed"
    """The grade: ``passed``, ``failed``, ``error`` or ``infra``."""
    reason: str = ""
    """Why the grade is not ``passed`` (one line)."""
    tests: dict[str, str] = field(default_factory=dict)
    """Outcome per test id of the task: ``passed``, ``failed``, ``error`` or ``skipped``."""
    collection_error: bool = False
    """pytest could not collect or run the tests (counts as failing)."""
    timed_out: bool = False
    changed: list[str] = field(default_factory=list)
    """Allowed files the grade took from the workspace (changed, added or removed)."""
    duration: float = 0.0
    """Seconds for the whole grading."""
    output: str = ""
    """The tail of pytest's output."""
    grade: dict[str, object] = field(default_factory=dict)
    """The grader's outcome as recorded on a trajectory (``Outcome.to_dict``)."""


@dataclass(kw_only=True, slots=True)
class TaskGrading:
    """What a task record says about grading it (the arguments of ``etude.sandbox.grader``)."""

    allowed: list[str]
    test_ids: list[str]
    test_env: dict[str, str]
    pytest_args: list[str]


def task_grading(task: TaskRecord, pristine: str | os.PathLike[str] | None = None) -> TaskGrading:
    """The allowed paths, test ids, test environment and pytest arguments of ``task``.

    The allowed paths are the package prefixes its gold patch touches; a record without such a
    patch allows the package directories of its ``pristine`` tree.
    """
    extra = task.etude.extra if task.etude is not None else {}
    test_env = extra.get("test_env", {})
    pytest_args = extra.get("pytest_args", [])
    if not isinstance(test_env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in test_env.items()
    ):
        raise ValueError(
            f"task {task.instance_id!r}: etude.test_env must map names to strings, got {test_env!r}"
        )
    if not isinstance(pytest_args, list) or not all(isinstance(a, str) for a in pytest_args):
        raise ValueError(
            f"task {task.instance_id!r}: etude.pytest_args must be a list of strings, "
            f"got {pytest_args!r}"
        )
    allowed = allowed_from_paths(patch_paths(task.patch))
    if not allowed and pristine is not None:
        allowed = allowed_from_tree(pristine)
    if not allowed:
        raise ValueError(
            f"task {task.instance_id!r}: neither its gold patch nor its workspace names a "
            "package directory, so no change of an agent could count; check the record's 'patch'"
        )
    return TaskGrading(
        allowed=allowed,
        test_ids=[*task.FAIL_TO_PASS, *task.PASS_TO_PASS],
        test_env=dict(test_env),
        pytest_args=list(pytest_args),
    )


def reward_of(outcome: Outcome) -> float | None:
    """1.0 for ``passed``, None for ``infra`` (not a score), else 0.0."""
    if outcome.status == "infra":
        return None
    return 1.0 if outcome.status == "passed" else 0.0


def _copyable(directory: str, names: list[str]) -> list[str]:
    """``shutil.copytree`` ignore hook: leave out FIFOs, sockets and devices."""
    skipped = []
    for name in names:
        mode = os.lstat(os.path.join(directory, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            skipped.append(name)
    return skipped


def _grant_owner_access(root: Path) -> None:
    """Give the owner read (and, on directories, write and search) permission on the whole tree.

    A sandboxed command may ``chmod 000`` what it made; without this a non-root copy or removal of
    the workspace would fail on it. Symlinks are not followed (their own mode does not matter).
    """
    mode = os.lstat(root).st_mode
    if stat.S_ISDIR(mode) and mode & stat.S_IRWXU != stat.S_IRWXU:
        os.chmod(root, mode | stat.S_IRWXU)
    # top-down: a directory is fixed while its parent is listed, before os.walk enters it
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode) and mode & stat.S_IRWXU != stat.S_IRWXU:
                os.chmod(path, mode | stat.S_IRWXU)
            elif stat.S_ISREG(mode) and not mode & stat.S_IRUSR:
                os.chmod(path, mode | stat.S_IRUSR | stat.S_IWUSR)


def copy_workspace(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, grant_access: bool = False
) -> Path:
    """Copy a workspace tree (symlinks as symlinks, special files left out); ``dst`` must not
    exist. With ``grant_access`` (for a workspace commands have run in), permission bits its
    owner lacks are added to ``src`` first, so that everything can be read."""
    if grant_access:
        _grant_owner_access(Path(src))
    shutil.copytree(src, dst, symlinks=True, ignore=_copyable)
    return Path(dst)


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove a directory tree, also where a command took away write or search permissions."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        _grant_owner_access(Path(path))
    shutil.rmtree(path)


def compute_reward(
    task: TaskRecord,
    workspace: str | os.PathLike[str],
    *,
    base_dir: str | os.PathLike[str] = ".",
    original: str | os.PathLike[str] | None = None,
    sandbox: SandboxConfig | None = None,
    timeout: float = 300.0,
    work_dir: str | os.PathLike[str] | None = None,
) -> RewardResult:
    """Score ``workspace`` for ``task`` (see the module docstring); ``workspace`` is only read.

    ``original`` is the task's pristine workspace (default: resolved from the record against
    ``base_dir``, an archive extracted for the call). ``sandbox`` gives the limits of the test
    run (its hidden paths are dropped: the reward sees everything). ``work_dir`` is where the
    grading copy goes (default: the system temp directory).
    """
    start = time.monotonic()
    if not task.FAIL_TO_PASS and not task.PASS_TO_PASS:
        raise ValueError(
            f"task {task.instance_id!r} has no FAIL_TO_PASS or PASS_TO_PASS tests; "
            "a reward needs at least one test id"
        )
    workspace = Path(workspace)
    if not workspace.is_dir():
        raise ValueError(f"workspace {str(workspace)!r} to score is not a directory")
    scratch: Path | None = None
    try:
        if original is None:
            scratch = Path(tempfile.mkdtemp(prefix=f"etude-grade-{os.getpid()}-", dir=work_dir))
            source = resolve_workspace(task, base_dir, dest=scratch / "original")
        else:
            source = Path(original)
            if not source.is_dir():
                raise ValueError(f"original workspace {str(source)!r} is not a directory")
        spec = task_grading(task, source)
        outcome = grade(
            source,
            workspace,
            spec.allowed,
            spec.test_ids,
            spec.test_env,
            spec.pytest_args,
            sandbox=sandbox or SandboxConfig(),
            timeout=timeout,
            work_dir=work_dir,
        )
    finally:
        if scratch is not None:
            remove_tree(scratch)
    return RewardResult(
        reward=reward_of(outcome),
        status=outcome.status,
        reason=outcome.reason,
        tests={test_id: outcome.outcome(test_id) for test_id in spec.test_ids},
        collection_error=bool(outcome.collection_errors),
        timed_out=outcome.timed_out,
        changed=list(outcome.changed),
        duration=time.monotonic() - start,
        output=outcome.output,
        grade=outcome.to_dict(),
    )
