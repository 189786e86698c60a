"""Copies of the deleted code anywhere the agent can read: AST-normalized search.

A task whose deleted method also lives, verbatim or reformatted, in a vendored module of the same
repository (or in a tutorial, a test helper, an installed package) is solved by copying it: the
reward says nothing about the agent. The line and n-gram scan of ``etude.tasks.leaks`` cannot
see such a copy, because by its definition nothing that remains in the tree is distinctive. So
the factory also compares **code**: every function, method and class of the deleted code is
normalized and looked for among the definitions of every readable file.

Normalization (``normalize``): the definition's AST with docstrings removed, annotations and the
definition's own name dropped, and its local names (arguments, assigned names, loop and
comprehension variables, ``as`` targets, nested definitions) renamed ``_0, _1, ...`` in order of
first appearance; global names, attribute names and constants stay. Two definitions match when
their normalized dumps are equal (renamed locals and reformatting still match). A definition also
matches when at least ``min_shared_statements`` of its statements, holding at least
``min_statement_share`` of its code (statements weighed by their own AST nodes, so shared
boilerplate such as an argument check does not count for much), occur in one other definition (statements normalized with every
local name replaced by ``_``): a copy with a line added or a branch reordered.

Where the search looks (``find_copies`` over ``(path, text)`` pairs): Python files (``.py``,
``.pyi``) whole; other text files (docs, changelogs, notebooks as text) by their code blocks
(Markdown fences, reStructuredText ``::`` blocks, doctest ``>>>`` sessions, and the whole text
when it parses). ``scan_paths`` does the same over directories; ``SANDBOX_SCRIPT`` runs it inside
the sandbox over the interpreter's ``sys.path`` (the filesystem the agent's Python can read),
looking only at files that define one of the wanted names.

Small definitions (fewer than ``min_nodes`` AST nodes after normalization, e.g.
``return self._x``) match too much to mean anything by their code alone, so one is searched only
when it has a docstring, and matches only a definition of the same name, the same normalized code
and the same docstring: a vendored copy (more-itertools' one-line ``nth_or_last``, docstring and
all, in setuptools' ``_vendor`` on the sandbox's filesystem, was accepted as a task before), not
an idiom. This module imports only the standard library so that it
can run as a script in the sandbox.

What this module does not do: decide what happens to a copy (the factory deletes it with the
feature or rejects the task), see paraphrases (another algorithm, another language), or read
binary files (``etude.tasks.leaks`` decodes archives and git objects).
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import json
import os
import re
import sys
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

MIN_NODES = 30
MIN_SHARED_STATEMENTS = 3
MIN_STATEMENT_SHARE = 0.6
MIN_STATEMENT_NODES = 8
PYTHON_SUFFIXES = (".py", ".pyi")
TEXT_SUFFIXES = (".md", ".rst", ".txt", ".ipynb", ".html", ".htm", "")
MAX_FILE_BYTES = 4 << 20

_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_DEF_RE = re.compile(rb"def[ \t]+(\w+)")
_CLASS_RE = re.compile(rb"class[ \t]+(\w+)")
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass(frozen=True, slots=True)
class Definition:
    """One normalized function, method or class of a file."""

    path: str
    """File (relative to the scanned root, or absolute for the sandbox's filesystem)."""
    qualname: str
    """``f``, ``C``, ``C.m``, ``f.<locals>.g`` (as ``f.g``)."""
    line: int
    """First line in the file (in the code block for non-Python files)."""
    digest: str
    """sha1 of the normalized dump."""
    nodes: int
    """AST nodes of the normalized definition."""
    statements: frozenset[str]
    """``digest:weight`` of its statements with every local replaced by ``_`` (for partial
    copies; the weight is the statement's own AST nodes, nested statements not counted)."""
    anchors: tuple[str, ...] = ()
    """Names and strings a copy keeps (globals, attributes, string constants): a file that lacks
    most of them is not parsed (``scan_paths``)."""
    doc: str = ""
    """sha1 of its docstring (``inspect.cleandoc``-ed), ``""`` without one."""

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def key(self) -> str:
        """What a search for it depends on: code, name (searches look for definitions of the
        same name) and docstring (small definitions match on it)."""
        return f"{self.digest}:{self.name}:{self.doc}"


@dataclass(frozen=True, slots=True)
class Copy:
    """A definition elsewhere that matches a deleted one."""

    deleted: str
    """Qualname of the deleted definition (``path:qualname``)."""
    path: str
    qualname: str
    line: int
    how: str
    """``exact`` (same normalized code) or ``statements`` (shared statements, with the count)."""

    def describe(self) -> str:
        return f"{self.deleted} is copied at {self.path}:{self.line} ({self.qualname}, {self.how})"


# ---------------------------------------------------------------------------------------------
# normalization


def _strip_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[1:] or [ast.Pass()]
    return body


def _local_names(node: ast.AST) -> list[str]:
    """Names bound inside ``node`` (a definition), in order of first appearance."""
    out: dict[str, None] = {}
    for sub in ast.walk(node):
        if isinstance(sub, ast.arg):
            out.setdefault(sub.arg)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store | ast.Del):
            out.setdefault(sub.id)
        elif isinstance(sub, _DEFS) and sub is not node:
            out.setdefault(sub.name)
        elif isinstance(sub, ast.ExceptHandler) and sub.name:
            out.setdefault(sub.name)
        elif isinstance(sub, ast.alias) and sub.asname:
            out.setdefault(sub.asname)
    return list(out)


