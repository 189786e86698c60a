"""Asynchronous RL with bounded staleness on a long-tail workload, from a warm start that earns
reward: steps per hour, the trainer's idle fraction and the reward at ``rollout.max_staleness``
0, 1 and 2, over 3 seeds.

Run: ``.venv/bin/python benchmarks/bench_async.py --warm-start DIR`` (writes
benchmarks/results/bench_async.json; ``--runs-dir RUNS`` keeps the runs, and a second invocation
with the same ``RUNS`` reads the finished ones instead of running them again). ``DIR`` is a demo run directory holding ``tasks/`` (the
demo's feature-deletion tasks) and ``sft/`` (the demo's SFT warm start), as ``etude demo``
leaves them. Without ``--warm-start`` the bench uses ``runs/bench-async-warm`` and, if it holds
no warm start yet, builds one there with the demo's own stages 1 and 2 (``configs/demo.toml``:
tasks from ``examples/repos/textkit``, then 300 SFT steps of the tiny MoE model; about 20 min
on a loaded 2-core machine), so a clean clone reproduces the figure; later runs reuse it.

Workload (the long tail is real): a copy of the warm start's tasks in which every third task
(by instance id) has a ``tests/conftest.py`` that sleeps ``--sleep`` seconds at the start of
every pytest session: the reward run and each ``run_tests`` call of the agent wait, as for a
repository whose suite takes long. The RL settings are the demo's ``[rl]`` section (10 turns,
400 new tokens per turn at temperature 0.7, the hinted teacher on unknown-tool calls, the
monitor, Muon), started from the warm start, except: ``--tasks-per-step`` tasks x
``--group-size`` episodes per step (2 x 2), uniform task draws (no curriculum, no spawned
variants: the same tasks at every staleness for a seed), ``--steps`` steps (4), one checkpoint at
the end, and ``rollout.num_workers`` (environment threads) = the episodes in flight at the
largest staleness (12), so that no episode of an early batch waits for a thread held by a
sleeping test session of another (the synchronous loop has a thread per episode too). The
steps of each seed that draw a slow task are printed (``SfSS``: steps 1, 3 and 4).

Measured per run, from RUN/metrics.jsonl: the loop's time (sum of ``step_seconds``, from the
first wait for a batch to the last step's log), steps per hour, the trainer's idle fraction
(``async/wait_seconds`` over the loop time), the largest staleness, the final reward and the
mean reward of the run's steps. The runs of one seed are back to back, so each ratio to
staleness 0 is taken per seed (the same load); ``steps_per_hour_staleness1_over_0`` is the
**minimum over seeds** (``..._mean`` beside it). ``schedule_bound`` is the speedup the admission
rule would give with the staleness-0 run's batch and training times and no contention for the
CPU (each batch as fast as when it ran alone): measured / bound is what contention cost.
``cpu_share`` is the CPU seconds this process and its finished children got per wall second of a
run: on a shared machine a run given less CPU is slower for that reason alone, so read a ratio
beside the two runs' shares.
The goal is >= 1.3x at staleness 1 in every seed, with the reward within noise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from etude.config import apply_overrides, from_dict, load_toml
from etude.report.metrics import read_metrics
from etude.rl.trainer import TrainRecipe, run_train
from etude.tasks.record import load_tasks

ROOT = Path(__file__).parents[1]
RESULTS = Path(__file__).parent / "results" / "bench_async.json"
DEMO = ROOT / "configs" / "demo.toml"
DEFAULT_WARM = ROOT / "runs" / "bench-async-warm"


def build_warm_start(run: Path) -> None:
    """The demo's stages 1 (tasks) and 2 (SFT) into ``run`` (resumable, like the demo)."""
    from etude.demo import load_demo_recipe, run_tasks_stage, stage_recipes
    from etude.rl.sft import run_sft

    repo = ROOT / "examples" / "repos" / "textkit"
    recipe = load_demo_recipe(DEMO, [f"demo.run_dir='{run}'", f"demo.repo='{repo}'"])
    if not (run / "tasks" / "tasks.jsonl").is_file():
        print(f"building the demo's tasks in {run / 'tasks'}", file=sys.stderr)
        run_tasks_stage(recipe, run)
    if not (run / "sft" / "export").is_dir():
        print(f"training the demo's SFT warm start in {run / 'sft'}", file=sys.stderr)
        run_sft(stage_recipes(recipe)[0])


def slow_task_ids(tasks_file: Path) -> list[str]:
    """Every third task by instance id: the ones whose test sessions sleep."""
    return sorted(t.instance_id for t in load_tasks(tasks_file))[::3]


def long_tail_tasks(warm: Path, root: Path, sleep_s: float) -> tuple[Path, list[str]]:
    """A copy of the warm start's tasks whose slow tasks sleep at every test session."""
    shutil.copytree(warm / "tasks", root / "tasks")
    tasks_file = root / "tasks" / "tasks.jsonl"
    slow = slow_task_ids(tasks_file)
    by_id = {t.instance_id: t for t in load_tasks(tasks_file)}
    for task_id in slow:
        tests = root / "tasks" / by_id[task_id].workspace / "tests"
        (tests / "conftest.py").write_text(
            "import time\n\n\ndef pytest_sessionstart(session):\n"
            f"    time.sleep({sleep_s})  # a long test suite\n"
        )
    return tasks_file, slow


