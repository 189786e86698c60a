"""Task quality: a difficulty score from several signals, a floor, and one task per F2P set.

A task that deletes ``return self._threshold`` and is checked by one test teaches little, and ten
tasks with the same FAIL_TO_PASS set reward the same behaviour ten times. So every record
carries ``etude.difficulty`` with these signals and a combined ``score``:

- ``deleted_lines``: lines of the deleted definitions (and files);
- ``deleted_statements``: statements of the deleted code (docstrings not counted);
- ``num_fail_to_pass``: tests that must go from failing to passing;
- ``callers``: places in the remaining tests and package that name the deleted interface;
- ``num_files``: files the deletion touched;
- ``detail_rank``: 0 for a full statement, 1 docstring only, 2 failing tests only.

``score = log2(1 + deleted_statements) + 0.5 log2(1 + num_fail_to_pass) + 0.5 log2(1 + callers)
+ (num_files - 1) + 0.5 detail_rank``: statements dominate (the work of re-implementing), and
more tests, more callers (more constraints to satisfy), more files and less detail each add.
A one-statement getter with one test and one caller scores 2.0; a ten-statement function with
five tests and five callers 6.0. ``min_difficulty`` (default 2.5) is the floor: a candidate below
it is rejected before any test runs when even its candidate tests cannot lift it over, and after
validation otherwise.

``dedupe_by_fail_to_pass`` keeps one task per FAIL_TO_PASS set: the one with the highest score
(the earliest on a tie); the others are rejected with the id of the one kept.

What this module does not do: measure how hard a task is for a model (the curriculum's pass
rates do that during training); the score only orders and filters.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterable, Mapping

from etude.tasks.proposal import Feature
from etude.tasks.record import TaskRecord


def _count_statements(node: ast.AST) -> int:
    count = 0
    for sub in ast.walk(node):
        if not isinstance(sub, ast.stmt) or sub is node:
            continue
        if isinstance(sub, ast.Expr) and isinstance(sub.value, ast.Constant):
            continue  # docstrings and bare constants
        if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue  # a nested definition counts by its body
        count += 1
    return count


def deleted_statements(sources: Mapping[str, str], feature: Feature) -> int:
    """Statements of the code ``feature`` deletes (definitions and whole files)."""
    total = 0
    for path, quals in feature.definitions:
        try:
            tree = ast.parse(sources[path])
        except (SyntaxError, ValueError):
            continue
        wanted = set(quals)
        for stmt in tree.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if stmt.name in wanted:
                    total += _count_statements(stmt)
                    continue
                if isinstance(stmt, ast.ClassDef):
                    for item in stmt.body:
                        if f"{stmt.name}.{getattr(item, 'name', '')}" in wanted:
                            total += _count_statements(item)
            elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                total += any(n in wanted for n in names)
    for path in feature.files:
        if path.endswith(".py"):
            try:
                total += _count_statements(ast.parse(sources[path]))
            except (SyntaxError, ValueError):
                continue
    return total


def count_callers(feature: Feature, files: Iterable[tuple[str, bytes]]) -> int:
    """Occurrences of the interface's short names (as words) in ``files`` (the remaining tree's
    Python files)."""
    names = {s.rsplit(".", 1)[-1] for s in feature.interface}
    names = {n for n in names if n.isidentifier()}
    if not names:
        return 0
    pattern = re.compile(r"\b(?:" + "|".join(map(re.escape, sorted(names))) + r")\b")
    total = 0
    for path, data in files:
        if path.endswith(".py"):
            total += len(pattern.findall(data.decode("utf-8", "replace")))
    return total


def difficulty_score(
    *,
    deleted_statements: int,
    num_fail_to_pass: int,
    callers: int,
    num_files: int,
    detail_rank: int,
) -> float:
    """The combined score (module docstring)."""
    score = (
        math.log2(1 + deleted_statements)
        + 0.5 * math.log2(1 + num_fail_to_pass)
        + 0.5 * math.log2(1 + callers)
        + max(0, num_files - 1)
        + 0.5 * detail_rank
    )
    return round(score, 3)


def difficulty(
    *,
    deleted_lines: int,
    deleted_statements: int,
    num_fail_to_pass: int,
    callers: int,
    num_files: int,
    num_symbols: int,
    detail_rank: int,
) -> dict[str, float]:
    """The record's ``etude.difficulty`` object: every signal and the score."""
    return {
        "deleted_lines": deleted_lines,
        "deleted_statements": deleted_statements,
        "num_symbols": num_symbols,
        "num_files": num_files,
        "num_fail_to_pass": num_fail_to_pass,
        "callers": callers,
        "detail_rank": detail_rank,
        "score": difficulty_score(
            deleted_statements=deleted_statements,
            num_fail_to_pass=num_fail_to_pass,
            callers=callers,
            num_files=num_files,
            detail_rank=detail_rank,
        ),
    }


def dedupe_by_fail_to_pass(records: list[TaskRecord]) -> tuple[list[TaskRecord], dict[str, str]]:
    """One record per FAIL_TO_PASS set (module docstring): ``(kept in order, dropped -> reason)``."""
    best: dict[tuple[str, ...], TaskRecord] = {}
    for r in records:
        key = tuple(sorted(r.FAIL_TO_PASS))
        kept = best.get(key)
        if kept is None or _score(r) > _score(kept):
            best[key] = r
    winners = {id(r) for r in best.values()}
    dropped = {
        r.instance_id: (
            f"duplicate FAIL_TO_PASS set: same {len(r.FAIL_TO_PASS)} tests as "
            f"{best[tuple(sorted(r.FAIL_TO_PASS))].instance_id}, which scores higher or came first"
        )
        for r in records
        if id(r) not in winners
    }
    return [r for r in records if id(r) in winners], dropped


def _score(record: TaskRecord) -> float:
    if record.etude is None:
        return 0.0
    return float(record.etude.difficulty.get("score", 0.0))
