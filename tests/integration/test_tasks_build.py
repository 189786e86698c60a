"""The task factory on the example repository: valid tasks that pass ``etude tasks check``.

The default suite builds the tasks of one module (fast); the ``slow`` test builds every task of
the repository (acceptance: at least 20) and re-checks each record.
"""

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from etude.sandbox import make_sandbox
from etude.tasks.build import TaskBuildConfig, build_tasks
from etude.tasks.proposal import ProposalConfig
from etude.tasks.record import load_tasks
from etude.tasks.validate import check_record

ROOT = Path(__file__).resolve().parents[2]
TEXTKIT = ROOT / "examples" / "repos" / "textkit"
HANDWRITTEN = ROOT / "examples" / "tasks" / "handwritten"


def _tree_state(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirs, names in os.walk(root):
        for name in dirs + names:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


def _check_all(out: Path, records, workers: int = 2):
    sandbox = make_sandbox()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda r: check_record(r, out, sandbox, timeout=300), records))
    failed = {r.instance_id: r.problems for r in results if not r.ok}
    assert not failed


def test_one_module_of_textkit(tmp_path):
    before = _tree_state(TEXTKIT)
    cfg = TaskBuildConfig(
        proposals=ProposalConfig(include=("textkit.roman", "textkit.roman.from_roman"))
    )
    records, report = build_tasks(TEXTKIT, tmp_path / "out", cfg)
    assert _tree_state(TEXTKIT) == before  # nothing written into the source repository
    ids = [r.instance_id for r in records]
    assert ids == ["textkit__roman.from_roman", "textkit__roman"], report.rejected
    assert report.valid == report.candidates == 2 and report.num_passing == 222
    assert load_tasks(tmp_path / "out") == records
    module_task = records[-1]
    reference = {r.instance_id: r for r in load_tasks(HANDWRITTEN)}["textkit__roman"]
    assert module_task.patch == reference.patch
    assert sorted(module_task.FAIL_TO_PASS) == sorted(reference.FAIL_TO_PASS)
    assert module_task.etude.deleted_files == ["textkit/roman.py"]
    _check_all(tmp_path / "out", records)


@pytest.mark.slow
def test_every_task_of_textkit(tmp_path):
    records, report = build_tasks(TEXTKIT, tmp_path / "out", TaskBuildConfig())
    assert len(records) >= 20, report.rejected
    assert all(r.etude.leak_scan["clean"] for r in records)
    kinds = {r.etude.extra["feature_kind"] for r in records}
    assert {"function", "class", "method", "module"} <= kinds
    _check_all(tmp_path / "out", records)
