"""The report renders in a real browser: headless Chromium runs its JavaScript from ``file://``.

Checks, on the two fixed runs overlaid (``tests/assets/report_run`` and ``report_run_nofb``):
every plot is in the DOM with data, the trajectory viewer filled its list and opened a
trajectory with turns and KL heat-map cells, the page's own error box stayed empty and Chromium
logged no uncaught error or console error. A screenshot is saved to the test's temporary
directory (its path is printed). Needs Debian's ``chromium`` package; skipped with the reason
when it is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from etude.report.html import write_report

ASSETS = Path(__file__).parents[1] / "assets"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (Debian: apt-get install chromium; `make` installs it)",
)


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    profile.mkdir(exist_ok=True)
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def attr(dom: str, element_id: str, name: str) -> str:
    tag = re.search(rf"<[a-z]+[^>]*\bid=\"{element_id}\"[^>]*>", dom)
    assert tag is not None, element_id
    m = re.search(rf'\b{name}="([^"]*)"', tag.group(0))
    assert m is not None, (element_id, name, tag.group(0))
    return m.group(1)


def test_report_renders_plots_and_viewer_without_errors(tmp_path):
    page = write_report(
        [ASSETS / "report_run", ASSETS / "report_run_nofb"], tmp_path / "report.html"
    )
    url = page.resolve().as_uri()
    run = chromium(tmp_path, "--enable-logging=stderr", "--v=0", "--dump-dom", url)
    assert run.returncode == 0, run.stderr[-2000:]
    dom = run.stdout
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-rendered="1"' in body, body

    # every plot rendered with data
    plots = re.findall(
        r'<svg class="plot" data-plot="([^"]+)" data-series="(\d+)" data-points="(\d+)"', dom
    )
    assert len(plots) >= 12
    assert f'data-plots="{len(plots)}"' in body and 'data-empty-plots="0"' in body
    for name, series, points in plots:
        assert int(series) >= 1 and int(points) > 0, name
    for required in (
        "reward",
        "tool_errors",
        "hints",
        "kl",
        "monitor_flags",
        "monitor_categories",
        "curriculum_pass_rate",
        "curriculum_pool",
        "throughput",
    ):
        assert required in {p[0] for p in plots}, required
    assert dom.count("<polyline") >= 20

    # the viewer: list filled, one trajectory open with its turns, hint and KL heat map
    assert attr(dom, "viewer", "data-rendered") == "1"
    assert attr(dom, "viewer", "data-trajectories") == "48"
    rows = re.search(r'<table id="traj-list">.*?</table>', dom, re.S).group(0)
    assert rows.count("<tr data-id=") == 48
    assert int(attr(dom, "traj-detail", "data-turns")) >= 5
    assert int(attr(dom, "traj-detail", "data-kl-cells")) > 0
    assert dom.count('class="tok"') > 10 and 'class="turn hint"' in dom
    assert "tool-call error unknown_tool" in dom
    assert re.search(
        r"<tbody>\s*<tr>", re.search(r'<table id="tasks".*?</table>', dom, re.S).group(0)
    )

    # no errors: the page's own box stayed empty, and Chromium logged none
    assert attr(dom, "report-errors", "data-count") == "0"
    assert 'id="report-errors" hidden' in dom
    # the page writes nothing to the console, so any console line (uncaught errors and
    # console.error calls show as ":CONSOLE:" lines with --enable-logging) is a failure
    logged = [line for line in run.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert not logged, logged

    shot = tmp_path / "report.png"
    run = chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,3000", url)
    assert run.returncode == 0, run.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    print(f"screenshot: {shot}")


def test_a_script_error_shows_in_the_page_and_is_caught(tmp_path):
    # the check above is only meaningful if an error would be seen: break the data on purpose
    page = write_report([ASSETS / "report_run"], tmp_path / "report.html", max_trajectories=3)
    text = page.read_text().replace('"trajectories":[', '"trajectories":[{"turns":7},', 1)
    page.write_text(text)
    run = chromium(tmp_path, "--dump-dom", page.resolve().as_uri())
    assert run.returncode == 0
    assert attr(run.stdout, "report-errors", "data-count") != "0"
    assert "render:" in run.stdout


def test_console_lines_are_seen_by_the_check(tmp_path):
    # guards the log filter above: an uncaught error in a page does reach Chromium's stderr
    page = tmp_path / "bad.html"
    page.write_text("<html><body><script>missingFunction();</script></body></html>")
    run = chromium(tmp_path, "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri())
    assert any(":CONSOLE" in line and "Uncaught" in line for line in run.stderr.splitlines())


def test_real_small_run_shows_kl_heat_map_and_eval_episodes(tmp_path):
    # a real run (not a fixture): 2 RL steps of a tiny model with text feedback, then the
    # demo's evaluation; its report must carry per-token KL from the trainer and the eval
    # episodes in the viewer
    import json
    import os
    import sys

    from etude.config import load_config
    from etude.demo import evaluate_policy
    from etude.rl.trainer import TrainRecipe

    root = Path(__file__).parents[2]
    run_dir = tmp_path / "run"
    overrides = [
        "model.preset='tiny'",
        "model.vocab_size=512",
        "model.dim=32",
        "model.num_layers=2",
        "model.num_heads=2",
        "model.num_kv_heads=1",
        "model.head_dim=16",
        "model.num_dense_layers=1",
        "model.num_experts=4",
        "model.num_experts_per_tok=2",
        "model.expert_ffn_dim=32",
        "model.dense_ffn_dim=64",
        "model.max_seq_len=4096",
        f"tasks.path='{root / 'examples' / 'tasks' / 'handwritten' / 'tasks.jsonl'}'",
        "tasks.limit=1",
        "env.max_turns=1",
        "env.max_tokens=4000",
        "rollout.tasks_per_step=1",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "rollout.num_workers=2",
        "teacher.beta=1.0",
        "train.init=''",
        "train.steps=2",
        f"train.run_dir='{run_dir}'",
        "train.progress=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "etude", "train", str(root / "configs" / "rl-tiny.toml")]
    done = subprocess.run(
        [*cmd, *overrides], env=env, capture_output=True, text=True, timeout=600, cwd=root
    )
    assert done.returncode == 0, done.stderr[-2000:]
    recipe = load_config(TrainRecipe, root / "configs" / "rl-tiny.toml", overrides)
    evaluate_policy(recipe, run_dir, 1, out=run_dir / "eval_trajectories.jsonl")

    page = write_report([run_dir], tmp_path / "report.html")
    html = page.read_text()
    data = json.loads(re.search(r'id="etude-data">(.*?)</script>', html, re.S).group(1))
    trajs = data["trajectories"]
    assert any(t["source"].startswith("eval_trajectories.jsonl:") for t in trajs)
    kl_turns = [u["kl"] for t in trajs for u in t["turns"] if u["kl"]]
    assert kl_turns and all(any(v is not None for v in kl["values"]) for kl in kl_turns)

    run = chromium(tmp_path, "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    dom = run.stdout
    assert attr(dom, "viewer", "data-rendered") == "1"
    assert attr(dom, "report-errors", "data-count") == "0"
    assert '<td class="step">eval</td>' in dom
    logged = [line for line in run.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert not logged, logged
