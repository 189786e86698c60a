"""Why did an arm of ``benchmarks/learning.py`` pass more or fewer episodes? Replay and probe.

An RL update is deterministic given the weights and the batch, so applying an arm's stored
batches (``RUN/ARM_seedN/trajectories/step_*.jsonl``) as updates to the warm start rebuilds that
arm's final policy exactly; the script checks it against the arm's export (``max |delta|``,
expected 0). Then every policy (the warm start and the rebuilt arms) samples one turn
(the rollouts' temperature, fixed seed) on the same fixed contexts cut from the stored episodes:

- every assistant-turn context of the arms' last three steps: the share of sampled turns that
  make a valid call, call an unknown tool, or write a malformed call;
- the context of each evaluation episode's first edit turn (``replace_in_file``/``write_file``;
  no malformed call before it), split by the arm whose evaluation it comes from: the share of sampled turns that make exactly
  an edit some passing episode of the same task made.

Per turn on the same contexts vs per episode in the evaluations: a policy can be better at every
turn and still pass fewer episodes if it reaches contexts where turns are harder.

    .venv/bin/python benchmarks/feedback_replay.py --run-dir runs/learning --seed 1

Prints a table and writes flat keys to ``benchmarks/results/feedback_replay.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from etude.demo import load_demo_recipe, stage_recipes
from etude.engine import Engine
from etude.engine.sampling import SamplingParams
from etude.env.protocol import parse_tool_calls
from etude.env.tools import TOOL_NAMES
from etude.env.trajectory import Trajectory, read_jsonl
from etude.report.metrics import write_json_atomic
from etude.rl.trainer import RLRun
from etude.rl.update import StepBatch

ROOT = Path(__file__).resolve().parents[1]
EDIT_TOOLS = ("replace_in_file", "write_file")
ARMS = ("rl", "feedback")


def first_trainable(turn) -> int:
    return next(k for k, m in enumerate(turn.trainable) if m)


def turn_contexts(trajectories: list[Trajectory], limit: int) -> list[list[int]]:
    """Ids up to the first generated token of every assistant turn but the first."""
    out = []
    for t in trajectories:
        offset = 0
        for turn in t.turns:
            if turn.role == "assistant" and offset > 0 and any(turn.trainable):
                out.append(t.token_ids[: offset + first_trainable(turn)])
            offset += len(turn.token_ids)
    return [c for c in out if len(c) < limit]


def edit_contexts(trajectories: list[Trajectory], limit: int) -> list[tuple[str, list[int]]]:
    """(task, ids) up to the first generated token of each episode's first edit turn (made or
    attempted: a malformed call that names an edit tool counts); episodes with an earlier
    malformed call are left out (what follows one is mostly more of them), detours through
    unknown tools stay in."""
    out = []
    for t in trajectories:
        offset = 0
        for turn in t.turns:
            if turn.role == "assistant":
                names = {c.name for c in turn.tool_calls or []}
                if names & set(EDIT_TOOLS) or any(f'"{n}"' in turn.text for n in EDIT_TOOLS):
                    ids = t.token_ids[: offset + first_trainable(turn)]
                    if len(ids) < limit:
                        out.append((t.task_id, ids))
                    break
                if any(e.kind == "malformed_json" for e in turn.errors or []):
                    break
            offset += len(turn.token_ids)
    return out


def passing_edits(trajectories: list[Trajectory]) -> dict[str, set[str]]:
    """Per task, the edit calls (arguments as canonical JSON) made in passing episodes."""
    good: dict[str, set[str]] = {}
    for t in trajectories:
        if t.reward != 1.0:
            continue
        for turn in t.turns:
            if turn.role == "assistant" and not turn.errors:
                for c in turn.tool_calls or []:
                    if c.name in EDIT_TOOLS:
                        good.setdefault(t.task_id, set()).add(
                            json.dumps(c.arguments, sort_keys=True)
                        )
    return good


def classify(text: str) -> str:
    calls = parse_tool_calls(text)
    if not calls or any(c.error is not None and c.error.kind == "malformed_json" for c in calls):
        return "malformed"
    if any(c.call is not None and c.call.name not in TOOL_NAMES for c in calls):
        return "unknown"
    if any(c.error is not None for c in calls):
        return "other_error"
    return "valid"


def sample_turns(r: RLRun, engine: Engine, params: SamplingParams, prompts: list[list[int]]):
    """One sampled turn per context, decoded without its end-of-turn id."""
    r.model.eval()
    with torch.no_grad():
        gens = engine.generate(prompts, params)
    end = r.tok.im_end_id
    return [r.tok.decode([i for i in g.token_ids if i != end]) for g in gens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "learning"))
    ap.add_argument("--recipe", default=str(ROOT / "configs" / "demo.toml"))
    ap.add_argument("--seed", type=int, default=1, help="the arms' seed to rebuild")
    ap.add_argument("--set", nargs="*", default=[], help="recipe overrides (KEY=VALUE)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "feedback_replay.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    run = Path(args.run_dir)
    scratch = Path(tempfile.mkdtemp(prefix="etude-replay-"))
    recipe = load_demo_recipe(args.recipe, [f'demo.run_dir="{scratch}"', *args.set])
    _, rl = stage_recipes(recipe)
    arm_dirs = {arm: run / f"{arm}_seed{args.seed}" for arm in ARMS}
    for d in arm_dirs.values():
        if not (d / "eval_trajectories.jsonl").is_file():
            raise ValueError(f"{d}: no eval_trajectories.jsonl; run benchmarks/learning.py first")

    evals = {arm: read_jsonl(d / "eval_trajectories.jsonl") for arm, d in arm_dirs.items()}
    last_steps = sorted((arm_dirs["rl"] / "trajectories").glob("step_*.jsonl"))[-3:]
    held = [t for p in last_steps for t in read_jsonl(p)]
    held += [
        t
        for p in sorted((arm_dirs["feedback"] / "trajectories").glob("step_*.jsonl"))[-3:]
        for t in read_jsonl(p)
    ]
    good = passing_edits([t for ts in evals.values() for t in ts])
    limit = rl.env.max_tokens - rl.rollout.max_new_tokens
    turns = turn_contexts(held, limit)[::2]
    edits = {
        arm: [(task, ids) for task, ids in edit_contexts(evals[arm], limit) if task in good]
        for arm in ARMS
    }

    results: dict[str, float] = {}
    rows = []
    for policy in ("sft", *ARMS):
        beta = rl.teacher.beta if policy == "feedback" else 0.0
        cfg = dataclasses.replace(
            rl,
            rl=dataclasses.replace(rl.rl, measure_shift=False),
            teacher=dataclasses.replace(rl.teacher, beta=beta),
            tasks=dataclasses.replace(
                rl.tasks, path=str(run / "tasks" / "tasks.jsonl"), curriculum=False
            ),
            train=dataclasses.replace(
                rl.train,
                init=str(run / "sft"),
                seed=args.seed,
                run_dir=str(scratch / policy),
                progress=False,
            ),
        )
        r = RLRun(cfg)
        if policy != "sft":
            steps = sorted((arm_dirs[policy] / "trajectories").glob("step_*.jsonl"))
            for i, path in enumerate(steps):
                batch = read_jsonl(path)
                for t in batch:  # the detectors and the update write these again
                    t.feedback = []
                    t.info.pop("kl", None)
                b = StepBatch(step=i, trajectories=batch, rollout_stats=None, started=0.0)
                r.score(b)
                r.advantages(b)
                r.teach(b)
                r.update(b)
            export = load_file(str(arm_dirs[policy] / "export" / "model.safetensors"))
            state = r.model.state_dict()
            results[f"{policy}_replay_max_abs_diff"] = max(
                float((state[k].float() - v.float()).abs().max()) for k, v in export.items()
            )
        engine = Engine(r.model, max_seq_len=rl.env.max_tokens, decode_fn=r.tok.decode)
        params = SamplingParams(
            max_new_tokens=rl.rollout.max_new_tokens,
            temperature=rl.rollout.temperature,
            stop_token_ids=(r.tok.im_end_id,),
            seed=1234,
        )

        def sample(prompts: list[list[int]], r=r, engine=engine, params=params) -> list[str]:
            return sample_turns(r, engine, params, prompts)

        start = time.perf_counter()
        kinds = [classify(text) for text in sample(turns)]
        for kind in ("valid", "unknown", "malformed"):
            results[f"{policy}_turn_{kind}"] = kinds.count(kind) / len(kinds)
        for arm in ARMS:
            texts = sample([ids for _, ids in edits[arm]])
            exact = 0
            for (task, _), text in zip(edits[arm], texts):
                calls = [c.call for c in parse_tool_calls(text) if c.call is not None]
                if any(
                    c.name in EDIT_TOOLS and json.dumps(c.arguments, sort_keys=True) in good[task]
                    for c in calls
                ):
                    exact += 1
            results[f"{policy}_exact_edit_after_{arm}_contexts"] = exact / max(len(texts), 1)
        results[f"{policy}_eval_pass_at_1"] = (
            json.loads((run / "eval_sft.json").read_text())["pass_at_1"]
            if policy == "sft"
            else json.loads((arm_dirs[policy] / "eval.json").read_text())["pass_at_1"]
        )
        rows.append(policy)
        print(f"{policy}: probed in {time.perf_counter() - start:.0f} s", flush=True)

    results.update(
        seed=float(args.seed),
        turn_contexts=float(len(turns)),
        edit_contexts_rl=float(len(edits["rl"])),
        edit_contexts_feedback=float(len(edits["feedback"])),
    )
    header = (
        f"{'policy':10s} {'eval pass@1':>11s} {'valid':>7s} {'unknown':>8s} {'malformed':>10s}"
        f" {'exact edit (rl ctx)':>20s} {'exact edit (fb ctx)':>20s}"
    )
    print(header)
    for p in rows:
        print(
            f"{p:10s} {results[f'{p}_eval_pass_at_1']:11.2f} {results[f'{p}_turn_valid']:7.2f}"
            f" {results[f'{p}_turn_unknown']:8.2f} {results[f'{p}_turn_malformed']:10.2f}"
            f" {results[f'{p}_exact_edit_after_rl_contexts']:20.2f}"
            f" {results[f'{p}_exact_edit_after_feedback_contexts']:20.2f}"
        )
    print(
        f"{len(turns)} turn contexts; edit contexts: {len(edits['rl'])} from the RL-only arm's "
        f"evaluation, {len(edits['feedback'])} from the feedback arm's; replay max |delta| "
        + ", ".join(f"{a} {results[f'{a}_replay_max_abs_diff']:.1e}" for a in ARMS)
    )
    results["python"] = platform.python_version()  # type: ignore[assignment]
    write_json_atomic(Path(args.out), dict(sorted(results.items())))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
