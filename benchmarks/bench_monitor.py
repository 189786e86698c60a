"""Monitor benchmarks: provenance overhead per sandboxed command, and monitor throughput.

Provenance overhead: the same command in the same bubblewrap sandbox over a copy of a task
workspace, with ``sandbox.provenance`` off and on with each mechanism (``strace``, ``fanotify``):
per command and mechanism a pass of ``--repeats`` pairs (untraced, traced), interleaved so that
load from other jobs hits both alike; the figure is the median over the pairs of traced time
over untraced time, over the pairs the hypervisor took no CPU time from (steal in
``/proc/stat``: other guests' load, which interleaving does not cancel; a pair with steal is run
again, up to three times the repeats, and when fewer than half the repeats come out without
steal every pair tried is used, ``pairs_*`` saying how many; the figure over every pair tried
is written too, as ``overhead_all_pairs_*``). Each mechanism has its own pass: the work a run leaves behind (strace's
tracer, the unmount of a sandbox's ``/tmp``) slows the run after it, which in one interleaved
pass of all three was the other mechanism's. The recorded time includes turning the events
into the command's record. The strace tracer starts once per sandbox (episode), with the first
command: ``tracer_start_ms`` is that first command's extra time over a warm one, measured on
fresh sandboxes, and is not in the per-command ratios (fanotify starts nothing per episode).
Throughput: ``scan`` over the provenance corpus (real sandboxed episodes) with every rule, with
the text rules alone and with the provenance rules alone, in trajectories per second.

    .venv/bin/python benchmarks/bench_monitor.py [--repeats 21]

Prints a table and writes flat keys to ``benchmarks/results/bench_monitor.json``;
``provenance_overhead_strace`` and ``provenance_overhead_fanotify`` are the geometric means of
the per-command ratios, and ``provenance_overhead`` is the default mechanism's
(``provenance_mechanism``). fanotify needs root; without it only strace is measured.
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
from etude.sandbox.fanotify import fanotify_unavailable_reason
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


def steal_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of the machine so far (``/proc/stat``). Steal is time the
    hypervisor gave to other guests while this one wanted to run: noise that interleaving does
    not cancel (a held program start waits on a descheduled reader; the untraced run has no
    such wait), so pairs it touched are measured again."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    return fields[7], sum(fields)


def timed_pairs(
    plain: BwrapSandbox, sandbox: BwrapSandbox, cmd: str, ws: Path, repeats: int
) -> tuple[list[tuple[float, float]], list[tuple[float, float]], float]:
    """``repeats`` (untraced, traced) pairs without steal, at most ``3 * repeats`` tries;
    every pair tried; and the pass's steal share in percent."""
    clean: list[tuple[float, float]] = []
    tried: list[tuple[float, float]] = []
    first = steal_jiffies()
    while len(clean) < repeats and len(tried) < 3 * repeats:
        before = steal_jiffies()
        pair = (time_command(plain, cmd, ws), time_command(sandbox, cmd, ws))
        tried.append(pair)
        if steal_jiffies()[0] == before[0]:
            clean.append(pair)
    last = steal_jiffies()
    return clean, tried, 100.0 * (last[0] - first[0]) / max(1, last[1] - first[1])


