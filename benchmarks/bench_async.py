"""Asynchronous RL with bounded staleness on a long-tail workload: steps per hour and the
trainer's idle fraction at ``rollout.max_staleness`` 0, 1 and 2, over 3 seeds.

Run: ``.venv/bin/python benchmarks/bench_async.py`` (writes benchmarks/results/bench_async.json;
``--steps``/``--seeds``/``--sleep`` to change the workload).

Workload: the hand-written textkit tasks, copied, with one of the three made slow: its
workspace gets a ``tests/conftest.py`` that sleeps ``--sleep`` seconds at the start of every
test session (the reward run and each ``run_tests`` call), a stand-in for a task whose suite
takes minutes. Two tasks per step (drawn uniformly from the three: the slow one is in two of
three batches), two samples each, two-turn episodes with compact tool declarations, a tiny
randomly initialized policy, the monitor on, no text feedback; the same tokenizer for every
run. Everything else is the
trainer as ``etude train`` runs it (``etude.rl.trainer.run_train``).

Measured per run, from RUN/metrics.jsonl: the loop's time (sum of ``step_seconds``, from the
first wait for a batch to the last step's log), steps per hour, the trainer's idle fraction
(``async/wait_seconds`` over the loop time: blocked waiting for a batch), the largest staleness
seen, and the final reward. The runs of one seed are back to back in one process, so the
ratios to staleness 0 are meaningful on a loaded machine; the goal is >= 1.3x steps per hour at
staleness 1 with the final reward of the same number of steps within noise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from etude.config import apply_overrides, from_dict, load_toml
from etude.model.tokenizer import train_default_tokenizer
from etude.report.metrics import read_metrics
from etude.rl.trainer import TrainRecipe, run_train

ROOT = Path(__file__).parents[1]
RESULTS = Path(__file__).parent / "results" / "bench_async.json"
HANDWRITTEN = ROOT / "examples" / "tasks" / "handwritten"
SLOW_TASK = "textkit__roman"
MODEL = {
    "preset": "tiny",
    "vocab_size": 4096,
    "dim": 64,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 32,
    "dense_ffn_dim": 192,
    "num_dense_layers": 1,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "expert_ffn_dim": 64,
    "max_seq_len": 4096,
}


def long_tail_tasks(root: Path, sleep_s: float) -> Path:
    """A copy of the hand-written tasks whose ``SLOW_TASK`` sleeps at every test session."""
    shutil.copytree(HANDWRITTEN, root / "tasks")
    conftest = root / "tasks" / "workspaces" / SLOW_TASK / "tests" / "conftest.py"
    conftest.write_text(
        "import time\n\n\ndef pytest_sessionstart(session):\n"
        f"    time.sleep({sleep_s})  # a long test suite\n"
    )
    return root / "tasks" / "tasks.jsonl"


def recipe(run_dir: Path, tasks: Path, *, staleness: int, seed: int, steps: int) -> TrainRecipe:
    data = load_toml(ROOT / "configs" / "rl-tiny.toml")
    data["model"] = dict(MODEL)
    data = apply_overrides(
        data,
        [
            f"tasks.path='{tasks}'",
            "env.max_turns=2",
            "env.tool_declarations='compact'",
            "env.max_tokens=4000",
            "rollout.tasks_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=24",
            "rollout.num_workers=4",
            f"rollout.max_staleness={staleness}",
            "teacher.beta=0",
            "feedback.detectors=[]",
            "train.init=''",
            f"train.seed={seed}",
            f"train.steps={steps}",
            f"train.checkpoint_every={steps}",
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
        "final_entropy": rows[-1]["entropy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=10.0)
    args = parser.parse_args()
    stalenesses = (0, 1, 2)
    runs: dict[int, list[dict[str, float]]] = {k: [] for k in stalenesses}
    with tempfile.TemporaryDirectory(prefix="etude-bench-async-") as tmp:
        root = Path(tmp)
        tasks = long_tail_tasks(root, args.sleep)
        tokenizer = train_default_tokenizer(MODEL["vocab_size"])
        for seed in range(args.seeds):
            for k in stalenesses:
                run_dir = root / f"run-s{seed}-k{k}"
                tokenizer.save(run_dir / "tokenizer")
                run_train(recipe(run_dir, tasks, staleness=k, seed=seed, steps=args.steps))
                row = measure(run_dir)
                runs[k].append(row)
                print(
                    f"seed {seed} staleness {k}: {row['steps_per_hour']:7.1f} steps/h, idle "
                    f"{row['idle_fraction']:.2f}, max staleness {row['staleness_max']:.0f}, "
                    f"final reward {row['final_reward']:.3f}",
                    file=sys.stderr,
                )
    results: dict[str, float] = {
        "steps": args.steps,
        "seeds": args.seeds,
        "sleep_seconds": args.sleep,
    }
    print(
        f"{'staleness':>9} {'steps/h':>9} {'x vs 0':>7} {'idle':>6} {'max stale':>9} {'reward':>7}"
    )
    base = statistics.fmean(r["steps_per_hour"] for r in runs[0])
    for k in stalenesses:
        rows = runs[k]
        rate = statistics.fmean(r["steps_per_hour"] for r in rows)
        # per seed, against the same seed's staleness-0 run (back to back: the same load)
        ratios = [r["steps_per_hour"] / r0["steps_per_hour"] for r, r0 in zip(rows, runs[0])]
        entry = {
            "steps_per_hour": rate,
            "idle_fraction": statistics.fmean(r["idle_fraction"] for r in rows),
            "staleness_max": max(r["staleness_max"] for r in rows),
            "final_reward_mean": statistics.fmean(r["final_reward"] for r in rows),
            "final_reward_std": statistics.pstdev([r["final_reward"] for r in rows]),
            "final_entropy_mean": statistics.fmean(r["final_entropy"] for r in rows),
            "speedup_min_over_seeds": min(ratios),
        }
        for key, value in entry.items():
            results[f"staleness{k}_{key}"] = round(value, 4)
        print(
            f"{k:9d} {rate:9.1f} {rate / base:7.2f} {entry['idle_fraction']:6.2f} "
            f"{entry['staleness_max']:9.0f} {entry['final_reward_mean']:7.3f}"
        )
    results["steps_per_hour_staleness1_over_0"] = round(
        statistics.fmean(r["steps_per_hour"] for r in runs[1]) / base, 4
    )
    results["steps_per_hour_staleness2_over_0"] = round(
        statistics.fmean(r["steps_per_hour"] for r in runs[2]) / base, 4
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
