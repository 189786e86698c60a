"""Clean task workspaces: rebuild the broken tree without leak channels, then scan it for leaks.

A feature-deletion task is only worth its reward if the deleted code cannot be recovered from the
workspace. A policy trained at scale finds every leftover: a type-checker cache holding the
deleted signature, bytecode of the deleted module, the original in VCS history, an installed copy.
So the workspace is **rebuilt, not cleaned**: ``export_tree`` copies only wanted regular files into
a new directory, ``fresh_git_repo`` gives it a history of one reproducible commit, and
``leak_scan`` then reads every file of the result (hidden and binary ones too, and every git
object) looking for the deleted code.

What ``export_tree`` leaves out (each skipped path is reported with its channel):
VCS directories (``.git``, ``.hg``, ``.svn``, ``.bzr``); bytecode (``__pycache__``, ``*.pyc``,
``*.pyo``); type-checker and tool caches (``.mypy_cache``, ``.dmypy.json``, ``.pytype``,
``.pyre``, ``.ruff_cache``, ``.pytest_cache``, ``.hypothesis``, ``.cache``, ``.benchmarks``);
coverage data (``.coverage*``, ``coverage.xml``, ``htmlcov``); packaging metadata and installed
copies (``*.egg-info``, ``*.dist-info``, ``.eggs``, ``*.egg``, ``*.whl``, virtualenvs: any
directory holding ``pyvenv.cfg``); build output (``build/`` and ``dist/`` at the root, ``.tox``,
``.nox``); built documentation (``_build``, ``site`` and ``_site`` at the root); editor and
backup files (``*~``, ``*.swp``, ``*.bak``, ``*.orig``, ``*.rej``, ``.#*``, ``.idea``,
``.vscode``...); compiled extensions and objects (``*.so``, ``*.pyd``, ``*.dylib``, ``*.dll``,
``*.o``, ``*.a``), which could have been built from deleted sources; symlinks that leave the tree;
sockets, fifos and devices.

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

What this module does not do: it cannot judge content that belongs to the repository itself. By
the definition above nothing in R is distinctive, so documentation that quotes the deleted code
(an implementation copied into a tutorial) is not reported; nor are paraphrases, translations to
another language, or information spread thinner than a line or an n-gram (a single argument
name). It does not decrypt or decode beyond the views above (base64 blobs, rot13). It does not
look outside the workspace: an installed copy of the package is caught by
``find_installed_copies``, which the factory runs before building.
"""

from __future__ import annotations

import fnmatch
import functools
import html
import io
import json
import marshal
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import types
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------
# export: which paths never reach a workspace, and why

_DIR_CHANNELS: dict[str, str] = {
    ".git": "vcs",
    ".hg": "vcs",
    ".svn": "vcs",
    ".bzr": "vcs",
    "_darcs": "vcs",
    "__pycache__": "bytecode",
    ".mypy_cache": "type-checker cache",
    ".pytype": "type-checker cache",
    ".pyre": "type-checker cache",
    ".pyright": "type-checker cache",
    ".ruff_cache": "tool cache",
    ".pytest_cache": "tool cache",
    ".hypothesis": "tool cache",
    ".cache": "tool cache",
    ".benchmarks": "tool cache",
    ".ipynb_checkpoints": "tool cache",
    "htmlcov": "coverage data",
    ".eggs": "packaging metadata",
    "pip-wheel-metadata": "packaging metadata",
    "__pypackages__": "installed copy",
    ".tox": "build output",
    ".nox": "build output",
    "_build": "built docs",
    ".idea": "editor file",
    ".vscode": "editor file",
}
_ROOT_DIR_CHANNELS: dict[str, str] = {
    "build": "build output",
    "dist": "build output",
    "wheelhouse": "build output",
    "site": "built docs",
    "_site": "built docs",
}
_DIR_SUFFIX_CHANNELS: tuple[tuple[str, str], ...] = (
    (".egg-info", "packaging metadata"),
    (".dist-info", "packaging metadata"),
    (".egg", "installed copy"),
)
_FILE_CHANNELS: tuple[tuple[str, str], ...] = (
    ("*.pyc", "bytecode"),
    ("*.pyo", "bytecode"),
    ("*.so", "compiled extension"),
    ("*.so.*", "compiled extension"),
    ("*.pyd", "compiled extension"),
    ("*.dylib", "compiled extension"),
    ("*.dll", "compiled extension"),
    ("*.o", "compiled extension"),
    ("*.obj", "compiled extension"),
    ("*.a", "compiled extension"),
    ("*.lib", "compiled extension"),
    (".coverage", "coverage data"),
    (".coverage.*", "coverage data"),
    ("coverage.xml", "coverage data"),
    ("coverage.json", "coverage data"),
    ("coverage.lcov", "coverage data"),
    (".dmypy.json", "type-checker cache"),
    ("dmypy.json", "type-checker cache"),
    ("*.egg", "installed copy"),
    ("*.whl", "installed copy"),
    ("*~", "backup file"),
    ("*.bak", "backup file"),
    ("*.orig", "backup file"),
    ("*.rej", "backup file"),
    ("*.swp", "editor file"),
    ("*.swo", "editor file"),
    (".#*", "editor file"),
    ("#*#", "editor file"),
    (".DS_Store", "editor file"),
)


