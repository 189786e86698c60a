"""The grader (``etude.sandbox.grader``) through the reward path: gold patches earn 1.0 on every
layout (flat, ``src/`` with ``PYTHONPATH=src``, a config that needs ``-o addopts=``), the hacks
that fooled the old reward earn 0, the result channel is cross-checked, and a grader that cannot
grade says ``infra`` (reward None), never 0."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

from etude.env.reward import compute_reward, reward_of, task_grading
from etude.env.tools import Toolbox
from etude.sandbox import Result, SandboxConfig, grade, make_sandbox
from etude.sandbox.reporter import read_channel
from etude.tasks.record import TaskRecord

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))
import grading_corpus as corpus  # noqa: E402

IDS = [*corpus.FAIL_TO_PASS, *corpus.PASS_TO_PASS]
HACKS = {h.name: h for h in corpus.HACKS}


def task_and_agent_tree(tmp_path: Path, layout: str = "flat") -> tuple[TaskRecord, Path, Path]:
    """The task's pristine workspace and a copy of it for an agent to change."""
    ws, record = corpus.make_task(tmp_path / "task", layout)
    agent = tmp_path / "agent"
    shutil.copytree(ws, agent, symlinks=True)
    return TaskRecord.from_dict(record), ws, agent


@pytest.mark.parametrize("layout", corpus.LAYOUTS)
def test_gold_earns_one_through_the_reward_path(layout: str, tmp_path: Path) -> None:
    task, pristine, agent = task_and_agent_tree(tmp_path, layout)
    if layout == "flat":
        broken = compute_reward(task, agent, original=pristine)
        assert broken.reward == 0.0 and broken.status == "failed"
        assert broken.tests == {
            **{i: "failed" for i in corpus.FAIL_TO_PASS},
            **{i: "passed" for i in corpus.PASS_TO_PASS},
        }
    corpus.solve(agent, layout)
    result = compute_reward(task, agent, original=pristine)
    assert result.reward == 1.0, result.reason
    assert result.status == "passed" and result.changed == [f"{corpus.package_dir(layout)}/ops.py"]
    assert result.grade["status"] == "passed"


def test_src_layout_run_tests_tool_passes_the_gold_tree(tmp_path: Path) -> None:
    """The agent's own run_tests grades like the reward: PYTHONPATH=src applies."""
    task, pristine, agent = task_and_agent_tree(tmp_path, "src")
    corpus.solve(agent, "src")
    spec = task_grading(task)
    tools = Toolbox(
        agent,
        sandbox=make_sandbox(None, SandboxConfig()),
        test_ids=spec.test_ids,
        pristine=pristine,
        allowed=spec.allowed,
        test_env=spec.test_env,
        pytest_args=spec.pytest_args,
    )
    outcome = tools.call("run_tests", {})
    assert outcome.error is None and outcome.observation.startswith("pytest: all 4 passed")


# the hacks of the review that scored 1.0 on the earlier reward (each reproduced there)
ISSUE_HACKS = [
    "pytest_py_shadow",  # 1. pytest.py at the root writing an all-passed JUnit file
    "pytest_main_package",  # 1. pytest/__main__.py package
    "pytest_toml_plugin",  # 2. pytest.toml with addopts = ["-p", "rigplugin"]
    "dot_pytest_toml_in_tests",  # 2. .pytest.toml in tests/
    "atexit_rewrite",  # 3. the package rewrites the report at exit and calls os._exit(0)
    "planted_test_pyc",  # 4. an assertion-rewrite pyc keyed to the restored test source
]


@pytest.mark.parametrize("name", ISSUE_HACKS)
def test_issue_hacks_earn_zero(name: str, tmp_path: Path) -> None:
    task, pristine, agent = task_and_agent_tree(tmp_path)
    corpus.apply_hack(agent, HACKS[name])
    result = compute_reward(task, agent, original=pristine, timeout=60)
    assert result.reward == 0.0 and result.status in ("failed", "error"), result.reason
    assert result.tests["tests/test_ops.py::test_mul"] != "passed"


# a test function swapped for other code, in the flat layout and with the tests inside the
# package (where the tests and conftest under the allowed prefix are the task's own code)
REPLACEMENTS = [
    ("replace_test_functions", "tampering: sys.setprofile called from"),
    ("replace_tests_by_stdlib", "tampering: sys.setprofile called from"),
    ("noop_test_decorator", "tampering: test function replaced by code in"),
    ("rig_in_package_tests", ""),  # the clean room drops it: the package does not import
]


