"""Validation by test runs in the sandbox, and re-checking finished records."""

import dataclasses
import subprocess

import pytest
from test_tasks_mine import write_mini_repo

from etude.tasks.build import TaskBuildConfig, TaskFactory
from etude.tasks.mine import Feature, ProposalConfig
from etude.tasks.record import TaskRecord, resolve_workspace
from etude.tasks.sanitize import run_git
from etude.tasks.validate import check_record, locate_symbol

STATE = '''\
"""In-place state helpers."""


def reset(state):
    """Empty ``state`` in place; returns None."""
    state.clear()
    return None


def on_event(event):
    """Hook called for every event; the default does nothing and returns None."""
    del event
    return None
'''
STATE_TESTS = """\
from minipkg import state


def test_reset_empties():
    s = {"a": 1}
    state.reset(s)
    assert s == {}


def test_reset_returns_none():
    assert state.reset({}) is None


def test_hook_returns_none():
    assert state.on_event("x") is None
"""
# a test helper the package ships, used as a decorator by its tests: pytest calls the helper's
# wrapper, code of the package (the grader's tamper check must not count it as the agent's while
# the file is unchanged)
CHECKS = """\
\"\"\"Test helpers shipped with the package.\"\"\"
import functools


def twice(check):
    \"\"\"Run ``check`` two times.\"\"\"

    @functools.wraps(check)
    def run_twice():
        check()
        check()

    return run_twice
"""
CHECKS_TESTS = """\
from minipkg.checks import twice


@twice
def test_twice_runs():
    assert True
"""


