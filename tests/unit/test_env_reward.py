"""The test-based reward on the hand-written tasks: the oracle earns 1.0, doing nothing 0.0, and
no edit to the tests (or planted pytest configuration) can buy a reward: the grader takes only
the agent's changes to the package source, on a pristine copy."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from etude.env.coding import CodingEnv, EnvConfig, run_episode
from etude.env.oracle import OracleAgent
from etude.env.reward import compute_reward
from etude.model.tokenizer import TOOL_CALL_END, TOOL_CALL_START, Tokenizer, default_corpus
from etude.tasks.record import TaskRecord, load_tasks, resolve_workspace

BASE = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "handwritten"
TASKS = load_tasks(BASE / "tasks.jsonl")
BY_ID = {t.instance_id: t for t in TASKS}
SLUGIFY = BY_ID["textkit__case.slugify"]

# a conftest that reports every test as passed: it works in the live workspace
RIGGED_CONFTEST = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(200_000), 512)


def call(name: str, **arguments) -> str:
    return f"{TOOL_CALL_START}{json.dumps({'name': name, 'arguments': arguments})}{TOOL_CALL_END}"


def solved_copy(task: TaskRecord, dest: Path) -> Path:
    """The task's workspace with its gold patch applied by `patch` (the reference tool)."""
    shutil.copytree(resolve_workspace(task, BASE), dest)
    subprocess.run(
        ["patch", "-p1", "--quiet", "--no-backup-if-mismatch"],
        input=task.patch,
        text=True,
        cwd=dest,
        check=True,
    )
    return dest


def episode(task: TaskRecord, tok: Tokenizer, texts: list[str], tmp_path: Path):
    """Drive an episode with ``texts`` (the last one must submit) and score it."""
    with CodingEnv(task, EnvConfig(work_dir=str(tmp_path)), tokenizer=tok, base_dir=BASE) as env:
        env.reset()
        results = [env.step(text) for text in texts]
        assert results[-1].done and results[-1].finish_reason == "submit"
        return env.finish(), results


@pytest.mark.parametrize("task", TASKS, ids=[t.instance_id for t in TASKS])
def test_oracle_earns_full_reward(task: TaskRecord, tok: Tokenizer, tmp_path: Path) -> None:
    with CodingEnv(task, EnvConfig(work_dir=str(tmp_path)), tokenizer=tok, base_dir=BASE) as env:
        trajectory = run_episode(env, OracleAgent(task, base_dir=str(BASE)))
    assert trajectory.reward == 1.0 and trajectory.finish_reason == "submit"
    assert trajectory.tests == {i: "passed" for i in [*task.FAIL_TO_PASS, *task.PASS_TO_PASS]}
    assert trajectory.info["grade"]["status"] == "passed"
    assert trajectory.info["error_counts"] == {}
    assert list(tmp_path.iterdir()) == []  # episode and scoring directories are gone


def test_doing_nothing_earns_zero(tok: Tokenizer, tmp_path: Path) -> None:
    trajectory, _ = episode(SLUGIFY, tok, [call("submit")], tmp_path)
    assert trajectory.reward == 0.0
    assert all(trajectory.tests[i] == "failed" for i in SLUGIFY.FAIL_TO_PASS)
    assert all(trajectory.tests[i] == "passed" for i in SLUGIFY.PASS_TO_PASS)
    for task in TASKS:
        if task is SLUGIFY:
            continue
        result = compute_reward(task, resolve_workspace(task, BASE), base_dir=BASE)
        assert result.reward == 0.0 and result.changed == []
        # the roman task lacks a whole module: its tests cannot even be collected
        assert result.collection_error == (task.instance_id == "textkit__roman")


def test_gold_patch_earns_one_and_test_edits_never_count(tmp_path: Path) -> None:
    solved = solved_copy(SLUGIFY, tmp_path / "solved")
    # a right solution with sabotaged tests still earns 1.0: the tests are restored
    test_file = solved / "tests" / "test_case.py"
    test_file.write_text(test_file.read_text().replace('== "hello-world"', '== "nope"'))
    (solved / "tests" / "test_wrap.py").unlink()
    result = compute_reward(SLUGIFY, solved, base_dir=BASE)
    assert result.reward == 1.0
    assert result.changed == ["textkit/case.py"]
    assert '== "nope"' in test_file.read_text()  # the scored workspace itself is left alone


def test_editing_the_tests_earns_nothing(tok: Tokenizer, tmp_path: Path) -> None:
    trivial = "def test_basic():\n    assert True\n"
    trajectory, _ = episode(
        SLUGIFY,
        tok,
        [call("write_file", path="tests/test_case.py", content=trivial), call("submit")],
        tmp_path,
    )
    assert trajectory.reward == 0.0
    assert trajectory.info["grade"]["changed"] == []
    assert trajectory.tests["tests/test_case.py::TestSlugify::test_basic"] == "failed"


def test_deleting_the_tests_earns_nothing(tok: Tokenizer, tmp_path: Path) -> None:
    trajectory, _ = episode(
        SLUGIFY,
        tok,
        [call("bash", command="rm -rf tests && mkdir tests"), call("submit")],
        tmp_path,
    )
    assert trajectory.reward == 0.0 and trajectory.info["grade"]["status"] == "failed"
    assert not trajectory.info["collection_error"]


def test_planted_conftest_and_pytest_config_earn_nothing(tok: Tokenizer, tmp_path: Path) -> None:
    deselect = "[pytest]\naddopts = -k 'not Slugify'\n"
    texts = [
        call("write_file", path="conftest.py", content=RIGGED_CONFTEST),
        call("run_tests"),
        call("write_file", path="tests/pytest.ini", content=deselect),
        call("submit"),
    ]
    trajectory, results = episode(SLUGIFY, tok, texts, tmp_path)
    # run_tests grades like the reward: the rig does not fool the agent's own run either
    assert results[1].observations[0].startswith("pytest: 211 passed, 11 failed")
    assert trajectory.reward == 0.0 and trajectory.info["grade"]["changed"] == []


def test_breaking_collection_earns_zero(tmp_path: Path) -> None:
    solved = solved_copy(SLUGIFY, tmp_path / "solved")
    with open(solved / "textkit" / "case.py", "a") as f:
        f.write("\ndef broken(:\n")
    result = compute_reward(SLUGIFY, solved, base_dir=BASE)
    assert result.reward == 0.0 and result.collection_error
    assert all(outcome != "passed" for outcome in result.tests.values())
