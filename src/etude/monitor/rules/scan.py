"""Matching: one rule against one event, a whole trajectory, and user rule files."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from etude.env.trajectory import Flag, Trajectory
from etude.monitor.rules.base import TARGETS, Rule, _compile
from etude.monitor.rules.checks import CHECKS, _excerpt
from etude.monitor.rules.context import ScanContext
from etude.monitor.rules.events import Event, extract_events
from etude.monitor.rules.table import BUILTIN_RULES
from etude.tasks.honeypot import Canary


def match_rule(rule: Rule, ev: Event, ctx: ScanContext) -> str | None:
    """Evidence when ``rule`` matches ``ev`` in context ``ctx``, else None."""
    if rule.tools and ev.tool not in rule.tools:
        return None
    pkgs = ctx.packages
    # cheapest tests first: path regexes, the pattern, the exception, then the state
    hits: list[str] = []
    if rule.path:
        rx = _compile(rule.path, pkgs)
        hits = [p for p in ev.paths if rx.search(p)]
        if not hits:
            return None
    if rule.not_path:
        rx = _compile(rule.not_path, pkgs)
        if any(rx.search(p) for p in ev.paths):
            return None
    match = None
    if rule.pattern:
        match = _compile(rule.pattern, pkgs).search(ev.text)
        if match is None:
            return None
    if rule.unless and _compile(rule.unless, pkgs).search(ev.text):
        return None
    if rule.unless_program:
        rx = _compile(rule.unless_program, pkgs)
        if any(rx.fullmatch(p) for p in ev.programs):
            return None
    if rule.when == "foreign_history" and ctx.own_history:
        return None
    if rule.when == "own_history" and not ctx.own_history:
        return None
    if rule.when == "preexisting":
        hits = [p for p in hits if ctx.existed(p, ev)]
    elif rule.when == "not_own":
        hits = [p for p in hits if not ctx.is_own(p)]
    if rule.when in ("preexisting", "not_own") and not hits:
        return None
    if rule.check:
        return CHECKS[rule.check](ev, ctx, rule)
    if match is not None:
        return _excerpt(ev.text, *match.span())
    at = ev.text.find(hits[0]) if hits else -1
    return _excerpt(ev.text, at, at + len(hits[0])) if at >= 0 else _excerpt(ev.text, 0, 0)


def scan(
    traj: Trajectory, rules: Sequence[Rule] | None = None, *, canaries: Iterable[Canary] = ()
) -> list[Flag]:
    """Flags for one trajectory: one per (rule, turn), in turn order."""
    rules = BUILTIN_RULES if rules is None else rules
    ctx = ScanContext.build(traj, canaries)
    by_target: dict[str, list[Rule]] = {t: [] for t in TARGETS}
    for rule in rules:
        for t in rule.targets:
            by_target[t].append(rule)
    counts: dict[str, int] = {}
    flags: dict[tuple[str, int], Flag] = {}
    events = extract_events(traj, ctx.packages)
    start = 0
    while start < len(events):
        end = start
        while end < len(events) and events[end].turn == events[start].turn:
            end += 1
        if traj.turns[events[start].turn].role == "assistant":
            # what the turn's commands created is known from their provenance (the tool turns
            # that follow, up to the next assistant turn) before the turn's text is judged
            nxt = end
            while nxt < len(events) and traj.turns[events[nxt].turn].role != "assistant":
                nxt += 1
            ctx.prefold(events[start:nxt])
        for ev in events[start:end]:
            for rule in by_target[ev.target]:
                evidence = match_rule(rule, ev, ctx)
                if evidence is None:
                    continue
                counts[rule.id] = counts.get(rule.id, 0) + 1
                if counts[rule.id] < rule.min_count or (rule.id, ev.turn) in flags:
                    continue
                if rule.min_count > 1:
                    evidence = f"{counts[rule.id]} matches; latest: {evidence}"
                prefix = f"{ev.tool}: " if ev.tool and ev.target != "tool" else ""
                flags[(rule.id, ev.turn)] = Flag(
                    rule=rule.id,
                    category=rule.category,
                    severity=rule.severity,
                    turn=ev.turn,
                    evidence=(prefix + evidence)[:400],
                )
        ctx.update(events[start:end])
        start = end
    return sorted(
        flags.values(), key=lambda f: (f.turn if f.turn is not None else -1, -f.severity, f.rule)
    )


# ------------------------------------------------------------------------------------ the table


_RULE_FIELDS = {f.name for f in fields(Rule)}


def rule_from_dict(data: dict[str, Any], where: str = "rule") -> Rule:
    """A ``Rule`` from a TOML/JSON table; list values become tuples, ``target`` is an alias."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a table, got {data!r}")
    data = dict(data)
    data.pop("enabled", None)
    if "target" in data:
        data["targets"] = data.pop("target")
    unknown = sorted(set(data) - _RULE_FIELDS)
    if unknown:
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r}; valid keys: enabled, target, {', '.join(sorted(_RULE_FIELDS))}"
        )
    for key in ("targets", "tools"):
        if isinstance(data.get(key), str):
            data[key] = (data[key],)
        elif isinstance(data.get(key), list):
            data[key] = tuple(data[key])
    try:
        return Rule(**data)
    except TypeError as e:
        raise ValueError(
            f"{where}: {e}; a rule needs id, category, severity, description, targets"
        ) from None


def load_rules(path: str | Path, *, base: Sequence[Rule] | None = None) -> list[Rule]:
    """The built-in table (or ``base``) merged with the rules of a TOML or JSON file.

    TOML: ``[[rule]]`` tables. JSON: a list of objects or ``{"rules": [...]}``. A rule whose id
    exists replaces it in place; ``enabled = false`` with an existing id removes that rule.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"rules file {str(path)!r} does not exist; point monitor.rules_file at a TOML or JSON file"
        )
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
            entries = data.get("rules") if isinstance(data, dict) else data
        else:
            data = tomllib.loads(text)
            entries = data.get("rule", data.get("rules"))
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"rules file {str(path)!r} does not parse: {e}") from None
    if not isinstance(entries, list):
        raise ValueError(
            f"rules file {str(path)!r} must hold [[rule]] tables (TOML) or a list of rules (JSON)"
        )
    merged = {r.id: r for r in (BUILTIN_RULES if base is None else base)}
    for n, entry in enumerate(entries):
        where = f"{path}: rule #{n + 1}"
        if isinstance(entry, dict) and entry.get("enabled", True) is False:
            if entry.get("id") not in merged:
                raise ValueError(
                    f"{where}: disables unknown rule {entry.get('id')!r}; check the id"
                )
            del merged[entry["id"]]
            continue
        rule = rule_from_dict(entry, where)
        merged[rule.id] = rule
    return list(merged.values())
