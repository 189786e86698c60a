"""run_pytest: per-test-id outcomes from a sandboxed pytest run, and broken runs never look clean.

Each test builds a tiny repository in ``tmp_path`` (passing, failing, erroring, skipped, xfail and
parametrized tests, a class, a nested directory, a package import) and checks the outcome of
every node id against what the test file says it must be.
"""

from __future__ import annotations

import shutil
import textwrap
import warnings
from pathlib import Path

import pytest

from etude.sandbox import SandboxConfig, make_sandbox, run_pytest
from etude.sandbox.pytest import junit_address, node_id_from_junit

HAVE_BWRAP = shutil.which("bwrap") is not None

TEST_MAIN = """
import pytest
from pkg.mod import double


def test_pass():
    assert double(2) == 4


def test_fail():
    assert double(2) == 5


@pytest.fixture
def broken():
    raise RuntimeError("setup breaks")


def test_error(broken):
    pass


@pytest.mark.skip(reason="not today")
def test_skip():
    pass


@pytest.mark.xfail(strict=True)
def test_xfail():
    assert False


@pytest.mark.parametrize("n", [1, 2, 3])
def test_param(n):
    assert n != 2


@pytest.mark.parametrize("s", ["a::b", "x/y", "p.q"])
def test_odd_params(s):
    assert s


class TestGroup:
    def test_inner(self):
        pass

    def test_inner_fail(self):
        assert False
"""

EXPECTED = {
    "tests/test_main.py::test_pass": "passed",
    "tests/test_main.py::test_fail": "failed",
    "tests/test_main.py::test_error": "error",
    "tests/test_main.py::test_skip": "skipped",
    "tests/test_main.py::test_xfail": "skipped",
    "tests/test_main.py::test_param[1]": "passed",
    "tests/test_main.py::test_param[2]": "failed",
    "tests/test_main.py::test_param[3]": "passed",
    "tests/test_main.py::test_odd_params[a::b]": "passed",
    "tests/test_main.py::test_odd_params[x/y]": "passed",
    "tests/test_main.py::test_odd_params[p.q]": "passed",
    "tests/test_main.py::TestGroup::test_inner": "passed",
    "tests/test_main.py::TestGroup::test_inner_fail": "failed",
    "tests/sub/test_nested.py::test_nested": "passed",
}


