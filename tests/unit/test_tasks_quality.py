"""Task quality: difficulty score and floor, one task per F2P set, feature-sized tasks, time
limits from the baseline, and records a harness can run without etude."""

from __future__ import annotations

import json
import subprocess

from test_tasks_mine import write_mini_repo

from etude.cli import main as cli_main
from etude.tasks.baseline import Baseline, derived_time_limit
from etude.tasks.build import TaskBuildConfig, TaskFactory
from etude.tasks.proposal import ProposalConfig
from etude.tasks.quality import dedupe_by_fail_to_pass, difficulty_score
from etude.tasks.record import EtudeInfo, TaskRecord, load_tasks

MIXED = {
    # a feature in two modules (one uses the other), reached only by tests/test_mixed.py
    "minipkg/stats.py": '''\
        """Statistics."""


        def spread(values):
            """Largest minus smallest of ``values``; 0 for none."""
            if not values:
                return 0
            low = min(values)
            high = max(values)
            return high - low
        ''',
    "minipkg/report.py": '''\
        """Reports."""


        from minipkg.stats import spread


        def summary(values):
            """One line about ``values``."""
            count = len(values)
            width = spread(values)
            return f"{count} values over {width}"
        ''',
    "tests/test_mixed.py": """\
        from minipkg import report, stats


        def test_spread():
            assert stats.spread([3, 9, 4]) == 6 and stats.spread([]) == 0


        def test_summary():
            assert report.summary([1, 5]) == "2 values over 4"
        """,
}


def _record(instance_id, f2p, score):
    return TaskRecord(
        instance_id=instance_id,
        FAIL_TO_PASS=f2p,
        etude=EtudeInfo(workspace="w", difficulty={"score": score}),
    )


def test_dedupe_keeps_the_highest_score_per_fail_to_pass_set():
    records = [_record("a", ["t1"], 2.0), _record("b", ["t1"], 5.0), _record("c", ["t2"], 1.0)]
    kept, dropped = dedupe_by_fail_to_pass(records)
    assert [r.instance_id for r in kept] == ["b", "c"]
    assert list(dropped) == ["a"] and "same 1 tests as b" in dropped["a"]


def test_difficulty_score_grows_with_each_signal():
    base = dict(deleted_statements=1, num_fail_to_pass=1, callers=1, num_files=1, detail_rank=0)
    assert difficulty_score(**base) == 2.0
    for key, value in [
        ("deleted_statements", 5),
        ("num_fail_to_pass", 4),
        ("callers", 9),
        ("num_files", 2),
        ("detail_rank", 1),
    ]:
        assert difficulty_score(**{**base, key: value}) > 2.0


def test_derived_time_limit_follows_the_baseline():
    baseline = Baseline(
        passing=(),
        failing=(),
        flaky=(),
        canonical={},
        line_tests={},
        importable=(),
        plain_seconds=(4.0, 6.0),
    )
    assert derived_time_limit(baseline, factor=3.0, floor=10.0, ceiling=600.0) == 18.0
    assert derived_time_limit(baseline, factor=3.0, floor=30.0, ceiling=600.0) == 30.0
    assert derived_time_limit(baseline, factor=300.0, floor=1.0, ceiling=600.0) == 600.0


def test_a_build_with_floor_dedupe_feature_groups_and_portable_records(tmp_path, capsys):
    repo = write_mini_repo(tmp_path / "repo", MIXED)
    cfg = TaskBuildConfig(
        workers=2,
        min_time_limit_s=15.0,
        proposals=ProposalConfig(
            min_lines=2, include=("minipkg.words*", "minipkg.stats*", "minipkg.report*")
        ),
    )
    out = tmp_path / "out"
    with TaskFactory(repo, out, cfg) as factory:
        records, report = factory.build()
        limit = factory.time_limit
    groups = {r.etude.extra["feature"]: r for r in records if r.etude.kind == "feature_deletion"}
    # the feature-sized task deletes code in two modules, reached only by tests/test_mixed.py
    group = groups["feature.test_mixed"]
    assert group.etude.extra["feature_kind"] == "feature"
    assert set(group.etude.symbols) == {"minipkg.stats.spread", "minipkg.report.summary"}
    assert group.FAIL_TO_PASS == [
        "tests/test_mixed.py::test_spread",
        "tests/test_mixed.py::test_summary",
    ]
    assert group.etude.difficulty["num_files"] == 2
    # one-statement helpers fall under the floor, with the score in the reason
    assert report.rejected["words.shout"].startswith("below the difficulty floor")
    assert report.reject_counts.get("below the difficulty floor", 0) >= 2
    # no two tasks share a FAIL_TO_PASS set; the duplicates are named
    sets = [tuple(r.FAIL_TO_PASS) for r in records]
    assert len(sets) == len(set(sets))
    assert any(v.startswith("duplicate FAIL_TO_PASS set") for v in report.rejected.values())
    # the difficulty record has every signal
    assert set(group.etude.difficulty) >= {
        "deleted_lines",
        "deleted_statements",
        "num_fail_to_pass",
        "callers",
        "num_files",
        "detail_rank",
        "score",
    }
    # portable: everything a harness needs at the top level
    on_disk = load_tasks(out / "tasks.jsonl")
    raw = json.loads((out / "tasks.jsonl").read_text().splitlines()[0])
    assert {"workspace", "test_command", "environment", "time_limit_s"} <= set(raw)
    assert raw["time_limit_s"] == limit == report.time_limit_s >= 15.0
    assert raw["environment"]["python"].count(".") == 1
    assert on_disk[0].workspace == on_disk[0].etude.workspace

    # a plain shell runs the record's test command in its workspace: F2P fails there
    record = on_disk[0]
    command = record.test_command.replace("{tests}", " ".join(record.FAIL_TO_PASS))
    command = command.replace("python -m pytest", f"{_python()} -m pytest")
    proc = subprocess.run(
        command, shell=True, cwd=out / record.workspace, capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stdout[-500:]

    # export in SWE-bench form
    export = tmp_path / "swebench.jsonl"
    code = cli_main(["tasks", "export", str(out), "--format", "swebench", "--out", str(export)])
    assert code == 0
    rows = [json.loads(line) for line in export.read_text().splitlines()]
    assert len(rows) == len(records)
    row = rows[0]
    assert json.loads(row["FAIL_TO_PASS"]) == on_disk[0].FAIL_TO_PASS  # JSON strings, as shipped
    assert row["environment_setup_commit"] == row["base_commit"]
    assert row["workspace"].startswith(str(out)) and "{tests}" in row["test_cmd"]
    assert "etude" not in row
    capsys.readouterr()


def _python():
    import sys

    return sys.executable
