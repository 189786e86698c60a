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
