"""The oracle agent: its diff handling against `patch`, its plan, and its injected mistakes."""

from __future__ import annotations

import dataclasses
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from etude.env.coding import CodingEnv, EnvConfig, run_episode
from etude.env.oracle import MISTAKE_KINDS, OracleAgent, apply_hunks, parse_unified_diff
from etude.env.protocol import parse_tool_calls
from etude.env.tools import TOOL_NAMES
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.tasks.record import load_tasks, resolve_workspace

BASE = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "handwritten"
TASKS = load_tasks(BASE / "tasks.jsonl")
BY_ID = {t.instance_id: t for t in TASKS}
SLUGIFY = BY_ID["textkit__case.slugify"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(200_000), 512)


def script(agent: OracleAgent) -> list[str]:
    """The agent's texts when every turn gets no feedback, until its plan is used up."""
    texts = []
    while agent._plan or agent._pending:
        texts.append(agent.act(None))
    return texts


@pytest.mark.parametrize("task", TASKS, ids=[t.instance_id for t in TASKS])
def test_gold_patch_applies_like_patch(task, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    shutil.copytree(resolve_workspace(task, BASE), reference)
    subprocess.run(
        ["patch", "-p1", "--quiet"], input=task.patch, text=True, cwd=reference, check=True
    )
    for file_patch in parse_unified_diff(task.patch):
        broken = resolve_workspace(task, BASE) / (file_patch.old_path or "missing")
        before = broken.read_text() if file_patch.old_path else ""
        after = apply_hunks(before, file_patch.hunks, file_patch.new_path)
        assert after == (reference / file_patch.new_path).read_text()


def test_apply_hunks_matches_diff_and_patch(tmp_path: Path) -> None:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "x = 1", "", "return y", "    pass"]
    for case in range(25):
        old = [rng.choice(words) for _ in range(rng.randrange(0, 40))]
        new = list(old)
        for _ in range(rng.randrange(1, 5)):
            at = rng.randrange(0, len(new) + 1)
            if new and rng.random() < 0.5:
                del new[at : at + rng.randrange(1, 3)]
            else:
                new[at:at] = [rng.choice(words) + f" {case}" for _ in range(rng.randrange(1, 3))]
        old_text = "\n".join(old) + ("\n" if rng.random() < 0.7 else "")
        new_text = "\n".join(new) + ("\n" if rng.random() < 0.7 else "")
        (tmp_path / "a").write_text(old_text)
        (tmp_path / "b").write_text(new_text)
        diff = subprocess.run(
            ["diff", "-u", "a", "b"], cwd=tmp_path, capture_output=True, text=True
        ).stdout
        if not diff:
            continue
        (file_patch,) = parse_unified_diff(diff)
        assert apply_hunks(old_text, file_patch.hunks, "a") == new_text, (case, diff)


def test_plan_at_rate_zero(tok: Tokenizer) -> None:
    texts = script(OracleAgent(SLUGIFY, base_dir=str(BASE)))
    calls = []
    for text in texts:
        (parsed,) = parse_tool_calls(text)
        assert parsed.error is None and parsed.call.name in TOOL_NAMES
        calls.append(parsed.call)
    assert [c.name for c in calls] == [
        "list_files",
        "read_file",
        "read_file",
        "replace_in_file",
        "replace_in_file",
        "run_tests",
        "submit",
    ]
    assert calls[1].arguments == {"path": "tests/test_case.py"}
    roman = script(OracleAgent(BY_ID["textkit__roman"], base_dir=str(BASE)))
    names = [parse_tool_calls(t)[0].call.name for t in roman]
    assert names == ["list_files", "read_file", "write_file", "run_tests", "submit"]


