"""Problem statements for feature-deletion tasks, at three levels of detail.

The statement tells the agent what to rebuild without showing how it was built. It is made from
the original source with LibCST, keeping only what a user of the feature could know:

- ``full``: the module and file, the interface as a Python outline (decorators, signatures,
  docstrings, class attributes, public and special methods, each body replaced by ``...``), and
  the failing tests;
- ``docstring``: the names and what their docstrings say, no signatures;
- ``tests``: the failing tests alone (the package is named, the module is not).

Private helpers that were deleted with the feature are never described: how to split the work is
the agent's business. Test names are grouped by function, with the number of parametrized cases.

What this module does not do: check that the statement reveals no body line (the outline is built
from signatures and docstrings only; a docstring that quotes its own implementation is the
repository's choice), or translate anything into natural language beyond fixed templates.
"""

from __future__ import annotations

import shlex
import textwrap
from collections.abc import Mapping, Sequence

import libcst as cst

from etude.tasks.mine import Layout
from etude.tasks.proposal import Feature

DETAIL_RANK = {"full": 0, "docstring": 1, "tests": 2}
"""Lower detail is harder: ``tests`` says least."""


def _docstring_stmt(body: Sequence[cst.BaseStatement]) -> cst.SimpleStatementLine | None:
    if body and isinstance(body[0], cst.SimpleStatementLine) and len(body[0].body) == 1:
        expr = body[0].body[0]
        if isinstance(expr, cst.Expr) and isinstance(
            expr.value, cst.SimpleString | cst.ConcatenatedString
        ):
            return body[0]
    return None


def _ellipsis_line() -> cst.SimpleStatementLine:
    return cst.SimpleStatementLine([cst.Expr(cst.Ellipsis())])


def _blank() -> list[cst.EmptyLine]:
    return [cst.EmptyLine(indent=False)]


def outline_function(fn: cst.FunctionDef) -> cst.FunctionDef:
    """Decorators and signature of ``fn`` with its docstring and ``...`` as the body."""
    body: list[cst.BaseStatement] = []
    if isinstance(fn.body, cst.IndentedBlock):
        doc = _docstring_stmt(fn.body.body)
        if doc is not None:
            body.append(doc.with_changes(leading_lines=[]))
    body.append(_ellipsis_line())
    return fn.with_changes(body=cst.IndentedBlock(body=body), leading_lines=[])


def _is_public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def outline_class(cls: cst.ClassDef, only: set[str] | None = None) -> cst.ClassDef:
    """Header, docstring, public class attributes and outlined public/special methods of ``cls``.

    ``only``: method names to keep (for a method feature); attributes are then left out.
    """
    items: list[cst.BaseStatement] = []
    if isinstance(cls.body, cst.IndentedBlock):
        stmts = list(cls.body.body)
        doc = _docstring_stmt(stmts)
        if doc is not None and only is None:
            items.append(doc.with_changes(leading_lines=[]))
        for stmt in stmts:
            if stmt is doc:
                continue
            if isinstance(stmt, cst.FunctionDef):
                name = stmt.name.value
                if (only is None and _is_public(name)) or (only is not None and name in only):
                    out = outline_function(stmt)
                    items.append(out.with_changes(leading_lines=_blank() if items else []))
            elif isinstance(stmt, cst.ClassDef) and only is None and _is_public(stmt.name.value):
                out = outline_class(stmt)
                items.append(out.with_changes(leading_lines=_blank() if items else []))
            elif isinstance(stmt, cst.SimpleStatementLine) and only is None:
                kept = _public_attributes(stmt)
                if kept is not None:
                    items.append(kept.with_changes(leading_lines=[]))
    if not items:
        items.append(_ellipsis_line())
    return cls.with_changes(body=cst.IndentedBlock(body=items), leading_lines=[])


def _public_attributes(stmt: cst.SimpleStatementLine) -> cst.SimpleStatementLine | None:
    """A class-level annotation or assignment of public names; long values become ``...``."""
    small = stmt.body[0] if len(stmt.body) == 1 else None
    if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
        if not _is_public(small.target.value):
            return None
        if small.value is not None and "\n" in cst.Module([]).code_for_node(small.value):
            small = small.with_changes(value=cst.Ellipsis())
        return stmt.with_changes(body=[small])
    if isinstance(small, cst.Assign) and all(
        isinstance(t.target, cst.Name) and _is_public(t.target.value) for t in small.targets
    ):
        if "\n" in cst.Module([]).code_for_node(small.value):
            small = small.with_changes(value=cst.Ellipsis())
        return stmt.with_changes(body=[small])
    return None


