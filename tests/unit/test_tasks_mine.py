"""Mining: layout detection, the ast index, the per-test coverage map, and feature proposals.

``write_mini_repo`` (also used by the other task-factory tests) writes a small package whose
suite runs in a fraction of a second, with one of each kind of feature and of each reason to skip.
"""

import os
import textwrap
from pathlib import Path

import pytest

from etude.sandbox import make_sandbox
from etude.tasks.mine import (
    Baseline,
    Miner,
    detect_layout,
    index_module,
    index_package,
    index_test_imports,
    is_test_path,
    run_baseline,
)
from etude.tasks.proposal import ProposalConfig

MINI_FILES = {
    "pyproject.toml": '[project]\nname = "minipkg"\nversion = "0.3.0"\n',
    "minipkg/__init__.py": '"""A small package."""\n\nfrom minipkg.shapes import area\n\n__all__ = ["area"]\n',
    "minipkg/shapes.py": '''\
        """Shapes: circles and boxes."""

        import math

        _UNIT = 1.0


        def area(radius):
            """Area of a circle of ``radius``."""
            return math.pi * _square(radius) * _UNIT


        def _square(x):
            return x * x


        def perimeter(radius):
            """Perimeter of a circle of ``radius``; ``ValueError`` when negative."""
            if radius < 0:
                raise ValueError("radius must be non-negative")
            return 2 * math.pi * radius


        def scale(value, factor=2):
            """Multiply ``value`` by ``factor``; used by ``Box``."""
            return value * factor


        DEFAULT_SIDE = scale(1)


        class Box:
            """A box of width ``w`` and height ``h``."""

            def __init__(self, w, h):
                self.w = w
                self.h = h

            def volume(self, depth):
                """Volume of the box extruded by ``depth``."""
                return self.w * self.h * depth

            def describe(self):
                """A short description such as ``box 2x3``."""
                return f"box {self.w}x{self.h}"
        ''',
    "minipkg/words.py": '''\
        """Word helpers."""


        def shout(text):
            """Upper-case ``text`` and add an exclamation mark."""
            return text.upper() + "!"


        def whisper(text):
            """Lower-case ``text`` and trail off."""
            return text.lower() + "..."
        ''',
    "tests/test_shapes.py": """\
        import math

        import pytest

        from minipkg import shapes


        def test_area():
            assert shapes.area(2) == pytest.approx(4 * math.pi)


        @pytest.mark.parametrize("r", [0, 1, 3])
        def test_perimeter(r):
            assert shapes.perimeter(r) == pytest.approx(2 * math.pi * r)


        def test_perimeter_rejects_negative():
            with pytest.raises(ValueError):
                shapes.perimeter(-1)


        def test_box_volume():
            assert shapes.Box(2, 3).volume(4) == 24


        def test_box_describe():
            assert shapes.Box(2, 3).describe() == "box 2x3"


        def test_default_side():
            assert shapes.DEFAULT_SIDE == 2
        """,
    "tests/test_words.py": """\
        from minipkg import words


        def test_shout():
            assert words.shout("hi") == "HI!"


        def test_whisper():
            assert words.whisper("HI") == "hi..."
        """,
}


def write_mini_repo(root: Path, extra: dict[str, str] | None = None) -> Path:
    """Write the mini repository (plus ``extra`` files) under ``root``; returns ``root``."""
    for rel, text in {**MINI_FILES, **(extra or {})}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_is_test_path():
    assert is_test_path("tests/test_x.py") and is_test_path("pkg/tests/helpers.py")
    assert is_test_path("conftest.py") and is_test_path("pkg/x_test.py")
    assert not is_test_path("pkg/testing.py") and not is_test_path("pkg/core.py")


