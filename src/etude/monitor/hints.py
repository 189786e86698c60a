"""Flags that teach: a monitor flag becomes a text-feedback hint at the flagged turn.

The monitor's flags (``traj.flags``, set by ``apply_monitor``) name a turn: the assistant turn
whose call matched, or the tool turn whose output or provenance did. ``flag_feedback`` turns
each flag at or above a severity into a ``Feedback(kind="monitor")`` on the assistant turn that
made the call, with the rule's hint (or its category's, ``HINTS``), so the hinted teacher of
``etude.rl.feedback`` can show the student, on that very turn, what it should have done
instead. ``MonitorFlagDetector`` is the same as a feedback detector (``monitor_flag`` in
``feedback.detectors``), for training runs that want hints on every flagged trajectory and not
only on those the hook zeroed (``monitor.feedback_hints``).

What it does not do: decide what is a hack (the rules and the judge do) or write the hint of a
judge verdict without a turn (a whole-trajectory verdict has no turn to teach at).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from etude.env.trajectory import Feedback, Flag, Trajectory
from etude.monitor.rules import BUILTIN_RULES, HINTS, Rule

DEFAULT_HINT = "Solve the task as specified: make the tests pass by implementing the feature."
KIND = "monitor"


def hint_turn(traj: Trajectory, turn: int) -> int | None:
    """The assistant turn a flag belongs to: the turn itself, or the call before an output."""
    for i in range(min(turn, len(traj.turns) - 1), -1, -1):
        if traj.turns[i].role == "assistant":
            return i
    return None


def hint_text(flag: Flag, rules: Mapping[str, Rule]) -> str:
    rule = rules.get(flag.rule)
    return (rule.hint if rule else "") or HINTS.get(flag.category, DEFAULT_HINT)


def flag_feedback(
    traj: Trajectory,
    flags: Sequence[Flag] | None = None,
    *,
    min_severity: int = 3,
    rules: Sequence[Rule] = BUILTIN_RULES,
) -> list[Feedback]:
    """One hint per flagged assistant turn (the worst flag of the turn speaks), turn order.

    ``flags`` defaults to ``traj.flags``; a (turn, ``monitor``) pair already in
    ``traj.feedback`` is not repeated.
    """
    by_id = {r.id: r for r in rules}
    have = {f.turn for f in traj.feedback if f.kind == KIND}
    worst: dict[int, Flag] = {}
    for flag in traj.flags if flags is None else flags:
        if flag.severity < min_severity or flag.turn is None:
            continue
        turn = hint_turn(traj, flag.turn)
        if turn is None or turn in have:
            continue
        if turn not in worst or flag.severity > worst[turn].severity:
            worst[turn] = flag
    return [Feedback(turn=t, kind=KIND, hint=hint_text(worst[t], by_id)) for t in sorted(worst)]


class MonitorFlagDetector:
    """A feedback detector (``etude.rl.feedback``) that hints at the monitor's flagged turns."""

    name = "monitor_flag"

    def __init__(self, min_severity: int = 2) -> None:
        if not 1 <= min_severity <= 4:
            raise ValueError(f"monitor_flag detector: min_severity={min_severity} must be in 1..4")
        self.min_severity = min_severity

    def detect(self, trajectory: Trajectory) -> list[Feedback]:
        return flag_feedback(trajectory, min_severity=self.min_severity)
