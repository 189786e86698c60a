"""The task factory: repository in, validated feature-deletion tasks with clean workspaces out.

``build_tasks(repo, out_dir, cfg)`` runs the pipeline and writes ``out_dir/tasks.jsonl`` (the
task record of ``etude.tasks.record``), one workspace per task under ``out_dir/workspaces/`` and
``out_dir/build_report.json`` (candidates, yield, rejection reasons, timings, flaky tests):

1. export the repository into a scratch directory (``sanitize.export_tree``: no caches, no
   history; the source repository is only read) and refuse a package the sandbox can import from
   outside the workspace (an installed copy would hold the deleted code);
2. baseline: the suite twice in the sandbox, the second run under per-test coverage
   (``mine.run_baseline``);
3. proposals (``mine.Miner``, plus the optional agent deleter);
4. per feature, in ``workers`` threads: delete (``delete.apply_removal``), export a fresh
   workspace, write the broken files, make a one-commit repository, scan it for leaks, validate
   it by test runs (``validate.validate_task``), write the problem statement and the record.

Test runs dominate the cost, so they are batched: one coverage run for the whole suite, then per
task one broken-tree run of the whole suite and three small runs of the FAIL_TO_PASS ids (two
stubs, gold).

``TaskFactory`` keeps the mined repository alive after the build, so the curriculum can ask it
for ``harder``/``easier`` variants of a task (``etude.tasks.variants``: validated like any task,
``etude.parent`` set). Its settings are ``build_config.TaskBuildConfig``; its report
``build_report.BuildReport``.

What this module does not do: run the agent on the tasks (``etude.env``), or install the
package: tests import it from the workspace (``PYTHONPATH`` for a ``src/`` layout, recorded in
``etude.test_env``), so nothing outside the workspace holds its code.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from etude.sandbox import SandboxConfig, make_sandbox
from etude.tasks.agent_deleter import propose_with_agent
from etude.tasks.build_config import TaskBuildConfig
from etude.tasks.build_report import BuildReport, TaskOutcome, reason_category
from etude.tasks.delete import (
    DeletionError,
    Removal,
    apply_removal,
    patch_added_text,
    read_source,
    unified_patch,
    write_source,
)
from etude.tasks.mine import (
    Feature,
    Miner,
    detect_layout,
    index_package,
    index_test_imports,
    run_baseline,
)
from etude.tasks.record import EtudeInfo, TaskRecord, archive_workspace, save_tasks
from etude.tasks.sanitize import (
    distinctive_material,
    export_tree,
    find_installed_copies,
    fresh_git_repo,
    leak_scan,
    source_code_streams,
    tree_files,
)
from etude.tasks.statement import DETAIL_RANK, problem_statement
from etude.tasks.validate import copy_tree, validate_task
from etude.tasks.variants import VariantMaker, remove_workspace

_ID_CHARS = re.compile(r"[^A-Za-z0-9._+@~-]")


class TaskFactory(VariantMaker):
    """A mined repository that turns features into validated tasks (see the module docstring).

    Use as a context manager; ``prepare`` runs on entry (export, baseline, index).
    """

    def __init__(
        self,
        repo: str | Path,
        out_dir: str | Path,
        cfg: TaskBuildConfig | None = None,
        *,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.repo = Path(repo).resolve()
        if not self.repo.is_dir():
            raise ValueError(
                f"repository {str(repo)!r} is not a directory; pass a repo or an unpacked sdist"
            )
        self.out_dir = Path(out_dir).resolve()
        self.cfg = cfg if cfg is not None else TaskBuildConfig()
        self.log = log or (lambda msg: None)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._ids: set[str] = set()
        self._lock = threading.Lock()
        self._features: dict[str, Feature] = {}
        self._proposed: list[Feature] | None = None
        self.proposals_rejected: dict[str, str] = {}
        self.seconds_baseline = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> TaskFactory:
        self.prepare()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def prepare(self) -> None:
        """Export, check for installed copies, run the baseline, index the package."""
        t0 = time.monotonic()
        self._tmp = tempfile.TemporaryDirectory(prefix="etude-tasks-")
        self.scratch = Path(self._tmp.name)
        self.pristine = self.scratch / "pristine"
        export = export_tree(self.repo, self.pristine)
        self.export_skipped = export.skipped
        self.layout = detect_layout(self.pristine, self.cfg.packages, default_name=self.repo.name)
        timeout = self.cfg.test_timeout_s
        self.sandbox = make_sandbox(
            self.cfg.backend,
            SandboxConfig(
                backend=self.cfg.backend,
                timeout_s=timeout,
                cpu_seconds=int(timeout) + 1,
                max_output_bytes=1 << 20,
            ),
        )
        installed = find_installed_copies(self.sandbox, self.layout.packages)
        if installed:
            name, where = next(iter(installed.items()))
            raise ValueError(
                f"package {name!r} is importable from outside the workspace ({where}); an agent "
                f"could read the deleted code there. Uninstall it (pip uninstall {name}) from the "
                "interpreter the tasks run with"
            )
        self.log(
            f"baseline: running the suite of {self.layout.name} {self.cfg.baseline_runs} times"
        )
        work = copy_tree(self.pristine, self.scratch / "baseline")
        self.baseline = run_baseline(
            self.sandbox,
            work,
            self.layout,
            runs=self.cfg.baseline_runs,
            timeout=timeout,
            pytest_args=self.cfg.pytest_args,
        )
        shutil.rmtree(work, ignore_errors=True)
        if not self.baseline.passing:
            tail = self.baseline.output.strip().splitlines()[-1:] or ["(no output)"]
            raise ValueError(
                f"no test of {self.layout.name} passes in the sandbox; check pytest_args (e.g. "
                "--noconftest for a conftest this pytest cannot load), packages and the test "
                f"dependencies. pytest said: {tail[0][:500]}"
            )
        self.sources = {
            rel: read_source(self.pristine / rel)
            for rel in [*self.layout.modules.values(), *self.layout.stubs]
        }
        index = index_package(self.pristine, self.layout)
        self.miner = Miner(
            self.layout, index, self.baseline, index_test_imports(self.pristine, self.layout)
        )
        self.seconds_baseline = time.monotonic() - t0
        self.log(
            f"baseline: {len(self.baseline.passing)} passing, {len(self.baseline.failing)} failing, "
            f"{len(self.baseline.flaky)} flaky ({self.seconds_baseline:.1f}s)"
        )

    # -- one task ----------------------------------------------------------------------------

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
                reason=reason,
                seconds=time.monotonic() - t0,
                test_seconds=seconds,
                test_runs=runs,
            )

        try:
            edit = apply_removal(
                self.sources,
                Removal(definitions=feature.definitions, files=feature.files),
                self.layout.modules,
            )
        except DeletionError as e:
            return reject(f"deletion refused: {e}")
        work = Path(tempfile.mkdtemp(prefix="task-", dir=self.scratch))
        try:
            ws = work / "workspace"
            export_tree(self.pristine, ws)
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
            if not scan["clean"]:
                hit = scan["hits"][0]
                return reject(f"leak scan: {hit['kind']} in {hit['path']}: {hit['match']!r}")
            path_to_module = {p: m for m, p in self.layout.modules.items()}
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
                baseline_passing=self.baseline.passing,
                canonical=self.baseline.canonical,
                importable=self.baseline.importable,
                deleted_modules=[path_to_module[p] for p in feature.files],
                package_files=self.layout.modules.values(),
                test_env=self.layout.test_env,
                timeout=self.cfg.test_timeout_s,
                pytest_args=self.cfg.pytest_args,
                gold_full_suite=self.cfg.gold_full_suite,
            )
            if not validation.ok:
                return reject(validation.reason, validation.log.runs, validation.log.seconds)
            instance_id = self._new_id(feature, detail)
            statement = problem_statement(
                feature, self.sources, self.layout, validation.fail_to_pass, detail
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
            if self.cfg.pytest_args:
                extra["pytest_args"] = list(self.cfg.pytest_args)
            if feature.parts:
                extra["parts"] = list(feature.parts)
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
                etude=EtudeInfo(
                    workspace=workspace,
                    kind=kind,
                    symbols=list(feature.symbols),
                    deleted_files=list(edit.removed),
                    difficulty={
                        "deleted_lines": edit.deleted_lines(),
                        "num_symbols": len(feature.symbols),
                        "num_files": len(edit.original),
                        "num_fail_to_pass": len(validation.fail_to_pass),
                        "detail_rank": DETAIL_RANK[detail],
                    },
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

    # -- the build ---------------------------------------------------------------------------

    def proposed(self) -> list[Feature]:
        """Every proposal of the miner (and of the agent deleter when enabled), computed once."""
        if self._proposed is None:
            proposals = self.miner.propose(self.cfg.proposals)
            self.proposals_rejected = dict(proposals.rejected)
            features = list(proposals.features)
            if self.cfg.agent.enabled:
                agent_features, agent_rejected = propose_with_agent(
                    self.miner, self.cfg.agent, self.cfg.proposals
                )
                features += agent_features
                self.proposals_rejected.update(agent_rejected)
            self._proposed = features
        return self._proposed

    def candidates(self) -> list[Feature]:
        """Proposals in build order: one feature per module in turn (so a ``max_tasks`` prefix
        covers many modules), symbols before whole modules."""
        features = self.proposed()
        symbols = [f for f in features if f.kind != "module"]
        modules = [f for f in features if f.kind == "module"]
        by_module: dict[str, list[Feature]] = {}
        for f in symbols:
            by_module.setdefault(f.definitions[0][0], []).append(f)
        ordered: list[Feature] = []
        queues = [list(v) for _, v in sorted(by_module.items())]
        while any(queues):
            for q in queues:
                if q:
                    ordered.append(q.pop(0))
        return ordered + modules

    def run_features(
        self,
        features: list[Feature],
        *,
        limit: int = 0,
        options: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[TaskOutcome]:
        """``make_task`` over ``features`` in ``workers`` threads, in order; stops submitting once
        ``limit`` tasks are valid (0: no limit). ``options``: per-feature keyword arguments (added
        to ``kwargs``). Outcomes come back in ``features`` order."""
        outcomes: dict[int, TaskOutcome] = {}
        pending: dict[Future[TaskOutcome], int] = {}
        next_index = 0
        valid = 0
        with ThreadPoolExecutor(max_workers=self.cfg.workers) as pool:
            while next_index < len(features) or pending:
                while (
                    next_index < len(features)
                    and len(pending) < self.cfg.workers
                    and (not limit or valid + len(pending) < limit)
                ):
                    extra = options[next_index] if options is not None else {}
                    future = pool.submit(self.make_task, features[next_index], **kwargs, **extra)
                    pending[future] = next_index
                    next_index += 1
                if not pending:
                    break
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    i = pending.pop(future)
                    outcome = future.result()
                    outcomes[i] = outcome
                    valid += outcome.record is not None
                    status = (
                        f"ok (F2P {len(outcome.record.FAIL_TO_PASS)}, "
                        f"P2P {len(outcome.record.PASS_TO_PASS)})"
                        if outcome.record
                        else f"rejected: {outcome.reason}"
                    )
                    self.log(
                        f"[{len(outcomes)}/{len(features)}] {outcome.feature}: {status} "
                        f"({outcome.seconds:.1f}s)"
                    )
        return [outcomes[i] for i in sorted(outcomes)]

    def build(self) -> tuple[list[TaskRecord], BuildReport]:
        """Validate every candidate (up to ``max_tasks`` valid), write ``tasks.jsonl`` and the report."""
        t0 = time.monotonic()
        features = self.candidates()
        self.log(
            f"proposals: {len(features)} candidates, {len(self.proposals_rejected)} symbols skipped"
        )
        outcomes = self.run_features(features, limit=self.cfg.max_tasks)
        records = [o.record for o in outcomes if o.record is not None]
        if self.cfg.max_tasks and len(records) > self.cfg.max_tasks:
            for extra in records[self.cfg.max_tasks :]:
                remove_workspace(self.out_dir, extra)
            records = records[: self.cfg.max_tasks]
        save_tasks(self.out_dir / "tasks.jsonl", records)
        rejected = dict(self.proposals_rejected)
        counts: dict[str, int] = {}
        for o in outcomes:
            if o.record is None:
                rejected[o.feature] = o.reason
                counts[reason_category(o.reason)] = counts.get(reason_category(o.reason), 0) + 1
        skips: dict[str, int] = {}
        for reason in self.proposals_rejected.values():
            skips[reason_category(reason)] = skips.get(reason_category(reason), 0) + 1
        total = time.monotonic() - t0 + self.seconds_baseline
        report = BuildReport(
            repo=str(self.repo),
            packages=list(self.layout.packages),
            num_tests=len(self.baseline.passing)
            + len(self.baseline.failing)
            + len(self.baseline.flaky),
            num_passing=len(self.baseline.passing),
            flaky=list(self.baseline.flaky),
            baseline_failing=len(self.baseline.failing),
            candidates=len(outcomes),
            valid=len(records),
            rejected=rejected,
            reject_counts=counts,
            skip_counts=skips,
            seconds_total=round(total, 2),
            seconds_baseline=round(self.seconds_baseline, 2),
            seconds_tests=round(
                self.baseline.run_seconds + sum(o.test_seconds for o in outcomes), 2
            ),
            seconds_per_task=round(sum(o.seconds for o in outcomes) / max(1, len(outcomes)), 2),
            tasks=[r.instance_id for r in records],
        )
        (self.out_dir / "build_report.json").write_text(
            json.dumps(report.to_dict(), indent=1) + "\n"
        )
        return records, report


def build_tasks(
    repo: str | Path,
    out_dir: str | Path,
    cfg: TaskBuildConfig | None = None,
    *,
    log: Callable[[str], None] | None = None,
) -> tuple[list[TaskRecord], BuildReport]:
    """Build tasks from ``repo`` into the new or empty directory ``out_dir`` (module docstring)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"output directory {str(out)!r} is not empty; pass a new directory (tasks are never "
            "mixed into an existing build)"
        )
    out.mkdir(parents=True, exist_ok=True)
    with TaskFactory(repo, out, cfg, log=log) as factory:
        return factory.build()


def log_to_stderr(message: str) -> None:
    """The CLI's progress printer."""
    print(message, file=sys.stderr, flush=True)
