"""The tool-call protocol through a coding episode: each mistake an observation with the
documented text and a typed error on the turn; token bookkeeping is append-only and exact."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from etude.env.coding import CodingEnv, EnvConfig
from etude.env.protocol import (
    NO_TOOL_CALL_MESSAGE,
    NOT_EXECUTED_SUBMITTED,
    NOT_EXECUTED_TIMEOUT,
    parse_tool_calls,
)
from etude.env.tools import TOOL_NAMES, TOOL_SCHEMAS
from etude.env.trajectory import ERROR_KINDS, ToolCall, ToolError
from etude.model.chat import Conversation
from etude.model.tokenizer import TOOL_CALL_END, TOOL_CALL_START, Tokenizer, default_corpus
from etude.tasks.record import EtudeInfo, TaskRecord

AVAILABLE = "Tool not found: {}. Available tools: " + ", ".join(TOOL_NAMES)
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}
FORMAT = f'Write {TOOL_CALL_START}{{"name": "<tool name>", "arguments": {{...}}}}{TOOL_CALL_END}.'


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(default_corpus(200_000), 512)


@pytest.fixture
def task(tmp_path: Path) -> TaskRecord:
    ws = tmp_path / "task"
    (ws / "pkg").mkdir(parents=True)
    (ws / "tests").mkdir()
    (ws / "secret").mkdir()
    (ws / "pkg" / "__init__.py").write_text("")
    (ws / "pkg" / "core.py").write_text("def add(a, b):\n    return a + b\n")
    (ws / "tests" / "test_core.py").write_text(
        "from pkg import core\n\n\ndef test_add():\n    assert core.add(1, 2) == 3\n\n\n"
        "def test_mul():\n    assert core.mul(2, 3) == 6\n"
    )
    (ws / "secret" / "notes.txt").write_text("hidden\n")
    (ws / "pyproject.toml").write_text('[tool.pytest.ini_options]\npythonpath = ["."]\n')
    (tmp_path / "outside.txt").write_text("outside\n")
    os.symlink(tmp_path / "outside.txt", ws / "escape")
    return TaskRecord(
        instance_id="tiny__mul",
        problem_statement="Add `mul(a, b)` to pkg/core.py.",
        FAIL_TO_PASS=["tests/test_core.py::test_mul"],
        PASS_TO_PASS=["tests/test_core.py::test_add"],
        etude=EtudeInfo(workspace=str(ws), kind="handwritten", hidden_paths=["secret"]),
    )


@pytest.fixture
def env(task: TaskRecord, tok: Tokenizer, tmp_path: Path):
    work = tmp_path / "episodes"
    work.mkdir()
    with CodingEnv(task, EnvConfig(max_turns=100, work_dir=str(work)), tokenizer=tok) as env:
        env.reset()
        yield env


def call(name: str, **arguments) -> str:
    return f"{TOOL_CALL_START}{json.dumps({'name': name, 'arguments': arguments})}{TOOL_CALL_END}"


def last_assistant(env: CodingEnv):
    return [t for t in env.trajectory.turns if t.role == "assistant"][-1]


def test_unknown_tool(env: CodingEnv) -> None:
    result = env.step("Let me open it.\n" + call("open_file", path="pkg/core.py"))
    message = AVAILABLE.format("open_file")
    assert result.observations == [message] and not result.done
    turn = last_assistant(env)
    assert turn.tool_calls == [ToolCall(name="open_file", arguments={"path": "pkg/core.py"})]
    assert turn.errors == [ToolError(kind="unknown_tool", message=message, tool="open_file")]
    tool_turn = env.trajectory.turns[-1]
    assert tool_turn.role == "tool" and tool_turn.text == message
    assert tool_turn.tool_name == "open_file"


@pytest.mark.parametrize(
    "body, problem",
    [
        (
            '{"name": "read_file", "arguments": {"path": "x"}',
            "the text inside the tags is not valid JSON (Expecting ',' delimiter",
        ),
        (
            "{'name': 'read_file'}",
            "the text inside the tags is not valid JSON (Expecting property name enclosed in double quotes",
        ),
        (
            '{"name": "submit", "arguments": {},}',
            "the text inside the tags is not valid JSON (Expecting property name",
        ),
        ("[1, 2]", 'the JSON must be an object with "name" and "arguments", got array'),
        ('{"arguments": {}}', '"name" must be a non-empty string naming the tool, got null'),
        (
            '{"name": "read_file", "arguments": "{\\"path\\": \\"x\\"}"}',
            '"arguments" of read_file must be a JSON object, got string',
        ),
        ('{"name": "submit", "args": {}}', 'unexpected keys "args"'),
        ("", "the tags hold no JSON"),
    ],
)
def test_malformed_json(env: CodingEnv, body: str, problem: str) -> None:
    result = env.step(f"{TOOL_CALL_START}{body}{TOOL_CALL_END}")
    assert len(result.observations) == 1 and not result.done
    observation = result.observations[0]
    assert observation.startswith(f"Malformed tool call: {problem}")
    assert observation.endswith(FORMAT)
    turn = last_assistant(env)
    assert [e.kind for e in turn.errors] == ["malformed_json"]
    assert turn.errors[0].message == observation and turn.tool_calls == []


def test_unclosed_and_stray_tags(env: CodingEnv) -> None:
    result = env.step(f'{TOOL_CALL_START}{{"name": "submit"}}')
    assert result.observations == [
        f"Malformed tool call: {TOOL_CALL_START} is not closed by {TOOL_CALL_END}. {FORMAT}"
    ]
    assert last_assistant(env).errors[0].tool == "submit" and not result.done
    result = env.step(f"done {TOOL_CALL_END}")
    assert result.observations == [
        f"Malformed tool call: {TOOL_CALL_END} without an opening {TOOL_CALL_START}. {FORMAT}"
    ]


def test_tag_inside_json_string_does_not_end_the_call(env: CodingEnv) -> None:
    content = f"doc = 'a {TOOL_CALL_END} in a string'\n"
    result = env.step(call("write_file", path="pkg/doc.py", content=content))
    assert result.errors == [] and (env.workspace / "pkg" / "doc.py").read_text() == content


@pytest.mark.parametrize(
    "name, arguments, problems",
    [
        ("read_file", {}, "missing required argument 'path'"),
        (
            "read_file",
            {"path": "pkg/core.py", "encoding": "utf-8"},
            "unexpected argument 'encoding'",
        ),
        ("write_file", {"path": "a.py"}, "missing required argument 'content'"),
        ("bash", {"command": ["ls"]}, "argument 'command' must be string, got array [\"ls\"]"),
        ("submit", {"reason": "done"}, "unexpected argument 'reason'"),
    ],
)
def test_bad_arguments(env: CodingEnv, name: str, arguments: dict, problems: str) -> None:
    result = env.step(call(name, **arguments))
    message = f"Bad arguments for {name}: {problems}. Parameters schema: {json.dumps(PARAMS[name])}"
    assert result.observations == [message] and not result.done
    assert last_assistant(env).errors == [
        ToolError(kind="bad_arguments", message=message, tool=name)
    ]


@pytest.mark.parametrize(
    "path, message",
    [
        (
            "../outside.txt",
            "Path '../outside.txt' contains '..'; paths must stay inside the repository root.",
        ),
        (
            "/etc/passwd",
            "Path '/etc/passwd' is absolute; use a path relative to the repository root.",
        ),
        ("escape", "Path 'escape' resolves through a symlink to a place outside the repository."),
        ("secret/notes.txt", "Path 'secret/notes.txt' is hidden in this task."),
    ],
)
def test_path_escape(env: CodingEnv, path: str, message: str) -> None:
    result = env.step(call("read_file", path=path) + call("write_file", path=path, content="x"))
    assert result.observations == [message, message]
    assert [e.kind for e in last_assistant(env).errors] == ["path_escape", "path_escape"]
    assert (env.workspace.parent.parent.parent / "outside.txt").read_text() == "outside\n"


def test_ambiguous_and_missing_replace(env: CodingEnv) -> None:
    env.step(call("write_file", path="pkg/dup.py", content="x = 1\ny = 2\nx = 1\n"))
    result = env.step(call("replace_in_file", path="pkg/dup.py", old="x = 1", new="x = 3"))
    assert result.observations == [
        "Ambiguous: `old` occurs 2 times in 'pkg/dup.py' (starting on lines 1, 3); nothing was "
        "replaced. Include more surrounding lines so that it occurs exactly once."
    ]
    assert [e.kind for e in result.errors] == ["tool_failed"]
    assert (env.workspace / "pkg" / "dup.py").read_text() == "x = 1\ny = 2\nx = 1\n"
    result = env.step(call("replace_in_file", path="pkg/dup.py", old="z = 9", new="z = 3"))
    assert result.observations[0].startswith("No match: `old` occurs 0 times in 'pkg/dup.py'.")
    assert [e.kind for e in result.errors] == ["tool_failed"]


def test_several_calls_run_in_order_and_submit_ends_the_turn(env: CodingEnv) -> None:
    text = (
        "Two edits, then submit.\n"
        + call("write_file", path="a.txt", content="1\n")
        + "\n"
        + call("read_file", path="a.txt")
        + call("submit")
        + call("write_file", path="b.txt", content="2\n")
    )
    result = env.step(text)
    assert result.observations == [
        "Created a.txt (2 bytes, 1 lines).",
        "a.txt (lines 1-1 of 1)\n     1\t1",
        "Submitted. The episode is over; your work will be tested.",
        NOT_EXECUTED_SUBMITTED,
    ]
    assert [c.name for c in result.tool_calls] == [
        "write_file",
        "read_file",
        "submit",
        "write_file",
    ]
    assert result.done and result.finish_reason == "submit"
    assert not (env.workspace / "b.txt").exists()
    assert [t.role for t in env.trajectory.turns[-5:]] == [
        "assistant",
        "tool",
        "tool",
        "tool",
        "tool",
    ]


def test_no_tool_call_is_a_typed_error_with_a_reminder(env: CodingEnv) -> None:
    result = env.step("I think the answer is 42.")
    assert result.observations == [NO_TOOL_CALL_MESSAGE] and not result.done
    assert [e.kind for e in last_assistant(env).errors] == ["no_tool_call"]
    reminder = env.trajectory.turns[-1]
    assert reminder.role == "user" and reminder.text == NO_TOOL_CALL_MESSAGE


def test_model_garbage_never_raises(task: TaskRecord, tok: Tokenizer) -> None:
    with CodingEnv(task, EnvConfig(max_turns=100, max_tokens=1 << 20), tokenizer=tok) as env:
        env.reset()
        check_garbage(env, tok)


def test_json_escapes_no_program_or_tokenizer_takes_are_observations(
    env: CodingEnv, tok: Tokenizer
) -> None:
    # the JSON escapes \ud800 (a lone surrogate) and \u0000 (NUL) decode to strings that
    # neither the tokenizer (observations quote the name) nor exec (a command) accept
    surrogate = f'{TOOL_CALL_START}{{"name": "x\\ud800"}}{TOOL_CALL_END}'
    result = env.step(surrogate)
    assert [e.kind for e in result.errors] == ["unknown_tool"]
    assert result.observations == [AVAILABLE.format("x\\ud800")]
    observation = env.step(call("bash", command="echo a\0b")).observation
    assert observation.startswith("exit code: 126") and "NUL" in observation
    open_header = [tok.im_start_id, *tok.encode("assistant\n")]
    assert env.trajectory.token_ids + open_header == env.conversation.ids


def check_garbage(env: CodingEnv, tok: Tokenizer) -> None:
    rng = random.Random(0)
    pieces = [
        TOOL_CALL_START,
        TOOL_CALL_END,
        "{",
        "}",
        "[",
        "]",
        '"name"',
        ":",
        ",",
        '"list_files"',
        '"arguments"',
        '"path"',
        '"../x"',
        "null",
        "1e999",
        "\\",
        '"',
        "<|im_end|>",
        "\n",
        "x",
        '"read_file"',
        '"submit_now"',
        "9" * 5000,
        "[" * 3000,
    ]
    for _ in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12)))
        result = env.step(text)
        assert all(e.kind in ERROR_KINDS for e in result.errors)
        assert len(result.observations) >= 1
        if result.done:
            break
    assert all(e.kind in ERROR_KINDS for t in env.trajectory.turns for e in t.errors)
    # while the episode runs, the conversation ends with the next turn's open header
    header = tok.encode("assistant\n")
    open_header = [] if env.done else [tok.im_start_id, *header]
    assert env.trajectory.token_ids + open_header == env.conversation.ids


def test_parse_finds_every_segment_in_order() -> None:
    text = (
        f'a {TOOL_CALL_START} {{"name": "x", "arguments": {{"k": [1, {{"v": null}}]}}}} {TOOL_CALL_END}'
        f' b {TOOL_CALL_START}{{"name": "y"}}{TOOL_CALL_END}{TOOL_CALL_START}oops{TOOL_CALL_END}'
    )
    parsed = parse_tool_calls(text)
    assert [p.call for p in parsed[:2]] == [
        ToolCall(name="x", arguments={"k": [1, {"v": None}]}),
        ToolCall(name="y", arguments={}),
    ]
    assert parsed[2].call is None and parsed[2].error.kind == "malformed_json"
    assert parse_tool_calls("no calls here") == []


# ---------------------------------------------------------------- token bookkeeping

SCRIPT = [
    "Let me look.\n" + call("list_files"),
    call("read_file", path="pkg/core.py") + call("nope"),
    "thinking out loud",
    call(
        "replace_in_file",
        path="pkg/core.py",
        old="    return a + b\n",
        new="    return a + b\n\n\ndef mul(a, b):\n    return a * b\n",
    ),
    "Done.\n" + call("submit"),
]


def test_trajectory_ids_are_the_conversation_ids(env: CodingEnv, tok: Tokenizer) -> None:
    for text in SCRIPT:
        env.step(text)
    trajectory = env.trajectory
    conversation = env.conversation
    assert trajectory.token_ids == conversation.ids
    mask = [m for t in trajectory.turns for m in t.trainable]
    assert mask == conversation.loss_mask
    for turn in trajectory.turns:
        assert len(turn.token_ids) == len(turn.trainable) == len(turn.logprobs)
        if turn.role != "assistant":
            assert not any(turn.trainable)
    # an assistant turn: header (0), the text and <|im_end|> (1), the newline separator (0)
    assistants = [t for t in trajectory.turns if t.role == "assistant"]
    assert [t.text for t in assistants] == SCRIPT
    for turn, text in zip(assistants, SCRIPT):
        trained = [i for i, m in zip(turn.token_ids, turn.trainable) if m]
        assert tok.decode(trained) == text + "<|im_end|>"
        assert tok.decode(turn.token_ids) == f"<|im_start|>assistant\n{text}<|im_end|>\n"
    # a conversation rebuilt message by message agrees with the appended ids
    rebuilt = Conversation(tok)
    for turn in trajectory.turns:
        content = turn.text
        rebuilt.add_message(turn.role, content)
    assert rebuilt.ids == conversation.ids


def test_text_and_generated_ids_give_identical_bookkeeping(
    task: TaskRecord, tok: Tokenizer
) -> None:
    rng = random.Random(1)
    with CodingEnv(task, tokenizer=tok) as by_text, CodingEnv(task, tokenizer=tok) as by_ids:
        by_text.reset()
        by_ids.reset()
        assert by_text.prompt_ids == by_ids.prompt_ids
        given = []
        for text in SCRIPT:
            ids = tok.encode(text, allow_special=[TOOL_CALL_START, TOOL_CALL_END])
            ids.append(tok.im_end_id)
            logprobs = [-rng.random() for _ in ids]
            given.append(logprobs)
            a = by_text.step(text)
            b = by_ids.step(token_ids=ids, logprobs=logprobs)
            assert a.observations == b.observations and a.done == b.done
        ta, tb = by_text.trajectory, by_ids.trajectory
        assert ta.token_ids == tb.token_ids == by_ids.conversation.ids
        assert [t.trainable for t in ta.turns] == [t.trainable for t in tb.turns]
        assert [t.text for t in ta.turns] == [t.text for t in tb.turns]
        for turn, logprobs in zip((t for t in tb.turns if t.role == "assistant"), given):
            assert [lp for lp, m in zip(turn.logprobs, turn.trainable) if m] == logprobs
            assert all(lp == 0.0 for lp, m in zip(turn.logprobs, turn.trainable) if not m)
        assert all(lp == 0.0 for t in ta.turns for lp in t.logprobs)


def test_prompt_ends_with_an_open_assistant_turn(env: CodingEnv, tok: Tokenizer) -> None:
    assert tok.decode(env.prompt_ids).endswith("<|im_start|>assistant\n")
    assert env.tokens_left == env.cfg.max_tokens - len(env.prompt_ids)
    system, user = env.trajectory.turns
    assert system.role == "system" and '"name": "replace_in_file"' in system.text
    assert user.role == "user" and user.text == "Add `mul(a, b)` to pkg/core.py."


# ---------------------------------------------------------------- episode limits


def test_generation_cut_before_im_end_ends_the_episode(env: CodingEnv, tok: Tokenizer) -> None:
    ids = tok.encode(call("write_file", path="cut.txt", content="x"), allow_special=True)
    result = env.step(token_ids=ids)
    assert result.done and result.finish_reason == "max_tokens" and result.observations == []
    assert not (env.workspace / "cut.txt").exists()
    assert env.trajectory.token_ids == env.conversation.ids
    with pytest.raises(ValueError, match="the episode is over"):
        env.step("more")


def test_turn_limit(task: TaskRecord, tok: Tokenizer) -> None:
    with CodingEnv(task, EnvConfig(max_turns=2), tokenizer=tok) as env:
        env.reset()
        assert not env.step(call("list_files")).done
        result = env.step(call("list_files"))
        assert result.done and result.finish_reason == "max_turns"


def test_token_limit(task: TaskRecord, tok: Tokenizer) -> None:
    with CodingEnv(task, tokenizer=tok) as probe:
        prompt = len(probe.reset().ids)
    with CodingEnv(task, EnvConfig(max_tokens=prompt + 40), tokenizer=tok) as env:
        env.reset()
        result = env.step(call("write_file", path="big.txt", content="word " * 50))
        assert result.done and result.finish_reason == "max_tokens"
        assert not (env.workspace / "big.txt").exists()  # no room for its answer: not run
    with pytest.raises(ValueError, match="raise env.max_tokens"):
        CodingEnv(task, EnvConfig(max_tokens=prompt - 10), tokenizer=tok).reset()


def test_wall_clock_limit(task: TaskRecord, tok: Tokenizer) -> None:
    now = [0.0]
    with CodingEnv(task, EnvConfig(wall_clock_s=10.0), tokenizer=tok, clock=lambda: now[0]) as env:
        env.reset()
        assert not env.step(call("list_files")).done
        now[0] = 11.0
        result = env.step(call("write_file", path="late.txt", content="x"))
        assert result.done and result.finish_reason == "timeout"
        assert result.observations == [NOT_EXECUTED_TIMEOUT]
        assert not (env.workspace / "late.txt").exists()


def test_episode_directory_lifecycle(task: TaskRecord, tok: Tokenizer, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    env = CodingEnv(task, EnvConfig(work_dir=str(work)), tokenizer=tok)
    env.reset()
    first = env.episode_dir
    assert (env.workspace / "pkg" / "core.py").is_file()
    env.reset()  # a new episode replaces the old directory
    assert not first.exists() and env.episode_dir.exists()
    env.step(call("bash", command="chmod 000 pkg && mkdir locked && chmod 000 locked"))
    env.close()
    assert list(work.iterdir()) == []
    with pytest.raises(ValueError, match="call reset"):
        _ = env.workspace
