"""Export task records for harnesses that know nothing of etude (``etude tasks export``).

``--format swebench`` writes one JSON object per line with the SWE-bench instance fields as the
SWE-bench datasets ship them (``FAIL_TO_PASS``/``PASS_TO_PASS`` as JSON-encoded strings,
``environment_setup_commit``, ``version``, ``hints_text``, ``created_at``) plus what a harness
needs to run a task without building an image per repository: ``workspace`` (the broken tree,
an absolute path; an archive is extracted beside the export), ``test_cmd`` (a shell command run
from the workspace root, ``{tests}`` standing for the node ids), ``test_env``, ``python``,
``pytest_args``, ``test_requirements`` (already installed in the workspace's ``.etude-deps``
when not empty) and ``time_limit_s``. The gold ``patch`` takes the workspace to the original
code; ``test_patch`` is empty because the tests never left the workspace.

What this module does not do: build Docker images or write SWE-bench's per-repository
specifications (the command and environment are in each row instead), or export foreign records
that have no workspace.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from etude.tasks.record import (
    TaskRecord,
    is_archive,
    record_pytest_args,
    record_test_env,
    resolve_workspace,
    write_atomic,
)

FORMATS = ("swebench",)


def swebench_row(record: TaskRecord, workspace: Path) -> dict[str, Any]:
    """One SWE-bench style row for ``record`` whose workspace is the directory ``workspace``."""
    environment = record.environment or {}
    return {
        "instance_id": record.instance_id,
        "repo": record.repo,
        "base_commit": record.base_commit,
        "patch": record.patch,
        "test_patch": record.test_patch,
        "problem_statement": record.problem_statement,
        "hints_text": record.hints_text or "",
        "created_at": record.created_at or "",
        "version": record.version,
        "FAIL_TO_PASS": json.dumps(record.FAIL_TO_PASS),
        "PASS_TO_PASS": json.dumps(record.PASS_TO_PASS),
        "environment_setup_commit": record.base_commit,
        "workspace": str(workspace),
        "test_cmd": record.test_command or "python -m pytest {tests}",
        "test_env": record_test_env(record),
        "python": environment.get("python", ""),
        "pytest_args": record_pytest_args(record),
        "test_requirements": list(environment.get("test_requirements", [])),
        "time_limit_s": record.time_limit_s,
    }


def export_records(
    records: Iterable[TaskRecord], base_dir: Path, out: Path, fmt: str = "swebench"
) -> int:
    """Write ``records`` (their task file lies in ``base_dir``) to ``out`` in ``fmt``; returns
    the number written. Archived workspaces are extracted under ``OUT.workspaces/``."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is not one of {list(FORMATS)}")
    rows = []
    extract_root = out.with_name(out.name + ".workspaces")
    for record in records:
        where = record.etude.workspace if record.etude is not None else record.workspace
        dest = None
        if where is not None and is_archive(where):
            dest = extract_root / record.instance_id
        workspace = resolve_workspace(record, base_dir, dest=dest)
        rows.append(swebench_row(record, workspace.resolve()))
    text = "".join(json.dumps(row) + "\n" for row in rows)
    write_atomic(out, text.encode("utf-8"))
    return len(rows)
