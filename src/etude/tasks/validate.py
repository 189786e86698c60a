"""Validate a feature-deletion task by running its tests, and re-check a finished record.

A task is valid when, all in the sandbox:

1. the package still imports (every module that imported before, but the deleted ones);
2. on the broken workspace, at least one candidate test fails (those become FAIL_TO_PASS) and
   every other test that passed in the baseline still passes (PASS_TO_PASS); a baseline-passing
   test outside the candidates that fails rejects the task (the deletion broke something else);
3. with trivial bodies (``raise NotImplementedError``, then ``pass``) in place of the feature, the
   FAIL_TO_PASS tests still fail: tests that a stub passes say nothing about the feature and are
   dropped from FAIL_TO_PASS (the task is rejected if none remain);
4. the gold patch (broken -> original) applies with ``git apply``, restores the original files
   byte for byte, and makes every FAIL_TO_PASS and PASS_TO_PASS test pass (only FAIL_TO_PASS
   without ``gold_full_suite``), in runs the grader calls sound (a gold tree whose tests pass but
   whose run reports tampering or ends short would be scored 0 by the reward, so it makes no
   task). The gold tree is graded ``gold_runs`` times: a test failing in every run rejects the
   task; one failing in some runs only is flaky (the tree is the baseline's, byte for byte) and
   leaves FAIL_TO_PASS and PASS_TO_PASS, so a socket or timing test that fails under load does
   not score a correct solution 0 at training time.

Every test run goes through the grader the reward uses (``etude.sandbox.grader``), with the
record's test environment and pytest arguments: the broken and stub trees are graded as they
are, the gold tree as an agent's final tree is (only its changes to the package source, applied
to a pristine copy of the broken workspace), so a valid task is one whose gold patch the reward
itself scores 1.0. Broken-tree runs execute the whole suite with
``--continue-on-collection-errors``: a deleted module makes its test files uncollectable, and
their tests count as failing. Runs with explicit ids (stubs, gold) are used only where every id
is collectable. Every run happens in a scratch copy; the shipped workspace is never executed in.

``check_record`` re-validates a finished record from the record alone (``etude tasks check``):
the workspace's commit, F2P failing and P2P passing on it, the gold patch passing both, the stubs
failing F2P, and a fresh leak scan (the deleted code is what the gold patch adds back).

What this module does not do: choose features, delete code or build workspaces; nor guard
against tests that pass by accident (randomness, order dependence) beyond the baseline's
flakiness filter and the repeated gold runs: a test that flakes in none of the build's runs
still reaches the record.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etude.sandbox.cleanroom import allowed_from_paths
from etude.sandbox.grader import Outcome, grade
from etude.sandbox.pytest import TestRun
from etude.tasks.delete import read_source, write_source
from etude.tasks.leaks import (
    LeakMaterial,
    distinctive_material,
    leak_scan,
    source_code_streams,
    tree_files,
)
from etude.tasks.mine import junit_address, probe_imports
from etude.tasks.patches import (
    StubKind,
    apply_patch,
    patch_added_text,
    patch_paths,
    stub_definitions,
)
from etude.tasks.record import TaskRecord, resolve_workspace, tree_digest
from etude.tasks.sanitize import workspace_head

COLLECT_ANYWAY = ("--continue-on-collection-errors",)
STUB_KINDS: tuple[StubKind, ...] = ("raise", "pass")


def absolute_env(test_env: Mapping[str, str], workspace: Path) -> dict[str, str]:
    """``test_env`` with relative ``PYTHONPATH`` entries made absolute under ``workspace``."""
    env = dict(test_env)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(
            p if os.path.isabs(p) else str(workspace / p)
            for p in env["PYTHONPATH"].split(os.pathsep)
        )
    return env


def copy_tree(src: Path, dest: Path) -> Path:
    """A scratch copy of ``src`` at ``dest`` (symlinks kept as links)."""
    shutil.copytree(src, dest, symlinks=True)
    return dest


@dataclass(kw_only=True, slots=True)
class RunLog:
    """Test runs made for one task: count and sandboxed seconds (for the benchmark)."""

    runs: int = 0
    seconds: float = 0.0

    def add(self, run: Outcome | TestRun | Any) -> None:
        self.runs += 1
        self.seconds += run.seconds if isinstance(run, Outcome) else run.duration


@dataclass(kw_only=True, slots=True)
class Validation:
    """Outcome of validating one task."""

    ok: bool
    """Every check passed."""
    reason: str = ""
    """Why not (first failed check), empty when ok."""
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)
    stub_passing: list[str] = field(default_factory=list)
    """Candidate tests that fail on the broken tree but pass with a trivial body (dropped)."""
    flaky: list[str] = field(default_factory=list)
    """Tests that failed in some gold runs and passed in others (dropped from both lists)."""
    log: RunLog = field(default_factory=RunLog)


def graded_outcomes(outcome: Outcome, canonical: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """The grade's per-test outcomes keyed by the canonical ids of their JUnit addresses."""
    return {canonical.get(junit_address(i), i): o for i, o in outcome.outcomes.items()}


