"""Feature-sized tasks: a group of tests and the code only they reach, deleted together.

The miner's own features are one public definition with its private helpers. A feature as a
developer means it is larger: a test file's worth of behaviour, implemented by several functions
and methods, often in more than one module. FeatureBench builds such tasks from the tests' side,
and so does ``feature_groups``: for every test file with passing tests, the units of the package
(functions, classes, methods, private helpers) whose body is executed by tests of that file and
by no other passing test are the feature. Per module, the largest subset of them that passes the
miner's static checks (``Miner.custom_feature``: nothing outside the set uses them, at import or
run time; no other test file needs them to be collected) is kept, grown greedily, and knowing what the group deletes in the other modules (a unit of one module
may use a unit of another: both go); the modules' parts are then deleted together
(``combine``), so a task can span files. A group needs at least
``min_units`` units in all, otherwise it is a symbol feature the miner already offers.

What this module does not do: group by anything but test files (a test class or a marker would
be finer), or check that the group's tests really fail without it (validation does).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import PurePosixPath

from etude.tasks.mine import Feature, Miner, ProposalConfig, combine


def _relaxed(cfg: ProposalConfig) -> ProposalConfig:
    return dataclasses.replace(
        cfg,
        max_lines=max(cfg.max_lines, cfg.max_feature_lines),
        max_test_fraction=1.0,
        include=(),
    )


def _tests_by_file(passing: frozenset[str]) -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for test_id in passing:
        out.setdefault(test_id.split("::", 1)[0], set()).add(test_id)
    return {k: frozenset(v) for k, v in out.items()}


def _module_part(
    miner: Miner,
    module: str,
    candidates: list[str],
    cfg: ProposalConfig,
    also_deleted: dict[str, list[str]],
) -> Feature | None:
    """The largest subset of ``candidates`` the miner accepts as one feature (greedy), given
    what the group deletes in other modules (``also_deleted``)."""
    whole = miner.custom_feature(module, candidates, cfg, also_deleted=also_deleted)
    if isinstance(whole, Feature):
        return whole
    chosen: list[str] = []
    changed = True
    while changed:
        changed = False
        for q in candidates:
            if q in chosen:
                continue
            trial = miner.custom_feature(module, [*chosen, q], cfg, also_deleted=also_deleted)
            if isinstance(trial, Feature):
                chosen.append(q)
                changed = True
    if not chosen:
        return None
    found = miner.custom_feature(module, chosen, cfg, also_deleted=also_deleted)
    return found if isinstance(found, Feature) else None


def _group_parts(miner: Miner, reached: dict[str, list[str]], cfg: ProposalConfig) -> list[Feature]:
    """Per module, the part of ``reached`` that can go, knowing what goes elsewhere; repeated
    until the choice settles (a module's part shrinking can make another's impossible)."""
    chosen = {m: list(q) for m, q in reached.items()}
    parts: dict[str, Feature] = {}
    for _ in range(3):
        parts = {}
        for module, candidates in sorted(reached.items()):
            others = {m: q for m, q in chosen.items() if m != module and q}
            part = _module_part(miner, module, candidates, cfg, others)
            if part is not None:
                parts[module] = part
        settled = {m: list(parts[m].definitions[0][1]) if m in parts else [] for m in reached}
        if settled == chosen:
            break
        chosen = settled
    return [parts[m] for m in sorted(parts)]


def feature_groups(
    miner: Miner, cfg: ProposalConfig, *, min_units: int = 2
) -> tuple[list[Feature], dict[str, str]]:
    """Feature-sized tasks of the package (module docstring) and the test files without one."""
    relaxed = _relaxed(cfg)
    features: list[Feature] = []
    skipped: dict[str, str] = {}
    by_file = _tests_by_file(miner.passing)
    for test_file, tests in sorted(by_file.items()):
        by_module: dict[str, list[str]] = {}
        for module, mod in sorted(miner.index.items()):
            if module not in miner.baseline.importable:
                continue
            reached: list[str] = []
            for q, unit in mod.units.items():
                if unit.kind == "assignment" or unit.body is None and unit.kind != "class":
                    continue
                if unit.kind == "method" and (unit.name.startswith("__") or q.count(".") != 1):
                    continue
                if "." in q and q.split(".")[0] in reached:
                    continue  # the class is deleted whole
                hit = miner.tests_of(mod.path, mod, [q])
                if hit and hit <= tests:
                    reached.append(q)
            classes = {q for q in reached if mod.units[q].kind == "class"}
            reached = [q for q in reached if q.split(".")[0] not in classes or q in classes]
            if reached:
                by_module[module] = reached
        parts = _group_parts(miner, by_module, relaxed)
        units = sum(len(q) for p in parts for _, q in p.definitions)
        label = f"feature {test_file}"
        if units < min_units:
            skipped[label] = f"{units} units only its tests reach (a symbol feature at most)"
            continue
        group = parts[0] if len(parts) == 1 else combine(parts)
        lines = group.deleted_lines
        if lines > cfg.max_feature_lines:
            skipped[label] = f"{lines} lines, outside the budget [1, {cfg.max_feature_lines}]"
            continue
        if cfg.include and not all(
            any(fnmatch.fnmatchcase(sym, pat) for pat in cfg.include) for sym in group.symbols
        ):
            continue
        stem = PurePosixPath(test_file).stem
        features.append(
            dataclasses.replace(
                group,
                kind="feature",
                name=f"feature.{stem}" if stem else "feature",
                parts=tuple(p.name for p in parts),
            )
        )
    return features, skipped
