"""Text-feedback detectors: each fires on its behavior, at the right turn, and nowhere else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from etude.env.coding import CodingEnv, EnvConfig, run_episode
from etude.env.oracle import OracleAgent
from etude.env.tools import TOOL_NAMES
from etude.env.trajectory import Feedback, ToolCall, ToolError, Trajectory, Turn
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.rl.feedback import (
    BUILTIN_DETECTORS,
    FeedbackConfig,
    apply_detectors,
    available_tools_hint,
    build_detectors,
    detect_feedback,
    hints_by_turn,
    is_test_path,
    register_detector,
    ruff_messages,
)
from etude.tasks.record import load_tasks

TASKS = Path(__file__).parents[2] / "examples" / "tasks" / "handwritten"
# oracle mistake kind -> the detector that must flag that turn
EXPECTED = {
    "unknown_tool": "unknown_tool",
    "malformed_json": "malformed_call",
    "bad_arguments": "malformed_call",
    "test_edit": "test_edit",
    "skip_tests": "submit_untested",
}


def _assistant(text: str, calls=(), errors=(), tokens: int = 4) -> Turn:
    return Turn(
        role="assistant",
        text=text,
        token_ids=list(range(tokens)),
        trainable=[0] + [1] * (tokens - 1),
        logprobs=[0.0] * tokens,
        tool_calls=list(calls),
        errors=list(errors),
    )


def _tool(name: str, text: str) -> Turn:
    return Turn(role="tool", text=text, token_ids=[1, 2], trainable=[0, 0], tool_name=name)


def _traj(*turns: Turn) -> Trajectory:
    prompt = Turn(role="user", text="fix it", token_ids=[5, 6], trainable=[0, 0])
    return Trajectory(task_id="t", turns=[prompt, *turns])


def _detect(traj: Trajectory, *names: str, **cfg) -> list[Feedback]:
    config = FeedbackConfig(detectors=names, **cfg)
    return detect_feedback(traj, build_detectors(config))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(200_000), 512)


def test_oracle_mistakes_are_found_at_their_turns(tok: Tokenizer, tmp_path: Path) -> None:
    tasks = load_tasks(TASKS / "tasks.jsonl")
    cfg = EnvConfig(work_dir=str(tmp_path))
    detectors = build_detectors(FeedbackConfig())
    found_kinds = set()
    for seed in range(4):
        for task in tasks[:1]:
            agent = OracleAgent(task, base_dir=str(TASKS), mistake_rate=0.35, seed=seed)
            with CodingEnv(task, cfg, tokenizer=tok, base_dir=TASKS) as env:
                traj = run_episode(env, agent)
            assistant = [i for i, _ in traj.assistant_turns()]
            items = detect_feedback(traj, detectors)
            by_turn: dict[int, set[str]] = {}
            for item in items:
                by_turn.setdefault(item.turn, set()).add(item.kind)
            for k, oracle_turn in enumerate(traj.info["oracle_turns"]):
                turn = assistant[k]
                if oracle_turn["mistake"] is not None:
                    want = EXPECTED[oracle_turn["mistake"]]
                    assert want in by_turn.get(turn, set()), (oracle_turn, by_turn)
                    found_kinds.add(want)
                else:
                    # a planned turn gets no hint about tools, calls or tests
                    kinds = by_turn.get(turn, set()) - {"overlong_turn", "ruff_style"}
                    assert not kinds, (k, oracle_turn["text"][:80], kinds)
    assert {"unknown_tool", "malformed_call"} <= found_kinds


def test_unknown_tool_hint_lists_the_tools() -> None:
    err = ToolError(kind="unknown_tool", message="Tool not found: ls", tool="ls")
    traj = _traj(_assistant("x", [ToolCall(name="ls")], [err]), _tool("ls", "Tool not found"))
    (item,) = _detect(traj, "unknown_tool")
    assert item.turn == 1 and item.kind == "unknown_tool"
    assert all(name in item.hint for name in TOOL_NAMES)


def test_bad_arguments_hint_quotes_the_schema() -> None:
    err = ToolError(kind="bad_arguments", message="Bad arguments", tool="read_file")
    traj = _traj(_assistant("x", [ToolCall(name="read_file", arguments={})], [err]))
    (item,) = _detect(traj, "malformed_call")
    assert '"required": ["path"]' in item.hint and "<tool_call>" in item.hint


def test_test_edit_by_write_and_by_shell() -> None:
    write = ToolCall(name="write_file", arguments={"path": "tests/test_a.py", "content": ""})
    code = ToolCall(name="write_file", arguments={"path": "pkg/a.py", "content": "x = 1\n"})
    rm = ToolCall(name="bash", arguments={"command": "rm -- tests/test_a.py"})
    ls = ToolCall(name="bash", arguments={"command": "ls tests/test_a.py"})
    traj = _traj(
        _assistant("a", [write]),
        _tool("write_file", "ok"),
        _assistant("b", [code]),
        _tool("write_file", "ok"),
        _assistant("c", [rm]),
        _tool("bash", "exit code: 0"),
        _assistant("d", [ls]),
        _tool("bash", "exit code: 0"),
    )
    assert [f.turn for f in _detect(traj, "test_edit")] == [1, 5]
    assert is_test_path("tests/x.py") and is_test_path("pkg/test_x.py")
    assert not is_test_path("pkg/testing.py")


def test_repeated_failure_needs_no_change_in_between() -> None:
    run = ToolCall(name="run_tests")
    edit = ToolCall(name="replace_in_file", arguments={"path": "a.py", "old": "1", "new": "2"})
    failing = "pytest: 1 failed (0.1 s)."
    traj = _traj(
        _assistant("a", [run]),
        _tool("run_tests", failing),
        _assistant("b", [run]),  # repeated with nothing changed: hinted
        _tool("run_tests", failing),
        _assistant("c", [edit]),
        _tool("replace_in_file", "ok"),
        _assistant("d", [run]),  # after an edit: legitimate
        _tool("run_tests", "pytest: all 3 passed (0.1 s)."),
    )
    assert [f.turn for f in _detect(traj, "repeated_failure")] == [3]


def test_ruff_style_quotes_rule_messages() -> None:
    messy = "import os\nimport sys\n\ndef f( x ):\n    return x \n"
    messages = ruff_messages(messy, filename="m.py")
    codes = {m.split()[0] for m in messages}
    assert {"F401", "W291"} <= codes
    assert ruff_messages("def f(x):\n    return x\n", filename="m.py") == []
    call = ToolCall(name="write_file", arguments={"path": "pkg/m.py", "content": messy})
    clean = ToolCall(name="write_file", arguments={"path": "pkg/n.py", "content": "x = 1\n"})
    traj = _traj(_assistant("a", [clean]), _tool("write_file", "ok"), _assistant("b", [call]))
    (item,) = _detect(traj, "ruff_style")
    assert item.turn == 3 and "F401" in item.hint and "pkg/m.py" in item.hint


def test_overlong_turn() -> None:
    call = ToolCall(name="list_files")
    short = _assistant("I list.\n<tool_call>{}</tool_call>", [call])
    long = _assistant("blah " * 200 + "<tool_call>{}</tool_call>", [call])
    many = _assistant("ok", [call], tokens=50)
    traj = _traj(short, _tool("list_files", "."), long, _tool("list_files", "."), many)
    items = _detect(traj, "overlong_turn", max_turn_tokens=20)
    assert [f.turn for f in items] == [3, 5]


def test_effort_calibration() -> None:
    edit = ToolCall(name="write_file", arguments={"path": "a.py", "content": "x = 1\n"})
    run, submit = ToolCall(name="run_tests"), ToolCall(name="submit")
    untested = _traj(_assistant("a", [edit]), _tool("write_file", "ok"), _assistant("b", [submit]))
    assert [f.turn for f in _detect(untested, "submit_untested")] == [3]
    tested = _traj(
        _assistant("a", [edit]),
        _tool("write_file", "ok"),
        _assistant("b", [run]),
        _tool("run_tests", "pytest: all 2 passed (0.1 s)."),
        _assistant("c", [submit]),
    )
    assert _detect(tested, "submit_untested") == []
    assert _detect(tested, "edit_after_pass") == []
    overdone = _traj(
        _assistant("a", [run]),
        _tool("run_tests", "pytest: all 2 passed (0.1 s)."),
        _assistant("b", [edit]),
    )
    assert [f.turn for f in _detect(overdone, "edit_after_pass")] == [3]


def test_apply_joins_hints_per_turn_and_keeps_existing() -> None:
    err = ToolError(kind="unknown_tool", message="nope", tool="ls")
    traj = _traj(_assistant("blah " * 200, [ToolCall(name="ls")], [err]))
    traj.feedback.append(Feedback(turn=1, kind="monitor", hint="Do not game the tests."))
    cfg = FeedbackConfig(detectors=("unknown_tool", "overlong_turn"))
    added = apply_detectors([traj], build_detectors(cfg), cfg)
    assert added == 2
    assert apply_detectors([traj], build_detectors(cfg), cfg) == 0
    hint = hints_by_turn(traj)[1]
    assert hint.splitlines()[0] == "Do not game the tests."
    assert len(hint.splitlines()) == 3


def test_pluggable_detector_and_config_errors() -> None:
    class Shouting:
        name = "shouting"

        def detect(self, trajectory: Trajectory) -> list[Feedback]:
            return [
                Feedback(turn=i, kind=self.name, hint="Reminder: no capitals.")
                for i, t in trajectory.assistant_turns()
                if t.text.isupper()
            ]

    register_detector("shouting", lambda cfg: Shouting())
    traj = _traj(_assistant("LOOK"), _tool("x", "y"), _assistant("fine"))
    assert [f.turn for f in _detect(traj, "shouting")] == [1]
    with pytest.raises(ValueError, match="registered already"):
        register_detector("shouting", lambda cfg: Shouting())
    with pytest.raises(ValueError, match="unknown detector 'nope'"):
        FeedbackConfig(detectors=("nope",))
    with pytest.raises(ValueError, match="twice"):
        FeedbackConfig(detectors=("unknown_tool", "unknown_tool"))
    assert set(BUILTIN_DETECTORS) >= set(EXPECTED.values())
    assert json.dumps(FeedbackConfig().detectors)


def test_sft_hint_examples_put_the_hint_before_the_corrected_turn(
    tok: Tokenizer, tmp_path: Path
) -> None:
    from etude.model.chat import encode_header
    from etude.rl.sft import SFTDataConfig, oracle_examples
    from etude.rl.teacher import hint_message_ids

    task = load_tasks(TASKS / "tasks.jsonl")[0]
    agent = OracleAgent(
        task, base_dir=str(TASKS), mistake_rate=0.5, mistakes=("unknown_tool",), seed=1
    )
    with CodingEnv(task, EnvConfig(work_dir=str(tmp_path)), tokenizer=tok, base_dir=TASKS) as env:
        traj = run_episode(env, agent)
    data = SFTDataConfig(max_seq_len=100_000, hint_weight=1)
    examples = oracle_examples([traj], tok, data, FeedbackConfig(detectors=("unknown_tool",)))
    episodes = [e for e in examples if e.kind == "episode"]
    hints = [e for e in examples if e.kind == "hint:unknown_tool"]
    mistakes = [t for t in traj.info["oracle_turns"] if t["mistake"]]
    assert len(episodes) == 1 and len(hints) == len(mistakes) > 0
    assert episodes[0].ids == traj.token_ids
    hint_ids = hint_message_ids(tok, available_tools_hint())
    header = encode_header(tok, "assistant")
    for example, mistake in zip(hints, mistakes):
        start = example.hint_start
        assert example.ids[:start] == traj.token_ids[:start]
        assert example.ids[start : start + len(hint_ids)] == hint_ids
        body = start + len(hint_ids) + len(header)
        assert example.ids[start + len(hint_ids) : body] == header
        assert tok.decode(example.ids[body:-1]) == mistake["corrected"]
        assert example.mask == [0] * body + [1] * (len(example.ids) - body)
        assert tok.decode(example.contrast[:-1]) == mistake["text"]


def test_unfinished_turn() -> None:
    closed = Turn(role="assistant", text="a", token_ids=[9, 5, 2, 7], trainable=[0, 1, 1, 0])
    cut = Turn(role="assistant", text="<tool_call>{", token_ids=[9, 5, 6], trainable=[0, 1, 1])
    traj = _traj(closed, _tool("x", "y"), cut)
    (item,) = _detect(traj, "unfinished_turn")
    assert item.turn == 3 and "</tool_call>" in item.hint
    assert _detect(traj, "unfinished_turn", end_of_turn_id=6)[0].turn == 1


def test_sft_clean_episodes_are_oracle_runs_without_mistakes(
    tok: Tokenizer, tmp_path: Path
) -> None:
    from etude.rl.sft import SFTDataConfig, SFTRecipe, collect_oracle_trajectories

    record = json.loads((TASKS / "tasks.jsonl").read_text().splitlines()[0])
    record["etude"]["workspace"] = str(TASKS / record["etude"]["workspace"])
    (tmp_path / "tasks.jsonl").write_text(json.dumps(record) + "\n")
    recipe = SFTRecipe(
        data=SFTDataConfig(
            tasks=str(tmp_path / "tasks.jsonl"),
            episodes_per_task=1,
            clean_episodes=1,
            mistake_rate=1.0,
        ),
        env=EnvConfig(work_dir=str(tmp_path), max_tokens=100_000),
    )
    recipe.train.progress = False
    with_mistakes, clean = collect_oracle_trajectories(recipe, tok)
    assert any(t["mistake"] for t in with_mistakes.info["oracle_turns"])
    assert all(t["mistake"] is None for t in clean.info["oracle_turns"])
    assert clean.info["oracle_mistake_rate"] == 0.0 and clean.reward == 1.0
    with pytest.raises(ValueError, match="clean_episodes"):
        SFTDataConfig(clean_episodes=-1)


def test_sft_recovery_mistakes_train_the_turn_after_the_error_not_the_mistake(
    tok: Tokenizer, tmp_path: Path
) -> None:
    from etude.rl.sft import SFTDataConfig, oracle_examples

    kinds = ("unknown_tool", "malformed_json")
    task = load_tasks(TASKS / "tasks.jsonl")[0]
    agent = OracleAgent(task, base_dir=str(TASKS), mistake_rate=0.6, mistakes=kinds, seed=2)
    with CodingEnv(task, EnvConfig(work_dir=str(tmp_path)), tokenizer=tok, base_dir=TASKS) as env:
        traj = run_episode(env, agent)
    oracle_turns = traj.info["oracle_turns"]
    assert set(kinds) <= {t["mistake"] for t in oracle_turns} and traj.reward == 1.0

    def episode_mask(**data) -> list[int]:
        config = SFTDataConfig(max_seq_len=100_000, mistakes=kinds, hint_examples=False, **data)
        (example,) = oracle_examples([traj], tok, config, FeedbackConfig())
        assert example.kind == "episode" and example.ids == traj.token_ids
        return example.mask

    mask = episode_mask(recovery_mistakes=("malformed_json",))
    imitated = episode_mask()
    offsets = traj.turn_offsets()
    assistant = [i for i, _ in traj.assistant_turns()]
    recovered = 0
    for k, oracle_turn in enumerate(oracle_turns):
        i = assistant[k]
        turn = traj.turns[i]
        span = slice(offsets[i], offsets[i] + len(turn.token_ids))
        assert imitated[span] == turn.trainable  # the default imitates every kind
        if oracle_turn["mistake"] != "malformed_json":
            assert mask[span] == turn.trainable  # planned turns and unknown tools: imitated
            continue
        recovered += 1
        assert not any(mask[span])  # the malformed turn carries no loss
        # the environment's real error observation, then the oracle's planned turn with loss
        (error,) = turn.errors
        observation = traj.turns[i + 1]
        assert observation.role == "tool" and not any(mask[offsets[i + 1] : offsets[i + 2]])
        assert error.kind == "malformed_json" and observation.text == error.message
        assert observation.text.startswith("Malformed tool call:")
        assert assistant[k + 1] == i + 2
        after = traj.turns[i + 2]
        after_mask = mask[offsets[i + 2] : offsets[i + 2] + len(after.token_ids)]
        assert after_mask == after.trainable and any(after_mask)
        trained = [t for t, m in zip(after.token_ids, after_mask) if m]
        assert tok.decode(trained[:-1]) == oracle_turn["corrected"] and not after.errors
    assert recovered > 0
    with pytest.raises(ValueError, match=r"data.recovery_mistakes: 'malformed_json' is not in"):
        SFTDataConfig(mistakes=("unknown_tool",), recovery_mistakes=("malformed_json",))
    with pytest.raises(ValueError, match="data.recovery_mistakes: 'skip_tests'"):
        SFTDataConfig(mistakes=("skip_tests",), recovery_mistakes=("skip_tests",))
