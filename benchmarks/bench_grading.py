"""Grading time against a plain pytest run of the same test ids, per task, in the same run.

For each task (the three hand-written textkit tasks and the ``calc`` task in its flat, ``src/``
and ``-o addopts=`` layouts, each with its gold solution applied) one repeat runs, interleaved so
that load on a shared machine hits both alike:

- ``pytest``: ``python -m pytest -p no:cacheprovider -q IDS`` in the solved tree, a plain
  subprocess with the record's test environment and pytest arguments (no sandbox, no copy);
- ``grade``: ``etude.sandbox.grader`` as the reward calls it: a pristine copy with the solved
  tree's package changes, a fresh bubblewrap sandbox, the isolated interpreter with its reporter,
  the cross-checks.

    .venv/bin/python benchmarks/bench_grading.py [--repeats 5]

Prints a table and writes flat keys to ``benchmarks/results/bench_grading.json``:
``grading_over_pytest`` is the ratio of the summed medians (all tasks), ``<task>/ratio`` per task.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from etude.env.reward import task_grading
from etude.sandbox import SandboxConfig, grade
from etude.tasks.record import TaskRecord, load_tasks, resolve_workspace

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bench_grading.json"
HANDWRITTEN = ROOT / "examples" / "tasks" / "handwritten"
sys.path.insert(0, str(ROOT / "tests" / "assets"))
import grading_corpus as corpus  # noqa: E402


def prepare(scratch: Path) -> list[tuple[str, TaskRecord, Path, Path]]:
    """``(name, record, pristine tree, solved tree)`` of every benchmarked task."""
    out = []
    for task in load_tasks(HANDWRITTEN / "tasks.jsonl"):
        pristine = resolve_workspace(task, HANDWRITTEN)
        solved = scratch / task.instance_id
        shutil.copytree(pristine, solved)
        subprocess.run(
            ["patch", "-p1", "--quiet"], input=task.patch, text=True, cwd=solved, check=True
        )
        out.append((task.instance_id, task, pristine, solved))
    for layout in corpus.LAYOUTS:
        pristine, record = corpus.make_task(scratch / f"calc-{layout}", layout)
        solved = scratch / f"calc-{layout}-solved"
        shutil.copytree(pristine, solved)
        corpus.solve(solved, layout)
        out.append((f"calc-{layout}", TaskRecord.from_dict(record), pristine, solved))
    return out


def plain_pytest(solved: Path, ids: list[str], env: dict[str, str], args: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args, *ids],
        cwd=solved,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **env},
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-2000:]
    return seconds


def graded(task: TaskRecord, pristine: Path, solved: Path, scratch: Path) -> float:
    spec = task_grading(task, pristine)
    start = time.perf_counter()
    outcome = grade(
        pristine,
        solved,
        spec.allowed,
        spec.test_ids,
        spec.test_env,
        spec.pytest_args,
        sandbox=SandboxConfig(backend="bwrap"),
        timeout=300,
        work_dir=scratch,
    )
    seconds = time.perf_counter() - start
    assert outcome.status == "passed", outcome.reason
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="etude-bench-grading-") as tmp:
        scratch = Path(tmp)
        tasks = prepare(scratch / "trees")
        (scratch / "work").mkdir()
        times: dict[str, dict[str, list[float]]] = {
            n: {"pytest": [], "grade": []} for n, *_ in tasks
        }
        for _ in range(args.repeats):
            for name, task, pristine, solved in tasks:
                spec = task_grading(task, pristine)
                times[name]["pytest"].append(
                    plain_pytest(solved, spec.test_ids, spec.test_env, spec.pytest_args)
                )
                times[name]["grade"].append(graded(task, pristine, solved, scratch / "work"))
    results: dict[str, float] = {"repeats": float(args.repeats), "num_tasks": float(len(tasks))}
    print(f"{'task':34s} {'ids':>5s} {'pytest s':>9s} {'grade s':>9s} {'ratio':>6s}")
    total_plain = total_grade = 0.0
    for name, task, *_ in tasks:
        plain = statistics.median(times[name]["pytest"])
        grade_s = statistics.median(times[name]["grade"])
        total_plain += plain
        total_grade += grade_s
        num_ids = len(task.FAIL_TO_PASS) + len(task.PASS_TO_PASS)
        print(f"{name:34s} {num_ids:5d} {plain:9.3f} {grade_s:9.3f} {grade_s / plain:6.2f}")
        results[f"{name}/pytest_s"] = round(plain, 4)
        results[f"{name}/grade_s"] = round(grade_s, 4)
        results[f"{name}/ratio"] = round(grade_s / plain, 3)
    results["grading_over_pytest"] = round(total_grade / total_plain, 3)
    print(f"grading_over_pytest (summed medians): {results['grading_over_pytest']:.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = RESULTS.with_suffix(".json.tmp")
    tmp_path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    tmp_path.replace(RESULTS)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
