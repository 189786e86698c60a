"""Task factory throughput on the example repository, and where the time goes.

Run: ``.venv/bin/python benchmarks/bench_tasks.py [--workers N] [--include PATTERN ...]``
(writes benchmarks/results/bench_tasks.json).

Builds every task of ``examples/repos/textkit`` (or the features matching ``--include``) into a
temporary directory and prints: validated tasks per minute of wall-clock time (baseline
included), the share of worker time spent inside sandboxed test runs (pytest and the import
probe: the sum of their durations over ``workers`` x wall-clock seconds), the baseline's cost,
and the mean cost of one candidate. With ``--workers 1`` the share is the plain fraction of the
build spent waiting for tests; the rest is export, LibCST, git, the leak scan and bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from etude.tasks.build import TaskBuildConfig, TaskFactory
from etude.tasks.mine import ProposalConfig

ROOT = Path(__file__).resolve().parents[1]
TEXTKIT = ROOT / "examples" / "repos" / "textkit"
RESULTS = Path(__file__).parent / "results" / "bench_tasks.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="tasks validated at once")
    parser.add_argument("--include", nargs="*", default=[], help="glob patterns of features")
    args = parser.parse_args()
    cfg = TaskBuildConfig(
        workers=args.workers, proposals=ProposalConfig(include=tuple(args.include))
    )
    with tempfile.TemporaryDirectory(prefix="etude-bench-tasks-") as tmp:
        t0 = time.monotonic()
        with TaskFactory(TEXTKIT, tmp, cfg) as factory:
            baseline_s = time.monotonic() - t0
            features = factory.candidates()
            outcomes = factory.run_features(features)
            wall_s = time.monotonic() - t0
            baseline_runs_s = factory.baseline.run_seconds
    valid = sum(o.record is not None for o in outcomes)
    test_s = baseline_runs_s + sum(o.test_seconds for o in outcomes)
    runs = cfg.baseline_runs + 1 + sum(o.test_runs for o in outcomes)  # +1: the import probe
    result = {
        "repo": "examples/repos/textkit",
        "workers": args.workers,
        "include": args.include,
        "candidates": len(outcomes),
        "valid": valid,
        "wall_s": round(wall_s, 2),
        "baseline_s": round(baseline_s, 2),
        "tasks_per_minute": round(valid / (wall_s / 60), 2),
        "test_run_s": round(test_s, 2),
        "test_runs": runs,
        "test_share": round(test_s / (args.workers * wall_s), 3),
        "mean_candidate_s": round(sum(o.seconds for o in outcomes) / max(1, len(outcomes)), 2),
        "mean_test_run_s": round(test_s / max(1, runs), 3),
        "machine": f"{platform.machine()} {platform.python_version()}",
    }
    print(f"{'metric':<22}value")
    for key in (
        "candidates",
        "valid",
        "wall_s",
        "baseline_s",
        "tasks_per_minute",
        "test_runs",
        "test_run_s",
        "mean_test_run_s",
        "test_share",
        "mean_candidate_s",
    ):
        print(f"{key:<22}{result[key]}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
