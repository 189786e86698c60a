"""Clean workspaces: every leak channel is kept out, and the leak scan finds each when forced in.

The channel test plants, in a source repository, artifacts that hold the code a task deletes:
git history with the original, a mypy cache with the deleted signature, bytecode of the deleted
module, an egg-info, coverage data and an HTML coverage report, a build/ copy and a virtualenv
with an installed copy. It builds real tasks from that repository, checks that none of them
reaches a workspace, then copies each artifact into a workspace and checks that the scan
reports it.
"""

import gzip
import hashlib
import io
import json
import os
import py_compile
import shutil
import subprocess
import sys
import tarfile
import zipfile
import zlib
from pathlib import Path

import pytest
from test_tasks_mine import write_mini_repo

from etude.sandbox import make_sandbox
from etude.tasks.build import TaskBuildConfig, TaskFactory
from etude.tasks.leaks import (
    LeakMaterial,
    distinctive_material,
    identifiers,
    leak_scan,
    ngrams,
    tree_files,
)
from etude.tasks.proposal import ProposalConfig
from etude.tasks.record import resolve_workspace
from etude.tasks.sanitize import (
    export_tree,
    find_installed_copies,
    fresh_git_repo,
    run_git,
    skip_reason,
    workspace_head,
)
from etude.tasks.validate import record_leak_material

CHANNEL_PATHS = {
    ".git/objects/ab/cdef": "vcs",
    "pkg/__pycache__/mod.cpython-311.pyc": "bytecode",
    "pkg/mod.pyc": "bytecode",
    ".mypy_cache/3.11/pkg/mod.data.json": "type-checker cache",
    ".pytype/pyi/pkg/mod.pyi": "type-checker cache",
    ".pyre/server.log": "type-checker cache",
    ".dmypy.json": "type-checker cache",
    ".ruff_cache/content": "tool cache",
    ".pytest_cache/v/cache/nodeids": "tool cache",
    ".hypothesis/examples/a": "tool cache",
    ".coverage": "coverage data",
    ".coverage.host.1234": "coverage data",
    "coverage.xml": "coverage data",
    "htmlcov/index.html": "coverage data",
    "pkg.egg-info/SOURCES.txt": "packaging metadata",
    "pkg-1.0.dist-info/RECORD": "packaging metadata",
    "build/lib/pkg/mod.py": "build output",
    "dist/pkg-1.0.tar.gz": "build output",
    ".tox/py311/log": "build output",
    ".nox/tests/log": "build output",
    "docs/_build/html/index.html": "built docs",
    "site/index.html": "built docs",
    "pkg/mod.py~": "backup file",
    "pkg/mod.py.orig": "backup file",
    "pkg/mod.py.bak": "backup file",
    "pkg/.mod.py.swp": "editor file",
    ".idea/workspace.xml": "editor file",
    ".vscode/settings.json": "editor file",
    "pkg/_speedups.cpython-311-x86_64-linux-gnu.so": "compiled extension",
    "pkg/_ext.pyd": "compiled extension",
    "pkg/native.o": "compiled extension",
    "venv/lib/python3.11/site-packages/pkg/mod.py": "installed copy",
}
WANTED = [
    "pkg/__init__.py",
    "pkg/mod.py",
    "pkg/mod.pyi",
    "pkg/build/__init__.py",
    "docs/index.md",
    "tests/test_mod.py",
    ".gitignore",
    "data/dist/table.csv",
]


