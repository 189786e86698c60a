"""Feature-sized groups across test files: code that the tests of two files share, and only they
run, makes one feature of both files (it belongs to neither file's own group)."""

from __future__ import annotations

import pytest
from test_tasks_mine import write_mini_repo

from etude.tasks.features import cluster_test_files, feature_groups
from etude.tasks.mine import Baseline, Miner, detect_layout, index_package, index_test_imports
from etude.tasks.proposal import ProposalConfig

TEXTFMT = '''\
"""Parse and render a tiny key=value format."""


def _tokenize(text):
    """Split ``text`` into stripped, non-empty lines."""
    lines = [line.strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def parse(text):
    """``a=1`` lines -> a dict of strings."""
    out = {}
    for line in _tokenize(text):
        key, _, value = line.partition("=")
        out[key.strip()] = value.strip()
    return out


def render(items):
    """A dict -> ``a=1`` lines, in key order; comments in values are dropped."""
    lines = []
    for key in sorted(items):
        lines.append(f"{key}={items[key]}")
    return "\\n".join(_tokenize("\\n".join(lines)))
'''
FILES = {
    "minipkg/textfmt.py": TEXTFMT,
    "tests/test_parse.py": "from minipkg.textfmt import parse\n\n\ndef test_parse():\n"
    "    assert parse('a = 1') == {'a': '1'}\n",
    "tests/test_render.py": "from minipkg.textfmt import render\n\n\ndef test_render():\n"
    "    assert render({'b': 2, 'a': 1}) == 'a=1\\nb=2'\n",
}
PARSE, RENDER = "tests/test_parse.py::test_parse", "tests/test_render.py::test_render"
OTHER = ("tests/test_shapes.py::test_area", "tests/test_words.py::test_shout")


def _miner(root, runs_of):
    """A miner over the mini repository plus ``FILES``, with the coverage map ``runs_of``
    (qualname of ``minipkg.textfmt`` -> the tests that execute its body)."""
    layout = detect_layout(root)
    index = index_package(root, layout)
    units = index["minipkg.textfmt"].units
    lines = {}
    for q, tests in runs_of.items():
        lo, hi = units[q].body
        for n in range(lo, hi + 1):
            lines[n] = frozenset(tests)
    baseline = Baseline(
        passing=(PARSE, RENDER, *OTHER),
        failing=(),
        flaky=(),
        canonical={},
        line_tests={"minipkg/textfmt.py": lines},
        importable=tuple(layout.modules),
    )
    return Miner(layout, index, baseline, index_test_imports(root, layout))


def test_code_two_test_files_share_makes_one_group_of_both(tmp_path):
    root = write_mini_repo(tmp_path, FILES)
    runs_of = {"_tokenize": {PARSE, RENDER}, "parse": {PARSE}, "render": {RENDER}}
    miner = _miner(root, runs_of)
    features, skipped = feature_groups(miner, ProposalConfig(min_lines=2))
    by_name = {f.name: f for f in features}
    # per file, one unit only that file's tests run: a symbol feature at most
    assert skipped["feature tests/test_parse.py"].startswith("1 units")
    assert skipped["feature tests/test_render.py"].startswith("1 units")
    both = by_name["feature.test_parse+test_render"]
    assert set(both.symbols) == {
        "minipkg.textfmt._tokenize",
        "minipkg.textfmt.parse",
        "minipkg.textfmt.render",
    }
    assert both.tests == frozenset({PARSE, RENDER}) and both.kind == "feature"
    # one group per test file only: the shared code is in no feature
    single, _ = feature_groups(miner, ProposalConfig(min_lines=2, feature_max_test_files=1))
    assert not any("textfmt" in s for f in single for s in f.symbols)


def test_clusters_leave_out_code_too_many_files_share():
    def unit(*files):
        return frozenset(f"{f}::t" for f in files)

    unit_tests = {
        ("m", "a"): unit("t1.py", "t2.py"),
        ("m", "b"): unit("t2.py", "t3.py"),
        ("m", "c"): unit("t4.py"),
        ("m", "hub"): unit("t4.py", "t5.py", "t6.py", "t7.py"),  # infrastructure: links nothing
        ("m", "d"): unit("t5.py", "t6.py"),
    }
    assert cluster_test_files(unit_tests, 3) == [("t1.py", "t2.py", "t3.py"), ("t5.py", "t6.py")]
    # a component over the limit is not a feature
    assert cluster_test_files(unit_tests, 2) == [("t5.py", "t6.py")]
    assert cluster_test_files(unit_tests, 1) == []
    with pytest.raises(ValueError, match="feature_max_test_files"):
        ProposalConfig(feature_max_test_files=0)


