"""`etude demo` recipe handling: flags map onto the recipe, stage paths derive from the run dir."""

import subprocess
import sys

import pytest

from etude.demo import load_demo_recipe, stage_recipes


def test_stage_recipes_derive_paths_length_and_feedback():
    recipe = load_demo_recipe(
        "configs/demo.toml", ['demo.run_dir="/tmp/x"', "demo.length=short", "demo.feedback=false"]
    )
    sft, rl = stage_recipes(recipe)
    assert sft.data.tasks == "/tmp/x/tasks/tasks.jsonl" and rl.tasks.path == sft.data.tasks
    assert sft.train.run_dir == "/tmp/x/sft" and rl.train.run_dir == "/tmp/x"
    assert sft.train.steps == round(recipe.sft.train.steps * 0.3)
    assert rl.train.steps == max(2, round(recipe.rl.train.steps * 0.3))
    assert rl.teacher.beta == 0.0 and recipe.rl.teacher.beta > 0
    assert rl.train.init == ""  # set to RUN/sft only once the warm start exists
    _, rl_fb = stage_recipes(load_demo_recipe("configs/demo.toml", []))
    assert rl_fb.teacher.beta == recipe.rl.teacher.beta


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="demo.length"):
        load_demo_recipe("configs/demo.toml", ["demo.length=huge"])
    with pytest.raises(ValueError, match="unknown config key 'rl.train.stepz'"):
        load_demo_recipe("configs/demo.toml", ["rl.train.stepz=3"])


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "etude", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_help_documents_every_flag_and_errors_exit_2(tmp_path):
    out = run_cli("demo", "--help")
    assert out.returncode == 0
    for flag in ("--run-dir", "--length", "--no-feedback"):
        assert flag in out.stdout
    assert run_cli("demo", "--length", "huge").returncode == 2
    bad = run_cli("demo", "configs/demo.toml", "demo.bogus=1")
    assert bad.returncode == 2 and "unknown config key 'demo.bogus'" in bad.stderr
    missing = run_cli("report", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "nope" in missing.stderr


def test_wilson_interval_and_verdict_say_worse_when_worse():
    from etude.demo import verdict_line, wilson_interval

    low, high = wilson_interval(10, 50)
    assert 0.11 < low < 0.2 < high < 0.34  # 0.20 with its 95% Wilson interval
    assert wilson_interval(0, 54)[0] < 1e-9 and wilson_interval(54, 54)[1] > 1 - 1e-9

    def ev(k: int, n: int = 54) -> dict:
        lo, hi = wilson_interval(k, n)
        return {
            "pass_at_1": k / n,
            "pass_at_1_low": lo,
            "pass_at_1_high": hi,
            "episodes": n,
            "tasks": 9,
            "targeted_error_rate": 0.1,
            "unknown_tool_rate": 0.12,
            "malformed_rate": 0.4,
        }

    assert "(WORSE)" in verdict_line(ev(30), ev(5), 10, True)
    assert "(better)" in verdict_line(ev(5), ev(30), 10, True)
    line = verdict_line(ev(10), ev(12), 10, False)
    assert "the intervals overlap" in line and "training tasks" in line and "54 eval" in line
    assert "unknown-tool calls 0.12 -> 0.12" in line and "malformed calls 0.40 -> 0.40" in line


def test_monitor_reads_a_demo_run_directory(tmp_path):
    # `etude monitor RUN_DIR` on the demo's layout: trajectories/step_N.jsonl + eval episodes
    from etude.env.trajectory import Trajectory, write_jsonl
    from etude.monitor.report import _trajectory_files

    write_jsonl(tmp_path / "trajectories" / "step_000001.jsonl", [Trajectory(task_id="t")])
    write_jsonl(tmp_path / "eval_trajectories.jsonl", [Trajectory(task_id="t")])
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.jsonl").write_text("")
    names = [p.relative_to(tmp_path).as_posix() for p in _trajectory_files(tmp_path)]
    assert names == ["eval_trajectories.jsonl", "trajectories/step_000001.jsonl"]


def test_episode_metrics_count_valid_calls_right_after_a_malformed_one():
    from etude.demo import episode_metrics
    from etude.env.trajectory import ToolCall, ToolError, Trajectory, Turn

    def turn(kind: str | None) -> Turn:
        errors = [ToolError(kind=kind, message=kind)] if kind else []
        calls = [] if kind == "malformed_json" else [ToolCall(name="list_files")]
        return Turn(role="assistant", text="", tool_calls=calls, errors=errors)

    def tool() -> Turn:
        return Turn(role="tool", text="x")

    a = Trajectory(task_id="a", turns=[turn("malformed_json"), tool(), turn(None), tool()])
    # malformed, malformed, unknown tool: two turns after a malformed one, neither valid
    b = Trajectory(
        task_id="b",
        turns=[
            turn("malformed_json"),
            tool(),
            turn("malformed_json"),
            tool(),
            turn("unknown_tool"),
        ],
    )
    m = episode_metrics([a, b], 2)
    assert m["turns_after_malformed"] == 3.0 and m["valid_after_malformed"] == 1 / 3
    assert episode_metrics([], 0)["valid_after_malformed"] == 0.0


def test_episode_metrics_split_failures_by_whether_an_edit_call_ran():
    from etude.demo import episode_metrics
    from etude.env.trajectory import ToolCall, ToolError, Trajectory, Turn

    def call(name: str, error: str | None = None) -> Turn:
        errors = [ToolError(kind=error, message=error)] if error else []
        calls = [] if error == "malformed_json" else [ToolCall(name=name)]
        return Turn(role="assistant", text="", tool_calls=calls, errors=errors)

    passed = Trajectory(task_id="a", turns=[call("replace_in_file")], reward=1.0)
    wrong_edit = Trajectory(task_id="a", turns=[call("write_file"), call("submit")], reward=0.0)
    # a garbled edit, an edit whose call failed (old text not found), then only reads
    no_edit = Trajectory(
        task_id="a",
        turns=[
            call("replace_in_file", "malformed_json"),
            call("replace_in_file", "tool_failed"),
            call("read_file"),
        ],
        reward=0.0,
    )
    m = episode_metrics([passed, wrong_edit, no_edit, no_edit], 1)
    assert m["pass_at_1"] == 0.25
    assert m["failed_with_edit"] == 0.25 and m["failed_without_edit"] == 0.5
    assert episode_metrics([], 0)["failed_without_edit"] == 0.0