def test_detect_layout_flat_src_and_single_module(tmp_path):
    flat = write_mini_repo(tmp_path / "flat")
    layout = detect_layout(flat)
    assert layout.name == "minipkg" and layout.version == "0.3.0" and layout.source_root == ""
    assert layout.modules == {
        "minipkg": "minipkg/__init__.py",
        "minipkg.shapes": "minipkg/shapes.py",
        "minipkg.words": "minipkg/words.py",
    }
    assert layout.test_files == ("tests/test_shapes.py", "tests/test_words.py")
    assert layout.test_env == {}

    src = tmp_path / "srclayout"
    (src / "src" / "lib" / "tests").mkdir(parents=True)
    (src / "src" / "lib" / "__init__.py").write_text("")
    (src / "src" / "lib" / "core.py").write_text("X = 1\n")
    (src / "src" / "lib" / "core.pyi").write_text("X: int\n")
    (src / "src" / "lib" / "tests" / "__init__.py").write_text("")
    (src / "src" / "lib" / "tests" / "test_core.py").write_text("")
    layout = detect_layout(src)
    assert layout.source_root == "src" and layout.packages == ("lib",)
    assert set(layout.modules) == {"lib", "lib.core"} and layout.stubs == ("src/lib/core.pyi",)
    assert layout.test_env == {"PYTHONPATH": "src"}

    single = tmp_path / "single"
    single.mkdir()
    (single / "parse.py").write_text("def parse(s):\n    return s\n")
    (single / "setup.py").write_text("")
    (single / "test_parse.py").write_text("")
    assert detect_layout(single).modules == {"parse": "parse.py"}
    with pytest.raises(ValueError, match="packages"):
        detect_layout(single, packages=["nothere"])


def test_index_separates_import_time_from_runtime_references():
    source = textwrap.dedent(MINI_FILES["minipkg/shapes.py"])
    index = index_module("minipkg.shapes", "minipkg/shapes.py", source, is_package=False)
    area = index.units["area"]
    assert {"math", "_square", "_UNIT"} <= area.runtime_refs and not area.import_refs
    assert "scale" in index.units["DEFAULT_SIDE"].import_refs  # runs at import time
    assert index.units["Box.volume"].kind == "method"
    assert index.units["Box"].start < index.units["Box.volume"].start <= index.units["Box"].end
    assert index.units["area"].body == (index.units["area"].start + 2,) * 2


def _miner(root: Path, line_tests: dict, passing: list[str]) -> Miner:
    layout = detect_layout(root)
    baseline = Baseline(
        passing=tuple(passing),
        failing=(),
        flaky=(),
        canonical={},
        line_tests=line_tests,
        importable=tuple(layout.modules),
    )
    return Miner(layout, index_package(root, layout), baseline, index_test_imports(root, layout))


ATTR_TEST = """\
from minipkg import words


class TestWords:
    WHISPER = staticmethod(words.whisper)

    def test_unrelated(self):
        assert 1
"""