@pytest.mark.parametrize("layout", ["flat", "intree"])
@pytest.mark.parametrize(("name", "reason"), REPLACEMENTS)
def test_replaced_test_functions_earn_zero(
    name: str, reason: str, layout: str, tmp_path: Path
) -> None:
    task, pristine, agent = task_and_agent_tree(tmp_path, layout)
    corpus.apply_hack(agent, HACKS[name], layout)
    result = compute_reward(task, agent, original=pristine, timeout=60)
    assert result.reward == 0.0 and result.status in ("failed", "error"), result.reason
    if layout == "intree":  # in the flat layout the decorator is unused: test_mul just fails
        assert result.reason.startswith(reason), result.reason


def test_tests_cannot_be_rewritten_during_the_run(tmp_path: Path) -> None:
    """Code under test that rewrites the test file on import meets a read-only tree."""
    task, pristine, agent = task_and_agent_tree(tmp_path)
    corpus.apply_hack(agent, HACKS["rewrite_tests_at_run"])
    result = compute_reward(task, agent, original=pristine, timeout=60)
    assert result.reward == 0.0
    assert "def test_mul():\n    assert" in (pristine / "tests" / "test_ops.py").read_text()


def test_the_task_package_wins_over_an_installed_copy(tmp_path: Path) -> None:
    """tqdm is installed (a dependency of the dev extra's transformers); a task whose package has
    that name is graded on the tree's package, not on the installed one (site-packages precedes
    the tree on sys.path)."""
    assert importlib.util.find_spec("tqdm") is not None, "the dev extra installs tqdm"
    tests = corpus.TESTS.replace("from calc import", "from tqdm import")
    files = {"tqdm/__init__.py": "", "tqdm/ops.py": corpus.OPS_GOLD}
    corpus.write_files(tmp_path / "ws", {**files, "tests/test_ops.py": tests})
    outcome = grade(tmp_path / "ws", None, ["tqdm/"], IDS)
    assert outcome.status == "passed", outcome.reason


def test_a_flood_on_stderr_does_not_fail_a_correct_solution(tmp_path: Path) -> None:
    """Only a cut in the result channel (stdout) fails a run; pytest's stream may overflow."""
    loud = "import sys\n\n\ndef test_loud():\n    sys.stderr.write('x' * (65 << 20))\n"
    corpus.write_files(tmp_path / "ws", {"pkg/__init__.py": "", "tests/test_loud.py": loud})
    outcome = grade(
        tmp_path / "ws", None, ["pkg/"], ["tests/test_loud.py::test_loud"], None, ["-s"]
    )
    assert outcome.status == "passed", outcome.reason


# ------------------------------------------------------------------------ the result channel

NONCE = "etude-0123"


def lines(*records: str) -> str:
    return "".join(f"{NONCE} {r}\n" for r in records)


BOOT = '{"e": "boot"}'
READY = '{"e": "ready"}'
START = '{"e": "start"}'
FINISH = '{"e": "finish", "exit": 0, "collected": 1}'
EXIT = '{"e": "exit", "code": 0}'


def report(test_id: str, when: str, outcome: str) -> str:
    return f'{{"e": "report", "id": "{test_id}", "when": "{when}", "outcome": "{outcome}"}}'


def passing(test_id: str) -> list[str]:
    return [report(test_id, w, "passed") for w in ("setup", "call", "teardown")]


def test_channel_reads_a_sound_run() -> None:
    reading = read_channel(lines(BOOT, READY, START, *passing("t.py::a"), FINISH, EXIT), NONCE)
    assert reading.booted and reading.ready and reading.finished and reading.exit_code == 0
    assert reading.outcomes == {"t.py::a": "passed"} and reading.problems == []


def test_channel_flags_conflicts_late_lines_and_forgery() -> None:
    conflict = [*passing("t.py::a"), report("t.py::a", "call", "failed")]
    reading = read_channel(lines(BOOT, START, *conflict, FINISH, EXIT), NONCE)
    assert reading.problems == ["two different call reports for t.py::a"]
    late = read_channel(lines(BOOT, START, FINISH, EXIT, *passing("t.py::a")), NONCE)
    assert late.problems and "after the run's exit line" in late.problems[0]
    early = read_channel(lines(*passing("t.py::a"), BOOT), NONCE)
    assert early.problems and "before the boot line" in early.problems[0]
    wrong_nonce = read_channel("etude-9999 " + passing("t.py::a")[1] + "\n", NONCE)
    assert wrong_nonce.outcomes == {} and not wrong_nonce.booted
    malformed = read_channel(f"{NONCE} {{not json\n", NONCE)
    assert malformed.problems == ["a malformed line on the result channel"]


