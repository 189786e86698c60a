"""Sandbox overhead: median wall time per command, bare subprocess vs local vs bwrap backend.

Each repeat runs every variant once, interleaved, so load on a shared machine hits all variants
alike. ``bare`` is ``subprocess.run`` with captured output; ``local`` adds the runner (clean env,
rlimits, new session, output cap, group kill); ``bwrap`` adds the namespaces, mounts, ``setpriv``
and ``prlimit`` (and, as root, the uid lease and the workspace chown for a small workspace).

    .venv/bin/python benchmarks/bench_sandbox.py [--repeats 50] [--episodes 8]

Prints a table and writes flat keys to ``benchmarks/results/bench_sandbox.json``. One function per
measurement: command overhead (above), and whole oracle episodes per minute on the hand-written
tasks with 1, 2 and 4 parallel workers (``etude.env.pool.EnvPool``; each episode is a reset,
five to seven tool calls including one ``run_tests``, and the reward's test run, all under the default
backend).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from etude.env.coding import EnvConfig
from etude.env.oracle import OracleAgent
from etude.env.pool import EnvPool
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.sandbox import SandboxConfig, make_sandbox
from etude.tasks.record import load_tasks

RESULTS = Path(__file__).resolve().parent / "results" / "bench_sandbox.json"
HANDWRITTEN = Path(__file__).resolve().parents[1] / "examples" / "tasks" / "handwritten"
WORKER_COUNTS = (1, 2, 4)
COMMANDS = {"true": ["true"], "python": [sys.executable, "-c", "pass"]}


def make_workspace(root: Path, num_files: int = 50) -> Path:
    """A small workspace (a package and tests), like a task repository's."""
    ws = root / "ws"
    for i in range(num_files):
        path = ws / ("tests" if i % 2 else "pkg") / f"mod_{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"VALUE_{i} = {i}\n")
    return ws


def median_ms(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each variant, run interleaved ``repeats`` times after a warm-up."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def bench_command_overhead(ws: Path, repeats: int) -> dict[str, float]:
    """Per-command time of ``true`` and ``python -c pass``: bare, local backend, bwrap backend."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        local = make_sandbox("local", SandboxConfig())
    bwrap = make_sandbox("bwrap", SandboxConfig())
    out: dict[str, float] = {}
    for label, argv in COMMANDS.items():

        def bare(argv=argv):
            return subprocess.run(argv, cwd=ws, capture_output=True, check=True)

        times = median_ms(
            {
                "bare": bare,
                "local": lambda argv=argv: local.run(argv, ws),
                "bwrap": lambda argv=argv: bwrap.run(argv, ws),
            },
            repeats,
        )
        for variant, ms in times.items():
            out[f"{variant}_{label}_ms"] = round(ms, 3)
        out[f"bwrap_{label}_overhead_ms"] = round(times["bwrap"] - times["bare"], 3)
        out[f"bwrap_{label}_ratio"] = round(times["bwrap"] / times["bare"], 3)
    return out


def bench_oracle_episodes(num_episodes: int) -> dict[str, float]:
    """Oracle episodes per minute with 1, 2 and 4 workers (the same episodes for each count)."""
    tokenizer = Tokenizer.train(default_corpus(200_000), 512)
    tasks = load_tasks(HANDWRITTEN / "tasks.jsonl")
    batch = [tasks[i % len(tasks)] for i in range(num_episodes)]
    out: dict[str, float] = {"oracle_episodes": num_episodes}
    for workers in WORKER_COUNTS:
        with EnvPool(
            EnvConfig(), tokenizer=tokenizer, base_dir=HANDWRITTEN, max_workers=workers
        ) as pool:
            start = time.perf_counter()
            trajectories = pool.run_episodes(
                batch, lambda task: OracleAgent(task, base_dir=str(HANDWRITTEN))
            )
            seconds = time.perf_counter() - start
        assert all(t.reward == 1.0 for t in trajectories), [t.reward for t in trajectories]
        out[f"oracle_episodes_per_min_{workers}w"] = round(num_episodes / seconds * 60, 2)
    for workers in WORKER_COUNTS[1:]:
        ratio = out[f"oracle_episodes_per_min_{workers}w"] / out["oracle_episodes_per_min_1w"]
        out[f"oracle_speedup_{workers}w"] = round(ratio, 3)
    return out


def print_table(results: dict[str, float]) -> None:
    print(f"{'command':<18}{'bare ms':>10}{'local ms':>10}{'bwrap ms':>10}{'added ms':>10}")
    for label in COMMANDS:
        name = "true" if label == "true" else "python -c pass"
        row = [results[f"{v}_{label}_ms"] for v in ("bare", "local", "bwrap")]
        row.append(results[f"bwrap_{label}_overhead_ms"])
        print(f"{name:<18}" + "".join(f"{x:>10.2f}" for x in row))
    print(f"\n{'oracle workers':<18}{'episodes/min':>14}{'speedup':>10}")
    for workers in WORKER_COUNTS:
        rate = results[f"oracle_episodes_per_min_{workers}w"]
        speedup = results.get(f"oracle_speedup_{workers}w", 1.0)
        print(f"{workers:<18}{rate:>14.1f}{speedup:>10.2f}")


def write_results(results: dict[str, object], path: Path) -> None:
    """Atomically (temp file + rename) write ``results`` as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per variant")
    parser.add_argument("--episodes", type=int, default=8, help="oracle episodes per worker count")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results file")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.episodes < 1:
        parser.error("--episodes must be >= 1")
    bwrap_version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="etude-bench-sandbox-") as tmp:
        ws = make_workspace(Path(tmp))
        timings = bench_command_overhead(ws, args.repeats)
    timings.update(bench_oracle_episodes(args.episodes))
    print_table(timings)
    results: dict[str, object] = dict(
        timings,
        repeats=args.repeats,
        as_root=os.geteuid() == 0,
        bwrap_version=bwrap_version.stdout.split()[-1],
        cpu_count=os.cpu_count(),
    )
    write_results(results, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
