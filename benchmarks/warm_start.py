"""Warm-start variants of the demo recipe, compared by the demo's own evaluation (no RL).

Run: ``nice .venv/bin/python benchmarks/warm_start.py --tasks-from runs/learning2`` (writes
benchmarks/results/warm_start.json). Per variant and seed (``--variants``, ``--seeds``): the demo
recipe's SFT stage (``configs/demo.toml``, ``sft.train.seed`` = the seed) with the variant's
overrides, then the demo's evaluation of the warm start (`etude.demo.evaluate_policy`:
``--eval-group-size`` rollouts per task, default the recipe's ``demo.eval_group_size``; no
hints, the same sampling seeds for every policy, on the training tasks). ``--tasks-from RUN`` reuses ``RUN/tasks`` (the tasks of a
``benchmarks/learning.py`` run, so the figures compare with its); without it the demo's tasks
stage runs once into ``--run-dir``. Each (variant, seed) lives in ``RUN_DIR/VARIANT_sSEED`` and
is resumable: a finished SFT or evaluation is read back, not redone, so one process per part
can share the cores and a last run with every part prints the table.

Variants (`VARIANTS`): ``unknown_only`` (the recipe before recovery examples: the oracle's
mistakes are unknown-tool calls at ``mistake_rate`` 0.25, imitated), ``demo`` (the committed
recipe: unknown-tool or malformed calls at 0.25 with equal odds, the malformed ones taught as
recovery, ``sft.data.recovery_mistakes``), ``recovery_r50`` (the same at 0.5: as many
unknown-tool mistakes as ``unknown_only`` plus as many malformed ones), ``unknown_r125`` (the
control: unknown-tool mistakes only at 0.125, as many as ``demo`` has, no malformed calls). No
variant has hint-following examples for malformed calls (``sft.feedback.detectors =
["unknown_tool"]``). Ratios are against ``unknown_only``.

Measured per policy: pass@1 (95% Wilson interval), malformed calls per assistant turn,
``valid_after_malformed`` (of the turns right after a malformed call, the fraction that make a
valid call), the episodes with a malformed call and how many of them passed; and the SFT cost as
tokens per example of the training pool (time per step scales with it; steps are fixed), as a
ratio to the ``demo`` variant. Not measured here: what RL does from each warm start
(``benchmarks/learning.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from etude.demo import episode_metrics, evaluate_policy, load_demo_recipe, stage_recipes
from etude.env.trajectory import read_jsonl
from etude.model.tokenizer import Tokenizer
from etude.report.metrics import write_json_atomic
from etude.rl.sft import SFTRecipe, oracle_examples, run_sft

ROOT = Path(__file__).resolve().parents[1]
_UNKNOWN_ONLY = ['sft.data.mistakes=["unknown_tool"]', "sft.data.recovery_mistakes=[]"]
BASELINE = "unknown_only"
VARIANTS = {
    # the recipe before recovery examples: unknown-tool mistakes only (the malformed_call,
    # test_edit and submit_untested detectors it listed made no examples without those mistakes)
    BASELINE: [*_UNKNOWN_ONLY, 'sft.feedback.detectors=["unknown_tool"]'],
    # the committed recipe: unknown-tool and malformed calls at the rate 0.25, recovery for the latter
    "demo": [],
    "recovery_r50": ["sft.data.mistake_rate=0.5"],
    # the control: as many unknown-tool mistakes as "demo" has, no malformed calls
    "unknown_r125": [*_UNKNOWN_ONLY, "sft.data.mistake_rate=0.125"],
}


def pool_tokens(sft: SFTRecipe) -> float:
    """Mean tokens per example of the SFT pool (the cached oracle episodes, rebuilt)."""
    run = Path(sft.train.run_dir)
    trajectories = read_jsonl(run / "sft_trajectories.jsonl")
    tok = Tokenizer.load(run / "tokenizer")
    examples = oracle_examples(trajectories, tok, sft.data, sft.feedback)
    return sum(len(e.ids) for e in examples) / len(examples)


def measure(
    recipe_path: str, run: Path, tasks_from: Path | None, overrides: list[str], group: int
) -> dict:
    recipe = load_demo_recipe(recipe_path, [f'demo.run_dir="{run}"', *overrides])
    sft, rl = stage_recipes(recipe)
    group = group or recipe.demo.eval_group_size
    if not (run / "tasks" / "tasks.jsonl").is_file():
        if tasks_from is None:
            from etude.demo import run_tasks_stage

            run_tasks_stage(recipe, run)
        else:
            shutil.copytree(tasks_from / "tasks", run / "tasks")
    if not (run / "sft" / "export" / "model.safetensors").is_file():
        run_sft(sft)
    out = run / f"eval_sft_g{group}.jsonl"
    summary_path = run / f"eval_sft_g{group}.json"
    if not summary_path.is_file():
        summary = evaluate_policy(rl, run / "sft", group, out=out, label=f"eval {run.name}")
        write_json_atomic(summary_path, summary)
    trajectories = read_jsonl(out)
    m = episode_metrics(trajectories, int(json.loads(summary_path.read_text())["tasks"]))
    malformed = [
        t
        for t in trajectories
        if any(e.kind == "malformed_json" for _, turn in t.assistant_turns() for e in turn.errors)
    ]
    hints = json.loads((run / "sft" / "hint_preference.json").read_text())
    return {
        **m,
        "episodes_with_malformed": float(len(malformed)),
        "passed_with_malformed": float(sum(float(t.reward or 0) >= 1 for t in malformed)),
        "pool_tokens_per_example": pool_tokens(sft),
        "recovery_turns": hints.get("recovery_turns", 0.0),
        "p_valid_hinted": hints.get("p_valid_hinted", 0.0),
        "p_valid_unhinted": hints.get("p_valid_unhinted", 0.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "configs" / "demo.toml"))
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "warm_start"))
    ap.add_argument("--tasks-from", default="", help="a run dir whose tasks/ to reuse")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--eval-group-size", type=int, default=0, help="0: the recipe's")
    ap.add_argument("--variants", nargs="+", default=[BASELINE, "demo"], choices=list(VARIANTS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "warm_start.json"))
    args = ap.parse_args()
    tasks_from = Path(args.tasks_from) if args.tasks_from else None

    results: dict[str, dict[int, dict]] = {}
    for name in args.variants:
        for seed in args.seeds:
            run = Path(args.run_dir) / f"{name}_s{seed}"
            overrides = [*VARIANTS[name], f"sft.train.seed={seed}"]
            results.setdefault(name, {})[seed] = measure(
                args.recipe, run, tasks_from, overrides, args.eval_group_size
            )

    print(
        "| variant | seed | pass@1 [95%] | malformed / turn | valid after malformed "
        "| episodes with malformed (passed) | tokens / example |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    out: dict[str, float | int | str] = {"seeds": " ".join(map(str, args.seeds))}
    base = results.get(BASELINE)
    for name, per_seed in results.items():
        for seed, m in per_seed.items():
            print(
                f"| {name} | {seed} | {m['pass_at_1']:.2f} [{m['pass_at_1_low']:.2f}, "
                f"{m['pass_at_1_high']:.2f}] | {m['malformed_rate']:.3f} | "
                f"{m['valid_after_malformed']:.2f} of {int(m['turns_after_malformed'])} | "
                f"{int(m['episodes_with_malformed'])}/{int(m['episodes'])} "
                f"({int(m['passed_with_malformed'])}) | {m['pool_tokens_per_example']:.0f} |"
            )
            for key in (
                "pass_at_1",
                "pass_at_1_low",
                "pass_at_1_high",
                "malformed_rate",
                "unknown_tool_rate",
                "valid_after_malformed",
                "turns_after_malformed",
                "episodes_with_malformed",
                "passed_with_malformed",
                "pool_tokens_per_example",
                "recovery_turns",
                "p_valid_hinted",
                "p_valid_unhinted",
            ):
                out[f"{name}_s{seed}_{key}"] = m[key]
        n = len(per_seed)
        out[f"{name}_pass_at_1_mean"] = sum(m["pass_at_1"] for m in per_seed.values()) / n
        out[f"{name}_pass_at_1_min"] = min(m["pass_at_1"] for m in per_seed.values())
        after = sum(m["turns_after_malformed"] for m in per_seed.values())
        valid = sum(
            m["valid_after_malformed"] * m["turns_after_malformed"] for m in per_seed.values()
        )
        out[f"{name}_valid_after_malformed_pooled"] = valid / max(after, 1)
        if base is not None and name != BASELINE and set(base) == set(per_seed):
            out[f"{name}_vs_{BASELINE}_pass_at_1_every_seed_higher"] = all(
                per_seed[s]["pass_at_1"] > base[s]["pass_at_1"] for s in per_seed
            )
            out[f"{name}_vs_{BASELINE}_tokens_per_example_ratio"] = sum(
                per_seed[s]["pool_tokens_per_example"] for s in per_seed
            ) / sum(base[s]["pool_tokens_per_example"] for s in per_seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(args.out), out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
