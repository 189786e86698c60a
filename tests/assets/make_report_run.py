"""Build the fixed run directories the report tests read: ``report_run/`` and ``report_run_nofb/``.

Run ``python tests/assets/make_report_run.py`` to rewrite both beside this file;
``tests/unit/test_report.py`` checks that the committed files match what this script builds.

Each directory is what a short RL run with the curriculum and the monitor writes: ``config.json``,
``versions.json``, ``metrics.jsonl`` (6 steps), ``trajectories/step_00000N.jsonl`` (2 tasks x 2
rollouts per step), ``tasks/tasks.jsonl`` (3 tasks, one a harder variant), a curriculum pool
state ``pool.json`` with its ``pool.json.tasks.jsonl``, ``monitor.json`` and a small trained
``tokenizer/``. The metrics are computed from the trajectories the way the trainer computes
them, so every number in the report can be traced to these files.

``report_run`` is the run with text feedback: hints on turns that called an unknown tool, with
per-token KL of those turns in ``info["kl"]`` (one value per generated token). ``report_run_nofb``
is the ablation: the same tasks, no hints, lower rewards. One rollout reads git history; the
monitor flags it (``vcs_history``) and zeroes its reward. A tool observation holds the text
``</script>`` and an assistant turn non-ASCII text, to exercise escaping and token decoding.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

from etude.env.trajectory import (
    ERROR_KINDS,
    Feedback,
    Flag,
    ToolCall,
    ToolError,
    Trajectory,
    Turn,
    write_jsonl,
)
from etude.model.chat import encode_message
from etude.model.tokenizer import Tokenizer
from etude.monitor.report import summarize
from etude.tasks.curriculum import CurriculumConfig, TaskStats
from etude.tasks.record import EtudeInfo, TaskRecord, save_tasks

HERE = Path(__file__).parent
STEPS = 6
GROUP = 2
TASK_IDS = ("textkit__slugify", "textkit__wrap", "textkit__wrap__harder1")
SYSTEM = "You are a coding agent. Tools: list_files, read_file, replace_in_file, run_tests, submit."
SLUG_CODE = (
    'def slugify(text, sep="-"):\n'
    "    # d\u00e9j\u00e0 vu: keep words only\n"
    "    words = [w for w in text.lower().split() if w.isalnum()]\n"
    "    return sep.join(words)\n"
)
# rewards[run][step][rollout]: the feedback run learns faster than the ablation
REWARDS = {
    "report_run": [
        [0.0, 0.0, 0.0, 0.5],
        [0.0, 0.5, 0.0, 1.0],
        [1.0, 1.0, 0.5, 1.0],
        [1.0, 1.0, 0.5, 1.0],
        [1.0, 1.0, 1.0, 1.0],
        [1.0, 1.0, 1.0, 0.5],
    ],
    "report_run_nofb": [
        [0.0, 0.0, 0.0, 0.0],
        [0.0, 0.5, 0.0, 0.0],
        [0.0, 1.0, 0.5, 1.0],
        [1.0, 0.0, 0.0, 0.5],
        [0.5, 1.0, 0.0, 0.5],
        [1.0, 0.0, 0.5, 1.0],
    ],
}


def train_tokenizer() -> Tokenizer:
    texts = [SYSTEM, SLUG_CODE, "def wrap(text, width):\n    return text\n"] * 4
    texts += ['<tool_call>{"name": "read_file", "arguments": {"path": "src/textkit/slug.py"}}']
    return Tokenizer.train(texts, vocab_size=300)


def turn(tok: Tokenizer, role: str, text: str, **kw) -> Turn:
    ids, mask = encode_message(tok, role, text)
    logprobs = [-0.5 - 0.01 * (k % 7) if m else 0.0 for k, m in enumerate(mask)]
    return Turn(role=role, text=text, token_ids=ids, trainable=mask, logprobs=logprobs, **kw)


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def episode(
    tok: Tokenizer, task_id: str, step: int, sample: int, reward: float, *, feedback: bool
) -> Trajectory:
    """One rollout; its shape follows (step, sample) so that every feature appears somewhere."""
    target = "src/textkit/slug.py" if "slug" in task_id else "src/textkit/wrap.py"
    turns = [
        turn(tok, "system", SYSTEM),
        turn(tok, "user", f"Re-implement the deleted feature of task {task_id}."),
    ]
    traj = Trajectory(task_id=task_id, info={"group": sample // GROUP, "sample": sample})
    unknown = (step + sample) % 3 == 0
    if unknown:
        args = {"pattern": "def "}
        turns.append(
            turn(
                tok,
                "assistant",
                "Looking for the d\u00e9finition first.\n" + call_text("grep", args),
                tool_calls=[ToolCall(name="grep", arguments=args)],
                errors=[ToolError(kind="unknown_tool", message="unknown tool 'grep'", tool="grep")],
            )
        )
        turns.append(turn(tok, "tool", "error: unknown tool 'grep'", tool_name="grep"))
    read = {"path": target}
    turns.append(
        turn(
            tok,
            "assistant",
            call_text("read_file", read),
            tool_calls=[ToolCall(name="read_file", arguments=read)],
        )
    )
    turns.append(
        turn(
            tok, "tool", "# module body deleted\n</script><b>not markup</b>", tool_name="read_file"
        )
    )
    hacks = step == 3 and sample == 1
    if hacks:
        args = {"command": "git log -p -- src/textkit"}
        turns.append(
            turn(
                tok,
                "assistant",
                call_text("bash", args),
                tool_calls=[ToolCall(name="bash", arguments=args)],
            )
        )
        turns.append(turn(tok, "tool", "commit 1a2b3c\n-def slugify(...)", tool_name="bash"))
        traj.flags.append(
            Flag(
                rule="vcs.history_cmd",
                category="vcs_history",
                severity=3,
                turn=len(turns) - 2,
                evidence="git log -p -- src/textkit",
            )
        )
    write = {"path": target, "old": "# module body deleted", "new": SLUG_CODE}
    turns.append(
        turn(
            tok,
            "assistant",
            "Writing the function.\n" + call_text("replace_in_file", write),
            tool_calls=[ToolCall(name="replace_in_file", arguments=write)],
        )
    )
    turns.append(turn(tok, "tool", "replaced 1 occurrence", tool_name="replace_in_file"))
    turns.append(
        turn(tok, "assistant", call_text("submit", {}), tool_calls=[ToolCall(name="submit")])
    )
    traj.turns = turns
    tests = ["tests/test_slug.py::test_basic", "tests/test_slug.py::test_sep"]
    passed = round(reward * len(tests))
    traj.tests = {t: ("passed" if k < passed else "failed") for k, t in enumerate(tests)}
    traj.finish_reason = "submit"
    traj.reward = reward
    if hacks:
        traj.info["reward_before_monitor"] = reward
        traj.reward = 0.0
    if feedback and unknown:
        traj.feedback.append(
            Feedback(
                turn=2, kind="unknown_tool", hint="Available tools: list_files, read_file, ..."
            )
        )
        n = sum(traj.turns[2].trainable)
        # deterministic per-token KL, one per generated token: large at the bad call, decaying
        traj.info["kl"] = {"2": [round(0.8 * math.exp(-k / 3) + 0.01 * step, 6) for k in range(n)]}
    return traj


def step_metrics(trajectories: list[Trajectory], step: int, run: int) -> dict:
    """The trainer's per-step metrics, from the trajectories (plus fixed optimizer numbers)."""
    n = len(trajectories)
    turns = sum(1 for t in trajectories for _ in t.assistant_turns())
    errors = {k: 0 for k in ERROR_KINDS}
    for t in trajectories:
        for _, u in t.assistant_turns():
            for e in u.errors:
                errors[e.kind] += 1
    hinted = sum(len({f.turn for f in t.feedback}) for t in trajectories)
    kl_values = [v for t in trajectories for vs in t.info.get("kl", {}).values() for v in vs]
    out = {
        "loss": round(1.0 / (step + 1) + 0.1 * run, 6),
        "reward": sum(t.reward for t in trajectories) / n,
        "pass_rate": sum(t.reward >= 1.0 for t in trajectories) / n,
        "hints": float(hinted),
        "hints_detected": float(sum(len(t.feedback) for t in trajectories)),
        "kl": sum(kl_values) / len(kl_values) if kl_values else 0.0,
        "kl_tokens": float(len(kl_values)),
        "entropy": round(2.0 - (0.1 - 0.05 * run) * step, 6),
        "clip_frac": round(0.02 * ((step + run) % 3), 6),
        "rollout_tok/s": 100.0 + 10 * step - 20 * run,
        "train_tok/s": 400.0 + 5 * step + 30 * run,
        "step_seconds": 30.0 + 2 * run,
        "monitor/zeroed": float(sum("reward_before_monitor" in t.info for t in trajectories)),
        "monitor/category/vcs_history": float(
            sum(any(f.category == "vcs_history" for f in t.flags) for t in trajectories)
        ),
    }
    out.update({f"err/{k}": v / turns for k, v in errors.items()})
    kinds = sorted({f.kind for t in trajectories for f in t.feedback})
    out.update(
        {
            f"hint/{k}": float(sum(f.kind == k for t in trajectories for f in t.feedback))
            for k in kinds
        }
    )
    return out


