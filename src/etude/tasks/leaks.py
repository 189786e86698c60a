"""Leak scan: look for the deleted code in every readable form of every file of a task workspace.

The workspace is rebuilt without the known leak channels (``etude.tasks.sanitize``); this module
checks the result by content. ``distinctive_material`` says what to look for, ``leak_scan`` reads
every file of the workspace (hidden and binary ones too, and every git object) looking for it.

What "distinctive" means for the scan (``distinctive_material``), given the deleted code D (the
lines the gold patch adds back, plus the code objects of the deleted definitions) and the
remaining tree R (every file of the broken tree but ``.git``):

- a **line** of D, whitespace-normalized (stripped, runs of whitespace collapsed to one space),
  at least ``min_line_chars`` long, that is not a substring of any whitespace-normalized file of R;
  the paths of deleted files count as such lines when R does not mention them;
- an **identifier n-gram**: ``n`` consecutive identifiers (``[A-Za-z_][A-Za-z0-9_]*``) of one of
  D's identifier streams (its text; each deleted code object's ``co_varnames`` and ``co_names``,
  i.e. what bytecode and type-checker caches store: argument lists, locals, attribute names), that
  occurs in no identifier stream of R (file texts and the code objects of R's Python files).

A workspace leaks when any view of any file contains a distinctive line (substring of the
normalized view) or a distinctive n-gram (in the view's identifier streams). Views of a file:
its bytes as UTF-8 text; zlib streams (git loose objects), gzip, zip and tar members, recursively;
strings and name tuples of marshalled code (``.pyc``); the strings of a JSON document; HTML with
tags stripped and entities decoded; and for a ``.git`` directory, every object git can read
(``git cat-file --batch-all-objects``, packs included) as the agent would decode it: blobs,
commits and tags as they are, trees as their entries' names. The raw files under ``.git`` are not
scanned themselves (their zlib streams hold binary tree ids), and no binary view (a NUL byte or
undecodable UTF-8) is scanned for n-grams: identifiers found by chance in hashes are no leak.

A scan is **clean** only when it found nothing *and* had something to look for: when every line
and n-gram of the deleted code also occurs in the remaining tree (the tree holds a copy, or the
deleted code is too small to recognize), the scan reports ``nothing_distinctive`` and is not
clean. Copies that are reformatted or renamed are found by ``etude.tasks.copies`` (AST-level).

What this module does not do: it removes nothing (``etude.tasks.sanitize`` builds the workspace),
and it cannot judge content that belongs to the repository itself. By the definition above nothing
in R is distinctive, so documentation that quotes the deleted code (an implementation copied into
a tutorial) is not reported; nor are paraphrases, translations to another language, or
information spread thinner than a line or an n-gram (a single argument name). It does not decrypt
or decode beyond the views above (base64 blobs, rot13). It does not look outside the workspace: an
installed copy of the package is caught by ``sanitize.find_installed_copies``, which the factory
runs before building.
"""

from __future__ import annotations

import functools
import html
import io
import json
import marshal
import os
import re
import tarfile
import types
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from etude.tasks.sanitize import run_git

_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WS_RE = re.compile(r"\s+")
_TAG_RE = re.compile(r"<[^<>]{0,2000}>")
MAX_VIEW_BYTES = 64 << 20
MAX_VIEW_DEPTH = 3


def normalize_text(text: str) -> str:
    """Whitespace runs collapsed to one space, ends stripped (the unit of line matching)."""
    return _WS_RE.sub(" ", text).strip()


def identifiers(text: str) -> list[str]:
    """The identifier stream of a text."""
    return _IDENT_RE.findall(text)


def ngrams(tokens: Sequence[str], n: int) -> set[tuple[str, ...]]:
    """All windows of ``n`` consecutive tokens."""
    if len(tokens) < n:
        return set()
    return set(zip(*(tokens[i:] for i in range(n))))


def code_streams(code: types.CodeType) -> list[list[str]]:
    """Identifier streams of one code object, as bytecode stores them: locals, then names."""
    return [list(code.co_varnames), list(code.co_names)]