def draw_pattern(tasks: Path, slow: list[str], seed: int, args: argparse.Namespace) -> str:
    """Which steps of ``seed`` draw a slow task: ``S`` (slow) or ``f`` per step."""
    from etude.rl.task_draw import sample_tasks

    records = load_tasks(tasks)
    return "".join(
        "S" if any(t.instance_id in slow for t in drawn) else "f"
        for drawn in (
            sample_tasks(records, args.tasks_per_step, seed=seed, step=step)
            for step in range(args.steps)
        )
    )


def recipe(
    run_dir: Path, tasks: Path, warm: Path, *, staleness: int, seed: int, args: argparse.Namespace
) -> TrainRecipe:
    data = load_toml(DEMO)["rl"]
    data = apply_overrides(
        data,
        [
            f"tasks.path='{tasks}'",
            "tasks.curriculum=false",
            "tasks.repo=''",
            f"rollout.tasks_per_step={args.tasks_per_step}",
            f"rollout.group_size={args.group_size}",
            f"rollout.max_staleness={staleness}",
            f"rollout.num_workers={args.env_threads}",
            f"train.init='{warm / 'sft'}'",
            f"train.seed={seed}",
            f"train.steps={args.steps}",
            f"train.checkpoint_every={args.steps}",
            "train.save_trajectories=false",
            "train.progress=false",
            f"train.run_dir='{run_dir}'",
        ],
    )
    return from_dict(TrainRecipe, data, "recipe")


def measure(run_dir: Path) -> dict[str, float]:
    rows = read_metrics(run_dir)
    loop = sum(r["step_seconds"] for r in rows)
    wait = sum(r.get("async/wait_seconds", 0.0) for r in rows)
    return {
        "loop_seconds": loop,
        "steps_per_hour": len(rows) / loop * 3600,
        "idle_fraction": wait / loop,
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in rows),
        "final_reward": rows[-1]["reward"],
        "mean_reward": statistics.fmean(r["reward"] for r in rows),
        "batch_seconds": [r["async/batch_seconds"] for r in rows],
        "train_seconds": [r["step_seconds"] - r["async/wait_seconds"] for r in rows],
        "generate_seconds": [r["async/generate_seconds"] for r in rows],
        "env_seconds": [r["async/env_seconds"] for r in rows],
    }


