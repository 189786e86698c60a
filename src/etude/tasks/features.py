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

Test files are also grouped with each other (``cluster_test_files``): a function executed by the
tests of two files (``test_parse.py`` and ``test_format.py`` both run ``_tokenize``) belongs to
neither file's group, so the files it links form one group, whose feature is the code only the
tests of those files execute, across modules. Files are linked through units executed by at most
``feature_max_test_files`` files (3), and a connected component larger than that is left out:
code every test runs is infrastructure, not a feature.

What this module does not do: group by anything finer than test files (a test class or a marker),
or check that the group's tests really fail without it (validation does).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import PurePosixPath

from etude.tasks.mine import Miner
from etude.tasks.proposal import Feature, ProposalConfig, combine


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


def _unit_tests(miner: Miner) -> dict[tuple[str, str], frozenset[str]]:
    """``(module, qualname) -> passing tests that execute its body`` for every unit a group may
    delete (functions, classes, methods one level down, not dunders or assignments)."""
    out: dict[tuple[str, str], frozenset[str]] = {}
    for module, mod in sorted(miner.index.items()):
        if module not in miner.baseline.importable:
            continue
        for q, unit in mod.units.items():
            if unit.kind == "assignment" or unit.body is None and unit.kind != "class":
                continue
            if unit.kind == "method" and (unit.name.startswith("__") or q.count(".") != 1):
                continue
            hit = miner.tests_of(mod.path, mod, [q])
            if hit:
                out[(module, q)] = frozenset(hit)
    return out


def _reached(
    miner: Miner, unit_tests: dict[tuple[str, str], frozenset[str]], tests: frozenset[str]
) -> dict[str, list[str]]:
    """Per module, the units only ``tests`` execute (a class whole, without its methods)."""
    by_module: dict[str, list[str]] = {}
    for (module, q), hit in unit_tests.items():
        if hit <= tests:
            by_module.setdefault(module, []).append(q)
    out: dict[str, list[str]] = {}
    for module, units in by_module.items():
        kinds = miner.index[module].units
        classes = {q for q in units if kinds[q].kind == "class"}
        kept = [q for q in units if q in classes or q.split(".")[0] not in classes]
        if kept:
            out[module] = kept
    return out


def _file_of(test_id: str) -> str:
    return test_id.split("::", 1)[0]


def cluster_test_files(
    unit_tests: dict[tuple[str, str], frozenset[str]], max_files: int
) -> list[tuple[str, ...]]:
    """Sets of 2 to ``max_files`` test files joined by code that only they execute: test files
    are linked when a unit is executed by tests of several files and of at most ``max_files``;
    each connected component that is not larger than ``max_files`` is a cluster (a larger one is
    shared infrastructure, not a feature)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for hit in unit_tests.values():
        files = sorted({_file_of(t) for t in hit})
        if 2 <= len(files) <= max_files:
            for other in files[1:]:
                parent[find(other)] = find(files[0])
    components: dict[str, list[str]] = {}
    for f in list(parent):
        components.setdefault(find(f), []).append(f)
    return sorted(tuple(sorted(c)) for c in components.values() if 2 <= len(c) <= max_files)


def _group(
    miner: Miner,
    reached: dict[str, list[str]],
    cfg: ProposalConfig,
    relaxed: ProposalConfig,
    min_units: int,
) -> Feature | str | None:
    """One feature-sized group from ``reached`` (a Feature), or why not (None: outside
    ``include``)."""
    parts = _group_parts(miner, reached, relaxed)
    units = sum(len(q) for p in parts for _, q in p.definitions)
    if units < min_units:
        return f"{units} units only its tests reach (a symbol feature at most)"
    group = parts[0] if len(parts) == 1 else combine(parts)
    lines = group.deleted_lines
    if lines > cfg.max_feature_lines:
        return f"{lines} lines, outside the budget [1, {cfg.max_feature_lines}]"
    if cfg.include and not all(
        any(fnmatch.fnmatchcase(sym, pat) for pat in cfg.include) for sym in group.symbols
    ):
        return None
    return dataclasses.replace(group, kind="feature", parts=tuple(p.name for p in parts))


def feature_groups(
    miner: Miner, cfg: ProposalConfig, *, min_units: int = 2
) -> tuple[list[Feature], dict[str, str]]:
    """Feature-sized tasks of the package (module docstring) and the groups without one."""
    relaxed = _relaxed(cfg)
    unit_tests = _unit_tests(miner)
    by_file = _tests_by_file(miner.passing)
    groups: list[tuple[str, str, frozenset[str]]] = [
        (f"feature {f}", f"feature.{PurePosixPath(f).stem}", tests)
        for f, tests in sorted(by_file.items())
    ]
    for files in cluster_test_files(unit_tests, cfg.feature_max_test_files):
        stems = "+".join(PurePosixPath(f).stem for f in files)
        tests = frozenset().union(*(by_file[f] for f in files if f in by_file))
        groups.append((f"feature {' + '.join(files)}", f"feature.{stems}", tests))
    features: list[Feature] = []
    skipped: dict[str, str] = {}
    for label, name, tests in groups:
        found = _group(miner, _reached(miner, unit_tests, tests), cfg, relaxed, min_units)
        if isinstance(found, str):
            skipped[label] = found
        elif found is not None:
            features.append(dataclasses.replace(found, name=name))
    return features, skipped
