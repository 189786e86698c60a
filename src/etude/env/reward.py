"""The test-based reward: the task's tests, run on the final workspace with the tests restored.

``compute_reward(task, workspace)`` scores a workspace the way an episode's end is scored:

1. copy the workspace into a fresh scoring directory (regular files, directories and symlinks;
   FIFOs, sockets and devices are left out, so copying can not block or read a device);
2. restore the task's test files there from the task's original workspace (`paths_to_restore`):
   the files the test ids name, every file under a ``tests``/``test`` directory, every
   ``test_*.py``, ``*_test.py`` and ``conftest.py``, the pytest configuration files at any level
   (``pytest.ini``, ``.pytest.ini``, ``pyproject.toml``, ``tox.ini``, ``setup.cfg``) and the task's
   hidden paths. Edited files are overwritten, deleted ones come back, and ``conftest.py`` or
   pytest configuration files the original does not have are removed (they could rewrite
   outcomes or deselect tests). So edits to tests never count;
3. run ``FAIL_TO_PASS + PASS_TO_PASS`` in a new sandbox with nothing hidden
   (``etude.sandbox.run_pytest``);
4. reward 1.0 when every one of those ids passed and the run was sound, else 0.0. A run that broke
   collection (a syntax error in the package, a missing module), timed out, or left an id without
   a result scores 0.0: "no failures reported" is not "all passed".

The per-test outcomes are kept (`RewardResult.tests`), and the scoring directory is removed.

What this does not catch: a change to the code under test that detects it is being tested
(monitoring is ``etude.monitor``'s job), a plugin loaded from a non-test module the tests import,
or edits to configuration files of other tools. A foreign record without ``etude.workspace``
can not be scored here (there is no original to restore from).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from etude.sandbox import SandboxConfig, make_sandbox, run_pytest
from etude.tasks.record import TaskRecord, resolve_workspace

TEST_DIR_NAMES = frozenset({"tests", "test"})
TEST_FILE_PATTERNS = ("test_*.py", "*_test.py", "conftest.py")
PYTEST_CONFIG_NAMES = frozenset(
    {"pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg"}
)
# files whose mere presence changes how pytest collects or reports: removed when the original
# workspace has none at that place
PLANTABLE_NAMES = PYTEST_CONFIG_NAMES | {"conftest.py"}


@dataclass(kw_only=True, slots=True)
class RewardResult:
    """The score of one workspace."""

    reward: float
    """1.0 when every FAIL_TO_PASS and PASS_TO_PASS id passed in a sound run, else 0.0."""
    tests: dict[str, str] = field(default_factory=dict)
    """Outcome per test id of the task: ``passed``, ``failed``, ``error`` or ``skipped``."""
    collection_error: bool = False
    """pytest could not collect or run the tests (counts as failing)."""
    timed_out: bool = False
    restored: list[str] = field(default_factory=list)
    """Test files the scoring copy got back from the original (changed, deleted or planted)."""
    duration: float = 0.0
    """Seconds for copying, restoring and the test run."""
    output: str = ""
    """The tail of pytest's output."""