def test_proposals_from_a_hand_made_coverage_map(tmp_path):
    root = write_mini_repo(
        tmp_path,
        {
            "tests/test_direct.py": "from minipkg.words import shout\n\n\ndef test_direct():\n    assert shout('a') == 'A!'\n\n\ndef test_other():\n    assert 1\n",
            "tests/test_attr.py": ATTR_TEST,
        },
    )
    shapes = textwrap.dedent(MINI_FILES["minipkg/shapes.py"]).splitlines()
    line = {text.strip(): i + 1 for i, text in enumerate(shapes)}
    words = textwrap.dedent(MINI_FILES["minipkg/words.py"]).splitlines()
    wline = {text.strip(): i + 1 for i, text in enumerate(words)}
    line_tests = {
        "minipkg/shapes.py": {
            line["return math.pi * _square(radius) * _UNIT"]: frozenset({"t::area"}),
            line["return x * x"]: frozenset({"t::area"}),
            line["if radius < 0:"]: frozenset({"t::perimeter"}),
            line["return value * factor"]: frozenset({"t::side"}),
            line["return self.w * self.h * depth"]: frozenset({"t::volume"}),
        },
        "minipkg/words.py": {
            wline['return text.upper() + "!"']: frozenset(
                {"tests/test_direct.py::test_direct", "w::shout"}
            ),
            wline['return text.lower() + "..."']: frozenset({"w::whisper"}),
        },
    }
    passing = [
        "t::area",
        "t::perimeter",
        "t::side",
        "t::volume",
        "w::shout",
        "w::whisper",
        "tests/test_direct.py::test_direct",
        "tests/test_direct.py::test_other",
        "tests/test_attr.py::TestWords::test_unrelated",
    ]
    miner = _miner(root, line_tests, passing)
    proposals = miner.propose(ProposalConfig(min_lines=2, max_test_fraction=0.9))
    by_name = {f.name: f for f in proposals.features}
    area = by_name["shapes.area"]
    # grown with the helpers only it uses; the re-export in __init__ is removable
    assert area.symbols == ("minipkg.shapes.area", "minipkg.shapes._UNIT", "minipkg.shapes._square")
    assert area.tests == {"t::area"}
    assert by_name["shapes.Box.volume"].tests == {"t::volume"}
    assert by_name["shapes.perimeter"].kind == "function"
    rejected = proposals.rejected
    assert rejected["minipkg.shapes.scale"] == "needed at import time by DEFAULT_SIDE"
    assert rejected["minipkg.shapes.Box.describe"] == "no passing test executes it"
    assert rejected["minipkg.words.shout"].startswith("needed to collect tests/test_direct.py")
    # used in a class body of a test file that also tests other things: needed at collection
    assert (
        rejected["minipkg.words.whisper"]
        == "needed to collect tests/test_attr.py, which also tests other code"
    )
    assert "words" in by_name and by_name["words"].files == ("minipkg/words.py",)
    # module features include the tests of files that import the module at the top
    assert {
        "w::shout",
        "w::whisper",
        "tests/test_direct.py::test_direct",
        "tests/test_direct.py::test_other",
        "tests/test_attr.py::TestWords::test_unrelated",
    } == set(by_name["words"].tests)
    small = miner.propose(ProposalConfig(min_lines=2, max_lines=3))
    assert "lines, outside the budget" in small.rejected["minipkg.shapes.Box"]


@pytest.fixture(scope="module")
def sandbox():
    return make_sandbox()


def test_baseline_maps_lines_to_tests_and_finds_flaky_ones(tmp_path, sandbox):
    flaky = """\
        import os


        def test_alternates():
            # passes on every other run: a counter file in the workspace keeps the state
            path = "counter.txt"
            n = int(open(path).read()) if os.path.exists(path) else 0
            open(path, "w").write(str(n + 1))
            assert n % 2 == 0
        """
    root = write_mini_repo(tmp_path / "repo", {"tests/test_flaky.py": flaky})
    layout = detect_layout(root)
    baseline = run_baseline(sandbox, root, layout, runs=2, timeout=120)
    assert baseline.flaky == ("tests/test_flaky.py::test_alternates",)
    assert "tests/test_shapes.py::test_perimeter[3]" in baseline.passing
    assert len(baseline.passing) == 10 and not baseline.failing
    shapes = textwrap.dedent(MINI_FILES["minipkg/shapes.py"]).splitlines()
    raise_line = next(i + 1 for i, t in enumerate(shapes) if "raise ValueError" in t)
    assert baseline.line_tests["minipkg/shapes.py"][raise_line] == {
        "tests/test_shapes.py::test_perimeter_rejects_negative"
    }
    volume_line = next(i + 1 for i, t in enumerate(shapes) if "self.w * self.h * depth" in t)
    assert baseline.line_tests["minipkg/shapes.py"][volume_line] == {
        "tests/test_shapes.py::test_box_volume"
    }
    assert set(baseline.importable) == set(layout.modules)
    # the coverage plugin and data are gone; only the flaky test's own counter file is new
    assert sorted(os.listdir(root)) == ["counter.txt", "minipkg", "pyproject.toml", "tests"]
    assert os.listdir(tmp_path) == ["repo"]  # the coverage run's copy is gone too