def _find(module: cst.Module, name: str) -> cst.CSTNode | None:
    for stmt in module.body:
        if isinstance(stmt, cst.FunctionDef | cst.ClassDef) and stmt.name.value == name:
            return stmt
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                targets = []
                if isinstance(small, cst.Assign):
                    targets = [t.target for t in small.targets]
                elif isinstance(small, cst.AnnAssign):
                    targets = [small.target]
                if any(isinstance(t, cst.Name) and t.value == name for t in targets):
                    return stmt
    return None


def outline_symbol(source: str, qualname: str) -> str:
    """The ``full``-level outline of one definition (``f``, ``C``, ``C.m`` or ``CONSTANT``)."""
    module = cst.parse_module(source)
    head, _, method = qualname.partition(".")
    node = _find(module, head)
    if node is None:
        raise ValueError(f"{qualname} is not defined at module level in this source")
    if isinstance(node, cst.FunctionDef):
        out: cst.CSTNode = outline_function(node)
    elif isinstance(node, cst.ClassDef):
        out = outline_class(node, only={method} if method else None)
    else:
        assert isinstance(node, cst.SimpleStatementLine)
        small = node.body[0]
        value = getattr(small, "value", None)
        if value is not None and "\n" in module.code_for_node(value):
            small = small.with_changes(value=cst.Ellipsis())
        out = node.with_changes(body=[small], leading_lines=[])
    return module.code_for_node(out).strip("\n") + "\n"


def _docstring_of(node: cst.CSTNode) -> str | None:
    body = getattr(node, "body", None)
    if isinstance(body, cst.IndentedBlock):
        doc = _docstring_stmt(body.body)
        if doc is not None:
            value = doc.body[0].value  # type: ignore[union-attr]
            text = value.evaluated_value if isinstance(value, cst.SimpleString) else None
            if isinstance(text, str):
                return _clean_doc(text)
    return None


def _clean_doc(text: str) -> str:
    lines = text.expandtabs().splitlines()
    if not lines:
        return ""
    first, rest = lines[0].strip(), textwrap.dedent("\n".join(lines[1:]))
    return (first + ("\n" + rest if rest.strip() else "")).strip()


def module_docstring(source: str) -> str | None:
    """The module's docstring, cleaned like ``inspect.cleandoc``."""
    module = cst.parse_module(source)
    doc = _docstring_stmt(module.body)
    if doc is None:
        return None
    value = doc.body[0].value  # type: ignore[union-attr]
    text = value.evaluated_value if isinstance(value, cst.SimpleString) else None
    return _clean_doc(text) if isinstance(text, str) else None


def describe_symbol(source: str, qualname: str) -> str:
    """The ``docstring``-level description: the name and what its docstrings say."""
    module = cst.parse_module(source)
    head, _, method = qualname.partition(".")
    node = _find(module, head)
    if node is None:
        raise ValueError(f"{qualname} is not defined at module level in this source")
    parts: list[str] = []
    if isinstance(node, cst.ClassDef) and method:
        for stmt in node.body.body if isinstance(node.body, cst.IndentedBlock) else []:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == method:
                node = stmt
                break
    doc = _docstring_of(node)
    parts.append(doc if doc else "(no documentation)")
    if isinstance(node, cst.ClassDef):
        for stmt in node.body.body if isinstance(node.body, cst.IndentedBlock) else []:
            if isinstance(stmt, cst.FunctionDef) and _is_public(stmt.name.value):
                mdoc = _docstring_of(stmt)
                if mdoc:
                    parts.append(f"`{stmt.name.value}`: {mdoc}")
    return "\n\n".join(parts)


def group_tests(test_ids: Sequence[str]) -> list[str]:
    """Test ids grouped by their function: ``id`` or ``id (N cases)`` for parametrized tests."""
    counts: dict[str, int] = {}
    for test_id in test_ids:
        base = test_id.split("[", 1)[0]
        counts[base] = counts.get(base, 0) + 1
    return [f"{base} ({n} cases)" if n > 1 else base for base, n in counts.items()]