def skip_reason(rel: str, *, is_dir: bool, directory: Path | None = None) -> str | None:
    """The leak channel that keeps workspace-relative path ``rel`` out of a workspace, or None.

    ``directory`` (the path on disk) lets a virtualenv be recognized by its ``pyvenv.cfg``.
    """
    name = rel.rsplit("/", 1)[-1]
    if is_dir:
        if name in _DIR_CHANNELS:
            return _DIR_CHANNELS[name]
        if "/" not in rel and name in _ROOT_DIR_CHANNELS:
            return _ROOT_DIR_CHANNELS[name]
        for suffix, channel in _DIR_SUFFIX_CHANNELS:
            if name.endswith(suffix):
                return channel
        if directory is not None and (directory / "pyvenv.cfg").exists():
            return "installed copy"
        return None
    for pattern, channel in _FILE_CHANNELS:
        if fnmatch.fnmatchcase(name, pattern):
            return channel
    return None


@dataclass(kw_only=True, slots=True)
class ExportReport:
    """What ``export_tree`` copied and what it left out."""

    copied: list[str] = field(default_factory=list)
    """Relative POSIX paths of the regular files written to the destination."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Relative path (a directory stands for everything under it) -> the channel it belongs to."""


def export_tree(src: str | Path, dest: str | Path) -> ExportReport:
    """Copy the wanted regular files of ``src`` into the new directory ``dest``.

    Only regular files are copied (content and executable bit; no times, owners or xattrs), and
    symlinks whose target stays inside ``src`` are recreated; everything on the leak-channel lists
    of the module docstring is skipped. ``dest`` must not exist or be empty.
    """
    src = Path(src).resolve()
    dest = Path(dest)
    if not src.is_dir():
        raise ValueError(f"cannot export {str(src)!r}: not a directory")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"export destination {str(dest)!r} must be a new or empty directory")
    dest.mkdir(parents=True, exist_ok=True)
    report = ExportReport()
    for root, dirs, files in os.walk(src):
        root_path = Path(root)
        rel_root = root_path.relative_to(src).as_posix()
        rel_root = "" if rel_root == "." else rel_root + "/"
        kept = []
        for name in sorted(dirs):
            rel = rel_root + name
            path = root_path / name
            if path.is_symlink():
                _export_link(src, path, dest / rel, rel, report)
                continue
            reason = skip_reason(rel, is_dir=True, directory=path)
            if reason is not None:
                report.skipped[rel] = reason
                continue
            (dest / rel).mkdir()
            kept.append(name)
        dirs[:] = kept
        for name in sorted(files):
            rel = rel_root + name
            path = root_path / name
            if path.is_symlink():
                _export_link(src, path, dest / rel, rel, report)
                continue
            reason = skip_reason(rel, is_dir=False)
            mode = path.lstat().st_mode
            if reason is None and not stat.S_ISREG(mode):
                reason = "special file"
            if reason is not None:
                report.skipped[rel] = reason
                continue
            shutil.copyfile(path, dest / rel)
            os.chmod(dest / rel, 0o755 if mode & stat.S_IXUSR else 0o644)
            report.copied.append(rel)
    report.copied.sort()
    return report


