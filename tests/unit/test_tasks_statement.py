"""Problem statements: the interface without the body, at three detail levels."""

from pathlib import Path

import pytest

from etude.tasks.delete import Removal, apply_removal
from etude.tasks.leaks import normalize_text
from etude.tasks.mine import detect_layout
from etude.tasks.patches import patch_added_text, unified_patch
from etude.tasks.proposal import Feature
from etude.tasks.statement import describe_symbol, group_tests, outline_symbol, problem_statement

TEXTKIT = Path(__file__).resolve().parents[2] / "examples" / "repos" / "textkit"


@pytest.fixture(scope="module")
def textkit():
    layout = detect_layout(TEXTKIT)
    return layout, {p: (TEXTKIT / p).read_text() for p in layout.modules.values()}


def _feature(kind, interface, definitions=(), files=()):
    return Feature(
        kind=kind,
        name="x",
        symbols=tuple(interface),
        interface=tuple(interface),
        definitions=tuple(definitions),
        files=tuple(files),
        tests=frozenset(),
        deleted_lines=1,
    )


def _body_lines(sources, layout, definitions=(), files=()):
    """Normalized deleted lines that are neither signature nor docstring text."""
    edit = apply_removal(
        sources, Removal(definitions=tuple(definitions), files=tuple(files)), layout.modules
    )
    added = patch_added_text(
        unified_patch({p: edit.changed.get(p) for p in edit.original}, edit.original)
    )
    lines = [normalize_text(line) for line in added.splitlines()]
    return [
        line
        for line in lines
        if line.startswith(("return ", "if ", "for ", "while ")) and len(line) > 12
    ]


F2P = [
    "tests/test_case.py::TestSlugify::test_basic",
    "tests/test_case.py::TestSlugify::test_folds_accents[a]",
    "tests/test_case.py::TestSlugify::test_folds_accents[b]",
]


def test_full_statement_shows_interface_not_body(textkit):
    layout, sources = textkit
    definitions = [("textkit/case.py", ("slugify", "_fold_accents", "_TRANSLITERATION"))]
    feature = _feature("function", ["textkit.case.slugify"], definitions)
    text = problem_statement(feature, sources, layout, F2P, "full")
    assert (
        'def slugify(text: str, separator: str = "-", max_length: int | None = None) -> str:'
        in text
    )
    assert "Make a lower-case ASCII slug" in text and "textkit/case.py" in text
    assert "- tests/test_case.py::TestSlugify::test_folds_accents (2 cases)" in text
    assert "_fold_accents" not in text and "_TRANSLITERATION" not in text
    body = _body_lines(sources, layout, definitions)
    assert body and not any(line in normalize_text(text) for line in body)


def test_detail_levels_say_less_and_less(textkit):
    layout, sources = textkit
    feature = _feature(
        "class", ["textkit.containers.RingBuffer"], [("textkit/containers.py", ("RingBuffer",))]
    )
    full = problem_statement(feature, sources, layout, F2P, "full")
    doc = problem_statement(feature, sources, layout, F2P, "docstring")
    tests = problem_statement(feature, sources, layout, F2P, "tests")
    assert "def append(self, item: Any) -> Any:" in full and "def popleft" in full
    assert "def " not in doc and "A fixed-capacity sequence" in doc and "`popleft`:" in doc
    assert "RingBuffer" not in tests and "containers" not in tests and "`textkit`" in tests
    for text in (full, doc, tests):
        assert "tests/test_case.py::TestSlugify::test_basic" in text
    assert len(tests) < len(doc) < len(full)
    with pytest.raises(ValueError, match="detail level"):
        problem_statement(feature, sources, layout, F2P, "everything")


def test_method_and_module_statements(textkit):
    layout, sources = textkit
    bump = outline_symbol(sources["textkit/semver.py"], "Version.bump")
    assert (
        bump.splitlines()[1] == "class Version:"
        and "    def bump(self, part: str) -> Version:" in bump
    )
    assert "def parse" not in bump and bump.rstrip().endswith("...")
    module = _feature(
        "module",
        ["textkit.roman.to_roman", "textkit.roman.from_roman", "textkit.roman.MAX_ROMAN"],
        files=["textkit/roman.py"],
    )
    text = problem_statement(module, sources, layout, F2P, "full")
    assert "`from textkit import roman` fails" in text and "MAX_ROMAN = 3999" in text
    assert "def to_roman(number: int) -> str:" in text and "_CANONICAL" not in text
    assert not any(
        line in normalize_text(text)
        for line in _body_lines(sources, layout, files=["textkit/roman.py"])
    )
    described = describe_symbol(sources["textkit/roman.py"], "from_roman")
    assert described.startswith("Read a Roman numeral")


def test_group_tests_counts_parameters():
    ids = ["a.py::t[1]", "a.py::t[2]", "a.py::u", "a.py::C::v[x-y]"]
    assert group_tests(ids) == ["a.py::t (2 cases)", "a.py::u", "a.py::C::v"]


def test_module_summary_is_whole_and_run_line_has_the_pytest_arguments(textkit):
    layout, sources = textkit
    sources = dict(sources)
    sources["textkit/roman.py"] = (
        '"""Roman numerals: conversion in both directions, with\nvalidation of the input.\n\n'
        'More text.\n"""\n' + sources["textkit/roman.py"].split('"""', 2)[2]
    )
    module = _feature("module", ["textkit.roman.to_roman"], files=["textkit/roman.py"])
    text = problem_statement(
        module, sources, layout, F2P, "full", pytest_args=["--noconftest", "-o", "addopts="]
    )
    assert "(Roman numerals: conversion in both directions, with validation of the input)" in text
    assert "More text" not in text.split("Interface", 1)[0]
    assert "python -m pytest --noconftest -o addopts=" in text
