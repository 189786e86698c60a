"""Task factory throughput, before and after the baseline-derived time limits.

Run: ``.venv/bin/python benchmarks/bench_tasks.py [--workers N] [--real DIR] [--include PAT ...]``
(writes benchmarks/results/bench_tasks.json).

Builds the tasks of ``examples/repos/textkit`` (the features matching ``--include``; default:
two of its modules) and of one real package (``--real``: an unpacked sdist; default the
inflection 0.5.1 sdist under ``$ETUDE_SDIST_DIR``), each twice in the same run: with
``time_limits = "fixed"`` (every validation run may take ``test_timeout_s`` = 600 s, the factory's
old behaviour) and with ``time_limits = "baseline"`` (each run may take 5x the baseline's slowest
whole-suite run, at least 30 s). For each it prints validated tasks per minute of wall-clock time
(baseline included), the time limit, the slowest candidate, the share of worker time spent inside
sandboxed test runs, and the cost of the baseline. Flat keys ``REPO_MODE_METRIC`` go to the JSON.

A hanging stub (a trivial body that makes a test loop forever) costs the whole limit: 600 s with
fixed limits, tens of seconds with derived ones. Where no candidate hangs, both modes should give
the same tasks per minute within the noise of a loaded machine; the ratio is the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from etude.tasks.build import TaskBuildConfig, TaskFactory
from etude.tasks.proposal import ProposalConfig

ROOT = Path(__file__).resolve().parents[1]
TEXTKIT = ROOT / "examples" / "repos" / "textkit"
RESULTS = Path(__file__).parent / "results" / "bench_tasks.json"
SDISTS = Path(os.environ.get("ETUDE_SDIST_DIR", Path.home() / ".cache" / "etude" / "sdists"))


def build_once(repo: Path, mode: str, workers: int, include: tuple[str, ...]) -> dict[str, Any]:
    cfg = TaskBuildConfig(
        workers=workers, time_limits=mode, proposals=ProposalConfig(include=include)
    )
    with tempfile.TemporaryDirectory(prefix="etude-bench-tasks-") as tmp:
        t0 = time.monotonic()
        with TaskFactory(repo, tmp, cfg) as factory:
            baseline_s = time.monotonic() - t0
            records, report = factory.build()
            wall_s = time.monotonic() - t0
            limit = factory.time_limit
    return {
        "candidates": report.candidates,
        "valid": report.valid,
        "wall_s": round(wall_s, 2),
        "baseline_s": round(baseline_s, 2),
        "tasks_per_minute": round(report.valid / (wall_s / 60), 2),
        "time_limit_s": limit,
        "test_run_s": report.seconds_tests,
        "test_share": round(report.seconds_tests / (workers * wall_s), 3),
        "mean_candidate_s": report.seconds_per_task,
        "median_fail_to_pass": report.median_fail_to_pass,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="tasks validated at once")
    parser.add_argument(
        "--include",
        nargs="*",
        default=["textkit.case*", "textkit.containers*"],
        help="glob patterns of textkit features",
    )
    parser.add_argument("--real", type=Path, default=SDISTS / "inflection-0.5.1")
    args = parser.parse_args()
    if not args.real.is_dir():
        raise SystemExit(
            f"{args.real} is not an unpacked sdist: pip download --no-deps --no-binary :all: "
            f"inflection==0.5.1, tar xzf it, and pass --real DIR (or set ETUDE_SDIST_DIR)"
        )
    repos = {
        "textkit": (TEXTKIT, tuple(args.include)),
        args.real.name.split("-")[0]: (args.real, ()),
    }
    result: dict[str, Any] = {
        "workers": args.workers,
        "textkit_include": args.include,
        "real_package": args.real.name,
        "machine": f"{platform.machine()} {platform.python_version()}",
    }
    print(
        f"{'repo':<12}{'limits':<10}{'valid/cand':>11}{'tasks/min':>11}{'limit s':>9}{'wall s':>9}"
    )
    for name, (repo, include) in repos.items():
        for mode in ("fixed", "baseline"):
            row = build_once(repo, mode, args.workers, include)
            for key, value in row.items():
                result[f"{name}_{mode}_{key}"] = value
            print(
                f"{name:<12}{mode:<10}{row['valid']:>5}/{row['candidates']:<5}"
                f"{row['tasks_per_minute']:>11}{row['time_limit_s']:>9}{row['wall_s']:>9}"
            )
        fixed = result[f"{name}_fixed_tasks_per_minute"]
        derived = result[f"{name}_baseline_tasks_per_minute"]
        result[f"{name}_speedup"] = round(derived / fixed, 3) if fixed else 0.0
        print(f"{name:<12}speedup of derived limits: {result[f'{name}_speedup']}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
