"""Delete a feature from Python sources with LibCST, leaving every other byte as it was.

A feature is a set of definitions (top-level functions, classes and assignments, or methods
``Class.method``) and possibly whole module files. ``apply_removal`` takes the sources of a
package and returns the edited ones:

- the definitions are removed with the comments and blank lines that lead into them (LibCST keeps
  those in the statement's ``leading_lines``); a class left with no body gets ``pass``;
- ``__all__`` entries naming them are removed (list/tuple assignments, ``+=``, ``.append``,
  ``.extend``), as are the same definitions in a ``.pyi`` stub beside the module;
- imports that the deleted code used and nothing else uses any more are removed (imports that
  were unused before the deletion, e.g. re-exports, are left alone);
- in every other module of the package, imports of a deleted name or module are removed with
  their ``__all__`` entries; if such a name is still used there, the removal is refused
  (``DeletionError``): the package would not import or would lose behaviour;
- deleted modules lose their file (and stub).

What it does not do: follow dynamic uses (``getattr(mod, "name")``, string references, entry
points), edit non-Python files, or decide whether a deletion is a good task (``mine`` proposes,
``validate`` decides). The gold patch and the trivial implementation of a deleted feature are
made by ``etude.tasks.patches``.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst


def read_source(path: str | Path) -> str:
    """A source file's text exactly as stored (UTF-8; ``\r\n`` line ends kept)."""
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def write_source(path: str | Path, text: str) -> None:
    """Write ``text`` without newline translation (the inverse of ``read_source``)."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


class DeletionError(ValueError):
    """The requested deletion cannot be made without breaking the rest of the package."""


@dataclass(frozen=True, slots=True)
class Removal:
    """What to delete from a package's sources."""

    definitions: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``(module path, qualnames)`` pairs; a qualname is ``name`` or ``Class.method``."""
    files: tuple[str, ...] = ()
    """Module paths removed whole (their ``.pyi`` stubs go too)."""


@dataclass(kw_only=True, slots=True)
class Edit:
    """Result of a removal: new texts, removed files, and the originals of both."""

    changed: dict[str, str] = field(default_factory=dict)
    """Path -> new source, for files that stay but changed."""
    removed: tuple[str, ...] = ()
    """Paths of files deleted whole."""
    original: dict[str, str] = field(default_factory=dict)
    """Path -> original source, for every changed or removed file."""

    def deleted_lines(self) -> int:
        """Lines the gold patch adds back."""
        total = 0
        for path, old in self.original.items():
            new = self.changed.get(path, "")
            sm = difflib.SequenceMatcher(None, new.splitlines(), old.splitlines(), autojunk=False)
            total += sum(j2 - j1 for tag, _, _, j1, j2 in sm.get_opcodes() if tag != "equal")
        return total


# ---------------------------------------------------------------------------------------------
# names used by a module (ast)


def used_names(source: str) -> set[str]:
    """Every name a module refers to: ``Name`` nodes, and the strings of its ``__all__``."""
    tree = ast.parse(source)
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= set(all_entries(tree))
    return names


def all_entries(tree: ast.Module) -> list[str]:
    """String entries of ``__all__`` assignments, ``+=`` and ``append``/``extend`` calls."""
    out: list[str] = []
    for node in tree.body:
        value = None
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            value = node.value
        elif isinstance(node, ast.AugAssign | ast.AnnAssign) and isinstance(node.target, ast.Name):
            value = node.value if node.target.id == "__all__" else None
        elif (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and isinstance(node.value.func.value, ast.Name)
            and node.value.func.value.id == "__all__"
        ):
            for arg in node.value.args:
                out += _string_elements(arg)
        if value is not None:
            out += _string_elements(value)
    return out


def _string_elements(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [
            e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
        ]
    return []


def import_bindings(source: str) -> dict[str, int]:
    """Name -> number of import aliases binding it (``import a.b`` binds ``a``)."""
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    continue
                bound = alias.asname or alias.name.split(".")[0]
                out[bound] = out.get(bound, 0) + 1
    return out


# ---------------------------------------------------------------------------------------------
# LibCST helpers


def _drop(
    elements: Sequence[cst.CSTNode], keep: Sequence[bool], *, trailing_comma_ok: bool
) -> list[cst.CSTNode]:
    """The kept elements of a comma-separated sequence, with a valid comma on the last one.

    When the original last element goes, its comma (which carries the whitespace before the
    closing bracket in a multi-line literal) moves to the new last element.
    """
    kept = [e for e, k in zip(elements, keep) if k]
    if not kept or kept[-1] is elements[-1]:
        return kept
    last = elements[-1]
    comma = getattr(last, "comma", cst.MaybeSentinel.DEFAULT) if trailing_comma_ok else None
    kept[-1] = kept[-1].with_changes(
        comma=comma if comma is not None else cst.MaybeSentinel.DEFAULT
    )
    return kept


def _simple_string(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def _is_all(node: cst.BaseExpression | cst.BaseAssignTargetExpression | None) -> bool:
    return isinstance(node, cst.Name) and node.value == "__all__"


class _Remover(cst.CSTTransformer):
    """Removes top-level definitions and methods, and ``__all__`` entries of ``exported``."""

    def __init__(self, qualnames: Iterable[str], exported: Iterable[str]) -> None:
        super().__init__()
        self.top: set[str] = set()
        self.methods: dict[str, set[str]] = {}
        for q in qualnames:
            head, _, tail = q.partition(".")
            if tail:
                self.methods.setdefault(head, set()).add(tail)
            else:
                self.top.add(head)
        self.exported = set(exported)
        self.found: set[str] = set()

    def on_visit(self, node: cst.CSTNode) -> bool:
        return isinstance(node, cst.Module)  # every edit happens at module level, in leave_Module

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        body = []
        for stmt in updated.body:
            if isinstance(stmt, cst.FunctionDef | cst.ClassDef) and stmt.name.value in self.top:
                self.found.add(stmt.name.value)
                continue
            if isinstance(stmt, cst.ClassDef) and stmt.name.value in self.methods:
                stmt = self._remove_methods(stmt)
            if isinstance(stmt, cst.SimpleStatementLine):
                small = [s for s in stmt.body if not self._assigns_removed(s)]
                if not small:
                    continue
                if len(small) != len(stmt.body):
                    small[-1] = small[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
                    stmt = stmt.with_changes(body=small)
                stmt = self._edit_all(stmt)
                if stmt is None:
                    continue
            body.append(stmt)
        return updated.with_changes(body=body)

    def _remove_methods(self, cls: cst.ClassDef) -> cst.ClassDef:
        name = cls.name.value
        drop = self.methods[name]
        if not isinstance(cls.body, cst.IndentedBlock):
            return cls
        body = []
        for stmt in cls.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value in drop:
                self.found.add(f"{name}.{stmt.name.value}")
                continue
            body.append(stmt)
        if not any(not is_docstring(s) for s in body):
            body.append(cst.SimpleStatementLine([cst.Pass()]))
        return cls.with_changes(body=cls.body.with_changes(body=body))

    def _assigns_removed(self, small: cst.BaseSmallStatement) -> bool:
        if isinstance(small, cst.Assign):
            names = [t.target for t in small.targets]
            if all(isinstance(n, cst.Name) and n.value in self.top for n in names):
                self.found.update(n.value for n in names)  # type: ignore[union-attr]
                return True
        if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
            if small.target.value in self.top:
                self.found.add(small.target.value)
                return True
        return False

    # __all__ -------------------------------------------------------------------------------

    def _edit_all(self, stmt: cst.SimpleStatementLine) -> cst.SimpleStatementLine | None:
        if not self.exported:
            return stmt
        small = []
        for s in stmt.body:
            new = self._edit_all_small(s)
            if new is not None:
                small.append(new)
        if not small:
            return None
        if small[-1] is not stmt.body[-1]:
            small[-1] = small[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
        return stmt.with_changes(body=small)

    def _edit_all_small(self, s: cst.BaseSmallStatement) -> cst.BaseSmallStatement | None:
        if isinstance(s, cst.Assign) and any(_is_all(t.target) for t in s.targets):
            return s.with_changes(value=self._filter_sequence(s.value))
        if isinstance(s, cst.AnnAssign | cst.AugAssign) and _is_all(s.target) and s.value:
            return s.with_changes(value=self._filter_sequence(s.value))
        if (
            isinstance(s, cst.Expr)
            and isinstance(s.value, cst.Call)
            and isinstance(s.value.func, cst.Attribute)
            and _is_all(s.value.func.value)
        ):
            call = s.value
            if call.func.attr.value in ("append", "remove") and call.args:
                if _simple_string(call.args[0].value) in self.exported:
                    return None
                return s
            if call.func.attr.value == "extend" and call.args:
                arg = call.args[0].with_changes(value=self._filter_sequence(call.args[0].value))
                return s.with_changes(value=call.with_changes(args=[arg]))
        return s

    def _filter_sequence(self, value: cst.BaseExpression) -> cst.BaseExpression:
        if not isinstance(value, cst.List | cst.Tuple | cst.Set):
            return value
        keep = [_simple_string(e.value) not in self.exported for e in value.elements]
        if all(keep):
            return value
        elements = _drop(value.elements, keep, trailing_comma_ok=True)
        if isinstance(value, cst.Tuple) and len(elements) == 1:
            # ("a") is a string, not a tuple: a one-element tuple needs its comma
            only = elements[0]
            if only.comma == cst.MaybeSentinel.DEFAULT:
                elements = [only.with_changes(comma=cst.Comma())]
        if isinstance(value, cst.Tuple) and not elements and not value.lpar:
            return cst.Tuple(elements=[], lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        if isinstance(value, cst.Set) and not elements:
            return cst.Call(func=cst.Name("set"))
        return value.with_changes(elements=elements)


def is_docstring(stmt: cst.BaseStatement) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, cst.SimpleString | cst.ConcatenatedString)
    )


class _ImportRemover(cst.CSTTransformer):
    """Removes import aliases selected by ``drop(module, level, alias_name, bound) -> bool``."""

    def __init__(self, should_drop) -> None:
        super().__init__()
        self.should_drop = should_drop
        self.dropped: set[str] = set()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return True  # imports inside functions count too

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
        small = []
        for s in updated.body:
            new = self._edit(s)
            if new is not None:
                small.append(new)
        if not small:
            return cst.RemoveFromParent()
        if len(small) != len(updated.body):
            small[-1] = small[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
            return updated.with_changes(body=small)
        return updated.with_changes(body=small)

    def _edit(self, s: cst.BaseSmallStatement) -> cst.BaseSmallStatement | None:
        if isinstance(s, cst.Import):
            keep = []
            for alias in s.names:
                dotted = _dotted(alias.name)
                bound = _alias_bound(alias) or dotted.split(".")[0]
                drop = self.should_drop(dotted, 0, None, bound)
                if drop:
                    self.dropped.add(bound)
                keep.append(not drop)
            if all(keep):
                return s
            if not any(keep):
                return None
            return s.with_changes(names=_drop(s.names, keep, trailing_comma_ok=False))
        if isinstance(s, cst.ImportFrom) and isinstance(s.names, cst.ImportStar):
            module = _dotted(s.module) if s.module is not None else ""
            if self.should_drop(module, len(s.relative), "*", "*"):
                raise DeletionError(
                    f"a star import of {'.' * len(s.relative)}{module} would lose its names"
                )
            return s
        if isinstance(s, cst.ImportFrom):
            module = _dotted(s.module) if s.module is not None else ""
            level = len(s.relative)
            keep = []
            for alias in s.names:
                name = _dotted(alias.name)
                bound = _alias_bound(alias) or name
                drop = self.should_drop(module, level, name, bound)
                if drop:
                    self.dropped.add(bound)
                keep.append(not drop)
            if all(keep):
                return s
            if not any(keep):
                return None
            return s.with_changes(names=_drop(s.names, keep, trailing_comma_ok=s.lpar is not None))
        return s


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    raise AssertionError(f"not a dotted name: {node!r}")


def _alias_bound(alias: cst.ImportAlias) -> str | None:
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    return None


def resolve_import(module: str, level: int, importer: str, importer_is_package: bool) -> str:
    """Absolute module named by ``from <level dots><module> import ...`` inside ``importer``."""
    if level == 0:
        return module
    parts = importer.split(".")
    base = parts if importer_is_package else parts[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


# ---------------------------------------------------------------------------------------------
# the removal


def remove_definitions(source: str, qualnames: Iterable[str], *, stub: bool = False) -> str:
    """``source`` without the definitions ``qualnames``, their ``__all__`` entries, and the imports
    only they used. Raises ``DeletionError`` if a definition is missing (unless ``stub``: a
    ``.pyi`` need not declare everything)."""
    qualnames = tuple(qualnames)
    module = cst.parse_module(source)
    exported = {q for q in qualnames if "." not in q}
    remover = _Remover(qualnames, exported)
    new_module = module.visit(remover)
    missing = sorted(set(qualnames) - remover.found)
    if missing and not stub:
        raise DeletionError(f"definitions not found at module or class level: {missing}")
    return drop_unused_imports(source, new_module.code)


def drop_unused_imports(before: str, after: str) -> str:
    """``after`` without imports that ``before`` used and ``after`` no longer uses."""
    used_before = used_names(before)
    used_after = used_names(after)
    bindings = import_bindings(after)
    stale = {n for n in bindings if n in used_before and n not in used_after}
    if not stale:
        return after
    remover = _ImportRemover(lambda module, level, name, bound: bound in stale)
    return cst.parse_module(after).visit(remover).code


def unlink_imports(
    source: str,
    *,
    importer: str,
    importer_is_package: bool,
    removed_names: Mapping[str, set[str]],
    removed_modules: set[str],
) -> str:
    """Remove imports of deleted names and modules from another module of the package.

    ``removed_names``: absolute module -> top-level names deleted from it; ``removed_modules``:
    absolute names of deleted modules. A bound name that is still used (beyond ``__all__``) is a
    ``DeletionError``.
    """

    # importing pkg.sub binds ``sub`` in package pkg as a side effect; without the import the
    # name is gone too (``del sub`` at the end of an __init__ is a common idiom)
    implicit: set[str] = set()

    def should_drop(module: str, level: int, name: str | None, bound: str) -> bool:
        if name is None:  # import a.b.c
            return any(module == m or module.startswith(m + ".") for m in removed_modules)
        absolute = resolve_import(module, level, importer, importer_is_package)
        if absolute in removed_modules or any(
            absolute.startswith(m + ".") for m in removed_modules
        ):
            parent, _, last = absolute.rpartition(".")
            if importer_is_package and parent == importer:
                implicit.add(last)
            return True
        if f"{absolute}.{name}" in removed_modules:
            return True
        return name in removed_names.get(absolute, set())

    tree = cst.parse_module(source)
    remover = _ImportRemover(should_drop)
    new = tree.visit(remover)
    if not remover.dropped:
        return source
    still = _names_used_outside_all(new.code) & (remover.dropped | implicit)
    still -= set(import_bindings(new.code))  # bound again by another import: not ours to judge
    if still:
        raise DeletionError(
            f"{importer} still uses {sorted(still)} after their import was removed; "
            "the feature is needed by code outside it"
        )
    cleaner = _Remover((), remover.dropped)
    return cst.parse_module(new.code).visit(cleaner).code


def _names_used_outside_all(source: str) -> set[str]:
    return {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}


def apply_removal(files: Mapping[str, str], removal: Removal, modules: Mapping[str, str]) -> Edit:
    """Apply ``removal`` to the package sources ``files`` (path -> text, ``.py`` and ``.pyi``).

    ``modules`` maps each module's dotted name to its path (``pkg/__init__.py`` for ``pkg``).
    Returns the changed and removed files; ``files`` is not modified.
    """
    path_to_module = {p: m for m, p in modules.items()}
    current = dict(files)
    original: dict[str, str] = {}

    def update(path: str, text: str) -> None:
        if text != current[path]:
            original.setdefault(path, files[path])
            current[path] = text

    removed_names: dict[str, set[str]] = {}
    for path, qualnames in removal.definitions:
        if path not in current:
            raise DeletionError(f"module {path} is not among the package sources")
        update(path, remove_definitions(current[path], qualnames))
        stub = path[:-3] + ".pyi"
        if stub in current:
            update(stub, remove_definitions(current[stub], qualnames, stub=True))
        removed_names.setdefault(path_to_module[path], set()).update(
            q for q in qualnames if "." not in q
        )
    removed_files: list[str] = []
    removed_modules: set[str] = set()
    for path in removal.files:
        if path not in current:
            raise DeletionError(f"module {path} is not among the package sources")
        removed_modules.add(path_to_module[path])
        for p in (path, path[:-3] + ".pyi"):
            if p in current:
                original.setdefault(p, files[p])
                removed_files.append(p)
                del current[p]
    # a module that mentions none of the removed names cannot import them: skip the parse
    needles = {n for names in removed_names.values() for n in names}
    needles |= {m.rsplit(".", 1)[-1] for m in removed_modules}
    for path in sorted(current):
        module = path_to_module.get(path[:-1] if path.endswith(".pyi") else path)
        if module is None or not any(n in current[path] for n in needles):
            continue
        text = unlink_imports(
            current[path],
            importer=module,
            importer_is_package=path.endswith(("__init__.py", "__init__.pyi")),
            removed_names=removed_names,
            removed_modules=removed_modules,
        )
        update(path, text)
    changed = {p: current[p] for p in original if p in current}
    for path, text in changed.items():
        try:
            ast.parse(text)
        except SyntaxError as e:  # pragma: no cover - LibCST output of valid input parses
            raise AssertionError(f"deletion produced invalid Python in {path}: {e}") from None
    return Edit(changed=changed, removed=tuple(sorted(removed_files)), original=original)