def walk_code(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and every code object nested in its constants."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from walk_code(const)


@functools.lru_cache(maxsize=8192)
def _all_code_streams(text: str) -> tuple[tuple[str, ...], ...]:
    # the remaining tree's files are the same for every task of a repository: compile each once
    return tuple(tuple(s) for s in source_code_streams(text))


def source_code_streams(text: str, qualnames: Iterable[str] | None = None) -> list[list[str]]:
    """Identifier streams of the code objects of a Python source.

    With ``qualnames``, only code objects of those definitions and the ones nested in them
    (``f``, ``f.<locals>.g``, ``C.m``); without, all of them. A source that does not compile
    gives none.
    """
    try:
        module = compile(text, "<source>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return []
    wanted = None if qualnames is None else tuple(qualnames)
    streams = []
    for code in walk_code(module):
        name = code.co_qualname
        if wanted is None or any(name == q or name.startswith(q + ".") for q in wanted):
            streams.extend(code_streams(code))
    return streams


@dataclass(kw_only=True, slots=True)
class LeakMaterial:
    """What the scan looks for: the distinctive pieces of the deleted code."""

    lines: tuple[str, ...]
    """Distinctive normalized lines (and paths of deleted files)."""
    ngrams: frozenset[tuple[str, ...]]
    """Distinctive identifier n-grams."""
    n: int
    """Length of the n-grams."""
    min_line_chars: int
    """Shortest line that counts."""
    candidate_lines: int = 0
    """Normalized lines of the deleted code long enough to count, before the R filter."""
    candidate_ngrams: int = 0
    """n-grams of the deleted code's streams, before the R filter."""


def distinctive_material(
    deleted_text: str,
    deleted_streams: Iterable[Sequence[str]],
    remaining: Iterable[tuple[str, bytes]],
    *,
    deleted_paths: Iterable[str] = (),
    min_line_chars: int = 16,
    n: int = 3,
) -> LeakMaterial:
    """The distinctive lines and n-grams of the deleted code (definitions in the module docstring).

    ``deleted_text``: the deleted source (lines the gold patch adds, deleted files whole);
    ``deleted_streams``: identifier streams of the deleted code objects (``source_code_streams``);
    ``remaining``: ``(relative path, bytes)`` of every file of the remaining tree R.
    """
    if min_line_chars < 1 or n < 1:
        raise ValueError(
            f"leak scan needs min_line_chars >= 1 and n >= 1, got {min_line_chars}, {n}"
        )
    lines = {normalize_text(line) for line in deleted_text.splitlines()}
    lines = {line for line in lines if len(line) >= min_line_chars}
    lines |= set(deleted_paths)
    candidate_lines = len(lines)
    grams: set[tuple[str, ...]] = ngrams(identifiers(deleted_text), n)
    for stream in deleted_streams:
        grams |= ngrams(list(stream), n)
    candidate_ngrams = len(grams)
    for rel, data in remaining:
        text = data.decode("utf-8", "replace")
        if lines:
            norm = normalize_text(text)
            lines = {line for line in lines if line not in norm}
        if grams:
            streams = [identifiers(text)]
            if rel.endswith(".py"):
                streams += [list(s) for s in _all_code_streams(text)]
            for stream in streams:
                grams -= ngrams(stream, n)
    return LeakMaterial(
        lines=tuple(sorted(lines)),
        ngrams=frozenset(grams),
        n=n,
        min_line_chars=min_line_chars,
        candidate_lines=candidate_lines,
        candidate_ngrams=candidate_ngrams,
    )


@dataclass(slots=True)
class _View:
    label: str
    text: str
    streams: list[list[str]]


def _decompress_capped(data: bytes, wbits: int) -> bytes | None:
    try:
        obj = zlib.decompressobj(wbits)
        out = obj.decompress(data, MAX_VIEW_BYTES)
    except zlib.error:
        return None
    return out or None


def _pyc_code(data: bytes) -> types.CodeType | None:
    # header: 4-byte magic ending in \r\n, 4-byte flags, 8 bytes of mtime+size or source hash
    if len(data) < 17 or data[2:4] != b"\r\n":
        return None
    try:
        code = marshal.loads(data[16:])
    except (ValueError, EOFError, TypeError):
        return None
    return code if isinstance(code, types.CodeType) else None


def _json_strings(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            out.append(str(k))
            _json_strings(v, out)
    elif isinstance(value, list):
        for v in value:
            _json_strings(v, out)


def is_binary(data: bytes, text: str | None = None) -> bool:
    """Bytes that are not text: a NUL byte, or more than 1% of undecodable UTF-8."""
    if b"\0" in data[:65536]:
        return True
    text = data.decode("utf-8", "replace") if text is None else text
    return text.count("\ufffd") > max(1, len(text) // 100)


def file_views(data: bytes, label: str, depth: int = 0) -> Iterator[_View]:
    """Every readable form of a file's bytes (module docstring: "Views of a file")."""
    text = data.decode("utf-8", "replace")
    # identifiers found by chance in binary bytes (hashes, compressed data) are no leak: binary
    # data is scanned only for whole lines and through the views that decode it
    yield _View(label, text, [] if is_binary(data, text) else [identifiers(text)])
    if depth >= MAX_VIEW_DEPTH:
        return
    code = _pyc_code(data)
    if code is not None:
        strings: list[str] = []
        streams: list[list[str]] = []
        for c in walk_code(code):
            streams.extend(code_streams(c))
            strings.extend(s for s in c.co_consts if isinstance(s, str))
            strings.append(c.co_qualname)
        joined = "\n".join(strings)
        yield _View(label + " (bytecode)", joined, [identifiers(joined), *streams])
    if len(data) >= 2 and data[0] == 0x78 and (data[0] * 256 + data[1]) % 31 == 0:
        inner = _decompress_capped(data, zlib.MAX_WBITS)
        if inner is not None:
            yield from file_views(inner, label + " (zlib)", depth + 1)
    if data[:2] == b"\x1f\x8b":
        inner = _decompress_capped(data, zlib.MAX_WBITS | 16)
        if inner is not None:
            yield from file_views(inner, label + " (gzip)", depth + 1)
    if data[:4] == b"PK\x03\x04":
        yield from _zip_views(data, label, depth)
    if len(data) > 512 and data[257:262] == b"ustar":
        yield from _tar_views(data, label, depth)
    stripped = data.lstrip()[:1]
    if stripped in (b"{", b"["):
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
        if doc is not None:
            strings = []
            _json_strings(doc, strings)
            joined = "\n".join(strings)
            yield _View(label + " (json strings)", joined, [identifiers(joined)])
    if "</" in text:
        plain = html.unescape(_TAG_RE.sub("", text))
        yield _View(label + " (markup stripped)", plain, [identifiers(plain)])


def _zip_views(data: bytes, label: str, depth: int) -> Iterator[_View]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return
    budget = MAX_VIEW_BYTES
    for info in infos:
        if info.is_dir() or info.file_size > budget:
            continue
        budget -= info.file_size
        try:
            member = archive.read(info)
        except (zipfile.BadZipFile, OSError, ValueError, RuntimeError, zlib.error):
            continue
        yield from file_views(member, f"{label}!{info.filename}", depth + 1)


def _tar_views(data: bytes, label: str, depth: int) -> Iterator[_View]:
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
        members = archive.getmembers()
    except (tarfile.TarError, OSError):
        return
    budget = MAX_VIEW_BYTES
    for member in members:
        if not member.isfile() or member.size > budget:
            continue
        budget -= member.size
        f = archive.extractfile(member)
        if f is not None:
            yield from file_views(f.read(), f"{label}!{member.name}", depth + 1)


def _git_objects(workspace: Path) -> list[tuple[str, str, bytes]] | None:
    """``(id, type, content)`` of every object git can read in the workspace (packs included)."""
    try:
        out = run_git(
            ["--git-dir", str(workspace / ".git"), "cat-file", "--batch-all-objects", "--batch"],
            workspace,
        )
    except (RuntimeError, OSError):
        return None
    objects = []
    pos = 0
    while pos < len(out):
        end = out.index(b"\n", pos)
        oid, kind, size = out[pos:end].decode().split()
        start = end + 1
        objects.append((oid, kind, out[start : start + int(size)]))
        pos = start + int(size) + 1
    return objects


def git_object_text(kind: str, content: bytes) -> bytes:
    """What an agent reads from a git object: blobs, commits and tags as they are, a tree as its
    entries' modes and names (the 20-byte ids in between are binary, not text)."""
    if kind != "tree":
        return content
    lines = []
    pos = 0
    while pos < len(content):
        nul = content.index(b"\0", pos)
        lines.append(content[pos:nul])
        pos = nul + 21
    return b"\n".join(lines)


def leak_scan(
    workspace: str | Path, material: LeakMaterial, *, max_hits: int = 20
) -> dict[str, Any]:
    """Scan every file under ``workspace`` (symlinks are not followed) for ``material``.

    Returns the record's ``etude.leak_scan`` object: ``clean``, counts of files, bytes, views and
    distinctive items, the definition's parameters, and up to ``max_hits`` hits
    ``{path, view, kind, match}``. A ``.git`` directory is also read through git itself.
    """
    workspace = Path(workspace)
    if not workspace.is_dir():
        raise ValueError(f"cannot scan {str(workspace)!r}: not a directory")
    hits: list[dict[str, str]] = []
    num_hits = 0
    files = bytes_read = views = 0

    def scan(view: _View, rel: str) -> None:
        nonlocal num_hits
        if material.lines:
            norm = normalize_text(view.text)
            for line in material.lines:
                if line in norm:
                    num_hits += 1
                    if len(hits) < max_hits:
                        hits.append(
                            {"path": rel, "view": view.label, "kind": "line", "match": line[:120]}
                        )
        if material.ngrams:
            for stream in view.streams:
                for gram in sorted(ngrams(stream, material.n) & material.ngrams):
                    num_hits += 1
                    if len(hits) < max_hits:
                        hits.append(
                            {
                                "path": rel,
                                "view": view.label,
                                "kind": "ngram",
                                "match": " ".join(gram),
                            }
                        )

    for root, dirs, names in os.walk(workspace):
        if Path(root) == workspace and ".git" in dirs and (workspace / ".git").is_dir():
            dirs.remove(".git")  # read through git below: what the agent decodes, not raw zlib
        dirs.sort()
        for name in sorted(names):
            path = Path(root) / name
            rel = path.relative_to(workspace).as_posix()
            if path.is_symlink() or not path.is_file():
                continue
            data = path.read_bytes()
            files += 1
            bytes_read += len(data)
            for view in file_views(data, rel):
                views += 1
                scan(view, rel)
    git_readable = None
    if (workspace / ".git").is_dir():
        objects = _git_objects(workspace)
        git_readable = objects is not None
        if objects is not None:
            for oid, kind, content in objects:
                bytes_read += len(content)
                for view in file_views(git_object_text(kind, content), f".git {kind} {oid[:12]}"):
                    views += 1
                    scan(view, ".git")
    # with nothing distinctive left to look for, a scan finds nothing whatever the tree holds:
    # the deleted code is all elsewhere in the tree (a copy) or too small to recognize
    nothing_distinctive = not material.lines and not material.ngrams
    if nothing_distinctive:
        num_hits += 1
        hits.insert(
            0,
            {
                "path": ".",
                "view": "-",
                "kind": "nothing distinctive",
                "match": "every line and identifier n-gram of the deleted code is elsewhere",
            },
        )
    return {
        "clean": num_hits == 0,
        "nothing_distinctive": nothing_distinctive,
        "num_hits": num_hits,
        "hits": hits,
        "files": files,
        "bytes": bytes_read,
        "views": views,
        "git_objects_read": git_readable,
        "distinctive_lines": len(material.lines),
        "distinctive_ngrams": len(material.ngrams),
        "candidate_lines": material.candidate_lines,
        "candidate_ngrams": material.candidate_ngrams,
        "min_line_chars": material.min_line_chars,
        "ngram": material.n,
    }


def tree_files(directory: str | Path, *, skip_git: bool = True) -> Iterator[tuple[str, bytes]]:
    """``(relative POSIX path, bytes)`` of every regular file under ``directory``, sorted."""
    directory = Path(directory)
    for root, dirs, names in os.walk(directory):
        if skip_git and ".git" in dirs and Path(root) == directory:
            dirs.remove(".git")
        dirs.sort()
        for name in sorted(names):
            path = Path(root) / name
            if path.is_file() and not path.is_symlink():
                yield path.relative_to(directory).as_posix(), path.read_bytes()
