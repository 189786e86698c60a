"""The grader with the test environment's own pytest plugins (a task's ``.etude-deps``) and a
repository that turns warnings into errors (itsdangerous' ``filterwarnings = ["error"]``): the
reporter loads the plugins before pytest starts, pytest warns that it cannot rewrite their
asserts, and that warning must not fail the run (it failed every graded run of itsdangerous
with pytest-timeout installed, so its build yielded no task)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from etude.sandbox import grade

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))
import grading_corpus as corpus  # noqa: E402

PLUGIN = '''"""A pytest plugin installed with the task's test requirements."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slowish: a marker the plugin declares")
'''


def test_an_installed_plugin_and_filterwarnings_error_grade_the_gold_tree(tmp_path: Path) -> None:
    ws, _ = corpus.make_task(tmp_path / "task", "flat")
    deps = ws / ".etude-deps"
    dist = deps / "etude_probe_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (deps / "etude_probe_plugin.py").write_text(PLUGIN)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: etude-probe-plugin\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text("[pytest11]\nprobe = etude_probe_plugin\n")
    (ws / "pytest.ini").write_text("[pytest]\nfilterwarnings =\n    error\n")
    agent = tmp_path / "agent"
    shutil.copytree(ws, agent, symlinks=True)
    corpus.solve(agent)
    f2p, p2p = corpus.test_ids("flat")
    env = {"PYTHONPATH": ".etude-deps"}
    outcome = grade(ws, agent, ["calc/"], [*f2p, *p2p], env, timeout=120)
    assert outcome.status == "passed", (outcome.reason, outcome.output[-2000:])
    broken = grade(ws, None, ["calc/"], [*f2p, *p2p], env, timeout=120)
    assert broken.status == "failed" and sorted(broken.failed_ids) == sorted(f2p)
