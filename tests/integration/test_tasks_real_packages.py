"""The task factory on a real package from PyPI: a vendored copy never ships with its task.

boltons' ``urlutils`` vendors its own ``OrderedMultiDict`` (the same methods as
``dictutils.OrderedMultiDict``). Tasks that delete one of those methods from ``dictutils`` are
solved by copying the method from ``urlutils``, so each must either delete the copy as well or be
rejected with the copy named. Marked ``slow`` (a real build, about a minute on an idle machine).

Nothing is downloaded at test time: the sdist must lie in ``$ETUDE_SDIST_DIR`` (default
``~/.cache/etude/sdists``), as the tarball or unpacked. Fetch it once with
``pip download --no-deps --no-binary :all: boltons==25.0.0 -d ~/.cache/etude/sdists``.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from etude.tasks.build import TaskBuildConfig, build_tasks
from etude.tasks.copies import definitions_of_source, find_copies
from etude.tasks.leaks import tree_files
from etude.tasks.patches import apply_patch
from etude.tasks.proposal import ProposalConfig
from etude.tasks.validate import copy_tree

BOLTONS = "boltons-25.0.0"
VENDORED = ("addlist", "poplast", "todict", "inverted")


def _sdist(name: str, tmp_path: Path) -> Path:
    root = Path(os.environ.get("ETUDE_SDIST_DIR", Path.home() / ".cache" / "etude" / "sdists"))
    if (root / name).is_dir():
        return root / name
    tarball = root / f"{name}.tar.gz"
    if not tarball.is_file():
        pytest.skip(
            f"{name} not found in {root}: pip download --no-deps --no-binary :all: "
            f"{name.replace('-', '==', 1)} -d {root} (or set ETUDE_SDIST_DIR)"
        )
    with tarfile.open(tarball) as archive:
        archive.extractall(tmp_path / "sdist", filter="data")
    return tmp_path / "sdist" / name


@pytest.mark.slow
def test_boltons_vendored_ordered_multidict_goes_with_its_task_or_rejects_it(tmp_path):
    repo = _sdist(BOLTONS, tmp_path)
    cfg = TaskBuildConfig(
        pytest_args=("--noconftest",),
        proposals=ProposalConfig(
            include=("boltons.dictutils.OrderedMultiDict.*",), feature_groups=False
        ),
    )
    out = tmp_path / "out"
    records, report = build_tasks(repo, out, cfg)
    by_feature = {r.etude.extra["feature"]: r for r in records}
    for method in VENDORED:
        name = f"dictutils.OrderedMultiDict.{method}"
        if name in by_feature:
            assert f"boltons.urlutils.OrderedMultiDict.{method}" in by_feature[name].etude.symbols
        else:
            reason = report.rejected[name]
            assert reason.startswith("copy of the deleted code") and "urlutils.py" in reason
    # and no accepted task leaves any copy of what it deleted in its workspace
    for record in records:
        workspace = out / record.workspace
        gold = copy_tree(workspace, tmp_path / f"gold-{record.instance_id}")
        apply_patch(gold, record.patch)
        source = (gold / "boltons" / "dictutils.py").read_text()
        quals = [s.split("dictutils.", 1)[1] for s in record.etude.symbols if ".dictutils." in s]
        deleted = definitions_of_source(source, "boltons/dictutils.py", quals)
        assert find_copies(deleted, tree_files(workspace)) == [], record.instance_id
