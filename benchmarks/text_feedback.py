"""Ablation: RL without feedback vs RL with text feedback, on injected unknown-tool calls.

Run: ``.venv/bin/python benchmarks/text_feedback.py`` (writes
benchmarks/results/text_feedback.json and docs/img/text_feedback.png). ``--steps``, ``--seeds``
and the rollout shape are flags; defaults fit a small CPU budget.

Setup: one warm start (``etude sft configs/sft-tiny.toml``: oracle episodes with 20% of turns
replaced by calls to a tool that does not exist, plus hint-following examples). From it, two
arms with the same recipe (``configs/rl-tiny.toml``), seeds and steps: ``teacher.beta=0`` (RL
alone) and ``teacher.beta=1`` (RL + the hinted-teacher KL). Rollouts never contain hints (the
hint only enters the teacher's context), so every rate below is measured on unhinted rollouts.

Measured per step:

- ``sampled``: the unknown-tool rate of the step's rollouts (unknown-tool errors per assistant
  turn), the quantity the trainer logs as ``err/unknown_tool``; noisy at a few episodes a step;
- ``share``: the policy's probability of calling an unknown tool at the first turn, computed
  exactly rather than sampled: with the oracle's first thought forced, the probability of the
  whole first turn with each tool name (the 8 real tools and the oracle's wrong names) from one
  KV-cached prefill per task; ``share`` = mass on wrong names / mass on all listed names, mean
  over the tasks. Step 0 is the warm start; with the hint spliced in, the same number says
  whether the hinted teacher prefers the valid tools (``hinted_share``).
- ``reward``: mean episode reward (tests pass after the episode).

Reported: per arm the mean curves over seeds and the steps each arm needs to halve ``share``
(first step at or below half its step-0 value; per seed, and from the mean curve).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from etude.config import load_config
from etude.env.coding import CodingEnv
from etude.env.oracle import WRONG_TOOL_NAMES, render_turn
from etude.env.tools import TOOL_NAMES
from etude.model.chat import encode_header
from etude.model.tokenizer import TOOL_CALL_END, TOOL_CALL_START, Tokenizer
from etude.report.metrics import read_metrics
from etude.rl.feedback import available_tools_hint
from etude.rl.sft import SFTRecipe, run_sft
from etude.rl.teacher import hint_message_ids
from etude.rl.trainer import TrainRecipe, run_train
from etude.tasks.record import load_tasks

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "text_feedback.json"
PLOT = ROOT / "docs" / "img" / "text_feedback.png"
FIRST_THOUGHT = "Let me look at the repository layout."
WRONG = sorted({name for names in WRONG_TOOL_NAMES.values() for name in names})


def first_turn_prompts(recipe: TrainRecipe, tok: Tokenizer) -> list[list[int]]:
    """The first-turn prompt of each task (system, user, open assistant header)."""
    path = Path(recipe.tasks.path)
    prompts = []
    for task in load_tasks(path)[: recipe.tasks.limit or None]:
        with CodingEnv(task, recipe.env, tokenizer=tok, base_dir=path.parent) as env:
            env.reset()
            prompts.append(env.prompt_ids)
    return prompts


@torch.no_grad()
def unknown_tool_share(model, tok: Tokenizer, prompts: list[list[int]], *, hint: str = "") -> float:
    """Mass on wrong tool names over mass on all listed names at the first turn (mean over tasks)."""
    markers = (TOOL_CALL_START, TOOL_CALL_END)
    names = [*TOOL_NAMES, *WRONG]
    turns = [
        [*tok.encode(render_turn(FIRST_THOUGHT, name, {}), allow_special=markers), tok.im_end_id]
        for name in names
    ]
    common = 0
    while all(len(t) > common and t[common] == turns[0][common] for t in turns):
        common += 1
    header_len = len(encode_header(tok, "assistant"))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    shares = []
    for prompt in prompts:
        if hint:  # the hint as a system message right before the assistant turn
            cut = len(prompt) - header_len
            prompt = prompt[:cut] + hint_message_ids(tok, hint) + prompt[cut:]
        prefix = prompt + turns[0][:common]
        longest = max(len(t) for t in turns) - common
        cache = model.make_cache(1, len(prefix) + longest)
        last = torch.tensor([[len(prefix) - 1]], device=device)
        first_logits = model(
            torch.tensor([prefix], device=device), cache=cache, logits_index_BN=last
        )
        first_logp = torch.log_softmax(first_logits[0, 0].float(), -1)
        logps = []
        for turn in turns:
            suffix = turn[common:]
            total = first_logp[suffix[0]].item()
            if len(suffix) > 1:
                # rewinding the cache: each candidate writes its own slots after the prefix
                positions = torch.arange(len(prefix), len(prefix) + len(suffix) - 1, device=device)
                logits = model(
                    torch.tensor([suffix[:-1]], device=device),
                    positions_BT=positions[None],
                    cache=cache,
                )[0].float()
                logp = torch.log_softmax(logits, -1)
                total += (
                    logp.gather(1, torch.tensor(suffix[1:], device=device)[:, None]).sum().item()
                )
            logps.append(total)
        logp_T = torch.tensor(logps, dtype=torch.float64)
        probs = torch.softmax(logp_T, 0)  # normalized over the listed names
        shares.append(float(probs[len(TOOL_NAMES) :].sum()))
    model.train(was_training)
    return sum(shares) / len(shares)


def unfinished_rate(run_dir: Path) -> list[float]:
    """Per step: assistant turns cut before ``<|im_end|>`` per assistant turn (from the saved
    trajectories); such turns run no tool, so they carry no typed error."""
    from etude.env.trajectory import read_jsonl

    out = []
    for path in sorted((run_dir / "trajectories").glob("step_*.jsonl")):
        turns = [turn for t in read_jsonl(path) for _, turn in t.assistant_turns()]
        cut = sum(1 for t in turns if sum(t.trainable) and t.text and not _closed(t))
        out.append(cut / max(len(turns), 1))
    return out


def _closed(turn) -> bool:
    generated = [i for i, m in zip(turn.token_ids, turn.trainable) if m]
    return bool(generated) and generated[-1] == 2  # <|im_end|> (SPECIAL_TOKENS order)


def halving_step(curve: list[float]) -> int | None:
    """First step whose value is at or below half of step 0's (None: never within the run)."""
    target = 0.5 * curve[0]
    return next((step for step, v in enumerate(curve) if step > 0 and v <= target), None)