@pytest.fixture(scope="module")
def factory(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validate")
    repo = write_mini_repo(
        tmp / "repo",
        {
            "minipkg/state.py": STATE,
            "tests/test_state.py": STATE_TESTS,
            "minipkg/checks.py": CHECKS,
            "tests/test_checks.py": CHECKS_TESTS,
        },
    )
    cfg = TaskBuildConfig(workers=1, proposals=ProposalConfig(min_lines=2))
    with TaskFactory(repo, tmp / "out", cfg) as f:
        yield f


def _feature(factory, module, qualname):
    found = factory.miner.symbol_feature(module, qualname, factory.cfg.proposals)
    assert isinstance(found, Feature), found
    return found


@pytest.fixture(scope="module")
def area_record(factory):
    outcome = factory.make_task(_feature(factory, "minipkg.shapes", "area"))
    assert outcome.record is not None, outcome.reason
    return outcome.record


def test_valid_task_and_its_record(factory, area_record):
    record = area_record
    assert record.FAIL_TO_PASS == ["tests/test_shapes.py::test_area"]
    assert len(record.PASS_TO_PASS) == len(factory.baseline.passing) - 1
    assert record.etude.symbols == [
        "minipkg.shapes.area",
        "minipkg.shapes._UNIT",
        "minipkg.shapes._square",
    ]
    assert "minipkg/__init__.py" in record.patch  # the re-export goes too
    # copies of the package the sandbox would show, searched once at build time for the env
    assert record.etude.extra["masked_paths"] == factory.package_copies(record.patch) == []
    ws = resolve_workspace(record, factory.out_dir)
    assert "area" not in (ws / "minipkg" / "__init__.py").read_text()
    assert run_git(["rev-parse", "HEAD"], ws).decode().strip() == record.base_commit
    # the stored record round-trips and re-validates from the record alone
    again = TaskRecord.from_json(record.to_json())
    result = check_record(again, factory.out_dir, factory.sandbox, timeout=120)
    assert result.ok, result.problems
    assert result.leak_scan["clean"]


def test_breaking_the_import_is_rejected(factory):
    # scale is needed at import time; force the deletion past the miner's check
    feature = Feature(
        kind="function",
        name="shapes.scale",
        symbols=("minipkg.shapes.scale",),
        interface=("minipkg.shapes.scale",),
        definitions=(("minipkg/shapes.py", ("scale",)),),
        files=(),
        tests=frozenset({"tests/test_shapes.py::test_default_side"}),
        deleted_lines=3,
    )
    outcome = factory.make_task(feature)
    assert outcome.record is None and outcome.reason.startswith(
        "package no longer imports: minipkg, minipkg.checks, minipkg.shapes"
    )


def test_failing_test_outside_the_candidates_is_rejected(factory):
    feature = _feature(factory, "minipkg.shapes", "perimeter")
    narrow = dataclasses.replace(
        feature, tests=frozenset({"tests/test_shapes.py::test_perimeter[1]"})
    )
    outcome = factory.make_task(narrow)
    assert outcome.record is None and outcome.reason.startswith("PASS_TO_PASS broken")


def test_tests_a_stub_passes_are_dropped_or_reject_the_task(factory):
    outcome = factory.make_task(_feature(factory, "minipkg.state", "reset"))
    assert outcome.record is not None, outcome.reason
    assert outcome.record.FAIL_TO_PASS == ["tests/test_state.py::test_reset_empties"]
    assert outcome.record.etude.extra["num_stub_passing"] == 1
    # neither F2P nor P2P: it fails on the broken tree but says nothing about the feature
    assert "tests/test_state.py::test_reset_returns_none" not in outcome.record.PASS_TO_PASS
    hook = factory.make_task(_feature(factory, "minipkg.state", "on_event"))
    assert hook.record is None and hook.reason.startswith("a trivial body")


def test_a_gold_tree_the_reward_would_score_zero_makes_no_task(factory):
    """Deleting the package's test decorator: the gold tree passes every test, but pytest then
    calls a wrapper from a file the solution wrote, which the grader reports as tampering: the
    reward would score any solution 0, so the validator must reject the task (it read the
    per-test outcomes only)."""
    feature = Feature(
        kind="function",
        name="checks.twice",
        symbols=("minipkg.checks.twice",),
        interface=("minipkg.checks.twice",),
        definitions=(("minipkg/checks.py", ("twice",)),),
        files=(),
        tests=frozenset({"tests/test_checks.py::test_twice_runs"}),
        deleted_lines=8,
    )
    outcome = factory.make_task(feature)
    assert outcome.record is None
    assert outcome.reason.startswith("the gold tree grades error: tampering: test function"), (
        outcome.reason
    )


def test_check_catches_a_tampered_workspace_and_a_bad_patch(factory, area_record):
    record = area_record
    ws = resolve_workspace(record, factory.out_dir)
    shapes = ws / "minipkg" / "shapes.py"
    original = shapes.read_text()
    shapes.write_text(
        original + "\n\ndef area(radius):\n    return 3.141592653589793 * radius * radius\n"
    )
    result = check_record(record, factory.out_dir, factory.sandbox, timeout=120)
    assert not result.ok
    assert any("FAIL_TO_PASS tests pass on the workspace" in p for p in result.problems)
    assert any("changes not in its commit" in p for p in result.problems)
    shapes.write_text(original)
    bad = TaskRecord.from_dict(
        {
            **record.to_dict(),
            "patch": record.patch.replace("\n import math\n", "\n import maths\n", 1),
        }
    )
    result = check_record(bad, factory.out_dir, factory.sandbox, timeout=120)
    assert "\n import maths\n" in bad.patch
    assert any("does not apply" in p for p in result.problems)
    subprocess.run(["git", "status"], cwd=ws, check=True, capture_output=True)


def test_locate_symbol(tmp_path):
    (tmp_path / "src" / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "src" / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "src" / "pkg" / "mod.py").write_text("")
    assert locate_symbol(tmp_path, "pkg.mod.Cls.meth") == ("src/pkg/mod.py", "Cls.meth")
    assert locate_symbol(tmp_path, "pkg.sub") == ("src/pkg/sub/__init__.py", "")
    assert locate_symbol(tmp_path, "pkg.helper") == ("src/pkg/__init__.py", "helper")
    assert locate_symbol(tmp_path, "other.x") is None
