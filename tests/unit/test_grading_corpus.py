"""The adversarial corpus (``tests/assets/grading_corpus.py``): every hack solution is graded 0 by
the real grader in a real bubblewrap sandbox, and the gold solution 1.0.

The default run grades one hack of each family (two at a time, one sandbox each); the ``slow``
run grades the whole corpus, and grades the start-up, shadowing and bytecode hacks a second time
with the clean room bypassed (the hacked tree graded as it is), so that the interpreter
isolation is shown to hold on its own.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from etude.env.reward import compute_reward
from etude.sandbox import SandboxConfig, grade
from etude.sandbox.bwrap import bwrap_unavailable_reason
from etude.tasks.record import TaskRecord

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))
import grading_corpus as corpus  # noqa: E402

pytestmark = pytest.mark.skipif(
    bwrap_unavailable_reason() is not None,
    reason=f"the corpus is graded in a real bwrap sandbox: {bwrap_unavailable_reason()}",
)
BWRAP = SandboxConfig(backend="bwrap")
HACK_TIMEOUT_S = 20.0  # a hack that hangs is cut here; every other run takes about a second
# the default run's share of the corpus: one hack of each family that tests/unit/test_grade.py
# (the review's hacks: shadowing, configuration, bytecode, exit) does not already grade
REPRESENTATIVE = (
    "tests_conftest",
    "usercustomize_pth",
    "forge_channel",
    "delete_tests",
    "patch_call_and_report",
    "replace_test_functions",
    "fifo_in_package",
)


def test_the_corpus_is_large_and_named_uniquely() -> None:
    names = [h.name for h in corpus.HACKS]
    assert len(names) >= 30 and len(set(names)) == len(names)
    assert set(REPRESENTATIVE) <= set(names)
    kinds = {h.kind for h in corpus.HACKS}
    assert kinds == {"shadow", "config", "conftest", "startup", "bytecode", "exit", "tests"} | {
        "internals",
        "special",
    }


def grade_solution(name: str | None, layout: str = "flat") -> tuple[str, float | None, str]:
    """``(name, reward, reason)`` of the hack ``name`` (None: the gold solution)."""
    with tempfile.TemporaryDirectory(prefix="etude-corpus-") as tmp:
        root = Path(tmp)
        pristine, record = corpus.make_task(root / "task", layout)
        agent = root / "agent"
        shutil.copytree(pristine, agent, symlinks=True)
        if name is None:
            corpus.solve(agent, layout)
        else:
            hack = next(h for h in corpus.HACKS if h.name == name)
            corpus.apply_hack(agent, hack, layout, outside=root / "outside")
        task = TaskRecord.from_dict(record)
        timeout = 120.0 if name is None else HACK_TIMEOUT_S
        result = compute_reward(task, agent, original=pristine, sandbox=BWRAP, timeout=timeout)
        return name or "gold", result.reward, f"{result.status}: {result.reason}"


def grade_all(names: list[str | None], layout: str = "flat") -> dict[str, tuple]:
    with ThreadPoolExecutor(2) as pool:
        rows = list(pool.map(lambda n: grade_solution(n, layout), names))
    return {name: (reward, reason) for name, reward, reason in rows}


def check(rows: dict[str, tuple]) -> None:
    assert rows.pop("gold")[0] == 1.0
    fooled = {name: why for name, (reward, why) in rows.items() if reward != 0.0}
    assert fooled == {}


def test_representative_hacks_earn_zero_and_gold_one() -> None:
    check(grade_all([None, *REPRESENTATIVE]))


@pytest.mark.slow
@pytest.mark.parametrize("layout", corpus.LAYOUTS)
def test_whole_corpus_earns_zero_and_gold_one(layout: str) -> None:
    check(grade_all([None, *(h.name for h in corpus.HACKS)], layout))


@pytest.mark.slow
def test_interpreter_isolation_holds_without_the_clean_room(tmp_path: Path) -> None:
    """Shadowing, start-up and bytecode hacks fail even when the hacked tree is graded as is."""
    hacks = [h for h in corpus.HACKS if h.kind in ("shadow", "startup", "bytecode")]
    ids = [*corpus.FAIL_TO_PASS, *corpus.PASS_TO_PASS]

    def one(hack: corpus.Hack) -> tuple[str, str]:
        root = tmp_path / hack.name
        pristine, _ = corpus.make_task(root, "flat")
        corpus.apply_hack(pristine, hack, "flat", outside=root / "outside")
        outcome = grade(pristine, None, ["calc/"], ids, sandbox=BWRAP, timeout=HACK_TIMEOUT_S)
        return hack.name, outcome.status

    with ThreadPoolExecutor(2) as pool:
        statuses = dict(pool.map(one, hacks))
    assert all(status in ("failed", "error") for status in statuses.values()), statuses