def _run_command(layout: Layout, pytest_args: Sequence[str] = ()) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(layout.test_env.items()))
    args = " ".join(shlex.quote(a) for a in pytest_args)
    return " ".join(p for p in (env, "python -m pytest", args) if p)


def first_paragraph(doc: str) -> str:
    """The first paragraph of a docstring as one line (a summary that spans lines stays whole)."""
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(paragraph.split())


def problem_statement(
    feature: Feature,
    sources: Mapping[str, str],
    layout: Layout,
    fail_to_pass: Sequence[str],
    detail: str,
    pytest_args: Sequence[str] = (),
) -> str:
    """The statement of a task deleting ``feature`` (``sources``: original path -> text;
    ``pytest_args``: what the tests need on pytest's command line, shown in the run command)."""
    if detail not in DETAIL_RANK:
        raise ValueError(f"detail level {detail!r} must be one of {list(DETAIL_RANK)}")
    tests = "\n".join(f"- {t}" for t in group_tests(list(fail_to_pass)))
    footer = (
        f"These tests fail now and must pass once the feature is back (run `{_run_command(layout, pytest_args)}` "
        f"from the repository root):\n\n{tests}\n\nEvery other test must keep passing. "
        "Do not modify the tests.\n"
    )
    if detail == "tests":
        package = ", ".join(f"`{p}`" for p in layout.packages)
        return (
            f"Some functionality of {package} has been removed. Implement it again so that the "
            f"failing tests below pass; read them to find out what is expected. Use only what "
            f"the repository already depends on.\n\n{footer}"
        )
    blocks: list[str] = []
    for path, items in _by_file(feature, layout):
        source = sources[path]
        module = _module_of(path, layout)
        if path in feature.files:
            blocks.append(_module_block(module, path, source, items, detail))
        else:
            blocks.append(_symbols_block(module, path, source, items, detail))
    return "\n\n".join(blocks) + "\n\n" + footer


def _module_of(path: str, layout: Layout) -> str:
    for dotted, rel in layout.modules.items():
        if rel == path:
            return dotted
    raise ValueError(f"{path} is not a module of the layout")


def _by_file(feature: Feature, layout: Layout) -> list[tuple[str, list[str]]]:
    """(module path, qualnames of the interface) per file, in the feature's order."""
    out: dict[str, list[str]] = {}
    for path in feature.files:
        out[path] = []
    for dotted in feature.interface:
        for module, rel in sorted(layout.modules.items(), key=lambda kv: -len(kv[0])):
            if dotted.startswith(module + "."):
                out.setdefault(rel, []).append(dotted[len(module) + 1 :])
                break
    return list(out.items())


def _module_block(module: str, path: str, source: str, items: list[str], detail: str) -> str:
    parent, _, last = module.rpartition(".")
    how = f"`from {parent} import {last}`" if parent else f"`import {module}`"
    doc = module_docstring(source)
    intro = f"The module `{module}` is missing: {how} fails. Write `{path}` again"
    intro += f" ({first_paragraph(doc).rstrip('.')})" if doc else ""
    public = [q for q in items if not q.startswith("_")]
    if detail == "full":
        outlines = "\n\n\n".join(outline_symbol(source, q).rstrip("\n") for q in public)
        return f"{intro}, with the interface below.\n\nInterface (`{path}`):\n\n```python\n{outlines}\n```"
    described = "\n\n".join(f"`{module}.{q}`: {describe_symbol(source, q)}" for q in public)
    return f"{intro}. It offers:\n\n{described}"


def _symbols_block(module: str, path: str, source: str, items: list[str], detail: str) -> str:
    names = ", ".join(f"`{q}`" for q in items)
    intro = (
        f"`{module}` has lost {names}. Add {'them' if len(items) > 1 else 'it'} back to `{path}`"
    )
    if detail == "full":
        outlines = "\n\n\n".join(outline_symbol(source, q).rstrip("\n") for q in items)
        return f"{intro} with the interface and behaviour below.\n\nInterface (`{path}`):\n\n```python\n{outlines}\n```"
    described = "\n\n".join(f"`{module}.{q}`: {describe_symbol(source, q)}" for q in items)
    return f"{intro}. What {'they do' if len(items) > 1 else 'it does'}:\n\n{described}"
