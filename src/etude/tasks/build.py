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
4. per feature, in ``workers`` threads (``task_maker.TaskMaker.make_task``): delete
   (``delete.apply_removal``), export a fresh workspace, write the broken files, make a
   one-commit repository, scan it for leaks, validate it by test runs
   (``validate.validate_task``), write the problem statement and the record.

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

import json
import os
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
from etude.tasks.agent_deleter import ChatModel, propose_with_agent
from etude.tasks.baseline import derived_time_limit
from etude.tasks.build_config import TaskBuildConfig
from etude.tasks.build_report import BuildReport, TaskOutcome, reason_category
from etude.tasks.copyguard import SandboxCopies, deleted_definitions
from etude.tasks.delete import read_source
from etude.tasks.diagnose import Diagnosis, diagnose, distribution_for
from etude.tasks.features import feature_groups
from etude.tasks.mine import Miner, detect_layout, index_package, index_test_imports, run_baseline
from etude.tasks.proposal import Feature
from etude.tasks.quality import dedupe_by_fail_to_pass
from etude.tasks.record import TaskRecord, save_tasks
from etude.tasks.sanitize import export_tree, find_installed_copies
from etude.tasks.task_maker import TaskMaker
from etude.tasks.testdeps import DEPS_DIR, declared_requirements, install, to_install
from etude.tasks.validate import copy_tree
from etude.tasks.variants import VariantMaker, remove_workspace