def test_a_module_without_the_group_s_units_is_derived_once(tmp_path):
    """The groups ask for another module minus what the group deletes there once per candidate
    subset; the LibCST deletion behind it runs once per module and set of names (on
    more-itertools it took tens of minutes per build before)."""
    root = write_mini_repo(tmp_path, FILES)
    miner = _miner(root, {"_tokenize": {PARSE, RENDER}, "parse": {PARSE}, "render": {RENDER}})
    mod = miner.index["minipkg.textfmt"]
    first = miner._without(mod, ["render", "parse"])
    assert "render" not in first.units and "parse" not in first.units and "_tokenize" in first.units
    assert miner._without(mod, ["parse", "render"]) is first
    assert miner._without(mod, ["render"]) is not first
    # a deletion that fails fails again, from the cache
    for _ in range(2):
        with pytest.raises(Exception, match="nonexistent"):
            miner._without(mod, ["nonexistent"])


FROZEN = '''\
"""An immutable dict (tinydb's ``FrozenDict``: its class body binds a method by name)."""


class Frozen(dict):
    def __hash__(self):
        return hash(tuple(sorted(self.items())))

    def _immutable(self, *args, **kws):
        raise TypeError("object is immutable")

    __setitem__ = _immutable
    clear = _immutable

    def update(self, e=None, **f):
        raise TypeError("object is immutable")

    def pop(self, k, d=None):
        raise TypeError("object is immutable")
'''
FROZEN_TEST = "tests/test_frozen.py::test_immutable"


def test_a_method_the_class_body_binds_at_import_time_stays(tmp_path):
    """tinydb 4.8.2: the group of ``test_utils.py`` deleted ``FrozenDict._immutable``, which the
    class body binds (``__setitem__ = _immutable``), so the package no longer imported. The
    miner's own method features were refused for this; the groups' (and the agent's) check was
    not."""
    root = write_mini_repo(tmp_path, {"minipkg/frozen.py": FROZEN})
    layout = detect_layout(root)
    index = index_package(root, layout)
    units = index["minipkg.frozen"].units
    lines = {}
    for q in ("Frozen._immutable", "Frozen.update", "Frozen.pop"):
        lo, hi = units[q].body
        lines.update({n: frozenset({FROZEN_TEST}) for n in range(lo, hi + 1)})
    lo, hi = units["Frozen.__hash__"].body  # other tests hash it: the class is not the group's
    lines.update({n: frozenset({OTHER[0]}) for n in range(lo, hi + 1)})
    baseline = Baseline(
        passing=(FROZEN_TEST, *OTHER),
        failing=(),
        flaky=(),
        canonical={},
        line_tests={"minipkg/frozen.py": lines},
        importable=tuple(layout.modules),
    )
    miner = Miner(layout, index, baseline, index_test_imports(root, layout))
    cfg = ProposalConfig(min_lines=2)
    why = miner.custom_feature("minipkg.frozen", ["Frozen._immutable", "Frozen.update"], cfg)
    assert why == "Frozen._immutable is needed at import time by its class"
    features, _ = feature_groups(miner, cfg)
    (group,) = [f for f in features if f.name == "feature.test_frozen"]
    assert set(group.symbols) == {"minipkg.frozen.Frozen.update", "minipkg.frozen.Frozen.pop"}
    # with the whole class the method goes too
    whole = ProposalConfig(min_lines=2, max_test_fraction=1.0)
    assert not isinstance(miner.custom_feature("minipkg.frozen", ["Frozen"], whole), str)


def test_uses_by_another_module_are_judged_once_per_name_and_set(tmp_path):
    """``user`` imports ``a`` and ``b`` from ``base`` and calls ``a``: deleting ``a`` (alone or
    with others) is refused, ``b`` or ``c`` may go. Each answer is a LibCST pass over ``user``,
    computed once (the groups ask again for every candidate subset)."""
    files = {
        "minipkg/base.py": "def a():\n    return 1\n\n\ndef b():\n    return 2\n\n\n"
        "def c():\n    return 3\n",
        "minipkg/user.py": "from minipkg.base import a, b\n\n\ndef twice():\n    return 2 * a()\n",
    }
    root = write_mini_repo(tmp_path, files)
    layout = detect_layout(root)
    index = index_package(root, layout)
    baseline = Baseline(
        passing=OTHER,
        failing=(),
        flaky=(),
        canonical={},
        line_tests={},
        importable=tuple(layout.modules),
    )
    miner = Miner(layout, index, baseline, index_test_imports(root, layout))
    base = miner.index["minipkg.base"]
    asked = [{"a"}, {"b"}, {"c"}, {"b", "c"}, {"a", "b"}, {"a", "b", "c"}]
    expected = [["minipkg.user"], [], [], [], ["minipkg.user"], ["minipkg.user"]]
    assert [miner._external_users(base, names) for names in asked] == expected
    # one pass per name user imports, none for the set of names it uses one of
    assert sorted(sorted(k[3]) for k in miner._unlink_cache) == [["a"], ["b"]]
    assert [miner._external_users(base, names) for names in asked] == expected
    assert len(miner._unlink_cache) == 2
