"""Validation by test runs in the sandbox, and re-checking finished records."""

import dataclasses
import json
import subprocess

import pytest
from test_tasks_mine import write_mini_repo

from etude.sandbox.grader import grading_config
from etude.tasks.build import TaskBuildConfig, TaskFactory
from etude.tasks.build_report import TaskOutcome
from etude.tasks.proposal import Feature, ProposalConfig
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
# a timing test of the kind that fails under load (a socket read with a timeout): here the load
# is an environment variable the sandbox sets on chosen runs (`LoadedHost`)
NET_TESTS = """\
import os


def test_echo_within_timeout():
    assert os.environ.get("ETUDE_TEST_HOST_LOADED") != "1", "timed out waiting for the echo"
"""
FLAKY = "tests/test_net.py::test_echo_within_timeout"


class LoadedHost:
    """The factory's sandbox on a host whose load makes ``FLAKY`` fail: in the gold runs (runs
    naming ``FLAKY`` among explicit ids) numbered in ``loaded_runs`` (1-based). Every command
    still runs in the real sandbox."""

    def __init__(self, inner, loaded_runs):
        self.inner = inner
        self.name = inner.name
        self.config = grading_config(inner.config)
        self.not_isolated = inner.not_isolated
        self.loaded_runs = set(loaded_runs)
        self.gold_runs = 0

    def run(self, cmd, cwd, *, timeout=None, env=None, stdin=None):
        if stdin and FLAKY in json.loads(stdin).get("args", []):
            self.gold_runs += 1
            if self.gold_runs in self.loaded_runs:
                env = {**(env or {}), "ETUDE_TEST_HOST_LOADED": "1"}
        return self.inner.run(cmd, cwd, timeout=timeout, env=env, stdin=stdin)

    def close(self):
        self.inner.close()


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
            "tests/test_net.py": NET_TESTS,
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


def _with_load(factory, loaded_runs, gold_runs=2):
    """``make_task`` for ``shapes.area`` on a loaded host; the factory is restored after."""
    inner, cfg = factory.sandbox, factory.cfg
    factory.sandbox = LoadedHost(inner, loaded_runs)
    factory.cfg = dataclasses.replace(cfg, gold_runs=gold_runs)
    try:
        return factory.make_task(_feature(factory, "minipkg.shapes", "area")), factory.sandbox
    finally:
        factory.sandbox, factory.cfg = inner, cfg


def test_a_test_that_flakes_on_the_gold_tree_leaves_the_task(factory, area_record):
    """The flaky test passed in both baseline runs and on the broken tree, then failed in one of
    the two gold runs: it is dropped from PASS_TO_PASS (the gold tree is the baseline's), the
    task stays, and the build keeps it out of every task, earlier ones included."""
    assert FLAKY in area_record.PASS_TO_PASS
    outcome, host = _with_load(factory, loaded_runs={1})
    try:
        assert host.gold_runs == 2
        assert outcome.record is not None, outcome.reason
        assert FLAKY not in outcome.record.PASS_TO_PASS
        assert outcome.record.FAIL_TO_PASS == ["tests/test_shapes.py::test_area"]
        assert FLAKY in factory.flaky_found
        earlier = dataclasses.replace(area_record)
        factory.drop_flaky([TaskOutcome(feature="area", record=earlier, reason="", seconds=0.0)])
        assert FLAKY not in earlier.PASS_TO_PASS and FLAKY in area_record.PASS_TO_PASS
    finally:
        factory.flaky_found.discard(FLAKY)


def test_a_test_failing_in_every_gold_run_rejects_the_task(factory):
    """Failing in both gold runs is not flakiness: the gold tree does not pass (rejected), and
    with one gold run a single failure rejects too (nothing to tell a flake by)."""
    outcome, _ = _with_load(factory, loaded_runs={1, 2})
    assert outcome.record is None
    assert outcome.reason == f"gold patch leaves 1 tests failing, e.g. {FLAKY}"
    single, host = _with_load(factory, loaded_runs={1}, gold_runs=1)
    assert host.gold_runs == 1 and single.record is None
    assert single.reason.startswith("gold patch leaves 1 tests failing")
    assert not factory.flaky_found


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