def _export_link(src: Path, path: Path, target: Path, rel: str, report: ExportReport) -> None:
    resolved = path.resolve()
    if resolved != src and src not in resolved.parents:
        report.skipped[rel] = "symlink outside the tree"
        return
    reason = skip_reason(rel, is_dir=resolved.is_dir())
    if reason is not None:
        report.skipped[rel] = reason
        return
    os.symlink(os.readlink(path), target)


# ---------------------------------------------------------------------------------------------
# a fresh repository of one reproducible commit

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "etude",
    "GIT_AUTHOR_EMAIL": "etude@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "etude",
    "GIT_COMMITTER_EMAIL": "etude@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
COMMIT_MESSAGE = "Initial commit"


def git_env(home: str) -> dict[str, str]:
    """An environment for git that reads no system or user configuration (no hooks, no signing)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": home,
        "LANG": "C",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
    }
    env.update(GIT_IDENTITY)
    return env


def run_git(args: Sequence[str], cwd: str | Path, *, input_bytes: bytes | None = None) -> bytes:
    """Run ``git ARGS`` in ``cwd`` with ``git_env``; a failure raises ``RuntimeError`` with stderr."""
    with tempfile.TemporaryDirectory(prefix="etude-git-home-") as home:
        proc = subprocess.run(
            ["git", "-c", "core.hooksPath=/dev/null", "-c", "commit.gpgsign=false", *args],
            cwd=cwd,
            env=git_env(home),
            input=input_bytes,
            capture_output=True,
            check=False,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {proc.stderr.decode(errors='replace')}")
    return proc.stdout


def fresh_git_repo(workspace: str | Path) -> str:
    """Make ``workspace`` a git repository whose history is one commit of all its files.

    No template (so no sample hooks or description), every file added (ignored ones too: the tree
    is exactly what was exported), fixed identity and dates: the same tree always gives the same
    commit id, which is returned. ``workspace`` must not be a repository already.
    """
    workspace = Path(workspace)
    if (workspace / ".git").exists():
        raise ValueError(f"{str(workspace)!r} already has a .git; export the tree first")
    with tempfile.TemporaryDirectory(prefix="etude-git-template-") as template:
        run_git(["init", "-q", f"--template={template}", "-b", "main"], workspace)
    run_git(["add", "-A", "-f"], workspace)
    run_git(["commit", "-q", "--allow-empty", "--no-verify", "-m", COMMIT_MESSAGE], workspace)
    return run_git(["rev-parse", "HEAD"], workspace).decode().strip()


def workspace_head(workspace: str | Path) -> tuple[str, bool]:
    """``(commit id of HEAD, whether the worktree matches it)`` of a workspace repository."""
    head = run_git(["rev-parse", "HEAD"], workspace).decode().strip()
    status = run_git(["status", "--porcelain", "--untracked-files=all"], workspace)
    return head, not status.strip()


# ---------------------------------------------------------------------------------------------
# installed copies: the deleted code must not be importable from outside the workspace

_FIND_SPECS = """
import importlib.util, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        spec = None
    if spec is not None:
        out[name] = spec.origin or ",".join(spec.submodule_search_locations or [])
print(json.dumps(out))
"""


def find_installed_copies(sandbox: Any, names: Iterable[str]) -> dict[str, str]:
    """Top-level module names the sandboxed interpreter imports from outside a workspace.

    Runs ``importlib.util.find_spec`` in ``sandbox`` with an empty directory as the workspace, so
    only installed copies (site-packages, ``.pth`` paths the sandbox can see) are found. Returns
    ``{name: where}``; an empty dict means the package can only come from the task workspace.
    """
    names = sorted(set(names))
    if not names:
        return {}
    with tempfile.TemporaryDirectory(prefix="etude-empty-") as empty:
        result = sandbox.run(["python", "-I", "-c", _FIND_SPECS, *names], empty, timeout=60)
    if result.exit_code != 0:
        raise RuntimeError(f"installed-copy probe failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# leak scan

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
