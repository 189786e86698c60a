"""The bundled example repo and the hand-written tasks built on it.

For the repo: its suite and its docstring examples pass. For each hand-written task: the record
loads, its workspace matches ``base_commit``, no deleted definition survives in the workspace,
FAIL_TO_PASS fails and PASS_TO_PASS passes on the workspace, and the gold patch (``git apply``
and ``patch -p1``) turns the workspace back into the original repo byte for byte, after which
every test passes. pytest runs in a subprocess on copies in a temporary directory, without
bytecode or cache files, so nothing is written under ``examples/``.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from etude.tasks.record import load_tasks, resolve_workspace, tree_digest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_REPO = ROOT / "examples" / "repos" / "textkit"
HANDWRITTEN = ROOT / "examples" / "tasks" / "handwritten"
TASKS = load_tasks(HANDWRITTEN)
CACHE_NAMES = {"__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis"}

_RESULT_RE = re.compile(r"^(PASSED|FAILED|ERROR) (\S+)")


def run_pytest(cwd: Path, *args: str) -> tuple[dict[str, str], set[str]]:
    """Run pytest in ``cwd``; return {node id: PASSED/FAILED/ERROR} and files that failed to collect."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA"]
        + ["--continue-on-collection-errors", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    results: dict[str, str] = {}
    broken_files: set[str] = set()
    for line in proc.stdout.splitlines():
        match = _RESULT_RE.match(line)
        if not match:
            continue
        status, target = match.groups()
        if "::" in target:
            results[target] = status
        else:
            broken_files.add(target)
    assert results or broken_files, proc.stdout[-3000:] + proc.stderr[-3000:]
    return results, broken_files


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*CACHE_NAMES))
    return dst


@pytest.fixture(scope="module")
def repo_results(tmp_path_factory):
    repo = copy_tree(EXAMPLE_REPO, tmp_path_factory.mktemp("repo") / "textkit")
    return run_pytest(repo, "--doctest-modules", "textkit", "tests")


def suite_ids(results: dict[str, str]) -> set[str]:
    return {node for node in results if node.startswith("tests/")}


def test_example_suite_and_docstrings_pass(repo_results):
    results, broken_files = repo_results
    assert not broken_files
    assert set(results.values()) == {"PASSED"}
    tests = suite_ids(results)
    doctests = set(results) - tests
    assert len(tests) >= 120
    # Every module is tested in its own file, and every docstring example runs.
    modules = {p.stem for p in (EXAMPLE_REPO / "textkit").glob("*.py")} - {"__init__"}
    assert {node.split("::")[0] for node in tests} == {f"tests/test_{m}.py" for m in modules}
    assert {node.split("::")[0] for node in doctests} <= {f"textkit/{m}.py" for m in modules}
    assert len(doctests) >= len(modules)


def test_three_handwritten_tasks():
    assert [t.etude.kind for t in TASKS] == ["handwritten"] * 3
    assert len({t.instance_id for t in TASKS}) == 3


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.instance_id)
class TestHandwrittenTask:
    def test_tests_split_the_whole_suite(self, task, repo_results):
        f2p, p2p = set(task.FAIL_TO_PASS), set(task.PASS_TO_PASS)
        assert not f2p & p2p
        assert f2p | p2p == suite_ids(repo_results[0])

    def test_workspace_matches_record(self, task):
        workspace = resolve_workspace(task, HANDWRITTEN)
        assert task.base_commit == tree_digest(workspace)
        assert task.test_patch == ""
        for rel in task.etude.deleted_files:
            assert (EXAMPLE_REPO / rel).is_file() and not (workspace / rel).exists()
        defined = set()
        for path in (workspace / "textkit").glob("*.py"):
            module = "textkit." + path.stem
            defined.add(module)
            for node in ast.parse(path.read_text()).body:
                targets = node.targets if isinstance(node, ast.Assign) else [node]
                defined.update(
                    f"{module}.{getattr(t, 'name', getattr(t, 'id', ''))}" for t in targets
                )
        assert task.etude.symbols and not set(task.etude.symbols) & defined

    def test_problem_statement_names_interface_and_tests(self, task):
        statement = task.problem_statement
        for node in task.FAIL_TO_PASS:
            assert node.split("[")[0] in statement
        for symbol in task.etude.symbols:
            if not symbol.rsplit(".", 1)[-1].startswith("_"):
                assert symbol.rsplit(".", 1)[-1] in statement

    def test_fail_to_pass_fails_and_pass_to_pass_passes(self, task, tmp_path):
        workspace = copy_tree(resolve_workspace(task, HANDWRITTEN), tmp_path / "ws")
        results, broken_files = run_pytest(workspace)
        for node in task.FAIL_TO_PASS:
            status = results.get(node) or ("ERROR" if node.split("::")[0] in broken_files else None)
            assert status in ("FAILED", "ERROR"), (node, status)
        assert all(results.get(node) == "PASSED" for node in task.PASS_TO_PASS)

    def test_gold_patch_restores_original(self, task, tmp_path):
        patched = copy_tree(resolve_workspace(task, HANDWRITTEN), tmp_path / "ws")
        # A git repository above the copy would make `git apply` resolve paths against it.
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path))
        subprocess.run(
            ["git", "apply"], input=task.patch, text=True, cwd=patched, env=env, check=True
        )
        assert tree_digest(patched) == tree_digest(EXAMPLE_REPO)
        results, broken_files = run_pytest(patched)
        assert not broken_files
        for node in task.FAIL_TO_PASS + task.PASS_TO_PASS:
            assert results.get(node) == "PASSED", node

    def test_gold_patch_applies_with_patch_p1(self, task, tmp_path):
        if shutil.which("patch") is None:
            pytest.skip("GNU patch is not installed; `git apply` is checked separately")
        patched = copy_tree(resolve_workspace(task, HANDWRITTEN), tmp_path / "ws")
        subprocess.run(
            ["patch", "-p1", "--quiet"], input=task.patch, text=True, cwd=patched, check=True
        )
        assert tree_digest(patched) == tree_digest(EXAMPLE_REPO)


def test_no_caches_under_examples():
    # Bytecode and tool caches in a workspace would leak the deleted code to the agent.
    found = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "examples").rglob("*")
        if p.name in CACHE_NAMES or p.suffix in (".pyc", ".pyo")
    ]
    assert not found
