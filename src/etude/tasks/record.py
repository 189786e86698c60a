"""The task record: one JSON line per task, a superset of the SWE-bench instance schema.

A record names the tests that make up the reward (``FAIL_TO_PASS`` must go from failing to
passing, ``PASS_TO_PASS`` must keep passing), the gold ``patch`` that takes the broken workspace
back to the original code, and the problem statement the agent sees. etude's own records add an
``etude`` object (``EtudeInfo``) that says where the broken workspace lies, what was deleted,
how hard the task is and what the sandbox must hide.

What loads: etude records; SWE-bench, SWE-Gym and SWE-smith instances (no ``etude`` object;
``FAIL_TO_PASS``/``PASS_TO_PASS`` as lists or, as SWE-bench ships them, JSON-encoded strings;
``version`` as a string or a number). Keys this module does not know are kept in ``extra`` and
written back unchanged, so a load/save round trip preserves every field of a foreign record.
Saving writes the test lists as JSON lists, whatever form they were read in.

Conventions for etude records:

- ``etude.workspace`` is a directory or a ``.tar.gz``/``.tgz``/``.tar`` archive of the broken
  tree, relative to the directory holding the record file (absolute paths are allowed);
  ``resolve_workspace`` turns it into a directory. Archives hold the tree's contents at their
  root (``archive_workspace`` writes them so, reproducibly).
- ``base_commit`` is the commit of the workspace's repository when it has one, else
  ``tree_digest(workspace)`` (``"sha256:..."``), so a stale workspace can be detected.
- the top-level ``workspace``, ``test_command``, ``environment`` and ``time_limit_s`` say what a
  harness that knows nothing of etude needs to run the tests (``environment``: Python version,
  test environment variables, pytest arguments, test requirements); ``workspace`` resolves like
  ``etude.workspace``, against the directory holding the record file;
- ``test_patch`` is empty for feature deletion: the tests stay in the workspace; the reward
  restores them before it runs.

What this module does not do: run tests, apply patches, or fetch SWE-bench repositories (a
foreign record without ``etude.workspace`` cannot be resolved to a workspace here). It imports
no torch.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

TASK_KINDS = ("feature_deletion", "handwritten", "agent_deletion")
"""How a task was made: the factory's deleter, a person, or a model proposing the deletion."""

DETAIL_LEVELS = ("full", "docstring", "tests")
"""How much the problem statement says: full interface, docstring only, or failing tests only."""

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")

# Field order on disk: SWE-bench's own order, then keys we do not know, then ``etude``.
_SWE_FIELDS = (
    "instance_id",
    "repo",
    "base_commit",
    "patch",
    "test_patch",
    "problem_statement",
    "hints_text",
    "created_at",
    "version",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)
_OPTIONAL_FIELDS = ("hints_text", "created_at")
# What a harness needs to run the tests, at the top level (written after SWE-bench's fields;
# omitted when None, so foreign records round-trip unchanged)
_PORTABLE_FIELDS = ("workspace", "test_command", "environment", "time_limit_s")