def test_export_keeps_every_channel_out(tmp_path):
    src = tmp_path / "src"
    for rel in [*CHANNEL_PATHS, *WANTED]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(f"content of {rel}\n")
    (src / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (src / "pkg" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "pkg" / "run.sh", 0o755)
    os.symlink("/etc/hostname", src / "pkg" / "outside.txt")
    os.symlink("mod.py", src / "pkg" / "alias.py")
    os.mkfifo(src / "pkg" / "pipe")
    report = export_tree(src, tmp_path / "out")
    out = tmp_path / "out"
    for rel, channel in CHANNEL_PATHS.items():
        assert not (out / rel).exists(), rel
        top = next(k for k in report.skipped if rel == k or rel.startswith(k + "/"))
        assert report.skipped[top] == channel, rel
    for rel in WANTED:
        assert (out / rel).read_text() == f"content of {rel}\n"
    assert os.access(out / "pkg" / "run.sh", os.X_OK)
    assert report.skipped["pkg/outside.txt"] == "symlink outside the tree"
    assert report.skipped["pkg/pipe"] == "special file"
    assert os.readlink(out / "pkg" / "alias.py") == "mod.py"
    with pytest.raises(ValueError, match="new or empty"):
        export_tree(src, out)


def test_skip_reason_only_drops_build_dirs_at_the_root():
    assert skip_reason("build", is_dir=True) == "build output"
    assert skip_reason("pkg/build", is_dir=True) is None
    assert skip_reason("pkg/__pycache__", is_dir=True) == "bytecode"


def test_fresh_git_repo_is_one_reproducible_commit(tmp_path):
    shas = []
    for name in ("a", "b"):
        ws = tmp_path / name
        (ws / "pkg").mkdir(parents=True)
        (ws / "pkg" / "mod.py").write_text("X = 1\n")
        (ws / ".gitignore").write_text("pkg/\n")  # ignored files are committed all the same
        shas.append(fresh_git_repo(ws))
        head, clean = workspace_head(ws)
        assert head == shas[-1] and clean
        assert run_git(["rev-list", "--all", "--count"], ws).strip() == b"1"
        assert b"pkg/mod.py" in run_git(["ls-files"], ws)
        assert not (ws / ".git" / "hooks").exists() and not (ws / ".git" / "description").exists()
    assert shas[0] == shas[1]


def test_installed_copies_are_found(tmp_path):
    sandbox = make_sandbox()
    found = find_installed_copies(sandbox, ["pytest", "surely_not_installed_anywhere_42"])
    assert set(found) == {"pytest"}
    repo = tmp_path / "repo"
    (repo / "iniconfig").mkdir(parents=True)  # a package that is installed in the venv
    (repo / "iniconfig" / "__init__.py").write_text("")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_x.py").write_text("def test_x():\n    pass\n")
    with pytest.raises(ValueError, match="importable from outside the workspace"):
        TaskFactory(repo, tmp_path / "out").prepare()


# ---------------------------------------------------------------------------------------------
# scan views


def _material(deleted: str):
    return distinctive_material(
        deleted, [], [("keep.py", b"def kept():\n    return 0\n")], min_line_chars=16, n=3
    )


DELETED = "def secret_feature(alpha, beta, gamma):\n    return alpha * beta + gamma_offset(gamma)\n"


def _tar_bytes(name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _zip_bytes(name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(name, data)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "encode",
    [
        lambda d: d,
        lambda d: zlib.compress(b"blob 99\x00" + d),
        lambda d: gzip.compress(_tar_bytes("pkg/mod.py", d)),
        lambda d: _zip_bytes("pkg/mod.py", d),
        lambda d: json.dumps({"source": d.decode()}).encode(),
        lambda d: (
            "<pre>" + d.decode().replace("(", "<span>(</span>").replace(" * ", " &#42; ") + "</pre>"
        ).encode(),
    ],
    ids=["plain", "zlib", "tar.gz", "zip", "json", "html"],
)
def test_scan_sees_through_every_view(tmp_path, encode):
    material = _material(DELETED)
    (tmp_path / "keep.py").write_text("def kept():\n    return 0\n")
    assert leak_scan(tmp_path, material)["clean"]
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "blob").write_bytes(encode(DELETED.encode()))
    scan = leak_scan(tmp_path, material)
    assert not scan["clean"] and scan["hits"][0]["path"] == ".hidden/blob"


def test_scan_reads_bytecode_names(tmp_path):
    material = distinctive_material(DELETED, [], [], n=3)
    source = tmp_path / "mod.py"
    source.write_text(DELETED.replace("return alpha", "    # reformatted\n    return  alpha"))
    py_compile.compile(str(source), cfile=str(tmp_path / "mod.cpython-311.pyc"))
    source.unlink()
    scan = leak_scan(tmp_path, material)
    assert any(h["view"].endswith("(bytecode)") and h["kind"] == "ngram" for h in scan["hits"])


def test_distinctive_means_absent_from_the_remaining_tree():
    deleted = "    result = compute_everything(values)\n    return result\nx = 1\n"
    remaining = [("other.py", b"def other(values):\n    return result\n")]
    material = distinctive_material(
        deleted, [["alpha", "beta", "gamma"]], remaining, min_line_chars=10, n=3
    )
    # long enough and not in R; "return result" is in R; "x = 1" is too short
    assert material.lines == ("result = compute_everything(values)",)
    assert ("alpha", "beta", "gamma") in material.ngrams
    assert ("return", "result", "x") in material.ngrams  # spans two deleted lines, not in R
    assert ("def", "other", "values") not in material.ngrams


# ---------------------------------------------------------------------------------------------
# the channels, end to end

PAD = '''

def pad(text, width, fill=" "):
    """Right-pad ``text`` with ``fill`` to ``width`` characters."""
    missing_count = max(0, width - len(text))
    return text + fill * missing_count
'''
PAD_TEST = """

def test_pad():
    assert words.pad("ab", 4, fill="*") == "ab**"


def test_pad_long():
    assert words.pad("abcdef", 3) == "abcdef"
"""


def _mypy_cache(words_source: str) -> dict:
    """The shape of mypy's ``.data.json`` for ``minipkg.words`` (names, FuncDefs, signatures)."""
    return {
        ".class": "MypyFile",
        "_fullname": "minipkg.words",
        "names": {
            ".class": "SymbolTable",
            "pad": {
                ".class": "SymbolTableNode",
                "kind": "Gdef",
                "node": {
                    ".class": "FuncDef",
                    "name": "pad",
                    "fullname": "minipkg.words.pad",
                    "arg_names": ["text", "width", "fill"],
                    "arg_kinds": [0, 0, 1],
                    "type": {
                        ".class": "CallableType",
                        "arg_types": ["builtins.str", "builtins.int", "builtins.str"],
                        "ret_type": "builtins.str",
                    },
                },
            },
            "shout": {
                ".class": "SymbolTableNode",
                "kind": "Gdef",
                "node": {
                    ".class": "FuncDef",
                    "name": "shout",
                    "fullname": "minipkg.words.shout",
                    "arg_names": ["text"],
                },
            },
        },
        "is_stub": False,
        "path": "minipkg/words.py",
        "hash": hashlib.sha1(words_source.encode()).hexdigest(),
    }


def _tree_hashes(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            if not path.is_symlink():
                out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A source repository full of leak artifacts, and the tasks built from it."""
    tmp = tmp_path_factory.mktemp("channels")
    repo = write_mini_repo(tmp / "repo")
    words = repo / "minipkg" / "words.py"
    words.write_text(words.read_text() + PAD)
    test_words = repo / "tests" / "test_words.py"
    test_words.write_text(test_words.read_text() + PAD_TEST)
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    git = ["git", "-c", "user.name=a", "-c", "user.email=a@b", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True, env=env)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True, env=env)
    subprocess.run([*git, "commit", "-q", "-m", "original"], cwd=repo, check=True, env=env)
    cache = repo / ".mypy_cache" / "3.11" / "minipkg"
    cache.mkdir(parents=True)
    (cache / "words.data.json").write_text(json.dumps(_mypy_cache(words.read_text())))
    (repo / "minipkg" / "__pycache__").mkdir()
    py_compile.compile(
        str(words),
        cfile=str(repo / "minipkg" / "__pycache__" / f"words.{sys.implementation.cache_tag}.pyc"),
    )
    egg = repo / "minipkg.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: minipkg\nVersion: 0.3.0\n")
    (egg / "SOURCES.txt").write_text("minipkg/__init__.py\nminipkg/shapes.py\nminipkg/words.py\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "coverage",
            "run",
            "--data-file=.coverage",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_words.py",
        ],
        cwd=repo,
        check=True,
        capture_output=True,
        env={**env, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    subprocess.run(
        [sys.executable, "-m", "coverage", "html", "--data-file=.coverage", "-d", "htmlcov"],
        cwd=repo,
        check=True,
        capture_output=True,
    )
    (repo / "build" / "lib" / "minipkg").mkdir(parents=True)
    shutil.copy(words, repo / "build" / "lib" / "minipkg" / "words.py")
    site = repo / ".venv" / "lib" / "python3.11" / "site-packages" / "minipkg"
    site.mkdir(parents=True)
    (repo / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    shutil.copy(words, site / "words.py")
    before = _tree_hashes(repo)
    cfg = TaskBuildConfig(
        proposals=ProposalConfig(include=("minipkg.words", "minipkg.words.pad")), workers=2
    )
    with TaskFactory(repo, tmp / "out", cfg) as factory:
        records, report = factory.build()
    return repo, tmp / "out", {r.etude.symbols[0]: r for r in records}, before, report


CHANNELS = {
    "git history": ".git",
    "mypy cache": ".mypy_cache",
    "bytecode": f"minipkg/__pycache__/words.{sys.implementation.cache_tag}.pyc",
    "egg-info": "minipkg.egg-info",
    "coverage data": ".coverage",
    "coverage html": "htmlcov",
    "build output": "build",
    "installed copy": ".venv",
}
# artifacts that hold code of the function task too (egg-info and the .coverage database hold
# only paths and line numbers, which identify a deleted module but not a deleted function)
HOLDS_FUNCTION_CODE = {
    "git history",
    "mypy cache",
    "bytecode",
    "coverage html",
    "build output",
    "installed copy",
}


def test_no_channel_reaches_a_workspace(planted):
    repo, out, records, before, report = planted
    assert set(records) == {"minipkg.words", "minipkg.words.pad"}, report.rejected
    assert _tree_hashes(repo) == before  # the source repository is only read
    for record in records.values():
        ws = resolve_workspace(record, out)
        for rel in CHANNELS.values():
            if rel != ".git":
                assert not (ws / rel).exists(), rel
        assert run_git(["rev-list", "--all", "--count"], ws).strip() == b"1"
        objects = run_git(["cat-file", "--batch-all-objects", "--batch"], ws)
        assert b"missing_count" not in objects  # a body line of pad
        if record.etude.deleted_files:
            assert b"def shout" not in objects
        assert record.etude.leak_scan["clean"] and record.etude.leak_scan["git_objects_read"]
        assert (
            record.etude.leak_scan["distinctive_lines"] > 0
            and record.etude.leak_scan["distinctive_ngrams"] > 0
        )


@pytest.mark.parametrize("channel", sorted(CHANNELS))
def test_scan_finds_each_channel_forced_in(planted, channel, tmp_path):
    repo, out, records, _, _ = planted
    for symbol, record in sorted(records.items()):
        ws = resolve_workspace(record, out)
        material = record_leak_material(record, ws)
        assert leak_scan(ws, material)["clean"]
        forced = tmp_path / symbol
        shutil.copytree(ws, forced, symlinks=True)
        rel = CHANNELS[channel]
        if (forced / rel).is_dir():
            shutil.rmtree(forced / rel)
        if (repo / rel).is_dir():
            shutil.copytree(repo / rel, forced / rel, symlinks=True)
        else:
            (forced / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / rel, forced / rel)
        scan = leak_scan(forced, material)
        if symbol == "minipkg.words" or channel in HOLDS_FUNCTION_CODE:
            assert not scan["clean"], (channel, symbol)
            assert all(h["path"].startswith(rel) for h in scan["hits"]), scan["hits"]
        else:
            assert scan["clean"], (channel, symbol, scan["hits"])


def test_nothing_distinctive_left_is_not_clean(tmp_path):
    """Deleted code whose every line and n-gram is elsewhere in the tree: a copy, not clean."""
    (tmp_path / "copy.py").write_text("def helper_total(values):\n    return sum(values)\n")
    deleted = "def helper_total(values):\n    return sum(values)\n"
    material = distinctive_material(deleted, [], tree_files(tmp_path))
    assert not material.lines and not material.ngrams and material.candidate_ngrams
    scan = leak_scan(tmp_path, material)
    assert not scan["clean"] and scan["nothing_distinctive"]
    assert scan["hits"][0]["kind"] == "nothing distinctive"


def test_binary_git_objects_and_binary_files_give_no_chance_ngram_hits(tmp_path):
    """Identifiers that occur by chance in binary bytes (tree ids, hashes) are no leak: git
    objects are read as git decodes them, binary data only for whole lines."""
    ws = tmp_path / "ws"
    ws.mkdir()
    names = [f"m{i}.py" for i in range(40)]
    for name in names:
        (ws / name).write_text(f"value = {name!r}\n")
    fresh_git_repo(ws)
    tree_id = run_git(["rev-parse", "HEAD^{tree}"], ws).decode().strip()
    raw_tree = run_git(["cat-file", "tree", tree_id], ws).decode("utf-8", "replace")
    words = {w for name in names for w in identifiers(name)}
    chance = {g for g in ngrams(identifiers(raw_tree), 2) if not set(g) & words}
    assert chance  # 40 binary ids of 20 bytes hold identifier-like runs
    binary = bytes(range(256)) + b" pq xr " + bytes(range(256))
    (ws / "image.bin").write_bytes(binary)
    material = LeakMaterial(
        lines=(), ngrams=frozenset({("pq", "xr"), *chance}), n=2, min_line_chars=16
    )
    scan = leak_scan(ws, material)
    assert scan["clean"], scan["hits"]
    (ws / "notes.txt").write_text("pq xr\n")  # the same identifiers in text are a hit
    assert not leak_scan(ws, material)["clean"]