def _walk_files(root: Path) -> Iterable[str]:
    """Relative POSIX paths of every non-directory entry under ``root`` (symlinks not followed)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            yield (Path(dirpath) / name).relative_to(root).as_posix()
        # a symlink to a directory is listed in dirnames but not descended into: it is an entry
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                yield (Path(dirpath) / name).relative_to(root).as_posix()


def _is_test_path(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    name = parts[-1]
    return (
        any(p in TEST_DIR_NAMES for p in parts[:-1])
        or any(fnmatch.fnmatchcase(name, pattern) for pattern in TEST_FILE_PATTERNS)
        or name in PYTEST_CONFIG_NAMES
    )


def _is_under(rel: str, prefix: str) -> bool:
    return rel == prefix or rel.startswith(prefix.rstrip("/") + "/")


def paths_to_restore(
    original: str | os.PathLike[str], test_ids: Sequence[str], hidden_paths: Sequence[str] = ()
) -> list[str]:
    """The files of ``original`` the reward restores (see the module docstring), sorted."""
    original = Path(original)
    named = {test_id.split("::", 1)[0].rstrip("/") for test_id in test_ids}
    out = []
    for rel in _walk_files(original):
        if (
            _is_test_path(rel)
            or any(_is_under(rel, n) for n in named)
            or any(_is_under(rel, h) for h in hidden_paths)
        ):
            out.append(rel)
    return sorted(out)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        remove_tree(path)


def _make_dirs(root: Path, rel_dir: PurePosixPath) -> None:
    """Create ``root/rel_dir`` as real directories, replacing files or symlinks in the way."""
    current = root
    for part in rel_dir.parts:
        current = current / part
        if current.is_symlink() or (current.exists() and not current.is_dir()):
            current.unlink()
        if not current.exists():
            current.mkdir()


def restore_test_files(
    original: str | os.PathLike[str],
    scored: str | os.PathLike[str],
    test_ids: Sequence[str],
    hidden_paths: Sequence[str] = (),
) -> list[str]:
    """Make ``scored``'s test files equal to ``original``'s; returns the paths that changed."""
    original, scored = Path(original), Path(scored)
    changed = []
    wanted = paths_to_restore(original, test_ids, hidden_paths)
    wanted_set = set(wanted)
    # planted files first: conftest.py or pytest configuration the original does not have,
    # and anything inside a hidden path that the original does not have
    for rel in list(_walk_files(scored)):
        name = PurePosixPath(rel).name
        planted = name in PLANTABLE_NAMES or any(_is_under(rel, h) for h in hidden_paths)
        if planted and rel not in wanted_set:
            _remove(scored / rel)
            changed.append(rel)
    for rel in wanted:
        src, dst = original / rel, scored / rel
        _make_dirs(scored, PurePosixPath(rel).parent)
        if os.path.lexists(dst):
            if _same_entry(src, dst):
                continue
            _remove(dst)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
        changed.append(rel)
    return sorted(set(changed))


def _same_entry(a: Path, b: Path) -> bool:
    if a.is_symlink() or b.is_symlink():
        return a.is_symlink() and b.is_symlink() and os.readlink(a) == os.readlink(b)
    if not (a.is_file() and b.is_file()):
        return False
    sa, sb = a.stat(), b.stat()
    if sa.st_size != sb.st_size or (sa.st_mode & 0o777) != (sb.st_mode & 0o777):
        return False
    return a.read_bytes() == b.read_bytes()


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
    """Score ``workspace`` for ``task`` (see the module docstring); ``workspace`` keeps its
    content (only permission bits its owner lacks may be added, see `copy_workspace`).

    ``original`` is the task's untouched workspace (default: resolved from the record against
    ``base_dir``, an archive extracted for the call). ``sandbox`` gives the limits of the test
    run (its hidden paths are dropped: the reward sees everything). ``work_dir`` is where the
    scoring directory goes (default: the system temp directory).
    """
    start = time.monotonic()
    test_ids = [*task.FAIL_TO_PASS, *task.PASS_TO_PASS]
    if not test_ids:
        raise ValueError(
            f"task {task.instance_id!r} has no FAIL_TO_PASS or PASS_TO_PASS tests; "
            "a reward needs at least one test id"
        )
    workspace = Path(workspace)
    if not workspace.is_dir():
        raise ValueError(f"workspace {str(workspace)!r} to score is not a directory")
    hidden = list(task.etude.hidden_paths) if task.etude is not None else []
    sandbox_cfg = dataclasses.replace(sandbox or SandboxConfig(), hidden_paths=())
    scratch = Path(tempfile.mkdtemp(prefix="etude-reward-", dir=work_dir))
    try:
        if original is None:
            source = resolve_workspace(task, base_dir, dest=scratch / "original")
        else:
            source = Path(original)
            if not source.is_dir():
                raise ValueError(f"original workspace {str(source)!r} is not a directory")
        scored = copy_workspace(workspace, scratch / "workspace", grant_access=True)
        restored = restore_test_files(source, scored, test_ids, hidden)
        run = run_pytest(make_sandbox(None, sandbox_cfg), scored, test_ids, timeout=timeout)
    finally:
        remove_tree(scratch)
    tests = {test_id: run.outcome(test_id) for test_id in test_ids}
    passed = run.all_passed(test_ids)
    assert not passed or all(o == "passed" for o in tests.values()), tests
    return RewardResult(
        reward=1.0 if passed else 0.0,
        tests=tests,
        collection_error=run.collection_error,
        timed_out=run.timed_out,
        restored=restored,
        duration=time.monotonic() - start,
        output=run.output,
    )