def run_arm(args, recipe_overrides: list[str], run_dir: Path, prompts_cache: dict) -> dict:
    if run_dir.exists() and not args.reuse:
        shutil.rmtree(run_dir)
    recipe = load_config(TrainRecipe, ROOT / "configs" / "rl-tiny.toml", recipe_overrides)
    from etude.model.tokenizer import Tokenizer as Tok

    tok = Tok.load(Path(recipe.train.init) / "tokenizer")
    if "prompts" not in prompts_cache:
        prompts_cache["prompts"] = first_turn_prompts(recipe, tok)
    prompts = prompts_cache["prompts"]

    def measure(step: int, model) -> dict[str, float]:
        out = {"eval/unknown_share": unknown_tool_share(model, tok, prompts)}
        if step == 0:
            out["eval/hinted_share"] = unknown_tool_share(
                model, tok, prompts, hint=available_tools_hint()
            )
        return out

    t0 = time.perf_counter()
    result = run_train(recipe, on_step=measure)
    seconds = time.perf_counter() - t0
    rows = read_metrics(run_dir)
    return {
        "share": [result["initial/eval/unknown_share"]] + [r["eval/unknown_share"] for r in rows],
        "hinted_share_step0": result["initial/eval/hinted_share"],
        "sampled": [r["err/unknown_tool"] for r in rows],
        "malformed": [r["err/malformed_json"] for r in rows],
        "hints_detected": [r["hints_detected"] for r in rows],
        "unfinished": unfinished_rate(run_dir),
        "reward": [r["reward"] for r in rows],
        "hints": [r["hints"] for r in rows],
        "kl": [r["kl"] for r in rows],
        "turns": [r["turns_per_episode"] for r in rows],
        "seconds": seconds,
    }


def mean_curve(curves: list[list[float]]) -> list[float]:
    return [sum(values) / len(values) for values in zip(*curves)]


