"""Reward-hacking monitor: rules over trajectories, an optional judge model, honeypots, reports.

- ``rules``: a data-driven table of patterns over tool calls, commands, written code and
  observations; ``scan(trajectory)`` returns ``Flag``s with rule, category, severity, turn and
  evidence; ``load_rules(path)`` merges a user's TOML/JSON rules with the built-ins.
- ``judge``: an optional model behind an OpenAI-compatible endpoint that audits a condensed
  trajectory; its failures are "unavailable", never "clean".
- ``hook``: ``apply_monitor`` for the RL trainer: flags, zeroes rewards at a severity threshold,
  returns counts for metrics.
- ``report``: ``summarize``/``format_summary`` and ``monitor_main`` (``etude monitor RUN_OR_JSONL``).

Honeypot canaries are planted by the task builder (``etude.tasks.honeypot``) and checked here.
See ``docs/monitor.md`` for the rule table and what the monitor cannot catch.
"""

from etude.monitor.hook import MonitorConfig, MonitorStats, apply_monitor
from etude.monitor.judge import JudgeConfig, Verdict, condense, judge_trajectory, parse_verdict
from etude.monitor.report import format_summary, monitor_main, summarize
from etude.monitor.rules import BUILTIN_RULES, CATEGORIES, Rule, load_rules, scan

__all__ = [
    "BUILTIN_RULES",
    "CATEGORIES",
    "JudgeConfig",
    "MonitorConfig",
    "MonitorStats",
    "Rule",
    "Verdict",
    "apply_monitor",
    "condense",
    "format_summary",
    "judge_trajectory",
    "load_rules",
    "monitor_main",
    "parse_verdict",
    "scan",
    "summarize",
]
