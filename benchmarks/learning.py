"""Does the main job learn? The demo recipe from one warm start, RL + text feedback vs RL only.

Run: ``nice .venv/bin/python benchmarks/learning.py`` (writes benchmarks/results/learning.json
and docs/img/learning.svg). ``--steps``, ``--seeds``, ``--eval-group-size``, ``--recipe`` and
``--set KEY=VALUE ...`` (recipe overrides) are flags; ``--steps`` below the recipe's RL steps is
a reduced version of the recipe, and the JSON says so (``reduced_steps``). ``--arms feedback``
or ``--arms rl`` (with ``--seeds``) runs a part in its own process so that several share the
cores; every finished (arm, seed) keeps its ``eval.json``, and a last run with both arms reads
them and writes the comparison.

Setup: the demo's tasks and warm start (``configs/demo.toml``: small symbol features of the
bundled textkit repo, SFT on whole oracle episodes), built once into ``--run-dir``. The warm
start is evaluated (``eval_group_size`` rollouts per task, no hints). From it, per seed, two
arms with the same recipe, seed and steps: ``teacher.beta`` as in the recipe (RL + feedback)
and ``teacher.beta=0`` (RL only). Each arm's final policy is evaluated the same way. Every
evaluation runs on the training tasks (the demo has no held-out split).

Measured:

- ``pass@1``: passing episodes / episodes of an evaluation (95% Wilson interval per arm);
- why the evaluation's episodes failed (``*_failed_without_edit``: no edit call ran without an
  error, e.g. every edit call's JSON came out garbled; ``*_failed_with_edit``: an edit ran and
  its content was wrong);
- the targeted error rate per step: (unknown-tool + malformed-call errors) per assistant turn of
  the step's RL rollouts, which never contain hints (a hint enters only the teacher's context);
  ``*_error_halving_steps``: the first step at or below half the warm start's rate (the warm
  start's evaluation is step 0), the number of steps when it never halves; mean over seeds.

- in the feedback arm (``rl.measure_shift``), per step with hinted turns: how far the update
  moved the policy's logprobs on hinted-turn tokens vs all other generated tokens
  (``feedback_shift_hinted_mean`` vs ``feedback_shift_other_mean``, mean |delta logp| per token),
  and whether the hinted teacher disprefers the student's own tokens at the flagged turns
  (``feedback_teacher_minus_student_mean`` < 0: teacher logp - student logp of those tokens).

Flat keys in the JSON: ``sft_pass_at_1``, ``feedback_final_pass_at_1_min``,
``rl_final_pass_at_1_min`` (minimum over seeds), ``feedback_error_halving_steps``,
``rl_error_halving_steps``, per-seed values, the goals with whether each was met, and what was
run: ``steps`` against the recipe's ``recipe_steps``, ``sft_steps`` against
``recipe_sft_steps`` (a warm start trained shorter than the recipe's, to leave the RL arms
room), and the ``--set`` overrides as one string (``overrides``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from etude.demo import (
    episode_metrics,
    evaluate_policy,
    load_demo_recipe,
    run_tasks_stage,
    stage_recipes,
)
from etude.env.trajectory import read_jsonl
from etude.report.metrics import read_metrics, write_json_atomic
from etude.rl.sft import run_sft
from etude.rl.trainer import run_train

ROOT = Path(__file__).resolve().parents[1]
# why evaluation episodes failed (etude.demo.episode_metrics): no edit call ran, or one ran and
# its content was wrong
FAILURE_KEYS = ("failed_without_edit", "failed_with_edit")


def targeted_rate(metrics: dict) -> float:
    return float(metrics.get("err/unknown_tool", 0.0)) + float(
        metrics.get("err/malformed_json", 0.0)
    )


def with_failure_keys(final: dict, trajectories: Path) -> dict:
    """``final`` with the failure keys recomputed from its stored trajectories when an older
    evaluation lacks them (the metrics are a function of the trajectories alone)."""
    if all(key in final for key in FAILURE_KEYS) or not trajectories.is_file():
        return final
    metrics = episode_metrics(read_jsonl(trajectories), int(final["tasks"]))
    return {**final, **{key: metrics[key] for key in FAILURE_KEYS}}


def halving_steps(start: float, rates: list[float]) -> int:
    """First step (1-based) whose rate is at most half of ``start``; len(rates) if none."""
    if start <= 0:
        return 0
    for step, rate in enumerate(rates, 1):
        if rate <= start / 2:
            return step
    return len(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "configs" / "demo.toml"))
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "learning"))
    ap.add_argument("--steps", type=int, default=0, help="RL steps per arm (0: the recipe's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-group-size", type=int, default=0, help="0: the recipe's")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "learning.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "learning.svg"))
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="dotted overrides of the demo recipe (e.g. rl.train.steps=4), as `etude demo` takes",
    )
    ap.add_argument(
        "--arms",
        nargs="+",
        default=["feedback", "rl"],
        choices=["feedback", "rl"],
        help="which arms to run (the JSON's comparison keys need both)",
    )
    args = ap.parse_args()

    run = Path(args.run_dir)
    recipe = load_demo_recipe(args.recipe, [f'demo.run_dir="{run}"', *args.set])
    sft, rl = stage_recipes(recipe)
    recipe_steps = rl.train.steps
    recipe_sft_steps = stage_recipes(load_demo_recipe(args.recipe, []))[0].train.steps
    steps = args.steps or recipe_steps
    group = args.eval_group_size or recipe.demo.eval_group_size
    started = time.perf_counter()
    if not (run / "tasks" / "tasks.jsonl").is_file():
        run_tasks_stage(recipe, run)
    if not (run / "sft" / "export" / "model.safetensors").is_file():
        run_sft(sft)
    sft_eval_path = run / "eval_sft.json"
    if sft_eval_path.is_file():
        sft_eval = with_failure_keys(
            json.loads(sft_eval_path.read_text()), run / "eval_sft_trajectories.jsonl"
        )
    else:
        sft_eval = evaluate_policy(
            rl, run / "sft", group, out=run / "eval_sft_trajectories.jsonl", label="eval sft"
        )
        write_json_atomic(sft_eval_path, sft_eval)

    arms = {
        arm: beta
        for arm, beta in {"feedback": rl.teacher.beta, "rl": 0.0}.items()
        if arm in args.arms
    }
    results: dict[str, dict[int, dict]] = {arm: {} for arm in arms}
    for seed in args.seeds:
        for arm, beta in arms.items():
            arm_dir = run / f"{arm}_seed{seed}"
            cfg = dataclasses.replace(
                rl,
                rl=dataclasses.replace(rl.rl, measure_shift=beta > 0),
                teacher=dataclasses.replace(rl.teacher, beta=beta),
                train=dataclasses.replace(
                    rl.train,
                    init=str(run / "sft"),
                    seed=seed,
                    steps=steps,
                    run_dir=str(arm_dir),
                    progress=False,
                ),
            )
            eval_path = arm_dir / "eval.json"
            if eval_path.is_file():
                final = json.loads(eval_path.read_text())
                final = with_failure_keys(final, arm_dir / "eval_trajectories.jsonl")
            else:
                run_train(cfg)
                final = evaluate_policy(
                    cfg, arm_dir, group, out=arm_dir / "eval_trajectories.jsonl", label=arm
                )
                write_json_atomic(eval_path, final)
            rows = read_metrics(arm_dir)
            rates = [targeted_rate(m) for m in rows]
            unknown = [float(m.get("err/unknown_tool", 0.0)) for m in rows]
            results[arm][seed] = {
                "shift": {
                    key: [float(m[key]) for m in rows if key in m]
                    for key in ("shift/hinted", "shift/other", "teacher_minus_student")
                },
                "final": final,
                "rates": rates,
                "halving": halving_steps(sft_eval["targeted_error_rate"], rates),
                # the error the demo's one detector targets, alone
                "unknown_halving": halving_steps(sft_eval.get("unknown_tool_rate", 0.0), unknown),
                "unknown_rates": unknown,
            }
            print(
                f"seed {seed} {arm:8s}: pass@1 {final['pass_at_1']:.3f} "
                f"[{final['pass_at_1_low']:.2f}, {final['pass_at_1_high']:.2f}] | targeted "
                f"errors/turn {sft_eval['targeted_error_rate']:.3f} -> {rates[-1]:.3f} | "
                + (
                    f"halved after {results[arm][seed]['halving']} of {steps} steps"
                    if min(rates, default=1.0) <= sft_eval["targeted_error_rate"] / 2
                    else f"not halved within {steps} steps"
                ),
                flush=True,
            )

    if set(arms) != {"feedback", "rl"}:
        # one arm per process lets two processes share the cores; a last run with both arms
        # (every eval.json then exists) writes the comparison
        print(f"arms {sorted(arms)} done; run again with both arms to write {args.out}")
        return

    def final_min(arm: str) -> float:
        return min(r["final"]["pass_at_1"] for r in results[arm].values())

    def mean_halving(arm: str, key: str = "halving") -> float:
        values = [r[key] for r in results[arm].values()]
        return sum(values) / len(values)

    sft_p = sft_eval["pass_at_1"]
    out: dict[str, float | int | str | bool] = {
        "sft_pass_at_1": sft_p,
        "sft_pass_at_1_low": sft_eval["pass_at_1_low"],
        "sft_pass_at_1_high": sft_eval["pass_at_1_high"],
        "sft_targeted_error_rate": sft_eval["targeted_error_rate"],
        "feedback_final_pass_at_1_min": final_min("feedback"),
        "rl_final_pass_at_1_min": final_min("rl"),
        "feedback_error_halving_steps": mean_halving("feedback"),
        "rl_error_halving_steps": mean_halving("rl"),
        "feedback_unknown_tool_halving_steps": mean_halving("feedback", "unknown_halving"),
        "rl_unknown_tool_halving_steps": mean_halving("rl", "unknown_halving"),
        "sft_unknown_tool_rate": sft_eval.get("unknown_tool_rate", 0.0),
        "sft_malformed_rate": sft_eval.get("malformed_rate", 0.0),
        "steps": steps,
        "recipe_steps": recipe_steps,
        "sft_steps": sft.train.steps,
        "recipe_sft_steps": recipe_sft_steps,
        "overrides": " ".join(args.set),
        "reduced_steps": steps < recipe_steps,
        "seeds": len(args.seeds),
        "eval_episodes_per_policy": int(sft_eval["episodes"]),
        "eval_on_training_tasks": True,
        "tasks": int(sft_eval["tasks"]),
        # this invocation's time: arms and evaluations finished by earlier runs are read, not rerun
        "wall_seconds_this_invocation": time.perf_counter() - started,
    }
    for arm in arms:
        for seed, r in results[arm].items():
            out[f"{arm}_seed{seed}_pass_at_1"] = r["final"]["pass_at_1"]
            out[f"{arm}_seed{seed}_error_halving_steps"] = r["halving"]
            out[f"{arm}_seed{seed}_final_targeted_error_rate"] = r["rates"][-1]
            out[f"{arm}_seed{seed}_unknown_tool_halving_steps"] = r["unknown_halving"]
            out[f"{arm}_seed{seed}_eval_unknown_tool_rate"] = r["final"]["unknown_tool_rate"]
            out[f"{arm}_seed{seed}_eval_malformed_rate"] = r["final"]["malformed_rate"]
            for key in FAILURE_KEYS:  # evaluations made before these keys existed lack them
                if key in r["final"]:
                    out[f"{arm}_seed{seed}_{key}"] = r["final"][key]
    for key in FAILURE_KEYS:
        if key in sft_eval:
            out[f"sft_{key}"] = sft_eval[key]
    for key in ("shift/hinted", "shift/other", "teacher_minus_student"):
        values = [v for r in results["feedback"].values() for v in r["shift"][key]]
        name = "feedback_" + key.replace("/", "_")
        out[name + "_mean"] = sum(values) / len(values) if values else float("nan")
        out[name + "_steps_measured"] = len(values)
    out["goal_sft_pass_at_1_ge_0.15"] = sft_p >= 0.15
    out["goal_feedback_ge_sft_plus_0.15_every_seed"] = all(
        r["final"]["pass_at_1"] >= sft_p + 0.15 for r in results["feedback"].values()
    )
    out["goal_feedback_halves_errors_2x_faster"] = mean_halving("feedback") * 2 <= mean_halving(
        "rl"
    ) and final_min("feedback") >= final_min("rl")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(args.out), out)
    print(json.dumps(out, indent=2))
    plot(results, sft_eval, steps, Path(args.plot))


def plot(results: dict, sft_eval: dict, steps: int, path: Path) -> None:
    """An SVG (``etude.report.plots``): targeted error rate per step, one line per arm and seed,
    and each arm's final pass@1 per seed against the warm start's."""
    from etude.report.plots import PALETTE, Series, line_plot

    colors = {"feedback": PALETTE[0], "rl": PALETTE[1]}
    rates, passes = [], []
    for arm, by_seed in results.items():
        for seed, r in by_seed.items():
            xs = list(range(0, len(r["rates"]) + 1))
            rates.append(
                Series(
                    label=f"{arm} seed {seed}",
                    xs=xs,
                    ys=[sft_eval["targeted_error_rate"], *r["rates"]],
                    color=colors[arm],
                    dashed=arm == "rl",
                )
            )
            passes.append(
                Series(
                    label=f"{arm} seed {seed}",
                    xs=[0, steps],
                    ys=[sft_eval["pass_at_1"], r["final"]["pass_at_1"]],
                    color=colors[arm],
                    dashed=arm == "rl",
                )
            )
    left = line_plot(
        "learning-errors",
        "unknown-tool + malformed calls per turn (step 0: warm start eval)",
        rates,
        y_label="per turn",
        legend=True,
    )
    right = line_plot(
        "learning-pass",
        f"pass@1, warm start -> after {steps} RL steps",
        passes,
        y_label="pass@1",
        y_range=(0.0, 1.0),
        legend=True,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    left = left.replace("<svg", '<svg x="0"', 1)
    right = right.replace("<svg", '<svg x="530"', 1)
    svg = (
        '<svg xmlns="http://www.w3.org/2000/svg" width="1060" height="300">'
        f"<g>{left}</g><g>{right}</g></svg>"
    )
    path.write_text(svg)


if __name__ == "__main__":
    main()