@pytest.mark.parametrize("kind", ["unknown_tool", "malformed_json", "bad_arguments"])
def test_protocol_mistakes_are_typed_and_corrected(kind: str, tok: Tokenizer) -> None:
    agent = OracleAgent(SLUGIFY, base_dir=str(BASE), mistake_rate=1.0, mistakes=[kind], seed=3)
    with CodingEnv(SLUGIFY, EnvConfig(), tokenizer=tok, base_dir=BASE) as env:
        trajectory = run_episode(env, agent)
    assert trajectory.reward == 1.0
    turns = trajectory.info["oracle_turns"]
    assert [t["mistake"] for t in turns] == [kind, None] * (len(turns) // 2)
    for mistake, correction in zip(turns[::2], turns[1::2]):
        assert mistake["errors"] == [kind]
        assert mistake["corrected"] == correction["text"] and correction["errors"] == []
        (parsed,) = parse_tool_calls(mistake["corrected"])
        assert parsed.error is None and parsed.call.name in TOOL_NAMES
    assert trajectory.info["error_counts"] == {kind: len(turns) // 2}
    assistants = [t for _, t in trajectory.assistant_turns()]
    assert [t.text for t in assistants] == [t["text"] for t in turns]


def test_test_edit_is_reverted_on_the_next_turn(tok: Tokenizer) -> None:
    agent = OracleAgent(
        SLUGIFY, base_dir=str(BASE), mistake_rate=1.0, mistakes=["test_edit"], seed=0
    )
    with CodingEnv(SLUGIFY, EnvConfig(), tokenizer=tok, base_dir=BASE) as env:
        trajectory = run_episode(env, agent)
    turns = trajectory.info["oracle_turns"]
    assert [t["mistake"] for t in turns].count("test_edit") == 1  # at most once per episode
    edit = next(i for i, t in enumerate(turns) if t["mistake"] == "test_edit")
    (touched,) = parse_tool_calls(turns[edit]["text"])
    assert "tests/test_case.py" in str(touched.call.arguments)
    (restore,) = parse_tool_calls(turns[edit + 1]["text"])
    assert (
        restore.call.name == "write_file" and restore.call.arguments["path"] == "tests/test_case.py"
    )
    assert (
        restore.call.arguments["content"]
        == (resolve_workspace(SLUGIFY, BASE) / "tests" / "test_case.py").read_text()
    )
    assert trajectory.reward == 1.0 and trajectory.info["grade"]["changed"] == ["textkit/case.py"]


def test_skip_tests_submits_without_running_them(tok: Tokenizer) -> None:
    agent = OracleAgent(
        SLUGIFY, base_dir=str(BASE), mistake_rate=1.0, mistakes=["skip_tests"], seed=0
    )
    with CodingEnv(SLUGIFY, EnvConfig(), tokenizer=tok, base_dir=BASE) as env:
        trajectory = run_episode(env, agent)
    turns = trajectory.info["oracle_turns"]
    assert turns[-1]["mistake"] == "skip_tests"
    assert parse_tool_calls(turns[-1]["text"])[0].call.name == "submit"
    assert parse_tool_calls(turns[-1]["corrected"])[0].call.name == "run_tests"
    names = [c.name for _, t in trajectory.assistant_turns() for c in t.tool_calls]
    assert "run_tests" not in names and trajectory.finish_reason == "submit"
    assert trajectory.reward == 1.0


def test_mistakes_are_seeded() -> None:
    def texts(seed: int) -> list[str]:
        return script(OracleAgent(SLUGIFY, base_dir=str(BASE), mistake_rate=0.5, seed=seed))

    assert texts(7) == texts(7)
    assert texts(7) != texts(8)
    agent = OracleAgent(SLUGIFY, base_dir=str(BASE), mistake_rate=0.5, seed=7)
    script(agent)
    kinds = [t.mistake for t in agent.turns]
    assert all(k is None or k in MISTAKE_KINDS for k in kinds)
    assert any(kinds) and not all(kinds)
    # a mistake is never followed by another one
    assert all(not (a and b) for a, b in zip(kinds, kinds[1:]))
    info = agent.episode_info()
    assert info["oracle_turns"] == [dataclasses.asdict(t) for t in agent.turns]


def test_bad_settings_are_value_errors() -> None:
    with pytest.raises(ValueError, match="mistake_rate"):
        OracleAgent(SLUGIFY, base_dir=str(BASE), mistake_rate=1.5)
    with pytest.raises(ValueError, match="unknown mistake kinds"):
        OracleAgent(SLUGIFY, base_dir=str(BASE), mistakes=["typo"])
    with pytest.raises(ValueError, match="no gold patch"):
        OracleAgent(dataclasses.replace(SLUGIFY, patch=""), base_dir=str(BASE))
    with pytest.raises(ValueError, match="does not apply"):
        broken = SLUGIFY.patch.replace(" import re\n", " import regex\n", 1)
        OracleAgent(dataclasses.replace(SLUGIFY, patch=broken), base_dir=str(BASE))
