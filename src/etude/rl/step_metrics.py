"""The metrics of one RL step, summed over ranks: reward, pass rate, tool-call error rates per
turn, hints, the loss terms, throughput (``etude.rl.trainer.RLRun.log`` writes them to
``metrics.jsonl``; ``etude.report`` plots them). Means are ratios of global sums, so a step's
numbers are the same on 1 rank or N.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from etude.env.trajectory import ERROR_KINDS, Trajectory
from etude.rl.teacher import HintedTurn
from etude.rl.update import StepSums, is_graded
from etude.runtime import all_reduce_sum, world


def error_rates(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    turns = sum(1 for t in trajectories for _ in t.assistant_turns())
    counts = Counter(
        e.kind for t in trajectories for _, turn in t.assistant_turns() for e in turn.errors
    )
    return {"turns": float(turns), **{f"err/{k}": float(counts.get(k, 0)) for k in ERROR_KINDS}}


def step_metrics(
    trajectories: Sequence[Trajectory],
    passed: Sequence[bool],
    zero_var: Sequence[bool],
    hinted: Sequence[HintedTurn],
    sums: StepSums,
    rstats: Any,
    train_seconds: float,
    grad_norm: float,
    *,
    num_groups: int,
    num_minibatches: int,
) -> dict[str, float]:
    """The step's metrics, summed over ranks (means are ratios of global sums)."""
    local: dict[str, float] = {
        # infrastructure failures have no reward: the means run over scored episodes
        "episodes": sum(1 for t in trajectories if is_graded(t)),
        "reward_sum": sum(float(t.reward or 0.0) for t in trajectories),
        "grade_infra": sum(not is_graded(t) for t in trajectories),
        "passed": sum(passed),
        "zero_var_groups": sum(zero_var) / max(len(zero_var), 1) * num_groups,
        "hinted_turns": len({(h.row, h.turn) for h in hinted}),
        "hints_detected": sum(len(t.feedback) for t in trajectories),
        "gen_tokens": rstats.generated_tokens,
        "rollout_seconds": rstats.seconds,
        "train_seconds": train_seconds,
        "episode_tokens": sum(len(t.token_ids) for t in trajectories),
        **error_rates(trajectories),
        **{k: float(v) for k, v in sums.values.items()},
    }
    kinds = Counter(f.kind for t in trajectories for f in t.feedback)
    for kind in sorted(kinds):
        local[f"hint/{kind}"] = kinds[kind]
    keys = sorted(local)
    if world()[1] > 1:
        # ranks may have seen different hint kinds: agree on the key set first
        gathered: list[list[str]] = [[] for _ in range(world()[1])]
        dist.all_gather_object(gathered, keys)
        keys = sorted({k for ks in gathered for k in ks})
    total = dict(zip(keys, all_reduce_sum([float(local.get(k, 0.0)) for k in keys])))
    world_size = world()[1]
    episodes = max(total["episodes"], 1.0)
    tokens = max(total.get("tokens", 0.0), 1.0)
    turns = max(total["turns"], 1.0)
    out = {
        "loss": total.get("loss", 0.0) / num_minibatches,
        "pg_loss": total.get("pg_loss", 0.0) / num_minibatches,
        "reward": total["reward_sum"] / episodes,
        "grade_infra": total["grade_infra"],
        "pass_rate": total["passed"] / episodes,
        "zero_var_groups": total["zero_var_groups"],
        "hints": total["hinted_turns"],
        "hints_detected": total["hints_detected"],
        "kl": total.get("kl_sum", 0.0) / max(total.get("kl_tokens", 0.0), 1.0),
        "kl_tokens": total.get("kl_tokens", 0.0),
        "entropy": total.get("entropy", 0.0) / tokens,
        "clip_frac": total.get("clip_frac", 0.0) / tokens,
        "ratio": total.get("ratio", 0.0) / tokens,
        "behavior_kl": total.get("behavior_kl", 0.0) / tokens,
        "grad_norm": grad_norm,
        "turns_per_episode": total["turns"] / episodes,
        "tokens_per_episode": total["episode_tokens"] / episodes,
        "trained_tokens": total.get("tokens", 0.0),
        # throughput of the whole job: tokens over the slowest rank's time
        "rollout_tok/s": total["gen_tokens"] / max(total["rollout_seconds"] / world_size, 1e-9),
        "train_tok/s": total["episode_tokens"] / max(total["train_seconds"] / world_size, 1e-9),
    }
    if "ref_kl" in total:
        out["ref_kl"] = total["ref_kl"] / tokens
    if total.get("shift_hinted_n", 0.0) > 0:
        out["shift/hinted"] = total["shift_hinted"] / total["shift_hinted_n"]
        out["shift/other"] = total["shift_other"] / max(total["shift_other_n"], 1.0)
    if total.get("teacher_minus_student_n", 0.0) > 0:
        out["teacher_minus_student"] = (
            total["teacher_minus_student"] / total["teacher_minus_student_n"]
        )
    for kind in ERROR_KINDS:
        out[f"err/{kind}"] = total[f"err/{kind}"] / turns
    for key in keys:
        if key.startswith("hint/"):
            out[key] = total[key]
    assert all(math.isfinite(v) for v in out.values()), out
    return out
