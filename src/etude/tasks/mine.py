"""Mine a repository for deletable features: baseline runs, a per-test coverage map, proposals.

Three steps, each a function:

1. ``detect_layout``: the package's modules (flat or ``src/`` layout, single-module
   distributions too), its stubs, its tests, and the environment the tests need.
2. ``run_baseline``: the suite runs twice in the sandbox, once plain and once (in a copy at
   another path) under coverage.py with one dynamic context per test (a small pytest plugin switches the context at each test's
   start; coverage's C tracer is pinned with ``COVERAGE_CORE=ctrace`` because the
   ``sys.monitoring`` core does not record dynamic contexts). Tests whose outcome differs between
   the runs are flaky and excluded; tests that pass in both are the pool of F2P/P2P tests. The
   result maps every executed line of the package to the node ids of the tests that ran it.
3. ``propose_features``: from an ``ast`` index of every module (functions, classes, methods,
   assignments, with what each refers to at import time and at run time), a feature is a public
   function, class or method together with the private helpers only it uses, or a whole module;
   its candidate F2P tests are the tests that executed its body. A symbol is skipped (with the
   reason) when it is needed at import time, used by code outside the feature (another
   definition, another module of the package), needed to collect a test file that also tests
   something else (imported by name at its top, or used in a class body or decorator), defined
   more than once, exercised by no passing test, or outside the size budget.

The coverage pass runs inside the sandbox on a scratch copy of the repository; its plugin and
data file live in a randomly named directory of that copy and are removed afterwards.

What this module does not do: delete (``delete``), run the per-task validation (``validate``), or
see dynamic uses (``getattr``, string-based registries, entry points): the validation's test runs
catch what the static analysis misses.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import shutil
import tomllib
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from etude.sandbox.pytest import TestRun, junit_address, run_pytest
from etude.tasks.delete import (
    DeletionError,
    all_entries,
    read_source,
    resolve_import,
    unlink_imports,
)

_TEST_DIRS = ("tests", "test")
_NOT_PACKAGE_FILES = {
    "setup.py",
    "conftest.py",
    "noxfile.py",
    "tasks.py",
    "fabfile.py",
    "manage.py",
    "versioneer.py",
    "bootstrap.py",
    "runtests.py",
}
_NOT_PACKAGE_DIRS = {
    "tests",
    "test",
    "docs",
    "doc",
    "examples",
    "example",
    "benchmarks",
    "benchmark",
    "scripts",
    "tools",
    "build",
    "dist",
}


def is_test_path(rel: str) -> bool:
    """Whether a repository-relative path is test code (files pytest collects or configures)."""
    p = PurePosixPath(rel)
    name = p.name
    if name == "conftest.py" or re.fullmatch(r"test_.*\.py|.*_test\.py", name):
        return True
    return any(part in _TEST_DIRS for part in p.parts[:-1])


# ---------------------------------------------------------------------------------------------
# layout


@dataclass(kw_only=True, slots=True)
class Layout:
    """Where a repository keeps its package and what its tests need."""

    name: str
    """Distribution name (``[project] name``) or the directory name."""
    version: str
    """Version from ``pyproject.toml`` or ``""``."""
    source_root: str
    """``""`` (flat layout) or ``"src"``."""
    packages: tuple[str, ...]
    """Top-level import names of the package(s)."""
    modules: dict[str, str]
    """Dotted module name -> relative path of its ``.py`` file (``pkg/__init__.py`` for pkg)."""
    stubs: tuple[str, ...]
    """Relative paths of ``.pyi`` files beside the package modules."""
    test_files: tuple[str, ...]
    """Relative paths of test modules and conftest files."""
    test_env: dict[str, str]
    """Environment the test runs need (``PYTHONPATH=src`` for a src layout)."""


def _pyproject(root: Path) -> dict[str, Any]:
    path = root / "pyproject.toml"
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}


def _metadata(root: Path, key: str) -> str:
    """``Name``/``Version`` from an sdist's PKG-INFO, else from setup.cfg; ``""`` if absent."""
    for name, pattern in (
        ("PKG-INFO", rf"(?im)^{key}:\s*(\S+)"),
        ("setup.cfg", rf"(?im)^{key}\s*=\s*(\S+)"),
    ):
        path = root / name
        if path.is_file():
            match = re.search(pattern, path.read_text(errors="replace"))
            if match:
                return match.group(1)
    return ""


