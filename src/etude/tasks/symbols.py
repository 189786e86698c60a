"""A static index of a package and its tests: definitions, references, imports.

``index_module`` parses one module with ``ast`` into its units (top-level functions, classes,
assignments and the methods of top-level classes) with what each refers to at import time and at
run time; ``index_package`` does it for every module of a layout. ``index_test_imports`` records
what each test file imports and evaluates when it is collected, so the miner knows which
deletions would make a test file uncollectable.

What this module does not do: see dynamic uses (``getattr``, string-based registries, entry
points), follow star imports, or run any code.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from etude.tasks.delete import all_entries, read_source, resolve_import
from etude.tasks.layout import Layout


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