class _Normalizer(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def _rename(self, name: str) -> str:
        return self.names.get(name, name)

    def visit_Name(self, node: ast.Name) -> ast.AST:
        node.id = self._rename(node.id)
        node.ctx = ast.Load()
        return node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        node.arg = self._rename(node.arg)
        node.annotation = None
        node.type_comment = None
        return node

    def _visit_def(self, node: ast.AST) -> ast.AST:
        self.generic_visit(node)
        node.name = self._rename(node.name)  # type: ignore[attr-defined]
        node.body = _strip_docstring(node.body)  # type: ignore[attr-defined]
        if isinstance(node, _FUNCS):
            node.returns = None
            node.type_comment = None
        return node

    visit_FunctionDef = _visit_def
    visit_AsyncFunctionDef = _visit_def
    visit_ClassDef = _visit_def

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> ast.AST:
        self.generic_visit(node)
        if node.name:
            node.name = self._rename(node.name)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        self.generic_visit(node)
        node.annotation = ast.Constant(None)
        return node


def _count(node: ast.AST) -> int:
    return sum(1 for _ in ast.walk(node))


def normalize(node: ast.AST) -> tuple[str, int]:
    """The normalized dump of a definition (module docstring) and its node count."""
    node = copy.deepcopy(node)
    names = {n: f"_{i}" for i, n in enumerate(_local_names(node))}
    if isinstance(node, _DEFS):
        names[node.name] = "_"  # the definition's own name does not matter
        if isinstance(node, ast.ClassDef):
            # method names are the class's interface: keep them, rename only inside bodies
            for item in node.body:
                if isinstance(item, _DEFS):
                    names.pop(item.name, None)
    out = _Normalizer(names).visit(node)
    return ast.dump(out, annotate_fields=False), _count(out)


def _statement_digests(node: ast.AST) -> frozenset[str]:
    if not isinstance(node, _FUNCS):
        return frozenset()
    local = set(_local_names(node))
    out = set()
    for stmt in ast.walk(node):
        if not isinstance(stmt, ast.stmt) or stmt is node or isinstance(stmt, _DEFS):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # docstrings and bare constants
        if _count(stmt) < MIN_STATEMENT_NODES:
            continue
        normalized = _Normalizer(dict.fromkeys(local, "_")).visit(copy.deepcopy(stmt))
        digest = hashlib.sha1(ast.dump(normalized, annotate_fields=False).encode()).hexdigest()
        out.add(f"{digest}:{_own_nodes(stmt)}")
    return frozenset(out)


def _own_nodes(stmt: ast.stmt) -> int:
    """AST nodes of a statement outside the statements nested in it (its own weight)."""
    count = 0
    todo: list[ast.AST] = [stmt]
    while todo:
        node = todo.pop()
        count += 1
        todo += [c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.stmt)]
    return count