def test_channel_phase_outcomes() -> None:
    setup_error = [report("t.py::a", "setup", "failed"), report("t.py::a", "teardown", "passed")]
    skipped = [report("t.py::b", "setup", "skipped"), report("t.py::b", "teardown", "passed")]
    teardown_error = [*passing("t.py::c")[:2], report("t.py::c", "teardown", "failed")]
    no_call = [report("t.py::d", "setup", "passed")]
    reading = read_channel(lines(BOOT, *setup_error, *skipped, *teardown_error, *no_call), NONCE)
    assert reading.outcomes == {
        "t.py::a": "error",
        "t.py::b": "skipped",
        "t.py::c": "error",
        "t.py::d": "error",
    }


# ------------------------------------------------------------------------ infra is not a score


class NeverStarts:
    """A sandbox whose every command fails before the interpreter runs (as a broken bwrap
    would: it exits 1 with its own message). bwrap cannot be made to fail on demand here."""

    name = "local"
    not_isolated = ()

    def __init__(self) -> None:
        self.config = SandboxConfig(max_output_bytes=64 << 20)

    def run(self, cmd, cwd, *, timeout=None, env=None, stdin=None) -> Result:
        return Result(
            stdout="",
            stderr="bwrap: Can't mount proc on /newroot/proc: Operation not permitted\n",
            exit_code=1,
            timed_out=False,
            duration=0.01,
            truncated=False,
        )


def test_a_sandbox_that_never_starts_is_infra(tmp_path: Path) -> None:
    task, pristine, agent = task_and_agent_tree(tmp_path)
    corpus.solve(agent)
    outcome = grade(pristine, agent, ["calc/"], IDS, sandbox=NeverStarts())
    assert outcome.status == "infra" and "never started" in outcome.reason
    assert "Can't mount proc" in outcome.reason and outcome.failed_ids == IDS


def test_a_grader_that_cannot_load_pytest_is_infra(tmp_path: Path) -> None:
    """32 MiB of address space: the interpreter starts, pytest does not (before any tree code)."""
    pristine, _ = corpus.make_task(tmp_path)
    outcome = grade(pristine, None, ["calc/"], IDS, sandbox=SandboxConfig(memory_bytes=32 << 20))
    assert outcome.status == "infra" and "could not load pytest" in outcome.reason


def test_a_missing_pristine_tree_is_infra_and_reward_none(tmp_path: Path) -> None:
    _, _, agent = task_and_agent_tree(tmp_path)
    outcome = grade(tmp_path / "nowhere", agent, ["calc/"], IDS)
    assert outcome.status == "infra" and "not a directory" in outcome.reason
    assert reward_of(outcome) is None


def test_the_run_ends_at_a_tampering_profile_hook(tmp_path: Path) -> None:
    """The first profile or trace function installed from the agent's files ends the run at the
    call: the hook it installs never runs a test (and a suite under a profile hook, 3x slower,
    is not run to no purpose)."""
    task, pristine, agent = task_and_agent_tree(tmp_path)
    init = agent / "calc" / "__init__.py"
    init.write_text(init.read_text() + "\nimport sys\n\nsys.setprofile(lambda *a: None)\n")
    g = task_grading(task, pristine)
    outcome = grade(pristine, agent, g.allowed, g.test_ids, g.test_env, g.pytest_args, timeout=60)
    assert outcome.status == "error", outcome.reason
    assert outcome.reason.startswith("tampering: sys.setprofile called from"), outcome.reason
    assert outcome.outcomes == {}, outcome.outcomes  # no test ran after the call


@pytest.mark.parametrize("kind", ["fifo", "dangling_link", "link_loop", "dir_named_py"])
def test_the_agent_cannot_turn_its_grade_into_infra(kind: str, tmp_path: Path) -> None:
    """An infra grade is masked, never a 0: a final tree that could make the grader's copy fail
    would let a failing agent escape its zero. Odd files under the package are graded as the
    solution they are (the package's own module gone, a failing grade), never as infra."""
    task, pristine, agent = task_and_agent_tree(tmp_path)
    target = agent / "calc" / "ops.py"
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dangling_link":
        target.symlink_to(agent / "nowhere.py")
    elif kind == "link_loop":
        target.symlink_to(target)
    else:
        target.mkdir()
        (target / "__init__.py").write_text("")
    result = compute_reward(task, agent, original=pristine, timeout=60)
    assert result.status in ("failed", "error") and result.reward == 0.0, (
        result.status,
        result.reason,
    )
