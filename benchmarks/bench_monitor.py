"""Monitor benchmarks: provenance overhead per sandboxed command, and monitor throughput.

Provenance overhead: the same command in the same bubblewrap sandbox over a copy of a task
workspace, with ``sandbox.provenance`` off and on, interleaved (off, on, off, on...) so that
load from other jobs hits both alike; the figure is the ratio of the medians per command. The
traced time includes parsing the command's log into its record. The tracer starts once per
sandbox (episode), with the first command: ``tracer_start_ms`` is that first command's extra
time over a warm one, measured on fresh sandboxes, and is not in the per-command ratios.
Throughput: ``scan`` over the provenance corpus (real sandboxed episodes) with every rule, with
the text rules alone and with the provenance rules alone, in trajectories per second.

    .venv/bin/python benchmarks/bench_monitor.py [--repeats 15]

Prints a table and writes flat keys to ``benchmarks/results/bench_monitor.json``;
``provenance_overhead`` is the geometric mean of the per-command ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from etude.env.trajectory import read_jsonl
from etude.monitor.rules import BUILTIN_RULES, TEXT_RULES, scan
from etude.sandbox import SandboxConfig
from etude.sandbox.bwrap import BwrapSandbox
from etude.tasks.record import write_atomic

ROOT = Path(__file__).resolve().parents[1]
WORKSPACE = ROOT / "examples" / "tasks" / "handwritten" / "workspaces" / "textkit__roman"
CORPUS = ROOT / "tests" / "assets" / "monitor_provenance"
OUT = ROOT / "benchmarks" / "results" / "bench_monitor.json"
COMMANDS = {
    "true": "true",
    "cat": "cat tests/test_roman.py > /dev/null",
    "grep_r": "grep -rn 'def ' textkit tests > /dev/null",
    "find_ls": "find . -name '*.py' | sort > /dev/null && ls -la textkit > /dev/null",
    "python_import": "python3 -c 'import json, textkit.case'",
    "pytest_file": "python3 -m pytest -q -p no:cacheprovider tests/test_case.py > /dev/null",
    "git_commit": "rm -rf .git && git init -q && git add -A && git -c user.name=a -c user.email=a@b "
    "commit -qm x && git log --oneline > /dev/null",
}


def time_command(sandbox: BwrapSandbox, cmd: str, ws: Path) -> float:
    start = time.perf_counter()
    result = sandbox.run(cmd, ws, timeout=120)
    elapsed = time.perf_counter() - start
    assert result.exit_code == 0, (cmd, result.stderr[-400:])
    return elapsed


def bench_overhead(repeats: int) -> dict[str, float]:
    plain = BwrapSandbox(SandboxConfig(backend="bwrap"))
    traced = BwrapSandbox(SandboxConfig(backend="bwrap", provenance=True))
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="etude-bench-monitor-") as tmp:
        ws = Path(tmp) / "ws"
        shutil.copytree(WORKSPACE, ws)
        for name, cmd in COMMANDS.items():
            time_command(plain, cmd, ws)  # warm the page cache and the private /etc
            time_command(traced, cmd, ws)
            off, on = [], []
            for _ in range(repeats):
                off.append(time_command(plain, cmd, ws))
                on.append(time_command(traced, cmd, ws))
            out[f"untraced_ms_{name}"] = 1000 * statistics.median(off)
            out[f"traced_ms_{name}"] = 1000 * statistics.median(on)
            out[f"overhead_{name}"] = statistics.median(on) / statistics.median(off)
            events = traced.run(cmd, ws, timeout=120).provenance
            out[f"events_{name}"] = float(events.num_events if events else 0)
        starts = []
        for _ in range(3):
            fresh = BwrapSandbox(SandboxConfig(backend="bwrap", provenance=True))
            first = time_command(fresh, "true", ws)
            warm = statistics.median(time_command(fresh, "true", ws) for _ in range(5))
            starts.append(first - warm)
            fresh.close()
        out["tracer_start_ms"] = 1000 * statistics.median(starts)
    traced.close()
    ratios = [v for k, v in out.items() if k.startswith("overhead_")]
    out["provenance_overhead"] = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    out["provenance_overhead_max"] = max(ratios)
    return out


def bench_throughput(rounds: int) -> dict[str, float]:
    trajectories = read_jsonl(CORPUS / "hacks.jsonl") + read_jsonl(CORPUS / "clean.jsonl")
    prov_rules = tuple(r for r in BUILTIN_RULES if r.is_provenance)
    out: dict[str, float] = {"corpus_trajectories": float(len(trajectories))}
    for name, rules in (("all", BUILTIN_RULES), ("text", TEXT_RULES), ("provenance", prov_rules)):
        start = time.perf_counter()
        for _ in range(rounds):
            for traj in trajectories:
                scan(traj, rules)
        out[f"monitor_traj_per_s_{name}"] = (
            rounds * len(trajectories) / (time.perf_counter() - start)
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per command and mode")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the corpus")
    args = parser.parse_args()
    results = {**bench_overhead(args.repeats), **bench_throughput(args.rounds)}
    results["repeats"] = float(args.repeats)
    print(f"{'command':14s} {'untraced ms':>12s} {'traced ms':>10s} {'ratio':>6s} {'events':>7s}")
    for name in COMMANDS:
        print(
            f"{name:14s} {results[f'untraced_ms_{name}']:12.1f} {results[f'traced_ms_{name}']:10.1f}"
            f" {results[f'overhead_{name}']:6.2f} {results[f'events_{name}']:7.0f}"
        )
    print(
        f"provenance_overhead (geometric mean) {results['provenance_overhead']:.2f}x, "
        f"max {results['provenance_overhead_max']:.2f}x; "
        f"tracer start (once per episode) {results['tracer_start_ms']:.0f} ms"
    )
    for name in ("all", "text", "provenance"):
        print(
            f"monitor throughput ({name} rules): {results[f'monitor_traj_per_s_{name}']:.0f} trajectories/s"
        )
    payload = {"host": platform.node(), "python": platform.python_version(), **results}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(OUT, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