def plot(results: dict, path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("share", "P(unknown tool) at turn 1 (exact)", 0),
        ("sampled", "unknown-tool calls per turn (sampled)", 1),
        ("malformed", "malformed calls per turn (sampled)", 1),
        ("unfinished", "turns cut before <|im_end|> (sampled)", 1),
        ("reward", "reward", 1),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(19, 3.8))
    palette = ("tab:gray", "tab:blue", "tab:orange", "tab:green")
    colors = {arm: palette[k % len(palette)] for k, arm in enumerate(results["arms"])}
    for ax, (key, title, first) in zip(axes, panels):
        for arm, runs in results["arms"].items():
            curves = [r[key] for r in runs.values() if key in r]
            if not curves:
                continue
            xs = range(first, first + len(curves[0]))
            for curve in curves:
                ax.plot(xs, curve, color=colors[arm], alpha=0.3, lw=1)
            ax.plot(xs, mean_curve(curves), color=colors[arm], lw=2.5, label=arm)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].axhline(
        results["arms_initial_share"] / 2, color="k", ls=":", lw=1, label="half of step 0"
    )
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sft-run", default="runs/sft-tiny", help="warm start run dir (made if missing)"
    )
    p.add_argument("--out", default="runs/text_feedback", help="run dirs of the arms")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tasks-per-step", type=int, default=1)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--beta", type=float, default=1.0, help="teacher.beta of the feedback arm")
    p.add_argument("--reuse", action="store_true", help="keep existing arm run dirs (resume)")
    p.add_argument(
        "--arms", nargs="+", default=["rl", "rl+feedback"], choices=["rl", "rl+feedback"]
    )
    p.add_argument("--results", default=str(RESULTS), help="results file to write")
    p.add_argument("--plot", default=str(PLOT), help="figure to write")
    p.add_argument(
        "--summarize-only",
        action="store_true",
        help="rebuild the table and plot from the results file and the arms' metrics.jsonl",
    )
    p.add_argument("overrides", nargs="*", help="extra dotted overrides for both arms")
    args = p.parse_args()
    if args.summarize_only:
        results = json.loads(Path(args.results).read_text())
        for arm, runs in results["arms"].items():
            for seed, run in runs.items():
                rows = read_metrics(Path(args.out) / f"{arm.replace('+', '_')}_seed{seed}")
                run["malformed"] = [r["err/malformed_json"] for r in rows]
                run["hints_detected"] = [r["hints_detected"] for r in rows]
                run["unfinished"] = unfinished_rate(
                    Path(args.out) / f"{arm.replace('+', '_')}_seed{seed}"
                )
        summarize(results, args)
        return

    sft = Path(args.sft_run)
    if not (sft / "export" / "model.safetensors").is_file():
        run_sft(
            load_config(
                SFTRecipe,
                ROOT / "configs" / "sft-tiny.toml",
                [f"train.run_dir='{sft}'", "train.progress=false"],
            )
        )
    warm = json.loads((sft / "hint_preference.json").read_text())
    out = Path(args.out)
    results: dict = {
        "config": {k: v for k, v in vars(args).items()},
        "warm_start": warm,
        "arms": {arm: {} for arm in args.arms},
    }
    prompts_cache: dict = {}
    for seed in args.seeds:
        for arm, beta in (("rl", 0.0), ("rl+feedback", args.beta)):
            if arm not in args.arms:
                continue
            run_dir = out / f"{arm.replace('+', '_')}_seed{seed}"
            overrides = [
                f"train.init='{sft}'",
                f"train.run_dir='{run_dir}'",
                f"train.steps={args.steps}",
                f"train.seed={seed}",
                f"train.checkpoint_every={args.steps}",
                "train.progress=false",
                "train.save_trajectories=true",
                f"teacher.beta={beta}",
                f"rollout.tasks_per_step={args.tasks_per_step}",
                f"rollout.group_size={args.group_size}",
                *args.overrides,
            ]
            run = run_arm(args, overrides, run_dir, prompts_cache)
            results["arms"][arm][str(seed)] = run
            print(
                f"{arm:12s} seed {seed}: share {run['share'][0]:.3f} -> {run['share'][-1]:.3f}, "
                f"sampled {sum(run['sampled']) / len(run['sampled']):.3f}, "
                f"reward {sum(run['reward']) / len(run['reward']):.3f}, {run['seconds']:.0f} s",
                flush=True,
            )
            Path(args.results).parent.mkdir(parents=True, exist_ok=True)
            Path(args.results).write_text(json.dumps(results, indent=1))
    summarize(results, args)


def summarize(results: dict, args: argparse.Namespace) -> None:
    """Table, summary block of the results file, and the plot."""
    summary = {}
    for arm, runs in results["arms"].items():
        share = mean_curve([r["share"] for r in runs.values()])
        summary[arm] = {
            "share_step0": share[0],
            "share_final": share[-1],
            "hinted_share_step0": sum(r["hinted_share_step0"] for r in runs.values()) / len(runs),
            "sampled_mean": sum(sum(r["sampled"]) for r in runs.values())
            / sum(len(r["sampled"]) for r in runs.values()),
            "sampled_curve": mean_curve([r["sampled"] for r in runs.values()]),
            "malformed_curve": mean_curve([r["malformed"] for r in runs.values()]),
            "unfinished_curve": mean_curve([r["unfinished"] for r in runs.values()]),
            "malformed_halving_step": halving_step(
                mean_curve([r["malformed"] for r in runs.values()])
            ),
            "reward_mean": sum(sum(r["reward"]) for r in runs.values())
            / sum(len(r["reward"]) for r in runs.values()),
            "halving_step_mean_curve": halving_step(share),
            "halving_step_per_seed": {s: halving_step(r["share"]) for s, r in runs.items()},
            "seconds": sum(r["seconds"] for r in runs.values()),
        }
    results["summary"] = summary
    results["arms_initial_share"] = next(iter(summary.values()))["share_step0"]
    Path(args.results).write_text(json.dumps(results, indent=1))
    print(
        "\narm          P(unknown) step 0 -> final   hinted@0   steps to halve   sampled   reward"
    )
    for arm, s in summary.items():
        halve = s["halving_step_mean_curve"]
        print(
            f"{arm:12s} {s['share_step0']:.3f} -> {s['share_final']:.3f}"
            f"          {s['hinted_share_step0']:.3f}      "
            f"{halve if halve is not None else f'> {args.steps}':>6}"
            f"           {s['sampled_mean']:.3f}     {s['reward_mean']:.3f}"
        )
    plot(results, Path(args.plot), args.steps)
    print(f"wrote {args.results} and {args.plot}")


if __name__ == "__main__":
    main()