class TaskFactory(TaskMaker, VariantMaker):
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
        agent_model: ChatModel | None = None,
    ) -> None:
        self.repo = Path(repo).resolve()
        self.agent_model = agent_model
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
        self.flaky_found: set[str] = set()
        """Tests that failed in some gold runs only (flaky): out of every task of the build."""

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
        """Export, install test requirements, check for installed copies, run the baseline
        (diagnosing it), derive the time limit, index the package."""
        t0 = time.monotonic()
        self._tmp = tempfile.TemporaryDirectory(prefix="etude-tasks-")
        self.scratch = Path(self._tmp.name)
        self.pristine = self.scratch / "pristine"
        export = export_tree(self.repo, self.pristine)
        self.export_skipped = export.skipped
        self.layout = detect_layout(self.pristine, self.cfg.packages, default_name=self.repo.name)
        self.pytest_args = list(self.cfg.pytest_args)
        self.requirements: list[str] = []
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
        if self.cfg.install_test_deps:
            self._install(
                [*declared_requirements(self.pristine), *self.cfg.test_requirements], declared=True
            )
        self._run_baseline()
        for _ in range(3):
            # the repository did not declare everything its tests import: install the
            # distributions of the missing modules and run the baseline again (a module can
            # hide another one that the same test file imports next)
            missing = [m for d in self.diagnoses for m in d.modules]
            if not (self.cfg.install_test_deps and missing):
                break
            if not self._install([distribution_for(m) for m in missing], declared=False):
                break
            self._run_baseline()
        for d in self.diagnoses:
            self.log(f"baseline: {d.kind}: {d.line}")
        if not self.baseline.passing:
            lines = [d.line for d in self.diagnoses] or [self._last_line()]
            raise ValueError(
                f"no test of {self.layout.name} passes in the sandbox: {' | '.join(lines)}"
            )
        if self.cfg.time_limits == "baseline":
            self.time_limit = derived_time_limit(
                self.baseline,
                factor=self.cfg.time_limit_factor,
                floor=self.cfg.min_time_limit_s,
                ceiling=timeout,
            )
        else:
            self.time_limit = timeout
        self.sources = {
            rel: read_source(self.pristine / rel)
            for rel in [*self.layout.modules.values(), *self.layout.stubs]
        }
        index = index_package(self.pristine, self.layout)
        self.miner = Miner(
            self.layout, index, self.baseline, index_test_imports(self.pristine, self.layout)
        )
        self.sandbox_copies = SandboxCopies(self.sandbox, min_nodes=self.cfg.copy_min_nodes)
        self.seconds_baseline = time.monotonic() - t0
        self.log(
            f"baseline: {len(self.baseline.passing)} passing, {len(self.baseline.failing)} failing, "
            f"{len(self.baseline.flaky)} flaky ({self.seconds_baseline:.1f}s); time limit per "
            f"run {self.time_limit:.0f}s"
        )

    def _install(self, requirements: list[str], *, declared: bool) -> list[str]:
        """Install what ``requirements`` lacks into the tree's ``DEPS_DIR``; what was installed."""
        wanted = to_install(requirements, own=[self.layout.name, *self.layout.packages])
        wanted = [r for r in dict.fromkeys(wanted) if r not in self.requirements]
        if not wanted:
            return []
        self.log(f"test requirements: installing {', '.join(wanted)} into {DEPS_DIR}")
        install(wanted, self.pristine / DEPS_DIR, timeout=self.cfg.test_timeout_s)
        self.requirements += wanted
        paths = [p for p in self.layout.test_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if DEPS_DIR not in paths:
            self.layout.test_env["PYTHONPATH"] = os.pathsep.join([*paths, DEPS_DIR])
            self.pytest_args.append(f"--ignore={DEPS_DIR}")
        return wanted

    def _run_baseline(self) -> None:
        self.log(
            f"baseline: running the suite of {self.layout.name} {self.cfg.baseline_runs} times"
        )
        work = copy_tree(self.pristine, self.scratch / "baseline")
        try:
            self.baseline = run_baseline(
                self.sandbox,
                work,
                self.layout,
                runs=self.cfg.baseline_runs,
                timeout=self.cfg.test_timeout_s,
                pytest_args=self.pytest_args,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
        self.diagnoses: list[Diagnosis] = diagnose(
            self.baseline.plain_output + "\n" + self.baseline.output,
            exit_code=self.baseline.exit_code,
            own_packages=self.layout.packages,
            failing=len(self.baseline.failing),
            install_test_deps=self.cfg.install_test_deps,
        )

    def _last_line(self) -> str:
        lines = [ln for ln in self.baseline.output.strip().splitlines() if ln.strip()]
        meaningful = [ln for ln in lines if not ln.startswith(("rootdir:", "configfile:", "="))]
        return f"pytest said: {(meaningful or lines or ['(no output)'])[-1][:500]}"

    # -- the build ---------------------------------------------------------------------------

    def proposed(self) -> list[Feature]:
        """Every proposal of the miner (and of the agent deleter when enabled), computed once."""
        if self._proposed is None:
            proposals = self.miner.propose(self.cfg.proposals)
            self.proposals_rejected = dict(proposals.rejected)
            features = list(proposals.features)
            if self.cfg.agent.enabled:
                agent_features, agent_rejected = propose_with_agent(
                    self.miner, self.cfg.agent, self.cfg.proposals, model=self.agent_model
                )
                features += agent_features
                self.proposals_rejected.update(agent_rejected)
            if self.cfg.proposals.feature_groups:
                groups, skipped = feature_groups(self.miner, self.cfg.proposals)
                seen = {f.symbols for f in features}
                features += [g for g in groups if g.symbols not in seen]
                self.proposals_rejected.update(skipped)
            self._proposed = features
        return self._proposed

    def candidates(self) -> list[Feature]:
        """Proposals in build order: feature-sized groups first, then one feature per module in
        turn (so a ``max_tasks`` prefix covers many modules), symbols before whole modules."""
        features = self.proposed()
        groups = [f for f in features if f.kind == "feature"]
        symbols = [f for f in features if f.kind not in ("module", "feature")]
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
        return groups + ordered + modules

    def run_features(
        self,
        features: list[Feature],
        *,
        limit: int = 0,
        deadline: float | None = None,
        options: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[TaskOutcome]:
        """``make_task`` over ``features`` in ``workers`` threads, in order; stops submitting once
        ``limit`` tasks are valid (0: no limit) or at ``deadline`` (``time.monotonic``).
        ``options``: per-feature keyword arguments (added to ``kwargs``). Outcomes come back in
        ``features`` order, for the features that were tried."""
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
                    and (deadline is None or time.monotonic() < deadline)
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

    def drop_flaky(self, outcomes: list[TaskOutcome]) -> None:
        """Take the tests found flaky on any task's gold tree out of every accepted record (a
        task accepted before the flake showed keeps none of them); a record left without
        FAIL_TO_PASS is rejected."""
        for outcome in outcomes:
            record = outcome.record
            if record is None or not self.flaky_found:
                continue
            f2p = [t for t in record.FAIL_TO_PASS if t not in self.flaky_found]
            if not f2p:
                remove_workspace(self.out_dir, record)
                outcome.record = None
                outcome.reason = f"every FAIL_TO_PASS test is flaky on a gold tree, e.g. {record.FAIL_TO_PASS[0]}"
                continue
            record.FAIL_TO_PASS = f2p
            record.PASS_TO_PASS = [t for t in record.PASS_TO_PASS if t not in self.flaky_found]

    def build(self) -> tuple[list[TaskRecord], BuildReport]:
        """Validate every candidate (up to ``max_tasks`` valid), write ``tasks.jsonl`` and the report."""
        t0 = time.monotonic()
        features = self.candidates()
        self.log(
            f"proposals: {len(features)} candidates, {len(self.proposals_rejected)} symbols skipped"
        )
        if self.cfg.copy_search:
            # one sandboxed search of the interpreter's filesystem for every candidate's code
            t_scan = time.monotonic()
            self.sandbox_copies.prefetch(
                d for f in features for d in deleted_definitions(self.sources, f)
            )
            self.log(f"copy search of the sandbox's filesystem: {time.monotonic() - t_scan:.1f}s")
        # the budget is for validating candidates: a slow baseline does not use it up
        deadline = time.monotonic() + self.cfg.time_budget_s if self.cfg.time_budget_s else None
        outcomes = self.run_features(features, limit=self.cfg.max_tasks, deadline=deadline)
        not_tried = [f.name for f in features[len(outcomes) :]]
        self.drop_flaky(outcomes)
        records = [o.record for o in outcomes if o.record is not None]
        if self.cfg.dedupe_fail_to_pass:
            records, duplicates = dedupe_by_fail_to_pass(records)
            by_id = {o.record.instance_id: o for o in outcomes if o.record is not None}
            for instance_id, reason in duplicates.items():
                outcome = by_id[instance_id]
                remove_workspace(self.out_dir, outcome.record)  # type: ignore[arg-type]
                outcome.record = None
                outcome.reason = reason
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
        for name in not_tried:
            rejected[name] = "not tried: the build's time budget (tasks.time_budget_s) ran out"
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
            flaky=[*self.baseline.flaky, *sorted(self.flaky_found)],
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
            diagnoses=[d.line for d in self.diagnoses],
            not_tried=len(not_tried),
            time_limit_s=self.time_limit,
            test_requirements=list(self.requirements),
            median_fail_to_pass=_median([len(r.FAIL_TO_PASS) for r in records]),
        )
        (self.out_dir / "build_report.json").write_text(
            json.dumps(report.to_dict(), indent=1) + "\n"
        )
        return records, report


def _median(values: list[int]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    mid = len(ordered) // 2
    return float(ordered[mid]) if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


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