def _not_doctest(test_id: str, package_files: set[str]) -> bool:
    # doctest items live in package modules; they vanish with the docstrings they came from
    return test_id.split("::", 1)[0] not in package_files


def _failing(outcomes: Mapping[str, str], ids: Iterable[str]) -> set[str]:
    return {t for t in ids if outcomes.get(t, "error") != "passed"}


def stub_tree_files(
    originals: Mapping[str, str],
    definitions: Sequence[tuple[str, Sequence[str]]],
    files: Sequence[str],
    kind: StubKind,
) -> dict[str, str]:
    """Path -> source with the feature's bodies trivial (``files``: every function of the file)."""
    out = {}
    for path, qualnames in definitions:
        out[path] = stub_definitions(originals[path], qualnames, kind)
    for path in files:
        out[path] = stub_definitions(originals[path], None, kind)
    return out


def validate_task(
    *,
    sandbox: Any,
    workspace: Path,
    original_tree: Path,
    scratch: Path,
    patch: str,
    originals: Mapping[str, str],
    definitions: Sequence[tuple[str, Sequence[str]]],
    deleted_files: Sequence[str],
    candidates: Iterable[str],
    baseline_passing: Iterable[str],
    canonical: Mapping[tuple[str, str], str],
    importable: Iterable[str],
    deleted_modules: Iterable[str],
    package_files: Iterable[str],
    test_env: Mapping[str, str],
    timeout: float,
    pytest_args: Sequence[str] = (),
    gold_full_suite: bool = True,
    gold_runs: int = 2,
) -> Validation:
    """Validate the broken ``workspace`` (module docstring, steps 1-4).

    ``original_tree`` is the unmodified export; ``originals`` the original texts of the files the
    deletion touched; ``scratch`` an empty directory for the run copies.
    """
    log = RunLog()
    package_files = set(package_files)
    passing = set(baseline_passing)
    candidates = set(candidates) & passing
    args = [*COLLECT_ANYWAY, *pytest_args]
    allowed = allowed_from_paths(patch_paths(patch))  # the package: imported from the tree

    broken = copy_tree(workspace, scratch / "broken")
    env = absolute_env(test_env, broken)
    expected = sorted(set(importable) - set(deleted_modules))
    t0 = time.monotonic()
    imported = set(probe_imports(sandbox, broken, expected, env, timeout))
    log.runs += 1
    log.seconds += time.monotonic() - t0
    lost = [m for m in expected if m not in imported]
    if lost:
        return Validation(
            ok=False, reason=f"package no longer imports: {', '.join(lost[:3])}", log=log
        )

    run = grade(workspace, None, allowed, [], test_env, args, sandbox=sandbox, timeout=timeout)
    log.add(run)
    if run.timed_out:
        return Validation(ok=False, reason="broken-tree run timed out", log=log)
    if run.status == "infra":
        return Validation(ok=False, reason=f"broken-tree run not graded: {run.reason}", log=log)
    outcomes = graded_outcomes(run, canonical)
    failing = _failing(outcomes, passing)
    unexpected = sorted(failing - candidates)
    if unexpected:
        return Validation(
            ok=False,
            reason=f"PASS_TO_PASS broken: {len(unexpected)} other tests fail, e.g. {unexpected[0]}",
            log=log,
        )
    f2p = {t for t in failing & candidates if _not_doctest(t, package_files)}
    if not f2p:
        return Validation(ok=False, reason="no test fails after the deletion", log=log)
    p2p = passing - failing

    stub_passing: set[str] = set()
    for kind in STUB_KINDS:
        tree = copy_tree(original_tree, scratch / f"stub-{kind}")
        for path, text in stub_tree_files(originals, definitions, deleted_files, kind).items():
            write_source(tree / path, text)
        ids = sorted(f2p - stub_passing)
        if not ids:
            break
        stub_run = grade(tree, None, allowed, ids, test_env, args, sandbox=sandbox, timeout=timeout)
        log.add(stub_run)
        stub_outcomes = graded_outcomes(stub_run, canonical)
        stub_passing |= {t for t in ids if stub_outcomes.get(t) == "passed"}
        shutil.rmtree(tree, ignore_errors=True)
    f2p -= stub_passing
    if not f2p:
        return Validation(
            ok=False,
            reason="a trivial body (raise NotImplementedError / pass) passes every failing test",
            stub_passing=sorted(stub_passing),
            log=log,
        )

    gold = copy_tree(workspace, scratch / "gold")  # the broken run may have left files behind
    try:
        apply_patch(gold, patch)
    except ValueError as e:
        return Validation(ok=False, reason=str(e), log=log)
    for path, text in originals.items():
        restored = gold / path
        if not restored.is_file() or restored.read_bytes() != text.encode("utf-8"):
            return Validation(ok=False, reason=f"gold patch does not restore {path}", log=log)
    if dict(tree_files(gold)) != dict(tree_files(original_tree)):
        return Validation(ok=False, reason="gold-patched tree differs from the original", log=log)
    gold_ids = sorted(f2p | p2p) if gold_full_suite else sorted(f2p)
    # graded the way the reward grades an agent: the gold tree's package changes on a pristine
    # copy of the broken workspace, ``gold_runs`` times
    failures: list[set[str]] = []
    for _ in range(max(1, gold_runs)):
        gold_run = grade(
            workspace, gold, allowed, gold_ids, test_env, args, sandbox=sandbox, timeout=timeout
        )
        log.add(gold_run)
        failed = _failing(graded_outcomes(gold_run, canonical), gold_ids)
        if gold_run.status not in ("passed", "failed") or (
            gold_run.status == "failed" and not failed
        ):
            # the run was not sound (tampering, a cut channel, an exit code pytest did not
            # return): the reward would score this gold tree 0, so no task
            return Validation(
                ok=False,
                reason=f"the gold tree grades {gold_run.status}: {gold_run.reason}",
                log=log,
            )
        failures.append(failed)
    always = sorted(set.intersection(*failures))
    if always:
        return Validation(
            ok=False,
            reason=f"gold patch leaves {len(always)} tests failing, e.g. {always[0]}",
            log=log,
        )
    # the gold tree is the baseline's tree byte for byte: a test that fails in one of its runs
    # and passes in another is flaky (timing, sockets, load); the reward would score a correct
    # solution 0 whenever it fails, so it leaves the task's tests
    flaky = set().union(*failures)
    if f2p - flaky == set():
        return Validation(
            ok=False,
            reason=f"every FAIL_TO_PASS test is flaky on the gold tree, e.g. {sorted(flaky)[0]}",
            flaky=sorted(flaky),
            log=log,
        )
    return Validation(
        ok=True,
        fail_to_pass=sorted(f2p - flaky),
        pass_to_pass=sorted(p2p - flaky),
        stub_passing=sorted(stub_passing),
        flaky=sorted(flaky),
        log=log,
    )