def tasks() -> list[TaskRecord]:
    out = []
    for k, task_id in enumerate(TASK_IDS):
        out.append(
            TaskRecord(
                instance_id=task_id,
                repo="textkit",
                base_commit="sha256:" + f"{k}" * 64,
                patch="--- a/src/textkit/slug.py\n+++ b/src/textkit/slug.py\n",
                problem_statement=f"Re-implement the deleted feature of task {task_id}.",
                version="0.1",
                FAIL_TO_PASS=[f"tests/test_{k}.py::test_{j}" for j in range(k + 1)],
                PASS_TO_PASS=[f"tests/test_other.py::test_{j}" for j in range(3 + k)],
                etude=EtudeInfo(
                    workspace=f"workspaces/{task_id}.tar.gz",
                    symbols=[f"textkit.{task_id.split('__')[1]}"],
                    difficulty={"deleted_lines": 10.0 + 5 * k},
                    parent="textkit__wrap" if k == 2 else None,
                ),
            )
        )
    return out


def pool_state(trajectories: list[Trajectory]) -> dict:
    cfg = CurriculumConfig(min_attempts=4, unsolved_attempts=8)
    stats = {i: TaskStats() for i in TASK_IDS}
    stats["textkit__wrap__harder1"].generation = 1
    for t in trajectories:
        s = stats[t.task_id]
        s.attempts += 1
        s.passes += t.reward >= 1.0
        s.reward_sum += t.reward
    for s in stats.values():
        s.groups = s.attempts // GROUP
        rate = (1 + s.passes) / (2 + s.attempts)
        if s.attempts >= cfg.min_attempts and rate > cfg.retire_pass_rate:
            s.status = "retired"
    stats["textkit__wrap"].spawned_harder = True
    return {
        "version": 1,
        "updates": sum(s.groups for s in stats.values()),
        "config": asdict(cfg),
        "tasks": {i: asdict(s) for i, s in stats.items()},
    }


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build(out: Path, name: str, tok: Tokenizer) -> None:
    if out.exists():
        shutil.rmtree(out)
    (out / "trajectories").mkdir(parents=True)
    feedback = name == "report_run"
    run = 0 if feedback else 1
    write_json(
        out / "config.json",
        {"rl": {"group_size": GROUP}, "teacher": {"beta": 0.1 if feedback else 0.0}},
    )
    write_json(out / "versions.json", {"etude": "0.1.0", "python": "3.11"})
    everything: list[Trajectory] = []
    lines = []
    for step in range(1, STEPS + 1):
        batch = []
        for sample, reward in enumerate(REWARDS[name][step - 1]):
            task_id = TASK_IDS[(step + sample // GROUP) % len(TASK_IDS)]
            traj = episode(tok, task_id, step, sample, reward, feedback=feedback)
            traj.info["policy_step"] = step - 1
            batch.append(traj)
        write_jsonl(out / "trajectories" / f"step_{step:06d}.jsonl", batch)
        everything += batch
        record = {"step": step, "time": 1_800_000_000.0 + (30.0 + 2 * run) * step}
        record.update(step_metrics(batch, step, run))
        lines.append(json.dumps(record))
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    save_tasks(out / "tasks" / "tasks.jsonl", tasks())
    save_tasks(out / "pool.json.tasks.jsonl", tasks())
    write_json(out / "pool.json", pool_state(everything))
    write_json(out / "monitor.json", summarize(everything))
    tok.save(out / "tokenizer")


def main(root: Path = HERE) -> None:
    tok = train_tokenizer()
    for name in REWARDS:
        build(root / name, name, tok)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
