"""Baselines that do not run say why, in one line with the fix; test requirements install."""

from __future__ import annotations

import base64
import hashlib
import textwrap
import zipfile

import pytest
from test_tasks_mine import MINI_FILES, write_mini_repo

from etude.tasks.build import TaskBuildConfig, TaskFactory
from etude.tasks.diagnose import diagnose, missing_modules, plugin_for, usage_error
from etude.tasks.proposal import ProposalConfig
from etude.tasks.testdeps import DEPS_DIR, declared_requirements, to_install

SUMMARY = """\
ERROR tests/test_time.py - ModuleNotFoundError: No module named 'freezegun'
FAILED tests/test_x.py::test_a - ModuleNotFoundError: No module named 'yaml.loader'
FAILED tests/test_x.py::test_b - assert 1 == 2
ERROR tests/test_y.py - SyntaxError: invalid syntax
"""


def test_missing_modules_and_their_distributions_are_named():
    missing = missing_modules(SUMMARY, own=["minipkg"])
    assert missing == {"freezegun": {"tests/test_time.py"}, "yaml": {"tests/test_x.py"}}
    (dep, collection) = diagnose(SUMMARY, exit_code=1, own_packages=["minipkg"], failing=3)
    assert dep.kind == "missing module" and dep.modules == ("freezegun", "yaml")
    assert "tasks.install_test_deps = true" in dep.line
    assert "pip install PyYAML freezegun" in dep.line and "\n" not in dep.line
    assert collection.kind == "collection error" and "tests/test_y.py" in collection.line


def test_a_module_of_the_package_itself_is_no_dependency():
    text = "ERROR tests/t.py - ModuleNotFoundError: No module named 'minipkg.gone'\n"
    assert missing_modules(text, own=["minipkg"]) == {}


def test_usage_error_keeps_pytests_own_line_and_names_the_plugin():
    output = (
        "ERROR: usage: __main__.py [options] [file_or_dir] [file_or_dir] [...]\n"
        "__main__.py: error: unrecognized arguments: --cov=minipkg --cov-report=term\n"
        "  inifile: /w/pyproject.toml\n  rootdir: /w\n"
    )
    assert usage_error(output) == "unrecognized arguments: --cov=minipkg --cov-report=term"
    assert plugin_for("unrecognized arguments: -n 4") == "pytest-xdist"
    (d,) = diagnose(output, exit_code=4)
    assert d.kind == "pytest usage error"
    assert d.line.startswith("pytest said: unrecognized arguments: --cov=minipkg")
    assert '["-o", "addopts="]' in d.line and "pytest-cov" in d.line


def _factory_error(tmp_path, extra, **cfg):
    repo = write_mini_repo(tmp_path / "repo", extra)
    config = TaskBuildConfig(workers=1, **cfg)
    with pytest.raises(ValueError) as info:
        with TaskFactory(repo, tmp_path / "out", config):
            pass
    return str(info.value)


def test_baseline_with_a_plugin_dependent_addopts_gets_a_diagnosis(tmp_path):
    pyproject = (
        MINI_FILES["pyproject.toml"] + '\n[tool.pytest.ini_options]\naddopts = "--cov=minipkg"\n'
    )
    message = _factory_error(tmp_path, {"pyproject.toml": pyproject})
    assert "no test of minipkg passes" in message
    assert "pytest said: unrecognized arguments: --cov=minipkg" in message
    assert "-o" in message and "addopts=" in message and "pytest-cov" in message
    assert "rootdir" not in message


def test_baseline_with_a_missing_test_dependency_gets_a_diagnosis(tmp_path):
    importing = "import etude_missing_dep_xyz\n\n" + textwrap.dedent(
        MINI_FILES["tests/test_shapes.py"]
    )
    words = "import etude_missing_dep_xyz\n\n" + textwrap.dedent(MINI_FILES["tests/test_words.py"])
    extra = {"tests/test_shapes.py": importing, "tests/test_words.py": words}
    message = _factory_error(tmp_path, extra)
    assert "tests import modules that are not installed: etude_missing_dep_xyz" in message
    assert "tasks.install_test_deps = true" in message


def _wheel(directory, name="etude_fakedep", version="1.0"):
    """A minimal pure-Python wheel, written by hand (pip installs it offline)."""
    files = {
        f"{name}.py": b"def double(x):\n    return 2 * x\n",
        f"{name}-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
        ),
        f"{name}-{version}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    files[f"{name}-{version}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
    return path


def test_install_test_deps_puts_them_in_every_workspace_and_the_record(tmp_path):
    wheel = _wheel(tmp_path)
    test = "from etude_fakedep import double\n\n\ndef test_double():\n    assert double(2) == 4\n"
    words = "import etude_fakedep\n\n" + textwrap.dedent(MINI_FILES["tests/test_words.py"])
    repo_extra = {"tests/test_dep.py": test, "tests/test_words.py": words}
    repo = write_mini_repo(tmp_path / "repo", repo_extra)
    cfg = TaskBuildConfig(
        workers=1,
        min_difficulty=0.0,
        install_test_deps=True,
        test_requirements=(str(wheel),),
        proposals=ProposalConfig(include=("minipkg.words.shout",), feature_groups=False),
    )
    with TaskFactory(repo, tmp_path / "out", cfg) as factory:
        records, report = factory.build()
    assert report.test_requirements == [str(wheel)] and len(records) == 1, report.rejected
    (record,) = records
    assert record.environment["test_requirements"] == [str(wheel)]
    assert record.environment["deps_dir"] == DEPS_DIR
    assert record.environment["test_env"]["PYTHONPATH"] == DEPS_DIR
    assert f"--ignore={DEPS_DIR}" in record.environment["pytest_args"]
    workspace = tmp_path / "out" / record.workspace
    assert (workspace / DEPS_DIR / "etude_fakedep.py").is_file()
    assert list((workspace / DEPS_DIR).glob("*.dist-info"))  # metadata kept for third parties


def test_declared_requirements_are_read_and_filtered(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["attrs>=20"]\n'
        '[project.optional-dependencies]\ntests = ["freezegun", "pytest", "tox", '
        "\"tomli; python_version < '3.0'\"]\n"
    )
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "tests.in").write_text("pretend  # comment\n-r other.txt\n")
    (tmp_path / "requirements" / "tests.txt").write_text("pretend==1.0 --hash=sha256:x\n")
    found = declared_requirements(tmp_path)
    assert found == ["attrs>=20", "freezegun", "pytest", "tox", "pretend"]
    assert "pytest" not in to_install(found) and "tox" not in to_install(found)
