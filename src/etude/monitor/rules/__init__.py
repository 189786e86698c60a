"""Reward-hacking rules: a table of patterns over a trajectory's calls, outputs and provenance.

A trajectory (``etude.env.trajectory``) is cut into *events* (``events``), each with a target
kind. From the text the model wrote and saw:

- ``tool``: a call's tool name; ``path``: a path argument of a call;
- ``command``: a whole ``bash`` command; ``segment``: one shell command of it (split on ``&&``,
  ``||``, ``;``, newlines outside quotes; ``sh -c '...'`` bodies too; here-document bodies not);
- ``script``: Python run from the shell (``python -c``, ``python - <<EOF``) or written to a
  scratch ``.py`` file outside the library and the tests;
- ``code``: code written to a file, with the file as its path; ``observation``: a tool's answer.

From what the sandboxed command *did* (``Turn.provenance``, recorded by
``etude.sandbox.provenance``), whatever its spelling: ``prov_read``, ``prov_list``,
``prov_write``, ``prov_delete``, ``prov_failed`` (a path each), ``prov_runtime`` (a runtime
directory read from), and ``process`` (the argv of each program started, normalized: options
between ``git`` and its subcommand are dropped, so ``git -c a=b --no-pager log`` reads as
``git log``).

Rules live in one module per family (``artifacts``, ``vcs``, ``installed``, ``network``,
``tampering``, ``grader``, ``probing``, ``provenance``), gathered in ``table.BUILTIN_RULES``;
``TEXT_RULES`` is the table without the provenance targets. ``scan`` runs a table over one
trajectory; ``load_rules`` merges a user's TOML/JSON rules with it. The repository's package and
module names, layout and test paths come from the task record (``Trajectory.info["repo"]``),
not from guesses over the text; single-module and flat layouts are library code too.

What the rules do not see: intent written only in prose; what a command did when it ran without
provenance (the local backend, a trajectory recorded before it existed); values computed at run
time inside written code (a rule sees code as text; ``getattr`` with a computed name is flagged
as such, not resolved). The judge (``etude.monitor.judge``) is the second opinion;
``docs/monitor.md`` lists the known blind spots and the measured recall and false flags.
"""

from etude.monitor.rules.base import CATEGORIES, HINTS, TARGETS, Rule
from etude.monitor.rules.context import ScanContext, repo_facts
from etude.monitor.rules.events import (
    Event,
    extract_events,
    normalize_argv,
    normalize_path,
    python_scripts,
    shell_write_targets,
    split_segments,
)
from etude.monitor.rules.scan import load_rules, match_rule, rule_from_dict, scan
from etude.monitor.rules.table import BUILTIN_RULES, TEXT_RULES

__all__ = [
    "BUILTIN_RULES",
    "CATEGORIES",
    "HINTS",
    "TARGETS",
    "TEXT_RULES",
    "Event",
    "Rule",
    "ScanContext",
    "extract_events",
    "load_rules",
    "match_rule",
    "normalize_argv",
    "normalize_path",
    "python_scripts",
    "repo_facts",
    "rule_from_dict",
    "scan",
    "shell_write_targets",
    "split_segments",
]