def write_repo(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return write_repo(
        tmp_path / "repo",
        {
            "pkg/__init__.py": "",
            "pkg/mod.py": "def double(x):\n    return 2 * x\n",
            "tests/test_main.py": TEST_MAIN,
            "tests/sub/test_nested.py": "def test_nested():\n    pass\n",
        },
    )


def sandbox(backend: str = "auto", **overrides):
    if backend == "bwrap" and not HAVE_BWRAP:
        pytest.skip("bubblewrap is not installed (`make system-deps` installs it)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return make_sandbox(backend, SandboxConfig(timeout_s=60, **overrides))


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"" for p in root.rglob("*")
    }


@pytest.mark.parametrize("backend", ["bwrap", "local"])
def test_outcome_per_node_id(repo, backend):
    before = snapshot(repo)
    run = run_pytest(sandbox(backend), repo, list(EXPECTED))
    assert run.results == EXPECTED, run.output
    assert run.exit_code == 1 and not run.collection_error and not run.timed_out
    assert snapshot(repo) == before  # no cache, no bytecode, no report left behind


def test_all_passed_and_group_ids(repo):
    run = run_pytest(sandbox(), repo, list(EXPECTED))
    passing = [i for i, o in EXPECTED.items() if o == "passed"]
    assert run.all_passed(passing)
    assert not run.all_passed()  # the requested set has failures
    assert not run.all_passed(["tests/test_main.py::test_skip"])  # skipped is not passed
    assert run.outcome("tests/test_main.py::TestGroup") == "failed"
    assert run.outcome("tests/sub") == "passed"
    assert run.outcome("tests/test_main.py::test_missing") == "error"


def test_file_ids_expand_to_node_ids(repo):
    run = run_pytest(sandbox(), repo, ["tests/test_main.py", "tests/sub/test_nested.py"])
    assert run.results == EXPECTED
    assert run.outcome("tests/test_main.py") == "error"  # the worst of its tests
    assert not run.all_passed()


def test_whole_suite_when_no_ids(tmp_path):
    repo = write_repo(tmp_path / "clean", {"tests/test_a.py": "def test_a():\n    pass\n"})
    run = run_pytest(sandbox(), repo, [])
    assert run.results == {"tests/test_a.py::test_a": "passed"} and run.all_passed()


@pytest.mark.parametrize(
    "breakage, reported",
    [
        ({"pkg/mod.py": "def double(x:\n    return x\n"}, {"tests/test_main.py": "error"}),
        ({"conftest.py": "raise RuntimeError('conftest breaks')\n"}, {}),
    ],
)
def test_broken_collection_fails_every_requested_test(repo, breakage, reported):
    write_repo(repo, breakage)
    ids = ["tests/test_main.py::test_pass", "tests/sub/test_nested.py::test_nested"]
    run = run_pytest(sandbox(), repo, ids)
    assert run.collection_error and run.exit_code in (2, 4)
    assert run.results == {**reported, **dict.fromkeys(ids, "error")}
    assert not run.all_passed()
    assert "Error" in run.output


def test_unknown_test_id_is_an_error(repo):
    run = run_pytest(sandbox(), repo, ["tests/test_main.py::test_pass", "tests/test_nope.py::t"])
    assert run.collection_error
    assert run.results["tests/test_nope.py::t"] == "error"
    assert not run.all_passed()


def test_no_tests_collected_is_not_a_pass(tmp_path):
    repo = write_repo(tmp_path / "empty", {"tests/test_a.py": "x = 1\n"})
    run = run_pytest(sandbox(), repo, [])
    assert run.exit_code == 5 and run.collection_error and not run.all_passed()


def test_timeout_fails_every_requested_test(tmp_path):
    repo = write_repo(
        tmp_path / "slow",
        {"tests/test_slow.py": "import time\n\ndef test_slow():\n    time.sleep(1000)\n"},
    )
    run = run_pytest(sandbox(), repo, ["tests/test_slow.py::test_slow"], timeout=3)
    assert run.timed_out and run.results == {"tests/test_slow.py::test_slow": "error"}
    assert not run.all_passed()


def test_planted_report_symlink_is_not_followed(tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("<testsuites><testsuite><testcase classname='tests.test_a' name='test_a'/>")
    conftest = f"""
        import atexit, os, sys

        def _plant():
            path = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml="))
            os.remove(path)
            os.symlink({str(secret)!r}, path)

        atexit.register(_plant)
    """
    repo = write_repo(
        tmp_path / "rigged",
        {"conftest.py": conftest, "tests/test_a.py": "def test_a():\n    assert False\n"},
    )
    run = run_pytest(sandbox(), repo, ["tests/test_a.py::test_a"])
    assert run.collection_error and run.results == {"tests/test_a.py::test_a": "error"}
    assert not run.all_passed()


@pytest.mark.parametrize(
    "plant",
    [
        "os.mkfifo(path)",  # opening it for reading would wait for a writer forever
        "os.mkdir(path); open(os.path.join(path, 'x'), 'w').close()",  # unlink would raise
    ],
)
def test_planted_report_fifo_or_directory_is_a_broken_run(tmp_path, plant):
    conftest = f"""
        import atexit, os, sys

        def _plant():
            path = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml="))
            os.remove(path)
            {plant}

        atexit.register(_plant)
    """
    repo = write_repo(
        tmp_path / "rigged",
        {"conftest.py": conftest, "tests/test_a.py": "def test_a():\n    assert True\n"},
    )
    run = run_pytest(sandbox(), repo, ["tests/test_a.py::test_a"])
    assert run.collection_error and run.results == {"tests/test_a.py::test_a": "error"}
    assert not run.all_passed()
    assert not list(repo.glob(".etude-junit-*"))


def test_src_layout_through_env(tmp_path):
    repo = write_repo(
        tmp_path / "srclayout",
        {
            "src/lib/__init__.py": "VALUE = 3\n",
            "tests/test_lib.py": "from lib import VALUE\n\ndef test_value():\n    assert VALUE == 3\n",
        },
    )
    ids = ["tests/test_lib.py::test_value"]
    assert run_pytest(sandbox(), repo, ids).collection_error  # lib is not importable...
    run = run_pytest(sandbox(), repo, ids, env={"PYTHONPATH": "src"})
    assert run.all_passed()  # ...until the environment says where it lives


def test_bad_test_ids_are_value_errors(repo):
    with pytest.raises(ValueError, match="test id"):
        run_pytest(sandbox(), repo, ["--collect-only"])
    with pytest.raises(ValueError, match="test id"):
        run_pytest(sandbox(), repo, [""])


@pytest.mark.parametrize(
    "node_id, address",
    [
        ("tests/test_x.py::test_y", ("tests.test_x", "test_y")),
        ("tests/a/test_x.py::TestC::test_y[1-a::b]", ("tests.a.test_x.TestC", "test_y[1-a::b]")),
        ("test_top.py::test_z[x/y.z]", ("test_top", "test_z[x/y.z]")),
    ],
)
def test_junit_address_round_trip(tmp_path, node_id, address):
    assert junit_address(node_id) == address
    path = tmp_path / node_id.split("::")[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    assert node_id_from_junit(*address, tmp_path) == node_id