def detect_layout(
    root: str | Path, packages: Iterable[str] = (), *, default_name: str | None = None
) -> Layout:
    """Find the package(s) of the repository at ``root``.

    ``packages`` (top-level import names) overrides the search. Otherwise: directories with an
    ``__init__.py`` directly under ``src/`` or the root (not tests, docs, examples...), else
    root-level modules that are not tests or tooling (single-module distributions). The name
    comes from ``pyproject.toml``, PKG-INFO or setup.cfg, else ``default_name``, else the
    directory's name.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"repository {str(root)!r} is not a directory")
    project = _pyproject(root).get("project", {})
    name = str(project.get("name") or _metadata(root, "name") or default_name or root.name)
    version = str(project.get("version") or _metadata(root, "version"))
    wanted = tuple(packages)
    source_root = ""
    tops: list[str] = []
    for candidate in ("src", ""):
        base = root / candidate if candidate else root
        if not base.is_dir():
            continue
        if wanted:
            found = [
                p
                for p in wanted
                if (base / p / "__init__.py").is_file() or (base / f"{p}.py").is_file()
            ]
            if len(found) == len(wanted):
                source_root, tops = candidate, list(wanted)
                break
            continue
        tops = sorted(
            d.name
            for d in base.iterdir()
            if d.is_dir()
            and (d / "__init__.py").is_file()
            and d.name not in _NOT_PACKAGE_DIRS
            and d.name.isidentifier()
        )
        if not tops:
            tops = sorted(
                f.stem
                for f in base.glob("*.py")
                if f.name not in _NOT_PACKAGE_FILES
                and not is_test_path(f.name)
                and f.stem.isidentifier()
                and f.stem not in ("setup", "conftest", "__init__")
            )
        if tops:
            source_root = candidate
            break
    if wanted and not tops:
        raise ValueError(
            f"packages {list(wanted)} not found under {str(root)!r} or its src/; set packages to "
            "the top-level import names of the repository"
        )
    base = root / source_root if source_root else root
    modules: dict[str, str] = {}
    stubs: list[str] = []
    prefix = f"{source_root}/" if source_root else ""
    for top in tops:
        if (base / f"{top}.py").is_file() and not (base / top).is_dir():
            modules[top] = f"{prefix}{top}.py"
            if (base / f"{top}.pyi").is_file():
                stubs.append(f"{prefix}{top}.pyi")
            continue
        for path in sorted((base / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            inner = path.relative_to(base)
            if is_test_path(inner.as_posix()) or not all(
                (base / Path(*inner.parts[:i]) / "__init__.py").is_file()
                for i in range(1, len(inner.parts))
            ):
                continue
            if not all(part.isidentifier() for part in inner.with_suffix("").parts):
                continue
            dotted = ".".join(inner.with_suffix("").parts)
            if dotted.endswith(".__init__"):
                dotted = dotted[: -len(".__init__")]
            modules[dotted] = rel
            if path.with_suffix(".pyi").is_file():
                stubs.append(path.with_suffix(".pyi").relative_to(root).as_posix())
    test_files = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if is_test_path(p.relative_to(root).as_posix())
        and not any(
            part.startswith(".") or part in ("build", "dist") for part in p.relative_to(root).parts
        )
    )
    test_env = {"PYTHONPATH": source_root} if source_root else {}
    return Layout(
        name=name,
        version=version,
        source_root=source_root,
        packages=tuple(tops),
        modules=modules,
        stubs=tuple(sorted(stubs)),
        test_files=tuple(test_files),
        test_env=test_env,
    )


# ---------------------------------------------------------------------------------------------
# symbol index


@dataclass(kw_only=True, slots=True)
class Unit:
    """One definition: a top-level function/class/assignment, or a method of a top-level class."""

    module: str
    """Dotted module name."""
    qualname: str
    """``f``, ``C``, ``C.m`` or ``X``."""
    kind: str
    """``function``, ``class``, ``method`` or ``assignment``."""
    start: int
    """First line (decorators included)."""
    end: int
    """Last line."""
    body: tuple[int, int] | None
    """First and last line of the executable body (docstring skipped), None for assignments."""
    import_refs: frozenset[str]
    """Names evaluated when the module is imported (decorators, defaults, bases, class body)."""
    runtime_refs: frozenset[str]
    """Names referenced inside function bodies (and annotations)."""
    attr_refs: frozenset[str]
    """Attribute names referenced (``x.name``), anywhere in the unit."""

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def refs(self) -> frozenset[str]:
        return self.import_refs | self.runtime_refs


@dataclass(kw_only=True, slots=True)
class ImportRef:
    """One import in a module: the absolute module and the imported name (None for ``import m``)."""

    module: str
    name: str | None
    bound: str
    toplevel: bool


@dataclass(kw_only=True, slots=True)
class ModuleIndex:
    """The definitions of one module and what its module-level code refers to."""

    module: str
    path: str
    source: str
    units: dict[str, Unit]
    """Qualname -> unit (methods included, as ``C.m``)."""
    bindings: dict[str, int]
    """Name -> number of module-scope statements binding it (inside if/try/with too)."""
    overloads: set[str]
    """Names bound only by several top-level function definitions (``typing.overload`` groups)."""
    module_refs: frozenset[str]
    """Names referenced by module-level statements that are not definitions."""
    module_attr_refs: frozenset[str]
    """Attribute names referenced anywhere in the module."""
    imports: list[ImportRef]
    exported: frozenset[str]
    """Strings of ``__all__``."""


def _names(node: ast.AST | None) -> set[str]:
    if node is None:
        return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _attrs(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _function_parts(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], set[str]]:
    """(import-time names, runtime names) of a function definition."""
    args = fn.args
    import_time = set()
    for d in [*fn.decorator_list, *args.defaults, *[d for d in args.kw_defaults if d is not None]]:
        import_time |= _names(d)
    runtime = set()
    for stmt in fn.body:
        runtime |= _names(stmt)
    annotations = [a.annotation for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    annotations += [args.vararg.annotation if args.vararg else None]
    annotations += [args.kwarg.annotation if args.kwarg else None, fn.returns]
    for a in annotations:
        runtime |= _names(a)
    return import_time, runtime


def _body_span(body: list[ast.stmt]) -> tuple[int, int] | None:
    stmts = body
    if stmts and isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant):
        if isinstance(stmts[0].value.value, str):
            stmts = stmts[1:]
    if not stmts:
        return None
    return stmts[0].lineno, max(s.end_lineno or s.lineno for s in stmts)


def _start(node: ast.AST) -> int:
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])


def _scope_statements(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements at module scope, descending into if/try/with/for/while blocks."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If | ast.For | ast.AsyncFor | ast.While | ast.With | ast.AsyncWith):
            yield from _scope_statements(stmt.body)
            yield from _scope_statements(getattr(stmt, "orelse", []))
        elif isinstance(stmt, ast.Try | ast.TryStar):
            yield from _scope_statements(stmt.body)
            for handler in stmt.handlers:
                yield from _scope_statements(handler.body)
            yield from _scope_statements(stmt.orelse)
            yield from _scope_statements(stmt.finalbody)


def _bound_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(stmt, ast.AnnAssign | ast.AugAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return [a.asname or a.name.split(".")[0] for a in stmt.names if a.name != "*"]
    return []


def index_module(module: str, path: str, source: str, *, is_package: bool) -> ModuleIndex:
    """The ``ast`` index of one module (see ``ModuleIndex``)."""
    tree = ast.parse(source)
    units: dict[str, Unit] = {}
    bindings: dict[str, int] = {}
    function_defs: dict[str, int] = {}
    for stmt in _scope_statements(tree.body):
        for name in _bound_names(stmt):
            bindings[name] = bindings.get(name, 0) + 1
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt in tree.body:
                function_defs[name] = function_defs.get(name, 0) + 1
    overloads = {n for n, c in function_defs.items() if c > 1 and bindings[n] == c}
    module_refs: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            import_time, runtime = _function_parts(stmt)
            previous = units.get(stmt.name)
            start = previous.start if previous else _start(stmt)
            units[stmt.name] = Unit(
                module=module,
                qualname=stmt.name,
                kind="function",
                start=start,
                end=stmt.end_lineno or stmt.lineno,
                body=_body_span(stmt.body),
                import_refs=frozenset(import_time | (previous.import_refs if previous else set())),
                runtime_refs=frozenset(runtime | (previous.runtime_refs if previous else set())),
                attr_refs=frozenset(_attrs(stmt) | (previous.attr_refs if previous else set())),
            )
        elif isinstance(stmt, ast.ClassDef):
            shell: set[str] = set()
            for d in [*stmt.decorator_list, *stmt.bases, *[k.value for k in stmt.keywords]]:
                shell |= _names(d)
            runtime_all: set[str] = set()
            for item in stmt.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    import_time, runtime = _function_parts(item)
                    shell |= import_time
                    runtime_all |= runtime
                    qual = f"{stmt.name}.{item.name}"
                    previous = units.get(qual)
                    units[qual] = Unit(
                        module=module,
                        qualname=qual,
                        kind="method",
                        start=previous.start if previous else _start(item),
                        end=item.end_lineno or item.lineno,
                        body=_body_span(item.body),
                        import_refs=frozenset(import_time),
                        runtime_refs=frozenset(
                            runtime | (previous.runtime_refs if previous else set())
                        ),
                        attr_refs=frozenset(
                            _attrs(item) | (previous.attr_refs if previous else set())
                        ),
                    )
                else:
                    shell |= _names(item)
            units[stmt.name] = Unit(
                module=module,
                qualname=stmt.name,
                kind="class",
                start=_start(stmt),
                end=stmt.end_lineno or stmt.lineno,
                body=None,
                import_refs=frozenset(shell - {stmt.name}),
                runtime_refs=frozenset(runtime_all),
                attr_refs=frozenset(_attrs(stmt)),
            )
        elif (
            isinstance(stmt, ast.Assign | ast.AnnAssign)
            and len(_bound_names(stmt)) == 1
            and (not isinstance(stmt, ast.Assign) or isinstance(stmt.targets[0], ast.Name))
            and _bound_names(stmt)[0] != "__all__"
        ):
            name = _bound_names(stmt)[0]
            value = stmt.value
            refs = _names(value) | (
                _names(stmt.annotation) if isinstance(stmt, ast.AnnAssign) else set()
            )
            units[name] = Unit(
                module=module,
                qualname=name,
                kind="assignment",
                start=stmt.lineno,
                end=stmt.end_lineno or stmt.lineno,
                body=None,
                import_refs=frozenset(refs - {name}),
                runtime_refs=frozenset(),
                attr_refs=frozenset(_attrs(stmt)),
            )
        elif not isinstance(stmt, ast.Import | ast.ImportFrom):
            module_refs |= _names(stmt)
    module_refs.discard("__all__")
    imports: list[ImportRef] = []
    toplevel_imports = {id(s) for s in _scope_statements(tree.body)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                imports.append(
                    ImportRef(
                        module=a.name,
                        name=None,
                        bound=a.asname or a.name.split(".")[0],
                        toplevel=id(node) in toplevel_imports,
                    )
                )
        elif isinstance(node, ast.ImportFrom):
            absolute = resolve_import(node.module or "", node.level, module, is_package)
            for a in node.names:
                imports.append(
                    ImportRef(
                        module=absolute,
                        name=a.name,
                        bound=a.asname or a.name,
                        toplevel=id(node) in toplevel_imports,
                    )
                )
    return ModuleIndex(
        module=module,
        path=path,
        source=source,
        units=units,
        bindings=bindings,
        overloads=overloads,
        module_refs=frozenset(module_refs),
        module_attr_refs=frozenset(_attrs(tree)),
        imports=imports,
        exported=frozenset(all_entries(tree)),
    )


def index_package(root: str | Path, layout: Layout) -> dict[str, ModuleIndex]:
    """``index_module`` for every module of the layout that parses (dotted name -> index)."""
    root = Path(root)
    out = {}
    for dotted, rel in sorted(layout.modules.items()):
        try:
            source = read_source(root / rel)
            out[dotted] = index_module(dotted, rel, source, is_package=rel.endswith("__init__.py"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
    return out


# ---------------------------------------------------------------------------------------------
# baseline runs


_COVERAGE_PLUGIN = '''\
"""Per-test coverage contexts for etude's task factory (written for one run, then removed)."""
import os

