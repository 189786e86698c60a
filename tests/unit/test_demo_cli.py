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
