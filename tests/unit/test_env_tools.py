"""The agent's tools on a small workspace: outputs, caps, argument checks and path rules."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from etude.env.tools import (
    TOOL_NAMES,
    TOOL_SCHEMAS,
    Toolbox,
    ToolConfig,
    cap_text,
    check_arguments,
    tool_schemas,
)
from etude.model.chat import tools_system_prompt
from etude.sandbox import SandboxConfig, make_sandbox

PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}

CORE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
TESTS = (
    "from pkg.core import add, sub\n\n\n"
    "def test_add():\n    assert add(1, 2) == 3\n\n\n"
    "def test_sub():\n    assert sub(3, 2) == 1\n\n\n"
    "def test_broken():\n    assert add(1, 1) == 3\n"
)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "tests").mkdir()
    (ws / "secret").mkdir()
    (ws / "pkg" / "__init__.py").write_text("")
    (ws / "pkg" / "core.py").write_text(CORE)
    (ws / "tests" / "test_core.py").write_text(TESTS)
    (ws / "secret" / "answer.txt").write_text("the hidden answer\n")
    (ws / "pyproject.toml").write_text('[tool.pytest.ini_options]\npythonpath = ["."]\n')
    (tmp_path / "outside.txt").write_text("outside\n")
    os.symlink(tmp_path / "outside.txt", ws / "link_out")
    os.symlink("core.py", ws / "pkg" / "alias.py")
    return ws


def make_toolbox(ws: Path, **cfg) -> Toolbox:
    return Toolbox(
        ws,
        sandbox=make_sandbox(cfg=SandboxConfig(hidden_paths=("secret",))),
        cfg=ToolConfig(**cfg),
        test_ids=["tests/test_core.py::test_add", "tests/test_core.py::test_sub"],
        hidden_paths=["secret"],
    )


def test_schemas_are_openai_functions_and_render() -> None:
    assert TOOL_NAMES == (
        "list_files",
        "read_file",
        "write_file",
        "replace_in_file",
        "search",
        "run_tests",
        "bash",
        "submit",
    )
    for tool in tool_schemas():
        assert tool["type"] == "function"
        params = tool["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert set(params["required"]) <= set(params["properties"])
    prompt = tools_system_prompt(tool_schemas())
    for name in TOOL_NAMES:
        assert f'"name": "{name}"' in prompt
    copy = tool_schemas()
    copy[0]["function"]["name"] = "changed"
    assert TOOL_SCHEMAS[0]["function"]["name"] == "list_files"


def test_check_arguments_lists_every_problem_and_quotes_schema() -> None:
    with pytest.raises(Exception) as info:
        check_arguments("read_file", {"start_line": "3", "mode": "r"})
    message = str(info.value)
    assert info.value.kind == "bad_arguments"
    assert "missing required argument 'path'" in message
    assert "unexpected argument 'mode'" in message
    assert "argument 'start_line' must be integer, got string \"3\"" in message
    assert message.endswith(f"Parameters schema: {json.dumps(PARAMS['read_file'])}")
    # JSON has one number type: 3.0 is the integer 3; a boolean is not an integer
    assert check_arguments("read_file", {"path": "x", "start_line": 3.0}) == {
        "path": "x",
        "start_line": 3,
    }
    with pytest.raises(Exception, match="start_line' must be integer, got boolean"):
        check_arguments("read_file", {"path": "x", "start_line": True})
    with pytest.raises(Exception, match="must be >= 1, got 0"):
        check_arguments("read_file", {"path": "x", "start_line": 0})
    with pytest.raises(Exception, match=r"argument 'tests'\[1\] must be string"):
        check_arguments("run_tests", {"tests": ["a", 2]})
    assert check_arguments("run_tests", {"tests": None}) == {"tests": None}
    with pytest.raises(Exception, match="argument 'old' must not be empty"):
        check_arguments("replace_in_file", {"path": "x", "old": "", "new": "y"})


def test_list_files_depth_order_hidden_and_cap(workspace: Path) -> None:
    box = make_toolbox(workspace)
    out = box.call("list_files", {}).observation.split("\n")
    assert out == [
        f"link_out -> {workspace.parent / 'outside.txt'}",
        "pkg/",
        "pkg/__init__.py",
        "pkg/alias.py -> core.py",
        "pkg/core.py",
        "pyproject.toml",
        "tests/",
        "tests/test_core.py",
    ]
    assert "secret" not in "\n".join(out)
    assert box.call("list_files", {"path": "pkg", "max_depth": 1}).observation.split("\n") == [
        "pkg/__init__.py",
        "pkg/alias.py -> core.py",
        "pkg/core.py",
    ]
    capped = make_toolbox(workspace, list_max_entries=3).call("list_files", {}).observation
    assert capped.split("\n")[:3] == out[:3]
    assert "[listing cut at 3 entries" in capped
    missing = box.call("list_files", {"path": "nope"})
    assert (
        missing.error.kind == "tool_failed" and missing.observation == "No such directory: 'nope'."
    )


def test_read_file_numbers_ranges_and_caps(workspace: Path) -> None:
    box = make_toolbox(workspace)
    whole = box.call("read_file", {"path": "pkg/core.py"}).observation
    lines = CORE.split("\n")[:-1]
    assert whole == "\n".join(
        ["pkg/core.py (lines 1-6 of 6)"] + [f"{i:6d}\t{line}" for i, line in enumerate(lines, 1)]
    )
    part = box.call("read_file", {"path": "pkg/core.py", "start_line": 5, "end_line": 99})
    assert part.observation.split("\n") == [
        "pkg/core.py (lines 5-6 of 6)",
        "     5\tdef sub(a, b):",
        "     6\t    return a - b",
    ]
    capped = make_toolbox(workspace, read_max_lines=2).call("read_file", {"path": "pkg/core.py"})
    assert capped.observation.split("\n")[0] == "pkg/core.py (lines 1-2 of 6)"
    assert capped.observation.endswith("call read_file with start_line=3 to read on]")
    past = box.call("read_file", {"path": "pkg/core.py", "start_line": 7})
    assert past.error.kind == "tool_failed"
    assert past.observation == "start_line 7 is past the end of 'pkg/core.py' (6 lines)."
    (workspace / "blob.bin").write_bytes(b"\x00\x01\x02")
    assert "binary file" in box.call("read_file", {"path": "blob.bin"}).observation
    os.mkfifo(workspace / "pipe")  # reading a FIFO would block the trainer
    fifo = box.call("read_file", {"path": "pipe"})
    assert fifo.error.kind == "tool_failed" and "not a regular file" in fifo.observation
    # a symlink inside the workspace reads its target
    assert box.call("read_file", {"path": "pkg/alias.py"}).observation.endswith("return a - b")


def test_write_and_replace(workspace: Path) -> None:
    box = make_toolbox(workspace)
    made = box.call("write_file", {"path": "pkg/new/mod.py", "content": "x = 1\ny = 2\n"})
    assert made.error is None and made.observation == "Created pkg/new/mod.py (12 bytes, 2 lines)."
    assert (workspace / "pkg/new/mod.py").read_text() == "x = 1\ny = 2\n"
    again = box.call("write_file", {"path": "pkg/new/mod.py", "content": "x = 1\nx = 1\n"})
    assert again.observation.startswith("Overwrote pkg/new/mod.py")
    ambiguous = box.call("replace_in_file", {"path": "pkg/new/mod.py", "old": "x = 1", "new": "z"})
    assert ambiguous.error.kind == "tool_failed"
    assert ambiguous.observation.startswith(
        "Ambiguous: `old` occurs 2 times in 'pkg/new/mod.py' (starting on lines 1, 2); "
        "nothing was replaced."
    )
    assert (workspace / "pkg/new/mod.py").read_text() == "x = 1\nx = 1\n"
    none = box.call("replace_in_file", {"path": "pkg/core.py", "old": "return a * b", "new": "z"})
    assert none.error.kind == "tool_failed"
    assert none.observation.startswith("No match: `old` occurs 0 times in 'pkg/core.py'.")
    done = box.call(
        "replace_in_file",
        {
            "path": "pkg/core.py",
            "old": "    return a - b\n",
            "new": "    c = a - b\n    return c\n",
        },
    )
    assert done.error is None
    assert done.observation == "Replaced lines 6-7 of pkg/core.py with 3 lines."
    assert (workspace / "pkg/core.py").read_text() == CORE.replace(
        "    return a - b\n", "    c = a - b\n    return c\n"
    )
    too_big = make_toolbox(workspace, write_max_bytes=4).call(
        "write_file", {"path": "big.txt", "content": "12345"}
    )
    assert too_big.error.kind == "tool_failed" and not (workspace / "big.txt").exists()
    is_dir = box.call("write_file", {"path": "pkg", "content": ""})
    assert is_dir.error.kind == "tool_failed"


@pytest.mark.parametrize(
    "path, fragment",
    [
        ("../outside.txt", "contains '..'"),
        ("pkg/../../outside.txt", "contains '..'"),
        ("/etc/passwd", "is absolute"),
        ("link_out", "resolves through a symlink to a place outside the repository"),
        ("secret/answer.txt", "is hidden in this task"),
        ("secret", "is hidden in this task"),
    ],
)
def test_paths_cannot_escape(workspace: Path, path: str, fragment: str) -> None:
    box = make_toolbox(workspace)
    for name, arguments in (
        ("read_file", {"path": path}),
        ("write_file", {"path": path, "content": "pwned\n"}),
        ("replace_in_file", {"path": path, "old": "outside", "new": "pwned"}),
        ("list_files", {"path": path}),
        ("search", {"pattern": "answer", "path": path}),
        ("run_tests", {"tests": [f"{path}::test_x"]}),
    ):
        outcome = box.call(name, arguments)
        assert outcome.error is not None and outcome.error.kind == "path_escape", (name, outcome)
        assert fragment in outcome.observation and outcome.error.tool == name
    assert (workspace.parent / "outside.txt").read_text() == "outside\n"
    assert (workspace / "secret" / "answer.txt").read_text() == "the hidden answer\n"


def test_absolute_path_inside_workspace_suggests_relative(workspace: Path) -> None:
    outcome = make_toolbox(workspace).call("read_file", {"path": str(workspace / "pkg/core.py")})
    assert outcome.error.kind == "path_escape"
    assert outcome.observation.endswith(
        "use a path relative to the repository root ('pkg/core.py')."
    )


def test_search_regex_caps_hidden_and_errors(workspace: Path) -> None:
    box = make_toolbox(workspace)
    found = box.call("search", {"pattern": r"def (add|sub)\("}).observation.split("\n")
    assert found == ["pkg/core.py:1: def add(a, b):", "pkg/core.py:5: def sub(a, b):"]
    # the symlink pkg/alias.py is skipped, the hidden directory is never searched
    assert box.call("search", {"pattern": "hidden answer"}).observation == (
        "No matches for /hidden answer/ in '.'."
    )
    scoped = box.call("search", {"pattern": "assert", "path": "tests/test_core.py"})
    assert scoped.observation.split("\n")[0] == "tests/test_core.py:5:     assert add(1, 2) == 3"
    capped = make_toolbox(workspace, search_max_results=2).call("search", {"pattern": "a"})
    assert capped.observation.split("\n")[-1].startswith("[only the first 2 matches are shown")
    bad = box.call("search", {"pattern": "def add("})
    assert bad.error.kind == "bad_arguments"
    assert "argument 'pattern' is not a valid Python regular expression" in bad.observation
    assert bad.observation.endswith(f"Parameters schema: {json.dumps(PARAMS['search'])}")


def test_search_that_backtracks_forever_is_stopped(workspace: Path) -> None:
    (workspace / "long.txt").write_text("a" * 40 + "!\n")
    box = make_toolbox(workspace, search_timeout_s=1.0)
    outcome = box.call("search", {"pattern": r"^(a+)+$"})
    assert outcome.error.kind == "tool_failed"
    assert outcome.observation.startswith("search timed out after 1 s")


def test_run_tests_reports_outcomes(workspace: Path) -> None:
    box = make_toolbox(workspace)
    assert box.call("run_tests", {}).observation.startswith("pytest: all 2 passed")
    some = box.call("run_tests", {"tests": ["tests/test_core.py"]}).observation
    assert some.startswith("pytest: 2 passed, 1 failed")
    assert "Not passed:\n  failed tests/test_core.py::test_broken" in some
    assert "--- pytest output (tail) ---" in some and "assert 2 == 3" in some
    (workspace / "pkg" / "core.py").write_text("def add(a, b:\n")
    broken = box.call("run_tests", {}).observation
    assert broken.startswith("pytest could not collect or run the tests")
    option = box.call("run_tests", {"tests": ["--collect-only"]})
    assert option.error.kind == "bad_arguments"


def test_bash_output_exit_code_and_timeout(workspace: Path) -> None:
    box = make_toolbox(workspace, bash_timeout_s=1.0)
    out = box.call("bash", {"command": "echo out; echo err >&2; exit 3"}).observation
    assert out == "exit code: 3\n--- stdout ---\nout\n--- stderr ---\nerr"
    assert box.call("bash", {"command": "true"}).observation == "exit code: 0\n(no output)"
    # a NUL can not reach exec: an observation, not an exception out of call()
    nul = box.call("bash", {"command": "echo a\x00b"}).observation
    assert nul.startswith("exit code: 126\n--- stderr ---\n") and "NUL" in nul
    slow = box.call("bash", {"command": "sleep 5"})
    assert slow.observation.startswith("timed out after 1 s; the command was killed")
    # the time left in the episode caps a tool's own timeout
    capped = make_toolbox(workspace).call("bash", {"command": "sleep 5"}, time_left=1.0)
    assert capped.observation.startswith("timed out after 1 s")
    if box.sandbox.name == "bwrap":
        hidden = box.call("bash", {"command": "cat secret/answer.txt"}).observation
        assert "the hidden answer" not in hidden


def test_observation_cap(workspace: Path) -> None:
    box = make_toolbox(workspace, max_observation_chars=300)
    outcome = box.call("bash", {"command": "python -c \"print('x' * 5000)\""})
    assert len(outcome.observation) <= 300
    assert "characters cut ..." in outcome.observation
    assert outcome.observation.startswith("exit code: 0")
    assert cap_text("short", 300) == "short"
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    capped = cap_text(text, 200)
    head, tail = capped.split("\n[... ")[0], capped.split("...]\n")[1]
    assert text.startswith(head) and text.endswith(tail)
    assert len(head) + len(tail) + int(capped.split("[... ")[1].split(" ")[0]) == len(text)


def test_toolbox_needs_a_sandbox_that_masks_its_hidden_paths(workspace: Path) -> None:
    with pytest.raises(ValueError, match=r"does not mask the hidden paths \['secret'\]"):
        Toolbox(workspace, sandbox=make_sandbox(), hidden_paths=["secret"])


def test_submit(workspace: Path) -> None:
    outcome = make_toolbox(workspace).call("submit", {})
    assert outcome.submitted and outcome.error is None
    assert make_toolbox(workspace).call("submit", {"now": True}).error.kind == "bad_arguments"