def _check_relative_path(value: Any, setting: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{setting} must be a non-empty string path, got {value!r}")
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts or "\\" in value:
        raise ValueError(
            f"{setting} must be a relative POSIX path inside the workspace (no leading '/', "
            f"no '..', no backslashes), got {value!r}"
        )
    return value


def _check_str_list(value: Any, setting: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{setting} must be a list of strings, got {value!r}")
    return value


@dataclass(kw_only=True, slots=True)
class EtudeInfo:
    """The ``etude`` object of a record: where the broken workspace is and how it was made."""

    workspace: str
    """Broken, sanitized tree: a directory or .tar.gz/.tgz/.tar archive, relative to the record file."""
    kind: str = "feature_deletion"
    """How the task was made, one of ``TASK_KINDS``."""
    symbols: list[str] = field(default_factory=list)
    """Dotted import paths of the deleted definitions (a module path for a whole module)."""
    deleted_files: list[str] = field(default_factory=list)
    """Workspace-relative POSIX paths of files removed whole (module deletions)."""
    difficulty: dict[str, float] = field(default_factory=dict)
    """Named measurements, e.g. deleted_lines, num_symbols, num_fail_to_pass, pass_rate; a bare
    number read from disk becomes ``{"score": number}``."""
    parent: str | None = None
    """instance_id of the task this one was spawned from (curriculum variants), else None."""
    leak_scan: dict[str, Any] | None = None
    """Result of the workspace leak scan (written by the factory); None when not scanned."""
    detail_level: str = "full"
    """Problem statement detail, one of ``DETAIL_LEVELS``."""
    hidden_paths: list[str] = field(default_factory=list)
    """Workspace-relative paths the sandbox masks with an empty directory during episodes."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys of the ``etude`` object this version does not know, written back unchanged."""

    def __post_init__(self) -> None:
        if not isinstance(self.workspace, str) or not self.workspace:
            raise ValueError(
                f"etude.workspace must be a non-empty path string, got {self.workspace!r}"
            )
        if self.kind not in TASK_KINDS:
            raise ValueError(f"etude.kind must be one of {TASK_KINDS}, got {self.kind!r}")
        if self.detail_level not in DETAIL_LEVELS:
            raise ValueError(
                f"etude.detail_level must be one of {DETAIL_LEVELS}, got {self.detail_level!r}"
            )
        _check_str_list(self.symbols, "etude.symbols")
        for i, path in enumerate(_check_str_list(self.deleted_files, "etude.deleted_files")):
            _check_relative_path(path, f"etude.deleted_files[{i}]")
        for i, path in enumerate(_check_str_list(self.hidden_paths, "etude.hidden_paths")):
            _check_relative_path(path, f"etude.hidden_paths[{i}]")
        if not isinstance(self.difficulty, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in self.difficulty.items()
        ):
            raise ValueError(
                f"etude.difficulty must map names to numbers (e.g. {{'deleted_lines': 12}}), "
                f"got {self.difficulty!r}"
            )
        if self.parent is not None and (not isinstance(self.parent, str) or not self.parent):
            raise ValueError(f"etude.parent must be an instance_id or null, got {self.parent!r}")
        if self.leak_scan is not None and not isinstance(self.leak_scan, dict):
            raise ValueError(f"etude.leak_scan must be an object or null, got {self.leak_scan!r}")
        clash = sorted(set(self.extra) & {f.name for f in dataclasses.fields(self)})
        if clash:
            raise ValueError(f"etude.extra repeats known keys {clash}; set those fields directly")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data: known fields in declaration order, then unknown keys."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        return json.loads(json.dumps(out))

    @classmethod
    def from_dict(cls, data: Any) -> EtudeInfo:
        """Build from the ``etude`` object of a record; unknown keys go to ``extra``."""
        if not isinstance(data, dict):
            raise ValueError(f"'etude' must be an object, got {data!r}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        if "workspace" not in data:
            raise ValueError(
                "'etude' needs a 'workspace' (directory or archive of the broken tree)"
            )
        kwargs = {k: v for k, v in data.items() if k in known}
        difficulty = kwargs.get("difficulty")
        if isinstance(difficulty, int | float) and not isinstance(difficulty, bool):
            kwargs["difficulty"] = {"score": difficulty}
        elif difficulty is None:
            kwargs.pop("difficulty", None)
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra=extra)


@dataclass(kw_only=True, slots=True)
class TaskRecord:
    """One task: SWE-bench instance fields plus an optional ``etude`` object."""

    instance_id: str
    """Unique id of the task within its file."""
    repo: str = ""
    """Source repository, e.g. ``owner/name`` or an example repo's name."""
    base_commit: str = ""
    """Commit (or ``tree_digest``) of the broken tree that ``patch`` applies to."""
    patch: str = ""
    """Gold patch, broken -> original, unified diff applying with ``git apply``/``patch -p1``."""
    test_patch: str = ""
    """Patch adding or changing tests (SWE-bench); empty when the tests are in the workspace."""
    problem_statement: str = ""
    """What the agent is told to do."""
    hints_text: str | None = None
    """Optional hints (SWE-bench); omitted on disk when None."""
    created_at: str | None = None
    """Optional creation time (ISO 8601); omitted on disk when None."""
    version: str = ""
    """Version of the repository or of the environment setup (SWE-bench's ``version``)."""
    FAIL_TO_PASS: list[str] = field(default_factory=list)
    """pytest node ids that fail on the broken tree and must pass after the fix."""
    PASS_TO_PASS: list[str] = field(default_factory=list)
    """pytest node ids that pass on the broken tree and must keep passing."""
    workspace: str | None = None
    """The broken tree (directory or archive), as ``etude.workspace``: a relative path is
    relative to the directory holding the record file."""
    test_command: str | None = None
    """The shell command that runs the tests from the workspace root, with ``{tests}`` where the
    node ids go; it sets the environment itself (``env PYTHONPATH=... python -m pytest ...``)."""
    environment: dict[str, Any] | None = None
    """What the tests need: ``python`` (major.minor), ``test_env`` (variables; relative
    ``PYTHONPATH`` entries are relative to the workspace), ``pytest_args``, ``test_requirements``
    (installed into ``deps_dir`` of the workspace when not empty) and ``deps_dir``."""
    time_limit_s: float | None = None
    """Seconds one run of the tests may take (derived from the baseline's durations)."""
    etude: EtudeInfo | None = None
    """etude's own part; None for a foreign (SWE-bench style) record."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Top-level keys this version does not know, written back unchanged."""

    def __post_init__(self) -> None:
        if not isinstance(self.instance_id, str) or not self.instance_id:
            raise ValueError(f"instance_id must be a non-empty string, got {self.instance_id!r}")
        for name in ("repo", "base_commit", "patch", "test_patch", "problem_statement", "version"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in _OPTIONAL_FIELDS:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string or null, got {getattr(self, name)!r}")
        _check_str_list(self.FAIL_TO_PASS, "FAIL_TO_PASS")
        _check_str_list(self.PASS_TO_PASS, "PASS_TO_PASS")
        if self.environment is not None and not isinstance(self.environment, dict):
            raise ValueError(f"environment must be an object or null, got {self.environment!r}")
        for name in ("workspace", "test_command"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or null, got {value!r}")
        if self.time_limit_s is not None and (
            isinstance(self.time_limit_s, bool)
            or not isinstance(self.time_limit_s, int | float)
            or self.time_limit_s <= 0
        ):
            raise ValueError(f"time_limit_s must be a positive number, got {self.time_limit_s!r}")
        clash = sorted(set(self.extra) & {*_SWE_FIELDS, *_PORTABLE_FIELDS, "etude", "extra"})
        if clash:
            raise ValueError(f"extra repeats known keys {clash}; set those fields directly")
        if self.etude is not None:
            # Foreign datasets are taken as they are; our own records keep these invariants.
            if not self.FAIL_TO_PASS:
                raise ValueError(
                    f"task {self.instance_id!r}: FAIL_TO_PASS is empty; a task needs at least "
                    "one test that fails on the broken tree"
                )
            both = sorted(set(self.FAIL_TO_PASS) & set(self.PASS_TO_PASS))
            if both:
                raise ValueError(
                    f"task {self.instance_id!r}: tests in both FAIL_TO_PASS and PASS_TO_PASS: "
                    f"{both[:3]}; each test belongs to one list"
                )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data in the on-disk key order; None optionals and a None etude are omitted."""
        out: dict[str, Any] = {}
        for name in _SWE_FIELDS:
            value = getattr(self, name)
            if name in _OPTIONAL_FIELDS and value is None:
                continue
            out[name] = value
        for name in _PORTABLE_FIELDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out.update(self.extra)
        if self.etude is not None:
            out["etude"] = self.etude.to_dict()
        return json.loads(json.dumps(out))

    @classmethod
    def from_dict(cls, data: Any) -> TaskRecord:
        """Build from one decoded JSON object (etude, SWE-bench, SWE-Gym or SWE-smith style)."""
        if not isinstance(data, dict):
            raise ValueError(
                f"a task record must be a JSON object (one per line), got {type(data).__name__}"
            )
        if "instance_id" not in data:
            raise ValueError("task record has no 'instance_id'")
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            if key == "etude":
                kwargs["etude"] = None if value is None else EtudeInfo.from_dict(value)
            elif key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
                kwargs[key] = _decode_test_list(value, key)
            elif (
                key == "version" and isinstance(value, int | float) and not isinstance(value, bool)
            ):
                kwargs[key] = str(value)
            elif key in _SWE_FIELDS:
                kwargs[key] = "" if value is None and key not in _OPTIONAL_FIELDS else value
            elif key in _PORTABLE_FIELDS:
                kwargs[key] = value
            else:
                extra[key] = value
        return cls(**kwargs, extra=extra)

    def to_json(self) -> str:
        """One line of ASCII JSON (no trailing newline)."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, line: str) -> TaskRecord:
        """Parse one JSON line; malformed JSON is a ``ValueError``."""
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e.msg} at column {e.colno}") from None
        return cls.from_dict(data)


def record_test_env(record: TaskRecord) -> dict[str, str]:
    """The test environment variables of a record (top-level ``environment``, else the older
    ``etude.extra.test_env``)."""
    if record.environment is not None and "test_env" in record.environment:
        return dict(record.environment["test_env"])
    if record.etude is not None:
        return dict(record.etude.extra.get("test_env", {}))
    return {}


def record_pytest_args(record: TaskRecord) -> list[str]:
    """The pytest arguments of a record (top-level ``environment``, else ``etude.extra``)."""
    if record.environment is not None and "pytest_args" in record.environment:
        return list(record.environment["pytest_args"])
    if record.etude is not None:
        return list(record.etude.extra.get("pytest_args", []))
    return []


def _decode_test_list(value: Any, key: str) -> list[str]:
    # SWE-bench stores the test lists as JSON-encoded strings; SWE-smith and etude as lists.
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(
                f"{key} is a string but not a JSON-encoded list: {value[:80]!r}"
            ) from None
    if value is None:
        return []
    return list(_check_str_list(value, key))


def load_tasks(path: str | Path) -> list[TaskRecord]:
    """Read task records from a JSONL file (or ``DIR/tasks.jsonl`` when given a directory).

    Blank lines are skipped. A malformed line, an invalid record or a repeated ``instance_id`` is
    a ``ValueError`` naming the file and the 1-based line number.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "tasks.jsonl"
    if not path.is_file():
        raise ValueError(
            f"task file {str(path)!r} does not exist; pass a tasks.jsonl or its directory"
        )
    records: list[TaskRecord] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = TaskRecord.from_json(line)
            except ValueError as e:
                raise ValueError(f"{path}:{number}: {e}") from None
            if record.instance_id in seen:
                raise ValueError(
                    f"{path}:{number}: instance_id {record.instance_id!r} already used on line "
                    f"{seen[record.instance_id]}; ids must be unique within a file"
                )
            seen[record.instance_id] = number
            records.append(record)
    return records


def save_tasks(path: str | Path, records: Iterable[TaskRecord]) -> Path:
    """Write ``records`` as JSONL atomically (temp file in the same directory, then rename).

    Either the old file or the complete new one is on disk at every moment, also if the process
    dies mid-write. Repeated ``instance_id``s are a ``ValueError`` and nothing is written.
    Returns the path written.
    """
    path = Path(path)
    records = list(records)
    seen: set[str] = set()
    for record in records:
        if record.instance_id in seen:
            raise ValueError(
                f"instance_id {record.instance_id!r} appears twice; ids must be unique"
            )
        seen.add(record.instance_id)
    payload = "".join(record.to_json() + "\n" for record in records)
    write_atomic(path, payload.encode("utf-8"))
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one (temp
    file in the same directory, fsync, rename, fsync of the directory); mode 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    # The rename itself is durable only once the directory entry is flushed.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def is_archive(workspace: str | Path) -> bool:
    """Whether a workspace path names an archive (by suffix) rather than a directory."""
    return str(workspace).endswith(ARCHIVE_SUFFIXES)


def resolve_workspace(
    record: TaskRecord, base_dir: str | Path, dest: str | Path | None = None
) -> Path:
    """The record's broken workspace as a directory.

    ``etude.workspace`` is resolved against ``base_dir`` (the directory holding the record file).
    A directory is returned as is (absolute); an archive is extracted into ``dest``, which must
    not exist or be empty, and ``dest`` is returned. Archive members that would land outside
    ``dest`` (absolute paths, ``..``, links pointing out) or are devices are refused.

    Raises ``ValueError`` for a record without ``etude``, a missing workspace, an archive without
    ``dest`` or a non-empty ``dest``.
    """
    where = record.etude.workspace if record.etude is not None else record.workspace
    if where is None:
        raise ValueError(
            f"task {record.instance_id!r} has no workspace (no etude.workspace: a SWE-bench style "
            "record); "
            f"check out {record.repo or 'its repo'} at {record.base_commit or 'base_commit'} and "
            "point the record's workspace at it"
        )
    workspace = Path(where)
    if not workspace.is_absolute():
        workspace = Path(base_dir) / workspace
    workspace = workspace.absolute()
    if not is_archive(workspace):
        if not workspace.is_dir():
            raise ValueError(
                f"workspace {str(workspace)!r} of task {record.instance_id!r} is not a directory; "
                "etude.workspace is relative to the directory holding the task file"
            )
        return workspace
    if not workspace.is_file():
        raise ValueError(
            f"workspace archive {str(workspace)!r} of task {record.instance_id!r} is missing"
        )
    if dest is None:
        raise ValueError(
            f"workspace of task {record.instance_id!r} is an archive; pass dest= (a new directory) "
            "to extract it into"
        )
    dest = Path(dest).absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"dest {str(dest)!r} must be a new or empty directory")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(workspace, "r:*") as tar:
        members = tar.getmembers()
        for member in members:
            _check_member(member, workspace)
        # The data filter (3.11.4+) repeats these checks and drops unsafe modes on its own.
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:
            tar.extractall(dest, members=members)
    return dest


def _check_member(member: tarfile.TarInfo, archive: Path) -> None:
    path = PurePosixPath(member.name)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(f"archive {str(archive)!r} has a member outside its root: {member.name!r}")
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise ValueError(f"archive {str(archive)!r} has a special file: {member.name!r}")
    if member.issym() or member.islnk():
        target = PurePosixPath(member.linkname)
        resolved = target if member.islnk() else path.parent / target
        if target.is_absolute() or _escapes(resolved):
            raise ValueError(
                f"archive {str(archive)!r} has a link pointing outside its root: "
                f"{member.name!r} -> {member.linkname!r}"
            )


def _escapes(path: PurePosixPath) -> bool:
    depth = 0
    for part in path.parts:
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


def _walk(directory: Path) -> list[Path]:
    """Every entry under ``directory`` (files, links, dirs), sorted, symlinks not followed."""
    entries = []
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            entries.append(Path(root) / name)
    return sorted(entries, key=lambda p: p.relative_to(directory).as_posix())


def archive_workspace(directory: str | Path, archive: str | Path) -> Path:
    """Pack ``directory``'s contents into a reproducible ``.tar.gz`` (or ``.tar``) at ``archive``.

    Members are relative to the directory (no leading ``./``), sorted, with mtime 0, owner 0 and
    modes 0755/0644, so the same tree always gives the same bytes. Written atomically.
    """
    directory = Path(directory)
    archive = Path(archive)
    if not directory.is_dir():
        raise ValueError(f"cannot archive {str(directory)!r}: not a directory")
    if not is_archive(archive):
        raise ValueError(f"archive name {str(archive)!r} must end in one of {ARCHIVE_SUFFIXES}")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in _walk(directory):
            info = tar.gettarinfo(str(entry), arcname=entry.relative_to(directory).as_posix())
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isdir() or (info.isfile() and info.mode & stat.S_IXUSR):
                info.mode = 0o755
            elif not info.issym():
                info.mode = 0o644
            if info.isfile():
                with entry.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    data = buffer.getvalue()
    if not str(archive).endswith(".tar"):
        data = gzip.compress(data, mtime=0)
    write_atomic(archive, data)
    return archive


def tree_digest(directory: str | Path) -> str:
    """``"sha256:<hex>"`` over every file and symlink under ``directory`` (paths, contents,
    executable bits, link targets); empty directories and timestamps do not count.

    Equal trees give equal digests on any machine; ``archive_workspace`` followed by extraction
    preserves it.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"cannot digest {str(directory)!r}: not a directory")
    digest = hashlib.sha256()
    for entry in _walk(directory):
        rel = entry.relative_to(directory).as_posix()
        if entry.is_symlink():
            digest.update(f"link {rel} {os.readlink(entry)}\n".encode())
        elif entry.is_file():
            kind = "exec" if entry.stat().st_mode & stat.S_IXUSR else "file"
            content = hashlib.sha256(entry.read_bytes()).hexdigest()
            digest.update(f"{kind} {rel} {content}\n".encode())
    return "sha256:" + digest.hexdigest()
