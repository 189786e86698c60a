"""The run report: its numbers come from the run's own files, and it stays bounded and safe.

The fixed run directories ``tests/assets/report_run`` (text feedback) and ``report_run_nofb``
(the ablation) are written by ``tests/assets/make_report_run.py``; every expected number below
is recomputed here from those files' raw JSON, not through the report's own readers.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
import re
from pathlib import Path

import pytest

from etude.env.trajectory import Trajectory, Turn
from etude.model.tokenizer import Tokenizer
from etude.report import plots
from etude.report.cli import DEFAULT_MAX_TRAJECTORIES, add_report_parser
from etude.report.html import DEFAULT_MAX_TRAJECTORIES as HTML_DEFAULT
from etude.report.html import build_report, write_report
from etude.report.run_data import load_run
from etude.report.viewer import select_trajectories, token_pieces, viewer_record

ASSETS = Path(__file__).parents[1] / "assets"
RUN = ASSETS / "report_run"
NOFB = ASSETS / "report_run_nofb"


def embedded(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="etude-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def raw_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def raw_trajectories(run: Path) -> list[dict]:
    out = []
    for f in sorted((run / "trajectories").glob("*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def stat(page: str, name: str) -> str:
    m = re.search(rf'data-stat="{re.escape(name)}">([^<]*)<', page)
    assert m is not None, name
    return m.group(1)


@pytest.fixture(scope="module")
def single() -> str:
    return build_report([RUN])


@pytest.fixture(scope="module")
def overlay() -> str:
    return build_report([RUN, NOFB])


def test_committed_fixture_is_what_the_generator_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_report_run", ASSETS / "make_report_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path)
    for name in ("report_run", "report_run_nofb"):
        made = sorted(
            p.relative_to(tmp_path / name) for p in (tmp_path / name).rglob("*") if p.is_file()
        )
        committed = sorted(
            p.relative_to(ASSETS / name) for p in (ASSETS / name).rglob("*") if p.is_file()
        )
        assert made == committed
        for rel in made:
            assert (tmp_path / name / rel).read_bytes() == (ASSETS / name / rel).read_bytes(), rel


def test_summary_header_shows_the_runs_numbers(single):
    metrics = raw_metrics(RUN)
    trajs = raw_trajectories(RUN)
    assert stat(single, "final_reward") == f"{metrics[-1]['reward']:.3f}" == "0.875"
    assert stat(single, "final_pass_rate") == f"{metrics[-1]['pass_rate']:.3f}"
    assert stat(single, "steps") == str(len(metrics))
    assert stat(single, "trajectories") == str(len(trajs)) == "24"
    flagged = sum(any(f["severity"] >= 3 for f in t["flags"]) for t in trajs)
    assert stat(single, "flagged") == str(flagged) == "1"
    assert stat(single, "hints") == str(sum(len(t["feedback"]) for t in trajs))
    tput = sum(m["rollout_tok/s"] for m in metrics) / len(metrics)
    assert stat(single, "tok_s") == f"{tput:,.0f}"
    summary = embedded(single)["runs"][0]["summary"]
    assert summary["first_reward"] == metrics[0]["reward"]
    assert summary["best_reward"] == max(m["reward"] for m in metrics)
    assert summary["wall_seconds"] == metrics[-1]["time"] - metrics[0]["time"]


def test_line_figures_plot_the_logged_values(single):
    metrics = raw_metrics(RUN)
    figures = embedded(single)["figures"]
    by_key = {s["key"]: s for s in figures["reward"]["series"]}
    assert by_key["reward"]["x"] == [m["step"] for m in metrics]
    assert by_key["reward"]["y"] == [m["reward"] for m in metrics]
    assert by_key["pass_rate"]["y"] == [m["pass_rate"] for m in metrics]
    assert [s["key"] for s in figures["tool_errors"]["series"]] == ["err/unknown_tool"]
    assert figures["tool_errors"]["series"][0]["y"] == [m["err/unknown_tool"] for m in metrics]
    assert figures["kl"]["series"][0]["y"] == [m["kl"] for m in metrics]
    assert all(m["kl_tokens"] > 0 for m in metrics)
    assert figures["hints"]["series"][0]["y"] == [m["hints"] for m in metrics]
    assert figures["monitor_flags"]["series"][0]["key"] == "monitor/category/vcs_history"
    assert {s["key"] for s in figures["throughput"]["series"]} == {"rollout_tok/s", "train_tok/s"}
    # each figure is an SVG carrying its point count
    for fig_id, fig in figures.items():
        m = re.search(
            rf'<svg class="plot" data-plot="{fig_id}" data-series="(\d+)" data-points="(\d+)"',
            single,
        )
        assert m is not None, fig_id
        assert int(m.group(2)) > 0, fig_id
        if "series" in fig:
            assert int(m.group(1)) == len(fig["series"])
            assert int(m.group(2)) == sum(len(s["y"]) for s in fig["series"])


def test_task_table_counts_rollouts_from_the_trajectories(single):
    trajs = raw_trajectories(RUN)
    tasks = [json.loads(line) for line in (RUN / "tasks" / "tasks.jsonl").read_text().splitlines()]
    rows = {r["task"]: r for r in embedded(single)["tasks"]}
    assert list(rows) == [t["instance_id"] for t in tasks]
    table = re.search(r'<table id="tasks".*?</table>', single, re.S).group(0)
    for task in tasks:
        mine = [t for t in trajs if t["task_id"] == task["instance_id"]]
        rate = sum(t["reward"] >= 1.0 for t in mine) / len(mine)
        mean = sum(t["reward"] for t in mine) / len(mine)
        row = rows[task["instance_id"]]
        assert row["F2P"] == len(task["FAIL_TO_PASS"]) and row["P2P"] == len(task["PASS_TO_PASS"])
        assert row["parent"] == (task["etude"]["parent"] or "")
        assert row["runs"][0]["rollouts"] == len(mine)
        assert row["runs"][0]["pass_rate"] == pytest.approx(rate)
        assert row["runs"][0]["mean_reward"] == pytest.approx(mean)
        cells = re.search(rf"<tr><td>{re.escape(task['instance_id'])}</td>(.*?)</tr>", table).group(
            1
        )
        assert f"<td>{rate:.3f}</td><td>{mean:.3f}</td>" in cells


def test_curriculum_and_monitor_figures_use_pool_and_monitor_files(single):
    figures = embedded(single)["figures"]
    pool = json.loads((RUN / "pool.json").read_text())
    a, b = pool["config"]["prior_alpha"], pool["config"]["prior_beta"]
    rates = [(a + s["passes"]) / (a + b + s["attempts"]) for s in pool["tasks"].values()]
    counts = [0] * 10
    for r in rates:
        counts[min(int(r * 10), 9)] += 1
    assert figures["curriculum_pass_rate"]["groups"][0]["counts"] == counts
    assert figures["curriculum_pass_rate"]["bins"][0] == "0.0-0.1"
    statuses = [s["status"] for s in pool["tasks"].values()]
    expect = [statuses.count(c) for c in ("active", "retired", "unsolved")]
    expect.append(sum(s["generation"] > 0 for s in pool["tasks"].values()))
    assert figures["curriculum_pool"]["groups"][0]["values"] == expect
    monitor = json.loads((RUN / "monitor.json").read_text())
    cats = figures["monitor_categories"]
    assert cats["categories"] == sorted(monitor["by_category"])
    assert cats["groups"][0]["values"] == [
        monitor["by_category"][c]["trajectories"] for c in cats["categories"]
    ]


def test_two_runs_overlay_in_every_line_plot(overlay):
    data = embedded(overlay)
    assert [r["name"] for r in data["runs"]] == ["report_run", "report_run_nofb"]
    series = data["figures"]["reward"]["series"]
    assert {(s["run"], s["key"]) for s in series} == {
        (r, k) for r in (0, 1) for k in ("reward", "pass_rate")
    }
    for r, run in enumerate((RUN, NOFB)):
        (reward,) = [s for s in series if s["run"] == r and s["key"] == "reward"]
        assert reward["y"] == [m["reward"] for m in raw_metrics(run)]
        assert reward["label"] == f"reward ({run.name})"
    # the second run is dashed, and its label is in the legend
    svg = re.search(r'<svg class="plot" data-plot="reward".*?</svg>', overlay, re.S).group(0)
    assert 'stroke-dasharray="6 4"' in svg and "pass_rate (report_run_nofb)" in svg
    assert stat(overlay, "final_reward") == "0.875"
    assert overlay.count('data-stat="final_reward"') == 2
    assert f"{raw_metrics(NOFB)[-1]['reward']:.3f}" in re.findall(
        r'data-stat="final_reward">([^<]*)<', overlay
    )
    # the ablation has no hinted turn: its KL is absent (kl_tokens 0), not drawn as zero
    assert all(m["kl"] == 0 and m["kl_tokens"] == 0 for m in raw_metrics(NOFB))
    assert [s["run"] for s in data["figures"]["kl"]["series"]] == [0]
    rows = embedded(overlay)["tasks"]
    assert all(len(r["runs"]) == 2 for r in rows)
    assert {t["run"] for t in data["trajectories"]} == {0, 1}


def test_viewer_heat_map_aligns_kl_with_generated_tokens(single):
    tok = Tokenizer.load(RUN / "tokenizer")
    records = {(t["source"]): t for t in embedded(single)["trajectories"]}
    raw = {}
    for f in sorted((RUN / "trajectories").glob("*.jsonl")):
        for n, line in enumerate(f.read_text().splitlines()):
            raw[f"trajectories/{f.name}:{n + 1}"] = json.loads(line)
    hinted = [s for s, t in raw.items() if "kl" in t["info"]]
    assert hinted
    for source in hinted:
        traj, rec = raw[source], records[source]
        for key, values in traj["info"]["kl"].items():
            turn, view = traj["turns"][int(key)], rec["turns"][int(key)]["kl"]
            assert view["align"] == "trainable"
            assert "".join(view["tokens"]) == tok.decode(turn["token_ids"])
            assert "d\u00e9finition" in "".join(view["tokens"])
            got = [v for v, m in zip(view["values"], turn["trainable"]) if m]
            assert got == pytest.approx(values)
            assert all(v is None for v, m in zip(view["values"], turn["trainable"]) if not m)
            assert view["max"] == pytest.approx(max(values))
        assert [f["hint"] for f in rec["feedback"]] == [f["hint"] for f in traj["feedback"]]
    (flagged,) = [s for s, t in raw.items() if t["flags"]]
    assert records[flagged]["flags"][0]["evidence"] == raw[flagged]["flags"][0]["evidence"]
    assert records[flagged]["reward_before_monitor"] == 1.0 and records[flagged]["reward"] == 0.0


def test_kl_alignments_and_fallbacks():
    tok = Tokenizer.load(RUN / "tokenizer")
    ids = tok.encode("abc def")
    turn = Turn(role="assistant", text="abc def", token_ids=ids, trainable=[1] * len(ids))
    every = [0.1 * k for k in range(len(ids))]
    traj = Trajectory(task_id="t", turns=[turn], info={"kl": {0: every}})
    view = viewer_record(traj, index=0, run=0, step=1, source="x", tokenizer=tok)["turns"][0]["kl"]
    assert view["align"] == "tokens" and view["values"] == pytest.approx(every)
    assert "".join(view["tokens"]) == "abc def"
    traj.info["kl"] = {"0": [0.5, 0.25]}  # fits neither the tokens nor the trainable ones
    view = viewer_record(traj, index=0, run=0, step=1, source="x", tokenizer=tok)["turns"][0]["kl"]
    assert view["align"] == "values" and view["tokens"] is None
    assert view["values"] == [0.5, 0.25] and view["mean"] == pytest.approx(0.375)
    foreign = Turn(role="assistant", text="?", token_ids=[10**6], trainable=[1])
    traj = Trajectory(task_id="t", turns=[foreign], info={"kl": {"0": [1.0]}})
    view = viewer_record(traj, index=0, run=0, step=1, source="x", tokenizer=tok)["turns"][0]["kl"]
    assert view["tokens"] is None and view["values"] == [1.0]  # another tokenizer's ids


def test_token_pieces_split_multibyte_characters_without_loss():
    tok = Tokenizer.load(RUN / "tokenizer")
    text = "d\u00e9j\u00e0 vu \u2014 \U0001f600 <|im_end|> ok"
    ids = tok.encode(text, allow_special=True)
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert "<|im_end|>" in pieces


def test_embedded_data_cannot_close_its_script_element(single):
    data_block = re.search(r'id="etude-data">(.*?)</script>', single, re.S).group(1)
    assert "</" not in data_block
    texts = [u["text"] for t in embedded(single)["trajectories"] for u in t["turns"]]
    assert any("</script><b>not markup</b>" in t for t in texts)


def test_max_trajectories_caps_the_viewer_and_keeps_flagged_and_hinted_first():
    page = build_report([RUN], max_trajectories=4)
    data = embedded(page)
    assert len(data["trajectories"]) == 4
    assert sum(bool(t["flags"]) for t in data["trajectories"]) == 1
    assert sum(bool(t["flags"] or t["feedback"]) for t in data["trajectories"]) == 3
    assert "4 of 24 trajectories embedded" in data["viewer_note"]
    # the figures and task table still count every trajectory
    assert stat(page, "trajectories") == "24"
    assert build_report([RUN], max_trajectories=0).count('"turns"') == 0


def test_select_trajectories_ranks_classes_and_spreads_within_them():
    priorities = [0 if i == 17 else 1 if i % 5 == 0 else 2 for i in range(50)]
    chosen = select_trajectories(priorities, 12)
    assert len(chosen) == 12 and chosen == sorted(set(chosen))
    assert 17 in chosen
    assert sum(priorities[i] == 2 for i in chosen) == 3  # a quarter kept for plain episodes
    hinted = [i for i in chosen if priorities[i] == 1]
    assert len(hinted) == 8 and hinted[0] == 0 and hinted[-1] == 45
    assert select_trajectories(priorities[:3], 10) == [0, 1, 2]
    assert select_trajectories(priorities, 0) == []
    assert len(select_trajectories([2] * 30, 7)) == 7


def test_write_report_defaults_to_run_dir_and_is_self_contained(tmp_path):
    out = write_report([RUN], tmp_path / "sub" / "r.html")
    page = out.read_text()
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "<link" not in page and "@import" not in page
    assert page.isascii()
    with pytest.raises(ValueError, match="is a directory"):
        write_report([RUN], tmp_path)


def test_missing_run_directory_is_an_error_naming_it(tmp_path):
    missing = tmp_path / "no_such_run"
    with pytest.raises(ValueError, match="no_such_run"):
        build_report([missing])
    with pytest.raises(ValueError, match="one or two"):
        build_report([RUN, RUN, RUN])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="etude")
    sub = p.add_subparsers(dest="command", required=True)
    add_report_parser(sub)
    return p


def test_cli_documents_every_flag_and_writes_the_report(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["report", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("RUN_DIR", "RUN_DIR2", "--out", "--max-trajectories", "file://"):
        assert flag in text
    assert DEFAULT_MAX_TRAJECTORIES == HTML_DEFAULT
    for bad in (["report", RUN.as_posix(), "--max-trajectories", "-1"], ["report", "--bogus", "x"]):
        with pytest.raises(SystemExit) as e:
            parser().parse_args(bad)
        assert e.value.code == 2
    args = parser().parse_args(["report", str(tmp_path / "gone")])
    with pytest.raises(ValueError, match="gone"):
        args.func(args)
    out = tmp_path / "both.html"
    args = parser().parse_args(
        ["report", str(RUN), str(NOFB), "--out", str(out), "--max-trajectories", "5"]
    )
    assert args.func(args) == 0
    assert len(embedded(out.read_text())["trajectories"]) == 5
    assert "wrote" in capsys.readouterr().out


def test_tolerates_partial_runs_and_unknown_keys(tmp_path):
    run = tmp_path / "partial"
    run.mkdir()
    lines = [
        {"step": 1, "time": 10.0, "reward": 0.1, "custom/a": 1.0, "custom/b": 2.0, "solo": 3},
        {"step": 2, "time": 20.0, "reward": "nan", "custom/a": 1.5, "note": "text"},
        {"step": 2, "time": 21.0, "reward": 0.3, "custom/a": 2.5},  # a resumed run re-logs step 2
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    page = build_report([run])
    data = embedded(page)
    assert data["figures"]["reward"]["series"][0]["y"] == [0.1, 0.3]
    custom = {s["key"]: s["y"] for s in data["figures"]["other_custom"]["series"]}
    assert custom == {"custom/a": [1.0, 2.5], "custom/b": [2.0]}
    assert "other_solo" in data["figures"] and "other_note" not in data["figures"]
    assert data["trajectories"] == [] and data["tasks"] == []
    assert stat(page, "final_reward") == "0.300"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert embedded(build_report([empty]))["figures"] == {}
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # a run still writing: its half line is left out
    assert [m["step"] for m in load_run(run).metrics] == [1, 2]
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, \n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        load_run(run)
    (run / "metrics.jsonl").write_text('{"time": 1}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        load_run(run)


def test_nice_ticks_cover_the_range_with_round_steps():
    for lo, hi in ((0, 1), (0.013, 0.087), (-3.2, 41.0), (100, 100000), (0.5, 0.5)):
        ticks = plots.nice_ticks(lo, hi)
        assert all(lo - 1e-9 <= t <= hi + 1e-9 for t in ticks)
        if hi > lo:
            steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
            assert len(steps) == 1
            (step,) = steps
            mantissa = step / 10 ** int(f"{step:e}".split("e")[1])
            assert round(mantissa, 6) in (1.0, 2.0, 2.5, 5.0)
            assert 3 <= len(ticks) <= 11
    assert plots.format_number(12500) == "12.5k" and plots.format_number(0.25, 0.05) == "0.25"


def test_line_plot_breaks_at_gaps_and_says_when_empty():
    series = plots.Series(label="a", xs=[1, 2, 3, 4, 5], ys=[1.0, 2.0, None, 4.0, 5.0])
    svg = plots.line_plot("p", "title", [series])
    assert svg.count("<polyline") == 2 and 'data-points="4"' in svg
    empty = plots.line_plot("q", "title", [plots.Series(label="a", xs=[1], ys=[None])])
    assert "no data" in empty and 'data-points="0"' in empty
    two = plots.line_plot("r", "t<&>", [series, plots.Series(label="b", xs=[1], ys=[2.0])])
    assert "t&lt;&amp;&gt;" in two and 'class="legend"' in two


def test_histogram_counts_put_edges_in_range():
    labels, counts = plots.histogram_counts([0.0, 0.1, 0.55, 1.0, 1.3, -0.2], bins=10)
    assert labels[0] == "0.0-0.1" and labels[-1] == "0.9-1.0"
    assert counts == [2, 1, 0, 0, 0, 1, 0, 0, 0, 2] and sum(counts) == 6
    svg = plots.histogram("h", "H", [("run", [0.1, 0.2, 0.2], "#000")], bins=4)
    assert svg.count('class="bar"') == 4 and html.unescape(svg).count("0.00-0.25: 3") == 1
