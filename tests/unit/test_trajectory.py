"""The trajectory record round-trips through JSONL and reports malformed lines clearly."""

import json

import pytest

from etude.env.trajectory import (
    Feedback,
    Flag,
    ToolCall,
    ToolError,
    Trajectory,
    Turn,
    read_jsonl,
    write_jsonl,
)


def make_trajectory() -> Trajectory:
    return Trajectory(
        task_id="t1",
        turns=[
            Turn(
                role="user",
                text="fix it",
                token_ids=[1, 2, 3],
                trainable=[0, 0, 0],
                logprobs=[0.0] * 3,
            ),
            Turn(
                role="assistant",
                text='<tool_call>{"name": "ls"}</tool_call>',
                token_ids=[4, 5],
                trainable=[1, 1],
                logprobs=[-0.5, -0.25],
                tool_calls=[ToolCall(name="ls", arguments={})],
                errors=[ToolError(kind="unknown_tool", message="Tool not found: ls", tool="ls")],
            ),
            Turn(role="tool", text="Tool not found: ls", token_ids=[6], tool_name="ls"),
        ],
        reward=0.0,
        tests={"tests/test_a.py::test_x": "failed"},
        finish_reason="max_turns",
        flags=[Flag(rule="r1", category="vcs", severity=3, turn=1, evidence="git log")],
        feedback=[Feedback(turn=1, kind="unknown_tool", hint="Reminder: available tools are ...")],
        info={"group": 0},
    )


def test_round_trip(tmp_path):
    traj = make_trajectory()
    write_jsonl(tmp_path / "t.jsonl", [traj, traj])
    write_jsonl(tmp_path / "t.jsonl", [traj], append=True)
    back = read_jsonl(tmp_path / "t.jsonl")
    assert back == [traj, traj, traj]
    assert back[0].token_ids == [1, 2, 3, 4, 5, 6]
    assert back[0].turn_offsets() == [0, 3, 5]
    assert [i for i, _ in back[0].assistant_turns()] == [1]


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [make_trajectory()])
    with open(path, "a") as f:
        f.write("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a trajectory record"):
        read_jsonl(path)
    # valid JSON of the wrong shape is named the same way
    good = json.dumps(make_trajectory().to_json())
    misaligned = good.replace('"trainable": [0, 0, 0]', '"trainable": [0]', 1)
    unknown_kind = good.replace('"kind": "unknown_tool"', '"kind": "no_such_kind"', 1)
    assert misaligned != good and unknown_kind != good
    for line in ('"a string"', "[1, 2]", '{"turns": []}', misaligned, unknown_kind):
        path.write_text(good + "\n" + line + "\n")
        with pytest.raises(ValueError, match=r"bad.jsonl:2: not a trajectory record"):
            read_jsonl(path)


def test_misaligned_mask_is_an_invariant_error():
    with pytest.raises(AssertionError):
        Turn(role="assistant", text="x", token_ids=[1, 2], trainable=[1])