import coverage

_cov = coverage.Coverage(
    data_file=os.environ["ETUDE_COV_DATA"],
    config_file=os.environ["ETUDE_COV_RC"],
    source=os.environ["ETUDE_COV_SOURCE"].split(os.pathsep),
)
_cov.start()


def pytest_runtest_logstart(nodeid, location):
    _cov.switch_context(nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _cov.switch_context("")


def pytest_unconfigure(config):
    _cov.stop()
    _cov.save()
'''
# the C tracer records dynamic contexts; sys.monitoring (coverage's default on 3.12+) does not
_COVERAGE_RC = "[run]\ncore = ctrace\nbranch = false\n"

_IMPORT_PROBE = """
import importlib, json, sys
ok = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        continue
    ok.append(name)
print(json.dumps(ok))
"""


@dataclass(kw_only=True, slots=True)
class Baseline:
    """Outcomes of the unmodified suite and the per-test coverage map."""

    passing: tuple[str, ...]
    """Canonical node ids that passed in every baseline run."""
    failing: tuple[str, ...]
    """Ids that failed (or errored, or were skipped) in every run."""
    flaky: tuple[str, ...]
    """Ids whose outcome differed between runs: excluded from every task."""
    canonical: dict[tuple[str, str], str]
    """JUnit address -> pytest node id, for ids reconstructed from reports."""
    line_tests: dict[str, dict[int, frozenset[str]]]
    """Relative path -> line -> ids of the tests that executed the line."""
    importable: tuple[str, ...]
    """Modules of the package that import in the sandbox."""
    run_seconds: float = 0.0
    """Wall-clock seconds of the baseline's sandboxed runs."""
    output: str = ""
    """The end of the coverage run's pytest output (for error messages)."""

    def outcomes(self, run: TestRun) -> dict[str, str]:
        """A run's outcomes keyed by canonical ids."""
        return canonical_outcomes(run, self.canonical)


def canonical_outcomes(run: TestRun, canonical: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """``run.results`` with each id replaced by the canonical id of its JUnit address."""
    out: dict[str, str] = {}
    for test_id, outcome in run.results.items():
        out[canonical.get(junit_address(test_id), test_id)] = outcome
    return out


def probe_imports(
    sandbox: Any, workspace: Path, modules: Iterable[str], env: Mapping[str, str], timeout: float
) -> list[str]:
    """Modules that import without error in ``sandbox`` from ``workspace``."""
    names = sorted(modules)
    if not names:
        return []
    result = sandbox.run(
        ["python", "-c", _IMPORT_PROBE, *names], workspace, timeout=timeout, env=dict(env)
    )
    if result.exit_code != 0 or not result.stdout.strip():
        return []
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_baseline(
    sandbox: Any,
    workspace: str | Path,
    layout: Layout,
    *,
    runs: int = 2,
    timeout: float = 600.0,
    pytest_args: Iterable[str] = (),
) -> Baseline:
    """Run the suite ``runs`` times: ``runs - 1`` plain runs in ``workspace`` (a scratch copy),
    then one under coverage in a copy of it beside it, at another path (removed afterwards).
    """
    if runs < 2:
        raise ValueError(f"baseline runs={runs}: need at least 2 to see flaky tests")
    ws = Path(workspace).resolve()
    env = dict(layout.test_env)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = str(ws / env["PYTHONPATH"])
    args = ["--continue-on-collection-errors", *pytest_args]
    importable = probe_imports(sandbox, ws, layout.modules, env, timeout)
    plain: list[TestRun] = [
        run_pytest(sandbox, ws, [], timeout=timeout, extra_args=args, env=env)
        for _ in range(runs - 1)
    ]
    # the coverage run happens in a copy at another path (made after the plain runs, so state
    # they left behind carries over): tests that depend on where the tree lies, or on files an
    # earlier run wrote, then differ between the runs and are caught as flaky
    cws = ws.parent / f"{ws.name}-{uuid.uuid4().hex[:10]}"
    shutil.copytree(ws, cws, symlinks=True)
    try:
        cov_dir = cws / f".etude-cov-{uuid.uuid4().hex}"
        cov_dir.mkdir()
        (cov_dir / "etude_cov_plugin.py").write_text(_COVERAGE_PLUGIN)
        (cov_dir / "coveragerc").write_text(_COVERAGE_RC)
        source_dirs = sorted(
            {str(cws / PurePosixPath(rel).parent) for rel in layout.modules.values()}
        )
        cov_env = dict(layout.test_env)
        if cov_env.get("PYTHONPATH"):
            cov_env["PYTHONPATH"] = str(cws / cov_env["PYTHONPATH"])
        cov_env.update(
            {
                "PYTHONPATH": ":".join(
                    p for p in (str(cov_dir), cov_env.get("PYTHONPATH", "")) if p
                ),
                "COVERAGE_CORE": "ctrace",
                "ETUDE_COV_DATA": str(cov_dir / "data"),
                "ETUDE_COV_RC": str(cov_dir / "coveragerc"),
                "ETUDE_COV_SOURCE": ":".join(source_dirs),
            }
        )
        covered = run_pytest(
            sandbox,
            cws,
            [],
            timeout=timeout,
            extra_args=["-p", "etude_cov_plugin", *args],
            env=cov_env,
        )
        line_tests, contexts = _read_coverage(cov_dir / "data", cws)
    finally:
        shutil.rmtree(cws, ignore_errors=True)
    if covered.timed_out or any(r.timed_out for r in plain):
        raise ValueError(
            f"the test suite of {layout.name} ran past the timeout of {timeout:.0f}s; raise "
            "test_timeout_s"
        )
    if not contexts and covered.results:
        raise ValueError(
            "coverage recorded no per-test contexts (is coverage's C tracer installed? "
            f"pytest output: {covered.output[-500:]})"
        )
    canonical = {junit_address(c): c for c in contexts}
    all_runs = [*plain, covered]
    per_run = [canonical_outcomes(r, canonical) for r in all_runs]
    ids = sorted(set().union(*per_run))
    passing, failing, flaky = [], [], []
    for test_id in ids:
        outcomes = {run.get(test_id, "error") for run in per_run}
        if outcomes == {"passed"}:
            passing.append(test_id)
        elif "passed" in outcomes:
            flaky.append(test_id)
        else:
            failing.append(test_id)
    return Baseline(
        passing=tuple(passing),
        failing=tuple(failing),
        flaky=tuple(flaky),
        canonical=canonical,
        line_tests=line_tests,
        importable=tuple(importable),
        run_seconds=sum(r.duration for r in all_runs),
        output=covered.output[-2000:],
    )


def _read_coverage(
    data_file: Path, ws: Path
) -> tuple[dict[str, dict[int, frozenset[str]]], set[str]]:
    import coverage

    if not data_file.exists():
        return {}, set()
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    contexts = {c for c in data.measured_contexts() if c}
    out: dict[str, dict[int, frozenset[str]]] = {}
    for filename in data.measured_files():
        path = Path(filename)
        if ws not in path.parents:
            continue
        by_line = {
            line: frozenset(c for c in ctxs if c)
            for line, ctxs in data.contexts_by_lineno(filename).items()
        }
        out[path.relative_to(ws).as_posix()] = {k: v for k, v in by_line.items() if v}
    return out, contexts


# ---------------------------------------------------------------------------------------------
# test-file imports


@dataclass(kw_only=True, slots=True)
class TestImports:
    """What each test file imports at module level (collection time)."""

    __test__ = False

    modules: dict[str, set[str]]
    """Test file -> absolute modules it imports (``import m``, ``from m import x``)."""
    names: dict[str, set[tuple[str, str]]]
    """Test file -> ``(module, name)`` pairs of ``from module import name``."""
    collection_names: dict[str, set[str]] = field(default_factory=dict)
    """Test file -> names and attribute names evaluated when the file is collected (module-level
    code, class bodies, decorators and defaults), e.g. ``staticmethod(pkg.func.cached)``."""


def _collection_time_nodes(body: list[ast.stmt]) -> Iterable[ast.AST]:
    """The parts of a module that run at import: everything but function bodies."""
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from stmt.decorator_list
            yield from stmt.args.defaults
            yield from (d for d in stmt.args.kw_defaults if d is not None)
        elif isinstance(stmt, ast.ClassDef):
            yield from stmt.decorator_list
            yield from stmt.bases
            yield from _collection_time_nodes(stmt.body)
        else:
            yield stmt


def index_test_imports(root: str | Path, layout: Layout) -> TestImports:
    """Module-level imports of every test file (conftest files included)."""
    root = Path(root)
    modules: dict[str, set[str]] = {}
    names: dict[str, set[tuple[str, str]]] = {}
    collection: dict[str, set[str]] = {}
    for rel in layout.test_files:
        try:
            tree = ast.parse((root / rel).read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        mods: set[str] = set()
        pairs: set[tuple[str, str]] = set()
        for stmt in _scope_statements(tree.body):
            if isinstance(stmt, ast.Import):
                mods.update(a.name for a in stmt.names)
            elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
                mods.add(stmt.module)
                pairs.update((stmt.module, a.name) for a in stmt.names)
        modules[rel] = mods
        names[rel] = pairs
        used: set[str] = set()
        for node in _collection_time_nodes(tree.body):
            used |= _names(node) | _attrs(node)
        collection[rel] = used
    return TestImports(modules=modules, names=names, collection_names=collection)


def tests_in_files(ids: Iterable[str], files: Iterable[str]) -> set[str]:
    """Ids whose file is one of ``files``, or lies under the directory of a listed conftest."""
    files = set(files)
    dirs = {str(PurePosixPath(f).parent) for f in files if f.endswith("conftest.py")}
    out = set()
    for test_id in ids:
        path = test_id.split("::", 1)[0]
        if path in files or any(d == "." or path.startswith(d + "/") for d in dirs):
            out.add(test_id)
    return out


# ---------------------------------------------------------------------------------------------
# features


@dataclass(frozen=True, slots=True)
class Feature:
    """A deletable piece of the package and the tests expected to fail without it."""

    kind: str
    """``function``, ``class``, ``method``, ``module``, ``multi`` (several features) or ``helper``."""
    name: str
    """Short display name, e.g. ``case.slugify`` or ``roman`` (unique within a repository)."""
    symbols: tuple[str, ...]
    """Dotted names of what is deleted: the interface first, then private helpers."""
    interface: tuple[str, ...]
    """Dotted names of the public definitions the problem statement describes."""
    definitions: tuple[tuple[str, tuple[str, ...]], ...]
    """``(module path, qualnames)`` to remove from modules that stay."""
    files: tuple[str, ...]
    """Module paths removed whole."""
    tests: frozenset[str]
    """Candidate FAIL_TO_PASS tests (canonical ids)."""
    deleted_lines: int
    """Lines of the deleted definitions (the size budget's measure)."""
    parts: tuple[str, ...] = ()
    """For ``multi``: names of the component features."""


@dataclass(kw_only=True, slots=True)
class ProposalConfig:
    """Which features ``propose_features`` offers."""

    min_lines: int = 3
    """Smallest feature (lines of deleted definitions)."""
    max_lines: int = 150
    """Largest symbol feature (lines)."""
    max_module_lines: int = 400
    """Largest module feature (lines)."""
    max_test_fraction: float = 0.5
    """Skip features exercised by more than this share of the passing tests (core utilities)."""
    methods: bool = True
    """Offer public methods of classes as features."""
    modules: bool = True
    """Offer whole modules as features."""
    include: tuple[str, ...] = ()
    """Glob patterns over dotted names (``textkit.case.*``); empty: everything."""

    def __post_init__(self) -> None:
        if self.min_lines < 1:
            raise ValueError(f"min_lines={self.min_lines} must be >= 1")
        if self.max_lines < self.min_lines or self.max_module_lines < self.min_lines:
            raise ValueError(
                f"max_lines={self.max_lines} and max_module_lines={self.max_module_lines} must be "
                f">= min_lines={self.min_lines}"
            )
        if not 0.0 < self.max_test_fraction <= 1.0:
            raise ValueError(f"max_test_fraction={self.max_test_fraction} must be in (0, 1]")


@dataclass(kw_only=True, slots=True)
class Proposals:
    """Features worth validating and the symbols that were skipped, with reasons."""

    features: list[Feature] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    """Dotted name -> why it is not a feature."""


class Miner:
    """Static facts about a package plus its baseline, answering "what is a feature?"."""

    def __init__(
        self,
        layout: Layout,
        index: Mapping[str, ModuleIndex],
        baseline: Baseline,
        test_imports: TestImports,
    ) -> None:
        self.layout = layout
        self.index = dict(index)
        self.baseline = baseline
        self.test_imports = test_imports
        self.passing = frozenset(baseline.passing)

    # -- helpers ---------------------------------------------------------------------------

    def _units_of(self, mod: ModuleIndex, qualnames: Iterable[str]) -> set[str]:
        """Qualnames plus the methods of listed classes."""
        out = set(qualnames)
        for q in list(out):
            if mod.units.get(q) is not None and mod.units[q].kind == "class":
                out |= {u for u in mod.units if u.startswith(q + ".")}
        return out

    def _users(self, mod: ModuleIndex, name: str) -> set[str]:
        """Units (top-level or methods) of ``mod`` whose references include ``name``."""
        return {q for q, u in mod.units.items() if name in u.refs and u.kind != "class"} | {
            q for q, u in mod.units.items() if u.kind == "class" and name in u.import_refs
        }

    def _attr_users(self, mod: ModuleIndex, attr: str) -> set[str]:
        return {q for q, u in mod.units.items() if attr in u.attr_refs and u.kind != "class"}

    def tests_of(self, path: str, mod: ModuleIndex, qualnames: Iterable[str]) -> set[str]:
        """Passing tests that executed the body of one of ``qualnames`` (methods of classes too)."""
        lines = self.baseline.line_tests.get(path, {})
        out: set[str] = set()
        for q in self._units_of(mod, qualnames):
            unit = mod.units[q]
            if unit.body is None:
                continue
            lo, hi = unit.body
            for line in range(lo, hi + 1):
                out |= lines.get(line, frozenset())
        return out & self.passing

    def _external_users(self, mod: ModuleIndex, names: set[str]) -> list[str]:
        """Other package modules that use ``names`` of ``mod`` beyond re-exporting them."""
        users = []
        for other in self.index.values():
            if other.module == mod.module:
                continue
            imports_names = any(i.module == mod.module and i.name in names for i in other.imports)
            imports_module = any(
                i.module == mod.module
                or (i.name is not None and f"{i.module}.{i.name}" == mod.module)
                for i in other.imports
            )
            if imports_module and not imports_names and names & other.module_attr_refs:
                users.append(other.module)
                continue
            if imports_names:
                try:
                    unlink_imports(
                        other.source,
                        importer=other.module,
                        importer_is_package=other.path.endswith("__init__.py"),
                        removed_names={mod.module: names},
                        removed_modules=set(),
                    )
                except DeletionError:
                    users.append(other.module)
        return users

    def _module_importers(self, module: str) -> list[str]:
        users = []
        last = module.rsplit(".", 1)[-1]
        for other in self.index.values():
            if other.module == module or other.module.startswith(module + "."):
                continue
            if last not in other.source:  # cannot import it without naming it
                continue
            try:
                unlink_imports(
                    other.source,
                    importer=other.module,
                    importer_is_package=other.path.endswith("__init__.py"),
                    removed_names={},
                    removed_modules={module},
                )
            except DeletionError:
                users.append(other.module)
        return users

    def _grow(self, mod: ModuleIndex, feature: set[str]) -> set[str]:
        """Add private helpers (module-level and, for methods, private methods of the class)
        that only the feature uses."""
        changed = True
        while changed:
            changed = False
            units = self._units_of(mod, feature)
            referenced: set[str] = set()
            attrs: set[str] = set()
            for q in units:
                referenced |= mod.units[q].refs
                attrs |= mod.units[q].attr_refs
            for name in sorted(referenced):
                unit = mod.units.get(name)
                if (
                    unit is None
                    or name in feature
                    or not name.startswith("_")
                    or name.startswith("__")
                ):
                    continue
                if mod.bindings.get(name, 0) != 1 and name not in mod.overloads:
                    continue
                if name in mod.module_refs or name in mod.exported:
                    continue
                if not self._users(mod, name) <= units | self._units_of(mod, [name]):
                    continue
                if self._external_users(mod, {name}) or self._imported_elsewhere(mod, name):
                    continue
                feature.add(name)
                changed = True
            classes = {q.split(".")[0] for q in feature if "." in q}
            for cls in classes:
                for q, unit in mod.units.items():
                    if not q.startswith(cls + ".") or q in feature or unit.kind != "method":
                        continue
                    attr = unit.name
                    if not attr.startswith("_") or attr.startswith("__") or attr not in attrs:
                        continue
                    if self._attr_users(mod, attr) - self._units_of(mod, feature) - {q}:
                        continue
                    if any(
                        attr in o.module_attr_refs
                        for o in self.index.values()
                        if o.module != mod.module
                    ):
                        continue
                    feature.add(q)
                    changed = True
        return feature

    def _imported_elsewhere(self, mod: ModuleIndex, name: str) -> bool:
        return any(
            i.module == mod.module and i.name == name
            for other in self.index.values()
            if other.module != mod.module
            for i in other.imports
        )

    def _test_file_conflicts(self, mod: ModuleIndex, names: set[str], tests: set[str]) -> list[str]:
        """Test files that import one of ``names`` at module level and hold other passing tests."""
        parents = {mod.module}
        parts = mod.module.split(".")
        parents |= {".".join(parts[:i]) for i in range(1, len(parts))}
        top = mod.module.split(".")[0]
        out = []
        for rel, pairs in self.test_imports.names.items():
            # ``from pkg import case`` names a module, not a definition called ``case``
            by_name = any(
                m in parents and n in names and f"{m}.{n}" not in self.layout.modules
                for m, n in pairs
            )
            # ``DECORATOR = staticmethod(pkg.func.cached)`` in a class body of the test file
            imports_package = any(
                m == top or m.startswith(top + ".") for m in self.test_imports.modules.get(rel, ())
            )
            by_attribute = imports_package and names & self.test_imports.collection_names.get(
                rel, set()
            )
            if not (by_name or by_attribute):
                continue
            in_file = tests_in_files(self.passing, [rel])
            if in_file - tests:
                out.append(rel)
        return out

    def _budget(self, mod: ModuleIndex, units: set[str]) -> int:
        tops = {q for q in units if "." not in q}
        lines = sum(mod.units[q].end - mod.units[q].start + 1 for q in tops)
        lines += sum(
            mod.units[q].end - mod.units[q].start + 1
            for q in units
            if "." in q and q.split(".")[0] not in tops
        )
        return lines

    # -- proposals -------------------------------------------------------------------------

    def symbol_feature(
        self, module: str, qualname: str, cfg: ProposalConfig, *, kind: str | None = None
    ) -> Feature | str:
        """The feature rooted at ``module.qualname``, or why there is none."""
        mod = self.index.get(module)
        if mod is None or qualname not in mod.units:
            return "not a definition at module or class level"
        if module not in self.baseline.importable:
            return "its module does not import in the sandbox"
        unit = mod.units[qualname]
        top = qualname.split(".")[0]
        if mod.bindings.get(top, 0) != 1 and top not in mod.overloads:
            return f"{top} is bound more than once at module scope"
        if unit.kind == "method":
            cls = mod.units[top]
            if unit.name.startswith("__") or qualname.count(".") != 1:
                return "dunder or nested method"
            feature = self._grow(mod, {qualname})
            outside = self._attr_users(mod, unit.name) - self._units_of(mod, feature)
            if outside:
                return f"used by {sorted(outside)[0]}"
            others = [
                o.module
                for o in self.index.values()
                if o.module != module and unit.name in o.module_attr_refs
            ]
            if others:
                return f"attribute {unit.name!r} is used by module {others[0]}"
            if unit.name in cls.import_refs:
                return "needed at import time by its class"
        else:
            feature = self._grow(mod, {qualname})
            units = self._units_of(mod, feature)
            if top in mod.module_refs:
                return "needed at import time by module-level code"
            at_import = sorted(
                q for q, u in mod.units.items() if top in u.import_refs and q not in units
            )
            if at_import:
                return f"needed at import time by {at_import[0]}"
            outside = self._users(mod, top) - units
            if outside:
                return f"used by {sorted(outside)[0]}"
            external = self._external_users(mod, {q for q in feature if "." not in q})
            if external:
                return f"used by module {external[0]}"
        units = self._units_of(mod, feature)
        tests = self.tests_of(mod.path, mod, feature)
        if not tests:
            return "no passing test executes it"
        if len(tests) > cfg.max_test_fraction * max(1, len(self.passing)):
            return f"exercised by {len(tests)} of {len(self.passing)} tests (a core utility)"
        conflicts = self._test_file_conflicts(mod, {q for q in feature if "." not in q}, tests)
        if conflicts:
            return f"needed to collect {conflicts[0]}, which also tests other code"
        lines = self._budget(mod, units)
        if not cfg.min_lines <= lines <= cfg.max_lines:
            return f"{lines} lines, outside the budget [{cfg.min_lines}, {cfg.max_lines}]"
        ordered = [qualname] + sorted(feature - {qualname})
        return Feature(
            kind=kind or unit.kind,
            name=f"{_short(module, self.layout)}.{qualname}",
            symbols=tuple(f"{module}.{q}" for q in ordered),
            interface=(f"{module}.{qualname}",),
            definitions=((mod.path, tuple(ordered)),),
            files=(),
            tests=frozenset(tests),
            deleted_lines=lines,
        )

    def module_feature(self, module: str, cfg: ProposalConfig) -> Feature | str:
        """The whole module as a feature, or why not."""
        mod = self.index.get(module)
        if mod is None:
            return "not a module of the package"
        if mod.path.endswith("__init__.py") or module.endswith("__main__"):
            return "package __init__ and __main__ modules are not deleted whole"
        if module not in self.baseline.importable:
            return "does not import in the sandbox"
        importers = self._module_importers(module)
        if importers:
            return f"imported by {importers[0]}"
        lines = len(mod.source.splitlines())
        if not cfg.min_lines <= lines <= cfg.max_module_lines:
            return f"{lines} lines, outside the budget [{cfg.min_lines}, {cfg.max_module_lines}]"
        covered: set[str] = set()
        for ids in self.baseline.line_tests.get(mod.path, {}).values():
            covered |= ids
        importing = [
            rel
            for rel, mods in self.test_imports.modules.items()
            if module in mods or any(m.startswith(module + ".") for m in mods)
        ]
        importing += [
            rel
            for rel, pairs in self.test_imports.names.items()
            if any(f"{m}.{n}" == module for m, n in pairs)
        ]
        tests = (covered | tests_in_files(self.passing, importing)) & self.passing
        if not tests:
            return "no passing test executes or imports it"
        if len(tests) > cfg.max_test_fraction * max(1, len(self.passing)):
            return f"exercised by {len(tests)} of {len(self.passing)} tests (a core module)"
        public = [
            f"{module}.{q}" for q, u in mod.units.items() if "." not in q and not q.startswith("_")
        ]
        return Feature(
            kind="module",
            name=_short(module, self.layout),
            symbols=(module,),
            interface=tuple(public),
            definitions=(),
            files=(mod.path,),
            tests=frozenset(tests),
            deleted_lines=lines,
        )

    def propose(self, cfg: ProposalConfig) -> Proposals:
        """Every feature of the package (symbols first, then modules), and the skipped ones."""
        out = Proposals()

        def included(dotted: str) -> bool:
            return not cfg.include or any(fnmatch.fnmatchcase(dotted, p) for p in cfg.include)

        seen: set[tuple[str, ...]] = set()
        for module, mod in sorted(self.index.items()):
            for q, unit in mod.units.items():
                dotted = f"{module}.{q}"
                if not included(dotted) or any(part.startswith("_") for part in q.split(".")):
                    continue
                if unit.kind == "assignment" or (unit.kind == "method" and not cfg.methods):
                    continue
                result = self.symbol_feature(module, q, cfg)
                if isinstance(result, str):
                    out.rejected[dotted] = result
                elif result.symbols not in seen:
                    seen.add(result.symbols)
                    out.features.append(result)
        if cfg.modules:
            for module in sorted(self.index):
                if not included(module) or module in self.layout.packages:
                    continue
                result = self.module_feature(module, cfg)
                if isinstance(result, str):
                    out.rejected[module] = result
                else:
                    out.features.append(result)
        return out

    def custom_feature(
        self, module: str, qualnames: Iterable[str], cfg: ProposalConfig
    ) -> Feature | str:
        """A feature made of exactly ``qualnames`` (e.g. proposed by a model), or why not.

        The same checks as ``symbol_feature`` apply, without growing the set: nothing outside it
        may use its definitions, at import time or at run time.
        """
        mod = self.index.get(module)
        if mod is None:
            return "not a module of the package"
        if module not in self.baseline.importable:
            return "its module does not import in the sandbox"
        names = list(dict.fromkeys(qualnames))
        missing = [q for q in names if q not in mod.units]
        if missing:
            return f"{missing[0]} is not a definition of {module}"
        units = self._units_of(mod, names)
        tops = {q for q in names if "." not in q}
        for q in names:
            top = q.split(".")[0]
            if mod.bindings.get(top, 0) != 1 and top not in mod.overloads:
                return f"{top} is bound more than once at module scope"
            if "." in q:
                outside = self._attr_users(mod, q.split(".")[-1]) - units
            else:
                if q in mod.module_refs:
                    return f"{q} is needed at import time by module-level code"
                at_import = sorted(
                    u for u, unit in mod.units.items() if q in unit.import_refs and u not in units
                )
                if at_import:
                    return f"{q} is needed at import time by {at_import[0]}"
                outside = self._users(mod, q) - units
            if outside:
                return f"{q} is used by {sorted(outside)[0]}"
        external = self._external_users(mod, tops)
        if external:
            return f"used by module {external[0]}"
        tests = self.tests_of(mod.path, mod, names)
        if not tests:
            return "no passing test executes it"
        if len(tests) > cfg.max_test_fraction * max(1, len(self.passing)):
            return f"exercised by {len(tests)} of {len(self.passing)} tests"
        conflicts = self._test_file_conflicts(mod, tops, tests)
        if conflicts:
            return f"needed to collect {conflicts[0]}, which also tests other code"
        lines = self._budget(mod, units)
        if not cfg.min_lines <= lines <= cfg.max_lines:
            return f"{lines} lines, outside the budget [{cfg.min_lines}, {cfg.max_lines}]"
        public = [q for q in names if not any(p.startswith("_") for p in q.split("."))]
        return Feature(
            kind="agent",
            name=f"{_short(module, self.layout)}.{'+'.join(public or names[:1])}",
            symbols=tuple(f"{module}.{q}" for q in names),
            interface=tuple(f"{module}.{q}" for q in (public or names)),
            definitions=((mod.path, tuple(names)),),
            files=(),
            tests=frozenset(tests),
            deleted_lines=lines,
        )

    def helper_feature(self, module: str, qualname: str, cfg: ProposalConfig) -> Feature | str:
        """A private helper alone as a feature (a smaller task than its public user)."""
        mod = self.index.get(module)
        if mod is None or qualname not in mod.units:
            return "not a definition"
        unit = mod.units[qualname]
        if unit.kind not in ("function", "method") or unit.body is None:
            return "only functions and methods with a body are helper features"
        tests = self.tests_of(mod.path, mod, [qualname])
        if not tests:
            return "no passing test executes it"
        lines = unit.end - unit.start + 1
        if not cfg.min_lines <= lines <= cfg.max_lines:
            return f"{lines} lines, outside the budget"
        return Feature(
            kind="helper",
            name=f"{_short(module, self.layout)}.{qualname}",
            symbols=(f"{module}.{qualname}",),
            interface=(f"{module}.{qualname}",),
            definitions=((mod.path, (qualname,)),),
            files=(),
            tests=frozenset(tests),
            deleted_lines=lines,
        )


def _short(module: str, layout: Layout) -> str:
    """Module name without the top-level package (``textkit.case`` -> ``case``)."""
    for top in layout.packages:
        if module.startswith(top + "."):
            return module[len(top) + 1 :]
    return module


def combine(features: Iterable[Feature]) -> Feature:
    """Several features deleted together (a harder task): definitions, files and tests unite."""
    parts = sorted(features, key=lambda f: f.name)
    if len(parts) < 2:
        raise ValueError("combine needs at least two features")
    files = tuple(sorted({p for f in parts for p in f.files}))
    by_path: dict[str, list[str]] = {}
    for f in parts:
        for path, quals in f.definitions:
            if path in files:
                continue
            by_path.setdefault(path, [])
            by_path[path] += [q for q in quals if q not in by_path[path]]
    symbols: list[str] = []
    interface: list[str] = []
    for f in parts:
        symbols += [s for s in f.symbols if s not in symbols]
        interface += [s for s in f.interface if s not in interface]
    return Feature(
        kind="multi",
        name="+".join(f.name for f in parts),
        symbols=tuple(symbols),
        interface=tuple(interface),
        definitions=tuple((p, tuple(q)) for p, q in sorted(by_path.items())),
        files=files,
        tests=frozenset().union(*(f.tests for f in parts)),
        deleted_lines=sum(f.deleted_lines for f in parts),
        parts=tuple(f.name for f in parts),
    )