def _weight(statements: Iterable[str]) -> int:
    return sum(int(s.rsplit(":", 1)[1]) for s in statements)


def _walk_defs(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    for stmt in body:
        if isinstance(stmt, _DEFS):
            qual = f"{prefix}{stmt.name}"
            yield qual, stmt
            yield from _walk_defs(stmt.body, qual + ".")
        elif isinstance(stmt, ast.If | ast.Try | ast.With | ast.For | ast.While):
            for block in ("body", "orelse", "finalbody"):
                yield from _walk_defs(getattr(stmt, block, []), prefix)
            for handler in getattr(stmt, "handlers", []):
                yield from _walk_defs(handler.body, prefix)


def definitions_of_tree(
    tree: ast.Module, path: str, *, line_offset: int = 0, qualnames: Iterable[str] | None = None
) -> list[Definition]:
    """Normalized definitions of a parsed module (only ``qualnames`` and their insides if given)."""
    wanted = None if qualnames is None else tuple(qualnames)
    out = []
    for qual, node in _walk_defs(tree.body):
        if wanted is not None and not any(qual == q or qual.startswith(q + ".") for q in wanted):
            continue
        dump, nodes = normalize(node)
        local = set(_local_names(node))
        kept = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id not in local}
        kept |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        kept |= {
            n.value
            for n in ast.walk(node)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and 4 <= len(n.value) < 80
        }
        kept.discard("self")
        anchors = tuple(sorted(sorted(kept, key=lambda a: (-len(a), a))[:12]))
        out.append(
            Definition(
                path=path,
                qualname=qual,
                line=node.lineno + line_offset,  # type: ignore[attr-defined]
                digest=hashlib.sha1(dump.encode()).hexdigest(),
                nodes=nodes,
                statements=_statement_digests(node),
                anchors=anchors,
                doc=_doc_digest(node),
            )
        )
    return out


def _doc_digest(node: ast.AST) -> str:
    doc = ast.get_docstring(node) if isinstance(node, _DEFS) else None  # type: ignore[arg-type]
    return hashlib.sha1(doc.encode()).hexdigest() if doc else ""


@functools.lru_cache(maxsize=4096)
def _cached_definitions(path: str, text: str) -> tuple[Definition, ...]:
    # files that stay the same from task to task are parsed once per build
    return tuple(definitions_of_text(path, text))