def scheduled_seconds(batch: list[float], train: list[float], staleness: int) -> float:
    """The loop's time under the admission rule (``etude.rl.pipeline``) if every batch took as
    long as it did alone and nothing competed for the CPU: step s's batch is submitted when the
    trainer asks for step ``s - staleness``; the trainer waits for batch s, then trains."""
    n = len(batch)
    submitted = [0.0] * n
    now, nxt = 0.0, 0
    for s in range(n):
        while nxt <= min(s + staleness, n - 1):
            submitted[nxt] = now
            nxt += 1
        now = max(now, submitted[s] + batch[s]) + train[s]
    return now


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (test runs, tools)."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def load_line() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warm-start", type=Path, default=DEFAULT_WARM)
    parser.add_argument(
        "--runs-dir",
        type=Path,
        default=None,
        help="keep the runs here (default: a temporary directory); runs finished there before "
        "are read, not run again, so a stopped benchmark continues",
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=20.0)
    parser.add_argument("--tasks-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--stalenesses", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--env-threads", type=int, default=0, help="rollout.num_workers (0: episodes in flight)"
    )
    args = parser.parse_args()
    if not args.env_threads:
        args.env_threads = args.tasks_per_step * args.group_size * (max(args.stalenesses) + 1)
    if args.stalenesses[0] != 0:
        raise ValueError("--stalenesses must start with 0 (the baseline of every ratio)")
    warm = args.warm_start.resolve()
    if warm == DEFAULT_WARM.resolve():
        build_warm_start(warm)
    elif not ((warm / "tasks" / "tasks.jsonl").is_file() and (warm / "sft").is_dir()):
        raise ValueError(
            f"--warm-start {warm} holds no tasks/tasks.jsonl and sft/: pass a demo run directory "
            "(etude demo's RUN), or leave the flag out to build one"
        )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    stalenesses = args.stalenesses
    runs: dict[int, list[dict]] = {k: [] for k in stalenesses}
    with contextlib.ExitStack() as stack:
        if args.runs_dir is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="etude-bench-")))
        else:
            root = args.runs_dir.resolve()
            root.mkdir(parents=True, exist_ok=True)
        if (root / "tasks" / "tasks.jsonl").is_file():  # a kept run directory: its workload
            tasks, slow = (
                root / "tasks" / "tasks.jsonl",
                slow_task_ids(root / "tasks" / "tasks.jsonl"),
            )
        else:
            tasks, slow = long_tail_tasks(warm, root, args.sleep)
        print(f"slow tasks ({args.sleep:g} s per test session): {slow}", file=sys.stderr)
        patterns = [draw_pattern(tasks, slow, seed, args) for seed in range(args.seeds)]
        print(f"steps with a slow task (S) per seed: {patterns}", file=sys.stderr)
        for seed in range(args.seeds):
            for k in stalenesses:
                run_dir = root / f"run-s{seed}-k{k}"
                kept = run_dir / "bench_row.json"
                if kept.is_file():  # finished by an earlier invocation with --runs-dir
                    row = json.loads(kept.read_text())
                else:
                    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished run starts over
                    cpu0, wall0 = cpu_seconds(), time.perf_counter()
                    run_train(recipe(run_dir, tasks, warm, staleness=k, seed=seed, args=args))
                    row = measure(run_dir)
                    # this process's CPU per wall second of the run: how much of a core it got
                    row["cpu_share"] = (cpu_seconds() - cpu0) / (time.perf_counter() - wall0)
                    row["load_after"] = load_line()
                    kept.write_text(json.dumps(row))
                runs[k].append(row)
                print(
                    f"seed {seed} staleness {k}: {row['steps_per_hour']:6.1f} steps/h, CPU share "
                    f"{row.get('cpu_share', float('nan')):.2f}, idle "
                    f"{row['idle_fraction']:.2f}, max staleness {row['staleness_max']:.0f}, "
                    f"reward final {row['final_reward']:.3f} mean {row['mean_reward']:.3f}; "
                    f"batch s {[round(b) for b in row['batch_seconds']]}, "
                    f"train s {[round(t) for t in row['train_seconds']]}, "
                    f"generate s {[round(t) for t in row['generate_seconds']]}, "
                    f"env s {[round(t) for t in row['env_seconds']]}",
                    file=sys.stderr,
                )
    results: dict[str, float | str] = {
        "steps": args.steps,
        "seeds": args.seeds,
        "sleep_seconds": args.sleep,
        "episodes_per_step": args.tasks_per_step * args.group_size,
        "slow_tasks": len(slow),
        "tasks": len(load_tasks(args.warm_start / "tasks" / "tasks.jsonl")),
        "warm_start": str(args.warm_start),
        "loads_per_run": " | ".join(
            f"s{seed}k{k}: {r.get('load_after', '?')}"
            for k in stalenesses
            for seed, r in enumerate(runs[k])
        ),
        "slow_steps_per_seed": " ".join(patterns),
        "env_threads": args.env_threads,
    }
    print(
        f"{'staleness':>9} {'steps/h':>8} {'x min':>6} {'x mean':>6} {'bound':>6} {'idle':>5} "
        f"{'stale':>5} {'final r':>7} {'mean r':>6}"
    )
    base = runs[0]
    for k in stalenesses:
        rows = runs[k]
        ratios = [r["steps_per_hour"] / r0["steps_per_hour"] for r, r0 in zip(rows, base)]
        bounds = [
            r0["loop_seconds"]
            / scheduled_seconds(r0["batch_seconds"], r0["train_seconds"], staleness=k)
            for r0 in base
        ]
        entry: dict[str, float] = {
            "steps_per_hour": statistics.fmean(r["steps_per_hour"] for r in rows),
            "idle_fraction": statistics.fmean(r["idle_fraction"] for r in rows),
            "staleness_max": max(r["staleness_max"] for r in rows),
            "final_reward_mean": statistics.fmean(r["final_reward"] for r in rows),
            "final_reward_std": statistics.pstdev([r["final_reward"] for r in rows]),
            "run_reward_mean": statistics.fmean(r["mean_reward"] for r in rows),
            "run_reward_std": statistics.pstdev([r["mean_reward"] for r in rows]),
            "speedup_min": min(ratios),
            "speedup_mean": statistics.fmean(ratios),
            "schedule_bound_min": min(bounds),
            "schedule_bound_mean": statistics.fmean(bounds),
        }
        for seed, (ratio, bound, r) in enumerate(zip(ratios, bounds, rows)):
            entry[f"speedup_seed{seed}"] = ratio
            entry[f"schedule_bound_seed{seed}"] = bound
            entry[f"idle_fraction_seed{seed}"] = r["idle_fraction"]
            if "cpu_share" in r:
                entry[f"cpu_share_seed{seed}"] = r["cpu_share"]
        for key, value in entry.items():
            results[f"staleness{k}_{key}"] = round(value, 4)
        print(
            f"{k:9d} {entry['steps_per_hour']:8.1f} {entry['speedup_min']:6.2f} "
            f"{entry['speedup_mean']:6.2f} {entry['schedule_bound_mean']:6.2f} "
            f"{entry['idle_fraction']:5.2f} {entry['staleness_max']:5.0f} "
            f"{entry['final_reward_mean']:7.3f} {entry['run_reward_mean']:6.3f}"
        )
        if k:
            results[f"steps_per_hour_staleness{k}_over_0"] = round(min(ratios), 4)
            results[f"steps_per_hour_staleness{k}_over_0_min"] = round(min(ratios), 4)
            results[f"steps_per_hour_staleness{k}_over_0_mean"] = round(statistics.fmean(ratios), 4)
    print(f"load at the end of each run: {results['loads_per_run']}", file=sys.stderr)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