def bench_overhead(repeats: int) -> dict[str, float | str]:
    mechanisms = ["strace"] + (["fanotify"] if fanotify_unavailable_reason() is None else [])
    plain = BwrapSandbox(SandboxConfig(backend="bwrap"))
    recorded = {
        m: BwrapSandbox(SandboxConfig(backend="bwrap", provenance=True, provenance_mechanism=m))
        for m in mechanisms
    }
    out: dict[str, float | str] = {}
    with tempfile.TemporaryDirectory(prefix="etude-bench-monitor-") as tmp:
        ws = Path(tmp) / "ws"
        shutil.copytree(WORKSPACE, ws)
        for name, cmd in COMMANDS.items():
            time_command(plain, cmd, ws)  # warm the page cache and the private /etc
            for m, sandbox in recorded.items():
                time_command(sandbox, cmd, ws)
                # one pass per mechanism, its runs interleaved with untraced ones (untraced,
                # traced, untraced...): the work one mechanism leaves behind (strace's tracer,
                # a sandbox's unmount) lands on its own pass, not on another mechanism's
                clean, tried, steal = timed_pairs(plain, sandbox, cmd, ws, repeats)
                pairs = clean if len(clean) >= repeats // 2 else tried
                out[f"steal_pct_{m}_{name}"] = steal
                out[f"pairs_{m}_{name}"] = float(len(pairs))
                out[f"pairs_without_steal_{m}_{name}"] = float(len(clean))
                base = statistics.median(p for p, _ in pairs)
                out[f"untraced_{m}_pass_ms_{name}"] = 1000 * base
                out[f"{m}_ms_{name}"] = 1000 * statistics.median(t for _, t in pairs)
                # the median of each traced run over the untraced run just before it: a slow
                # stretch of the machine hits both runs of a pair
                out[f"overhead_{m}_{name}"] = statistics.median(t / p for p, t in pairs)
                # the same over every pair tried, steal or not
                out[f"overhead_all_pairs_{m}_{name}"] = statistics.median(t / p for p, t in tried)
                prov = sandbox.run(cmd, ws, timeout=120).provenance
                out[f"events_{m}_{name}"] = float(prov.num_events if prov else 0)
            out[f"untraced_ms_{name}"] = min(
                float(out[f"untraced_{m}_pass_ms_{name}"]) for m in mechanisms
            )
        starts = []
        for _ in range(3):
            fresh = BwrapSandbox(SandboxConfig(backend="bwrap", provenance=True))
            first = time_command(fresh, "true", ws)
            warm = statistics.median(time_command(fresh, "true", ws) for _ in range(5))
            starts.append(first - warm)
            fresh.close()
        out["tracer_start_ms"] = 1000 * statistics.median(starts)
    for sandbox in recorded.values():
        sandbox.close()
    for m in mechanisms:
        ratios = [float(out[f"overhead_{m}_{name}"]) for name in COMMANDS]
        out[f"provenance_overhead_{m}"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        out[f"provenance_overhead_{m}_max"] = max(ratios)
        every = [float(out[f"overhead_all_pairs_{m}_{name}"]) for name in COMMANDS]
        out[f"provenance_overhead_all_pairs_{m}"] = math.exp(sum(map(math.log, every)) / len(every))
        out[f"provenance_overhead_all_pairs_{m}_max"] = max(every)
    default = SandboxConfig(provenance=True).resolved_provenance_mechanism()
    out["provenance_mechanism"] = default
    out["provenance_overhead"] = out[f"provenance_overhead_{default}"]
    out["provenance_overhead_max"] = out[f"provenance_overhead_{default}_max"]
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
    parser.add_argument("--repeats", type=int, default=21, help="timed runs per command and mode")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the corpus")
    args = parser.parse_args()
    results = {**bench_overhead(args.repeats), **bench_throughput(args.rounds)}
    results["repeats"] = float(args.repeats)
    mechanisms = [m for m in ("strace", "fanotify") if f"provenance_overhead_{m}" in results]
    head = "".join(f" {m + ' ms':>12s} {'ratio':>6s} {'events':>7s}" for m in mechanisms)
    print(f"{'command':14s} {'untraced ms':>12s}{head} {'steal%':>6s} {'all pairs':>9s}")
    for name in COMMANDS:
        row = "".join(
            f" {results[f'{m}_ms_{name}']:12.1f} {results[f'overhead_{m}_{name}']:6.2f}"
            f" {results[f'events_{m}_{name}']:7.0f}"
            for m in mechanisms
        )
        steal = max(results[f"steal_pct_{m}_{name}"] for m in mechanisms)
        every = results.get(f"overhead_all_pairs_fanotify_{name}", float("nan"))
        print(f"{name:14s} {results[f'untraced_ms_{name}']:12.1f}{row} {steal:6.1f} {every:9.2f}")
    for m in mechanisms:
        print(
            f"provenance overhead, {m} (geometric mean) {results[f'provenance_overhead_{m}']:.2f}x,"
            f" max {results[f'provenance_overhead_{m}_max']:.2f}x; over every pair tried, steal"
            f" or not: {results[f'provenance_overhead_all_pairs_{m}']:.2f}x,"
            f" max {results[f'provenance_overhead_all_pairs_{m}_max']:.2f}x"
        )
    print(
        f"default mechanism {results['provenance_mechanism']}: provenance_overhead "
        f"{results['provenance_overhead']:.2f}x; strace tracer start (once per episode) "
        f"{results['tracer_start_ms']:.0f} ms"
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
