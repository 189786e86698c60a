"""``etude tasks build|show|check`` through the argparse entry point."""

import json

from test_tasks_mine import write_mini_repo

from etude.tasks.cli import format_tasks_table, main
from etude.tasks.record import load_tasks, save_tasks


def test_build_show_check(tmp_path, capsys):
    repo = write_mini_repo(tmp_path / "repo")
    out = tmp_path / "out"
    config = tmp_path / "tasks.toml"
    config.write_text("[tasks]\nworkers = 1\n\n[tasks.proposals]\nmin_lines = 2\n")
    code = main(
        [
            "tasks",
            "build",
            str(repo),
            'proposals.include=["minipkg.words.shout"]',
            "--out",
            str(out),
            "--config",
            str(config),
            "--max-tasks",
            "1",
            "--detail",
            "docstring",
            "--quiet",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.startswith("1 valid tasks of 1 candidates")
    (record,) = load_tasks(out)
    assert (
        record.instance_id == "minipkg__words.shout@docstring"
        and record.etude.detail_level == "docstring"
    )
    report = json.loads((out / "build_report.json").read_text())
    assert (
        report["valid"] == 1
        and report["num_passing"] == 10
        and report["tasks"] == [record.instance_id]
    )

    assert main(["tasks", "show", str(out)]) == 0
    table = capsys.readouterr().out
    assert "minipkg__words.shout@docstring" in table and "clean" in table and "1 tasks" in table

    assert main(["tasks", "check", str(out), "--workers", "1"]) == 0
    assert "1 of 1 tasks valid" in capsys.readouterr().out

    broken = record.to_dict()
    broken["patch"] = broken["patch"].replace("+def shout(text):", "+def shout(txt):")
    save_tasks(out / "tasks.jsonl", [type(record).from_dict(broken)])
    assert main(["tasks", "check", str(out), "--workers", "1"]) == 1
    assert "FAIL  minipkg__words.shout@docstring" in capsys.readouterr().out


def test_user_errors_exit_2(tmp_path, capsys):
    repo = write_mini_repo(tmp_path / "repo")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "file").write_text("x")
    assert main(["tasks", "build", str(repo), "--out", str(busy)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["tasks", "build", str(repo), "no_such_key=1", "--out", str(tmp_path / "new")]) == 2
    assert "no_such_key" in capsys.readouterr().err
    assert main(["tasks", "show", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_table_format():
    assert format_tasks_table([]).splitlines()[0].split() == [
        "id",
        "symbols",
        "F2P",
        "P2P",
        "difficulty",
        "detail",
        "leak",
        "scan",
    ]
