"""The trainer's monitor hook: flag trajectories, zero the reward of hacks, count for metrics.

The RL trainer calls ``apply_monitor`` after rewards are computed and before advantages
(docs/architecture.md data flow: rollout -> monitor -> advantages). For each trajectory it runs the rule
table (``etude.monitor.rules``, plus a user rules file), checks the task's honeypot canaries,
optionally asks the judge (``etude.monitor.judge``), and writes the result to ``traj.flags``.
A trajectory whose worst flag reaches ``min_severity_to_zero`` gets reward 0.0 (the original is
kept in ``traj.info["reward_before_monitor"]``). With group-relative advantages a zero reward
can never be above its group's mean, so a hack never gets a positive advantage. With
``feedback_hints`` each flagged assistant turn also gets a text-feedback hint (kind
``monitor``), so the hinted teacher of ``etude.rl.feedback`` can steer away from the hack.

What it does not do: decide anything about groups (dropping zero-variance groups is the
trainer's business) or block the episode while it runs (the monitor reads finished
trajectories).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from etude.env.trajectory import Trajectory
from etude.monitor.hints import flag_feedback
from etude.monitor.judge import JudgeConfig, judge_many, verdict_flags
from etude.monitor.rules import BUILTIN_RULES, Rule, load_rules, scan
from etude.tasks.honeypot import Canary, load_canaries

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class MonitorConfig:
    """The ``[monitor]`` section of a training recipe."""

    enabled: bool = True
    """Run the monitor on every batch of trajectories."""
    min_severity_to_zero: int = 3
    """Zero the reward when a flag reaches this severity (5: log only, never zero)."""
    rules_file: str = ""
    """A TOML/JSON file of extra or overriding rules ('' uses the built-in table alone)."""
    canaries_file: str = ""
    """Canaries by task: a tasks.jsonl whose records carry ``etude.canaries``, or a JSON map."""
    feedback_hints: bool = False
    """Add a text-feedback hint (kind ``monitor``) at each flagged turn of a zeroed trajectory."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The optional judge model (off by default)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_severity_to_zero <= 5:
            raise ValueError(
                f"monitor.min_severity_to_zero must be in 1..5 (5 logs without zeroing), got {self.min_severity_to_zero}"
            )
        for name in ("rules_file", "canaries_file"):
            value = getattr(self, name)
            if value and not Path(value).is_file():
                raise ValueError(
                    f"monitor.{name}={value!r} does not exist; fix the path or set it to ''"
                )


@dataclass(kw_only=True, slots=True)
class MonitorStats:
    """What the monitor did to one batch, for the step's metrics."""

    num_trajectories: int = 0
    num_flagged: int = 0
    """Trajectories with at least one flag of severity >= 1."""
    num_zeroed: int = 0
    """Trajectories whose reward was set to zero."""
    reward_removed: float = 0.0
    """Sum of the rewards that were zeroed."""
    num_judge_unavailable: int = 0
    by_rule: dict[str, int] = field(default_factory=dict)
    """Trajectories flagged by each rule (any severity, ``judge.unavailable`` included)."""
    by_category: dict[str, int] = field(default_factory=dict)
    """Trajectories flagged in each category (severity >= 1)."""

    def metrics(self, prefix: str = "monitor/") -> dict[str, float]:
        """Flat metrics: counts, the zeroed fraction, and one entry per rule and category."""
        out = {
            f"{prefix}flagged": float(self.num_flagged),
            f"{prefix}zeroed": float(self.num_zeroed),
            f"{prefix}zeroed_frac": self.num_zeroed / max(1, self.num_trajectories),
            f"{prefix}reward_removed": self.reward_removed,
            f"{prefix}judge_unavailable": float(self.num_judge_unavailable),
        }
        out.update({f"{prefix}rule/{k}": float(v) for k, v in sorted(self.by_rule.items())})
        out.update({f"{prefix}category/{k}": float(v) for k, v in sorted(self.by_category.items())})
        return out


@functools.lru_cache(maxsize=8)
def _rules_cached(path: str, mtime_ns: int) -> tuple[Rule, ...]:
    return tuple(load_rules(path))


def rules_for(cfg: MonitorConfig) -> tuple[Rule, ...]:
    """The built-in table merged with ``cfg.rules_file`` (re-read when the file changes)."""
    if not cfg.rules_file:
        return BUILTIN_RULES
    return _rules_cached(cfg.rules_file, Path(cfg.rules_file).stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _canaries_cached(path: str, mtime_ns: int) -> dict[str, list[Canary]]:
    return load_canaries(path)


def apply_monitor(
    trajectories: Sequence[Trajectory],
    cfg: MonitorConfig,
    *,
    canaries_by_task: Mapping[str, Sequence[Canary]] | None = None,
) -> MonitorStats:
    """Flag every trajectory and zero the reward of those at or above the severity threshold.

    Sets ``traj.flags`` (replacing earlier monitor flags, so a second call is idempotent); a
    zeroed trajectory keeps its first reward in ``info["reward_before_monitor"]`` and gets
    ``info["monitor"] = {"max_severity", "zeroed"}``. Zero reward keeps a hack out of the
    positive advantages of its group. ``canaries_by_task`` adds to ``cfg.canaries_file``.
    """
    stats = MonitorStats(num_trajectories=len(trajectories))
    if not cfg.enabled:
        return stats
    rules = rules_for(cfg)
    canaries: dict[str, list[Canary]] = {}
    if cfg.canaries_file:
        path = cfg.canaries_file
        canaries.update(_canaries_cached(path, Path(path).stat().st_mtime_ns))
    for task_id, items in (canaries_by_task or {}).items():
        canaries[task_id] = [*canaries.get(task_id, []), *items]
    flags_of = [scan(t, rules, canaries=canaries.get(t.task_id, ())) for t in trajectories]
    if cfg.judge.enabled:
        for flags, verdict in zip(flags_of, judge_many(list(trajectories), cfg.judge)):
            flags += verdict_flags(verdict, cfg.judge)
    threshold = cfg.min_severity_to_zero
    for traj, flags in zip(trajectories, flags_of):
        traj.flags = flags
        worst = max((f.severity for f in flags), default=-1)
        for rule in {f.rule for f in flags}:
            stats.by_rule[rule] = stats.by_rule.get(rule, 0) + 1
        for category in {f.category for f in flags if f.severity >= 1}:
            stats.by_category[category] = stats.by_category.get(category, 0) + 1
        stats.num_judge_unavailable += any(f.rule == "judge.unavailable" for f in flags)
        stats.num_flagged += worst >= 1
        for flag in flags:
            if flag.severity >= 1:
                logger.info(
                    "monitor: %s turn %s %s (%d): %s",
                    traj.task_id,
                    flag.turn,
                    flag.rule,
                    flag.severity,
                    flag.evidence,
                )
        zeroed = worst >= threshold
        if zeroed:
            before = traj.info.setdefault("reward_before_monitor", traj.reward)
            stats.reward_removed += float(before or 0.0)
            stats.num_zeroed += 1
            traj.reward = 0.0
            top = max(flags, key=lambda f: f.severity)
            logger.warning(
                "monitor: zeroed reward of %s (was %s): %s: %s",
                traj.task_id,
                before,
                top.rule,
                top.evidence,
            )
            if cfg.feedback_hints:
                traj.feedback += flag_feedback(traj, flags, min_severity=threshold, rules=rules)
        traj.info["monitor"] = {"max_severity": max(worst, 0), "zeroed": zeroed}
    return stats
