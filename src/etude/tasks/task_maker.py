"""One task from one feature: delete it, build the workspace, scan it, validate it, record it.

``TaskMaker.make_task(feature)`` is the per-feature step of the task factory (step 4 of
``etude.tasks.build``): it rejects a feature that cannot reach the difficulty floor or whose
deletion is refused; searches the other files and the sandbox's filesystem for copies of the
deleted code (rejecting the task, or deleting the copies too with ``delete_copies``); exports a
fresh workspace, writes the broken files and makes a one-commit repository; scans it for leaks of
the deleted code; validates it by test runs (``validate.validate_task``); scores its difficulty
and writes the problem statement and the record (``TaskOutcome``: a record or a rejection
reason). ``test_command`` is the record's shell command for the tests.

``TaskMaker`` is a mixin of ``etude.tasks.build.TaskFactory``, which prepares everything it
reads (the exported tree, the baseline, the sandbox, the miner) and calls it from ``workers``
threads; what the threads share (instance ids, flaky tests, features by id) is taken under
``_lock``.

What this module does not do: choose or order the features, run the baseline, or write
``tasks.jsonl`` and the report (``etude.tasks.build``); the validation rules themselves
(``etude.tasks.validate``) or the leak scan's rules (``etude.tasks.leaks``).
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from etude.sandbox import Sandbox
from etude.sandbox.cleanroom import allowed_from_paths
from etude.sandbox.masking import find_package_copies, foreign_package_dirs, visible_roots
from etude.tasks.baseline import Baseline
from etude.tasks.build_config import TaskBuildConfig
from etude.tasks.build_report import TaskOutcome
from etude.tasks.copyguard import (
    SandboxCopies,
    deleted_definitions,
    extend_with_copies,
    workspace_copies,
)
from etude.tasks.delete import DeletionError, Removal, apply_removal, write_source
from etude.tasks.layout import Layout
from etude.tasks.leaks import distinctive_material, leak_scan, source_code_streams, tree_files
from etude.tasks.mine import Miner
from etude.tasks.patches import patch_added_text, patch_paths, unified_patch
from etude.tasks.proposal import Feature
from etude.tasks.quality import count_callers, deleted_statements, difficulty, difficulty_score
from etude.tasks.record import EtudeInfo, TaskRecord, archive_workspace
from etude.tasks.sanitize import export_tree, fresh_git_repo
from etude.tasks.statement import DETAIL_RANK, problem_statement
from etude.tasks.testdeps import DEPS_DIR
from etude.tasks.validate import COLLECT_ANYWAY, validate_task
from etude.tasks.variants import _relaxed

_ID_CHARS = re.compile(r"[^A-Za-z0-9._+@~-]")


class TaskMaker:
    """Features into validated tasks, one at a time; mixed into ``etude.tasks.build.TaskFactory``,
    whose ``__init__`` and ``prepare`` set every attribute below."""

    cfg: TaskBuildConfig
    log: Callable[[str], None]
    out_dir: Path
    scratch: Path
    pristine: Path
    layout: Layout
    sources: dict[str, str]
    baseline: Baseline
    miner: Miner
    sandbox: Sandbox
    sandbox_copies: SandboxCopies
    time_limit: float
    pytest_args: list[str]
    requirements: list[str]
    flaky_found: set[str]
    _features: dict[str, Feature]
    _ids: set[str]
    _lock: threading.Lock

    def _new_id(self, feature: Feature, detail: str) -> str:
        base = f"{self.layout.name}__{feature.name}" + ("" if detail == "full" else f"@{detail}")
        base = _ID_CHARS.sub("_", base)
        if len(base) > 120:
            base = base[:100] + "~" + hashlib.sha1(base.encode()).hexdigest()[:8]
        with self._lock:
            candidate, n = base, 1
            while candidate in self._ids or any(
                (self.out_dir / "workspaces" / (candidate + s)).exists() for s in ("", ".tar.gz")
            ):
                n += 1
                candidate = f"{base}~{n}"
            self._ids.add(candidate)
        return candidate

    def make_task(
        self,
        feature: Feature,
        *,
        detail: str | None = None,
        parent: str | None = None,
        kind: str | None = None,
        relative: bool = True,
        _with_copies: bool = False,
    ) -> TaskOutcome:
        """Delete ``feature``, build and validate its workspace; a record or a rejection.

        ``relative``: the record's workspace path relative to ``out_dir`` (for ``tasks.jsonl``
        there) or absolute (for a curriculum pool elsewhere).
        """
        t0 = time.monotonic()
        detail = detail or self.cfg.detail_level
        kind = kind or ("agent_deletion" if feature.kind == "agent" else "feature_deletion")

        def reject(reason: str, runs: int = 0, seconds: float = 0.0) -> TaskOutcome:
            return TaskOutcome(
                feature=feature.name,
                record=None,
                reason=" ".join(reason.split()),  # one line in the report
                seconds=time.monotonic() - t0,
                test_seconds=seconds,
                test_runs=runs,
            )

        statements = deleted_statements(self.sources, feature)
        # the floor keeps trivial tasks out of a build; a curriculum's easier variant may be small
        floor = self.cfg.min_difficulty if parent is None else 0.0
        if floor:
            # the most this task can score: every candidate test in FAIL_TO_PASS, many callers
            best = difficulty_score(
                deleted_statements=statements,
                num_fail_to_pass=len(feature.tests),
                callers=1 << 20,
                num_files=len({p for p, _ in feature.definitions} | set(feature.files)),
                detail_rank=DETAIL_RANK[detail],
            )
            if best < floor:
                return reject(f"below the difficulty floor: at most {best} < {floor}")
        try:
            edit = apply_removal(
                self.sources,
                Removal(definitions=feature.definitions, files=feature.files),
                self.layout.modules,
            )
        except DeletionError as e:
            return reject(f"deletion refused: {e}")
        remaining = list(self._remaining_files(edit.changed, edit.removed))
        copies_searched = 0
        if self.cfg.copy_search:
            deleted = deleted_definitions(self.sources, feature)
            copies_searched = len([d for d in deleted if d.nodes >= self.cfg.copy_min_nodes])
            found = workspace_copies(deleted, remaining, min_nodes=self.cfg.copy_min_nodes)
            found += self.sandbox_copies.copies_of(deleted)
            if found:
                if _with_copies or not self.cfg.delete_copies:
                    return reject(f"copy of the deleted code: {found[0].describe()}")
                extended = extend_with_copies(
                    feature, found, self.miner, _relaxed(self.cfg.proposals)
                )
                if isinstance(extended, str):
                    return reject(extended)
                self.log(f"{feature.name}: deleting its copies too ({found[0].describe()})")
                outcome = self.make_task(
                    extended,
                    detail=detail,
                    parent=parent,
                    kind=kind,
                    relative=relative,
                    _with_copies=True,
                )
                outcome.feature = feature.name
                return outcome
        callers = count_callers(feature, remaining)
        work = Path(tempfile.mkdtemp(prefix="task-", dir=self.scratch))
        try:
            ws = work / "workspace"
            export_tree(self.pristine, ws)
            if (self.pristine / DEPS_DIR).is_dir():
                # third-party test requirements keep their metadata (pytest finds plugins by it)
                shutil.rmtree(ws / DEPS_DIR, ignore_errors=True)
                shutil.copytree(self.pristine / DEPS_DIR, ws / DEPS_DIR, symlinks=True)
            for path, text in edit.changed.items():
                write_source(ws / path, text)
            for path in edit.removed:
                (ws / path).unlink()
            base_commit = fresh_git_repo(ws)
            patch = unified_patch({p: edit.changed.get(p) for p in edit.original}, edit.original)
            streams: list[list[str]] = []
            for path, quals in feature.definitions:
                streams += source_code_streams(self.sources[path], quals)
            for path in feature.files:
                streams += source_code_streams(self.sources[path], None)
            material = distinctive_material(
                patch_added_text(patch),
                streams,
                tree_files(ws),
                deleted_paths=edit.removed,
                min_line_chars=self.cfg.leak_min_line_chars,
                n=self.cfg.leak_ngram,
            )
            scan = leak_scan(ws, material)
            scan["copies_searched"] = copies_searched
            scan["copies_found"] = 0
            if not scan["clean"]:
                hit = scan["hits"][0]
                return reject(f"leak scan: {hit['kind']} in {hit['path']}: {hit['match']!r}")
            path_to_module = {p: m for m, p in self.layout.modules.items()}
            with self._lock:
                passing = [t for t in self.baseline.passing if t not in self.flaky_found]
            validation = validate_task(
                sandbox=self.sandbox,
                workspace=ws,
                original_tree=self.pristine,
                scratch=work,
                patch=patch,
                originals=edit.original,
                definitions=feature.definitions,
                deleted_files=feature.files,
                candidates=feature.tests,
                baseline_passing=passing,
                canonical=self.baseline.canonical,
                importable=self.baseline.importable,
                deleted_modules=[path_to_module[p] for p in feature.files],
                package_files=self.layout.modules.values(),
                test_env=self.layout.test_env,
                timeout=self.time_limit,
                pytest_args=self.pytest_args,
                gold_full_suite=self.cfg.gold_full_suite,
                gold_runs=self.cfg.gold_runs,
            )
            if validation.flaky:
                with self._lock:
                    self.flaky_found.update(validation.flaky)
                self.log(
                    f"{feature.name}: {len(validation.flaky)} tests flaky on the gold tree, "
                    f"dropped from every task: {', '.join(validation.flaky[:3])}"
                )
            if not validation.ok:
                return reject(validation.reason, validation.log.runs, validation.log.seconds)
            level = difficulty(
                deleted_lines=edit.deleted_lines(),
                deleted_statements=statements,
                num_fail_to_pass=len(validation.fail_to_pass),
                callers=callers,
                num_files=len(edit.original),
                num_symbols=len(feature.symbols),
                detail_rank=DETAIL_RANK[detail],
            )
            if level["score"] < floor:
                return reject(
                    f"below the difficulty floor: score {level['score']} < {floor} "
                    f"({statements} statements, "
                    f"{len(validation.fail_to_pass)} FAIL_TO_PASS, {callers} callers)",
                    validation.log.runs,
                    validation.log.seconds,
                )
            instance_id = self._new_id(feature, detail)
            statement = problem_statement(
                feature,
                self.sources,
                self.layout,
                validation.fail_to_pass,
                detail,
                pytest_args=self.pytest_args,
            )
            target = self.out_dir / "workspaces" / instance_id
            target.parent.mkdir(parents=True, exist_ok=True)
            if self.cfg.workspace_format == "tar.gz":
                target = target.with_name(instance_id + ".tar.gz")
                archive_workspace(ws, target)
            else:
                shutil.move(str(ws), target)
            workspace = target.relative_to(self.out_dir).as_posix() if relative else str(target)
            extra: dict[str, Any] = {
                "feature": feature.name,
                "feature_kind": feature.kind,
                "num_stub_passing": len(validation.stub_passing),
            }
            if self.layout.test_env:
                extra["test_env"] = dict(self.layout.test_env)
            if self.pytest_args:
                extra["pytest_args"] = list(self.pytest_args)
            if feature.parts:
                extra["parts"] = list(feature.parts)
            extra["masked_paths"] = self.package_copies(patch)
            record = TaskRecord(
                instance_id=instance_id,
                repo=self.layout.name,
                base_commit=base_commit,
                patch=patch,
                test_patch="",
                problem_statement=statement,
                version=self.layout.version,
                FAIL_TO_PASS=validation.fail_to_pass,
                PASS_TO_PASS=validation.pass_to_pass,
                workspace=workspace,
                test_command=test_command(self.layout.test_env, self.pytest_args),
                environment=self.environment(),
                time_limit_s=self.time_limit,
                etude=EtudeInfo(
                    workspace=workspace,
                    kind=kind,
                    symbols=list(feature.symbols),
                    deleted_files=list(edit.removed),
                    difficulty=level,
                    parent=parent,
                    leak_scan=scan,
                    detail_level=detail,
                    extra=extra,
                ),
            )
            with self._lock:
                self._features[instance_id] = feature
            return TaskOutcome(
                feature=feature.name,
                record=record,
                seconds=time.monotonic() - t0,
                test_seconds=validation.log.seconds,
                test_runs=validation.log.runs,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _remaining_files(
        self, changed: dict[str, str], removed: list[str]
    ) -> Iterator[tuple[str, bytes]]:
        """``(path, bytes)`` of the broken tree without building it (the pristine tree with the
        deletion's changes), ``.git`` excluded."""
        gone = set(removed)
        for rel, data in tree_files(self.pristine):
            if rel in gone:
                continue
            yield rel, changed[rel].encode("utf-8") if rel in changed else data

    def package_copies(self, patch: str) -> list[str]:
        """Host paths the sandbox shows that hold a copy of the package ``patch`` changes,
        recorded as ``etude.masked_paths`` so that an episode need not search for them
        (``etude.sandbox.masking``; one walk per process and package shape)."""
        allowed = allowed_from_paths(patch_paths(patch))
        extra = self.sandbox.config.extra_ro_paths
        return find_package_copies(
            self.pristine, allowed, visible_roots(extra), foreign_package_dirs(extra)
        )

    def environment(self) -> dict[str, Any]:
        """The record's ``environment``: what a harness needs to run the tests."""
        return {
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "test_env": dict(self.layout.test_env),
            "pytest_args": [*COLLECT_ANYWAY, *self.pytest_args],
            "test_requirements": list(self.requirements),
            "deps_dir": DEPS_DIR if self.requirements else None,
        }


def test_command(test_env: dict[str, str], pytest_args: list[str]) -> str:
    """The shell command that runs ``{tests}`` from the workspace root (the record's
    ``test_command``), environment included."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(test_env.items()))
    args = " ".join(
        shlex.quote(a) for a in ["-p", "no:cacheprovider", *COLLECT_ANYWAY, *pytest_args]
    )
    return f"{'env ' + env + ' ' if env else ''}python -m pytest {args} {{tests}}"