# ---------------------------------------------------------------------------------------------
# re-checking a finished record


def locate_symbol(tree: Path, dotted: str) -> tuple[str, str] | None:
    """``(module path, qualname)`` of a dotted symbol in ``tree`` (``""`` qualname: a module)."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        for root in ("", "src/"):
            base = root + "/".join(parts[:k])
            for candidate in (base + ".py", base + "/__init__.py"):
                if (tree / candidate).is_file():
                    return candidate, ".".join(parts[k:])
    return None


def record_leak_material(
    record: TaskRecord,
    workspace: Path,
    *,
    gold: Path | None = None,
    min_line_chars: int = 16,
    ngram: int = 3,
) -> LeakMaterial:
    """The leak scan's material for a record, from the record and its workspace alone.

    The deleted code is what the gold patch adds back (and the code objects of the record's
    symbols in the patched files); the remaining tree is the workspace without ``.git``.
    ``gold``: the workspace with the patch applied, when the caller has one already.
    """
    assert record.etude is not None
    with tempfile.TemporaryDirectory(prefix="etude-gold-") as tmp:
        if gold is None:
            gold = copy_tree(workspace, Path(tmp) / "gold")
            apply_patch(gold, record.patch)
        paths = patch_paths(record.patch)
        originals = {p: read_source(gold / p) for p in paths if (gold / p).is_file()}
        created = [p for p in paths if not (workspace / p).exists()]
        quals: dict[str, list[str]] = {}
        for symbol in record.etude.symbols:
            where = locate_symbol(gold, symbol)
            if where is not None and where[1]:
                quals.setdefault(where[0], []).append(where[1])
        streams: list[list[str]] = []
        for path, text in originals.items():
            if not path.endswith(".py"):
                continue
            if path in created:
                streams += source_code_streams(text, None)
            elif quals.get(path):
                streams += source_code_streams(text, quals[path])
        return distinctive_material(
            patch_added_text(record.patch),
            streams,
            tree_files(workspace),
            deleted_paths=created,
            min_line_chars=min_line_chars,
            n=ngram,
        )


@dataclass(kw_only=True, slots=True)
class CheckResult:
    """Outcome of re-validating one record."""

    instance_id: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    leak_scan: dict[str, Any] | None = None
    log: RunLog = field(default_factory=RunLog)


def check_record(
    record: TaskRecord,
    base_dir: str | Path,
    sandbox: Any,
    *,
    timeout: float = 600.0,
    min_line_chars: int | None = None,
    ngram: int | None = None,
) -> CheckResult:
    """Re-validate ``record`` (module docstring); ``base_dir`` holds its task file."""
    result = CheckResult(instance_id=record.instance_id, ok=False)
    problems = result.problems
    if record.etude is None:
        problems.append("not an etude record (no etude.workspace)")
        return result
    extra = record.etude.extra
    test_env = dict(extra.get("test_env", {}))
    pytest_args = [*COLLECT_ANYWAY, *extra.get("pytest_args", [])]
    scan_cfg = record.etude.leak_scan or {}
    min_line_chars = min_line_chars or int(scan_cfg.get("min_line_chars", 16))
    ngram = ngram or int(scan_cfg.get("ngram", 3))
    with tempfile.TemporaryDirectory(prefix="etude-check-") as tmp:
        scratch = Path(tmp)
        workspace = resolve_workspace(record, base_dir, dest=scratch / "extracted")
        if record.base_commit.startswith("sha256:"):
            if tree_digest(workspace) != record.base_commit:
                problems.append("workspace digest differs from base_commit")
        else:
            try:
                head, clean = workspace_head(workspace)
            except RuntimeError as e:
                problems.append(f"workspace is not a git repository: {e}")
            else:
                if head != record.base_commit:
                    problems.append(
                        f"workspace HEAD {head[:12]} is not base_commit {record.base_commit[:12]}"
                    )
                if not clean:
                    problems.append("workspace has changes not in its commit")

        allowed = allowed_from_paths(patch_paths(record.patch))
        run = grade(
            workspace, None, allowed, [], test_env, pytest_args, sandbox=sandbox, timeout=timeout
        )
        result.log.add(run)
        if run.status == "infra":
            problems.append(f"the workspace could not be graded: {run.reason}")
        outcomes = graded_outcomes(
            run, {junit_address(t): t for t in [*record.FAIL_TO_PASS, *record.PASS_TO_PASS]}
        )
        passing_f2p = [t for t in record.FAIL_TO_PASS if outcomes.get(t) == "passed"]
        if passing_f2p:
            problems.append(
                f"{len(passing_f2p)} FAIL_TO_PASS tests pass on the workspace, e.g. {passing_f2p[0]}"
            )
        failing_p2p = sorted(_failing(outcomes, record.PASS_TO_PASS))
        if failing_p2p:
            problems.append(
                f"{len(failing_p2p)} PASS_TO_PASS tests fail on the workspace, e.g. {failing_p2p[0]}"
            )

        gold = copy_tree(workspace, scratch / "gold")
        try:
            apply_patch(gold, record.patch)
        except ValueError as e:
            problems.append(str(e))
            return result
        ids = [*record.FAIL_TO_PASS, *record.PASS_TO_PASS]
        # exactly the reward's grading of an agent that wrote the gold patch
        gold_run = grade(
            workspace,
            gold,
            allowed,
            ids,
            test_env,
            list(extra.get("pytest_args", [])),
            sandbox=sandbox,
            timeout=timeout,
        )
        result.log.add(gold_run)
        if gold_run.status != "passed":
            not_passing = gold_run.failed_ids or ids
            problems.append(
                f"the gold patch grades {gold_run.status} ({gold_run.reason}), "
                f"{len(not_passing)} tests not passing, e.g. {not_passing[0]}"
            )

        definitions: dict[str, list[str]] = {}
        files: list[str] = []
        for symbol in record.etude.symbols:
            where = locate_symbol(gold, symbol)
            if where is None:
                problems.append(f"symbol {symbol} not found in the gold tree")
                continue
            path, qualname = where
            if not qualname:
                files.append(path)
            elif path not in files:
                definitions.setdefault(path, []).append(qualname)
        for kind in STUB_KINDS:
            tree = copy_tree(gold, scratch / f"stub-{kind}")
            sources = {p: read_source(gold / p) for p in {*definitions, *files}}
            texts = stub_tree_files(sources, list(definitions.items()), files, kind)
            for path, text in texts.items():
                write_source(tree / path, text)
            stub_run = grade(
                tree,
                None,
                allowed,
                record.FAIL_TO_PASS,
                test_env,
                pytest_args,
                sandbox=sandbox,
                timeout=timeout,
            )
            result.log.add(stub_run)
            passed = [t for t in record.FAIL_TO_PASS if stub_run.outcome(t) == "passed"]
            if passed:
                problems.append(
                    f"{len(passed)} FAIL_TO_PASS tests pass with a '{kind}' stub, e.g. {passed[0]}"
                )

        material = record_leak_material(
            record, workspace, gold=gold, min_line_chars=min_line_chars, ngram=ngram
        )
        scan = leak_scan(workspace, material)
        result.leak_scan = scan
        if not scan["clean"]:
            first = scan["hits"][0]
            problems.append(
                f"leak scan: {scan['num_hits']} hits, e.g. {first['kind']} in {first['path']}: {first['match']!r}"
            )
    result.ok = not problems
    return result