def definitions_of_source(
    source: str, path: str, qualnames: Iterable[str] | None = None
) -> list[Definition]:
    """Normalized definitions of Python source (``[]`` if it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    return definitions_of_tree(tree, path, qualnames=qualnames)


_FENCE_RE = re.compile(r"^[ \t]*(```|~~~)[^\n]*\n(.*?)^[ \t]*\1", re.M | re.S)
_PROMPT_RE = re.compile(r"^[ \t]*(>>>|\.\.\.) ?(.*)$")


def code_blocks(text: str) -> Iterator[tuple[int, str]]:
    """``(first line - 1, code)`` of the code blocks of a text file (module docstring)."""
    yield 0, text
    for match in _FENCE_RE.finditer(text):
        yield text.count("\n", 0, match.start(2)), match.group(2)
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::"):
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or lines[j][:1] in " \t"):
                j += 1
            yield i + 1, textwrap.dedent("\n".join(lines[i + 1 : j]))
            i = j
            continue
        if _PROMPT_RE.match(line) and line.lstrip().startswith(">>>"):
            j = i
            block = []
            while j < len(lines) and _PROMPT_RE.match(lines[j]):
                block.append(_PROMPT_RE.match(lines[j]).group(2))  # type: ignore[union-attr]
                j += 1
            yield i, "\n".join(block)
            i = j
            continue
        i += 1


def definitions_of_text(path: str, text: str) -> list[Definition]:
    """Normalized definitions of any readable file: Python whole, other text by code blocks."""
    if path.endswith(PYTHON_SUFFIXES):
        return definitions_of_source(text, path)
    out: list[Definition] = []
    seen: set[tuple[str, int]] = set()
    for offset, block in code_blocks(text):
        if "def " not in block and "class " not in block:
            continue
        try:
            tree = ast.parse(block)
        except (SyntaxError, ValueError):
            continue
        for d in definitions_of_tree(tree, path, line_offset=offset):
            if (d.digest, d.line) not in seen:
                seen.add((d.digest, d.line))
                out.append(d)
    return out


# ---------------------------------------------------------------------------------------------
# search


def searchable(deleted: Iterable[Definition], min_nodes: int = MIN_NODES) -> list[Definition]:
    """The deleted definitions to search for: big enough, or small with a docstring."""
    return [d for d in deleted if d.nodes >= min_nodes or d.doc]


def match(
    deleted: Definition,
    other: Definition,
    *,
    min_shared: int = MIN_SHARED_STATEMENTS,
    min_share: float = MIN_STATEMENT_SHARE,
    min_nodes: int = MIN_NODES,
) -> str | None:
    """How ``other`` copies ``deleted`` (``exact``, ``N of M statements``), or None. A deleted
    definition smaller than ``min_nodes`` matches only itself: same name, code and docstring."""
    if deleted.nodes < min_nodes:
        same = (other.digest, other.name, other.doc) == (deleted.digest, deleted.name, deleted.doc)
        return "exact, same name and docstring" if same and deleted.doc else None
    if other.digest == deleted.digest:
        return "exact"
    if deleted.statements and other.statements:
        shared = deleted.statements & other.statements
        # weighed by each statement's own nodes: shared boilerplate (an argument check, a
        # try/except around a conversion) is not a copy of what the function is for
        if len(shared) >= min_shared and _weight(shared) >= min_share * _weight(deleted.statements):
            return f"{len(shared)} of {len(deleted.statements)} statements"
    return None


def find_copies(
    deleted: Iterable[Definition],
    files: Iterable[tuple[str, bytes | str]],
    *,
    min_nodes: int = MIN_NODES,
    line_offset: int = 0,
) -> list[Copy]:
    """Every definition in ``files`` (``(path, content)``) that copies a deleted definition.

    Content that is not UTF-8 text is skipped. One copy per (deleted definition, path, qualname);
    a copy of a class also reports its methods' copies, which the caller may group by path.
    """
    wanted = searchable(deleted, min_nodes)
    if not wanted:
        return []
    out: list[Copy] = []
    for path, content in files:
        if not _readable_suffix(path):
            continue
        if isinstance(content, bytes):
            if len(content) > MAX_FILE_BYTES or b"\0" in content:
                continue
            try:
                text = content.decode("utf-8")
            except UnicodeDecodeError:
                continue
        else:
            text = content
        if "def " not in text and "class " not in text:
            continue
        for other in _cached_definitions(path, text):
            for d in wanted:
                if other.nodes < min_nodes // 2 and d.nodes >= min_nodes:
                    continue
                how = match(d, other, min_nodes=min_nodes)
                if how is not None:
                    out.append(
                        Copy(
                            deleted=f"{d.path}:{d.qualname}",
                            path=other.path,
                            qualname=other.qualname,
                            line=other.line + line_offset,
                            how=how,
                        )
                    )
    return out


def definition_blocks(text: str, names: set[str]) -> Iterator[tuple[int, str]]:
    """``(line offset, dedented source)`` of each ``def``/``class`` of one of ``names`` in
    ``text``: the definition's lines up to the next line indented no deeper (parsing a block is
    much cheaper than parsing a large file)."""
    lines = text.splitlines()
    pattern = re.compile(
        r"^([ \t]*)(?:async[ \t]+)?(?:def|class)[ \t]+("
        + "|".join(map(re.escape, sorted(names)))
        + r")\b"
    )
    for i, line in enumerate(lines):
        m = pattern.match(line)
        if m is None:
            continue
        indent = len(m.group(1).expandtabs())
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped and len(lines[j]) - len(lines[j].lstrip()) <= indent:
                if not stripped.startswith((")", "]", "}")):
                    break
            j += 1
        yield i, textwrap.dedent("\n".join(lines[i:j]))


def _readable_suffix(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    suffix = name[name.rfind(".") :] if "." in name else ""
    return suffix in PYTHON_SUFFIXES or suffix.lower() in TEXT_SUFFIXES or name.isupper()


def _def_names(definitions: Iterable[Definition]) -> set[str]:
    return {d.qualname.rsplit(".", 1)[-1] for d in definitions}


def scan_paths(
    roots: Iterable[str], wanted: list[dict[str, object]], *, min_nodes: int = MIN_NODES
) -> list[dict[str, object]]:
    """``find_copies`` over every ``.py`` file under ``roots`` that defines a wanted name.

    ``wanted``: ``Definition`` objects as dicts (JSON-friendly, for the sandbox script). Returns
    copies as dicts. Files are filtered by the names they define (``def NAME``, ``class NAME``)
    first, so only files that could hold a copy are parsed; a directory reached twice (links)
    is walked once.
    """
    deleted = [
        Definition(
            **{**w, "statements": frozenset(w["statements"]), "anchors": tuple(w["anchors"])}
        )  # type: ignore[arg-type]
        for w in wanted
    ]
    deleted = searchable(deleted, min_nodes)
    if not deleted:
        return []
    by_name: dict[bytes, list[Definition]] = {}
    for d in deleted:
        by_name.setdefault(d.qualname.rsplit(".", 1)[-1].encode(), []).append(d)
    names = set(by_name)
    found: list[dict[str, object]] = []
    seen_dirs: set[tuple[int, int]] = set()
    for root in roots:
        if not os.path.isdir(root):
            continue
        for directory, dirs, files in os.walk(root):
            st = os.stat(directory)
            if (st.st_dev, st.st_ino) in seen_dirs:
                dirs[:] = []
                continue
            seen_dirs.add((st.st_dev, st.st_ino))
            dirs.sort()
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(directory, name)
                try:
                    with open(path, "rb") as f:
                        data = f.read(MAX_FILE_BYTES + 1)
                except OSError:
                    continue
                if len(data) > MAX_FILE_BYTES:
                    continue
                # two literal-prefixed scans are far faster than one anchored alternation
                defined = (set(_DEF_RE.findall(data)) | set(_CLASS_RE.findall(data))) & names
                # parse only files holding most of what a copy of a wanted definition keeps
                likely = [
                    d
                    for n in defined
                    for d in by_name[n]
                    if sum(a.encode() in data for a in d.anchors) >= 0.8 * len(d.anchors)
                ]
                if not likely:
                    continue
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                wanted_names = {d.qualname.rsplit(".", 1)[-1] for d in likely}
                for line, block in definition_blocks(text, wanted_names):
                    found += [
                        asdict(c)
                        for c in find_copies(
                            likely, [(f"{path}", block)], min_nodes=min_nodes, line_offset=line
                        )
                    ]
    return found


def definition_to_json(d: Definition) -> dict[str, object]:
    out = asdict(d)
    out["statements"] = sorted(d.statements)
    return out


WANTED_FILE = "etude-wanted-definitions.json"


def _sandbox_main() -> None:
    """Sandbox entry: read ``{"min_nodes": N, "definitions": [...]}`` from ``WANTED_FILE`` in
    the working directory (an otherwise empty directory), scan every ``sys.path`` entry outside
    it, print JSON."""
    with open(WANTED_FILE, encoding="utf-8") as f:
        wanted = json.load(f)
    cwd = os.path.realpath(os.getcwd())
    roots = [
        p for p in sys.path if p and os.path.isdir(p) and not os.path.realpath(p).startswith(cwd)
    ]
    found = scan_paths(roots, wanted["definitions"], min_nodes=int(wanted["min_nodes"]))
    print(json.dumps(found))


# the sandbox runs this file's text with ``python -c`` (``__name__`` is then ``__main__``)
if __name__ == "__main__":
    _sandbox_main()
