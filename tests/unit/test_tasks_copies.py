"""Copies of the deleted code: AST-normalized search, and what the factory does with a copy."""

from __future__ import annotations

import inspect
import shlex
import textwrap

import pytest
from test_tasks_mine import write_mini_repo

from etude.sandbox import SandboxConfig, make_sandbox
from etude.tasks.build import TaskBuildConfig, TaskFactory
from etude.tasks.copies import code_blocks, definitions_of_source, find_copies, normalize
from etude.tasks.copyguard import SandboxCopies
from etude.tasks.proposal import ProposalConfig

ORIGINAL = '''
def merge_counts(pairs, start=0):
    """Sum the counts of each key."""
    totals = {}
    for key, count in pairs:
        if count < 0:
            raise ValueError("negative count for %r" % (key,))
        totals[key] = totals.get(key, start) + count
    return sorted(totals.items())
'''

# the same code with other local names, other formatting, no docstring, annotations added
RENAMED = """
def combine(items: list, base: int = 0) -> list:
    acc = {}
    for k, n in items:
        if n < 0:
            raise ValueError(
                "negative count for %r" % (k,)
            )
        acc[k] = acc.get(k, base) + n
    return sorted(acc.items())
"""

# statements added: a partial copy
EDITED = """
def combine(items, base=0):
    acc = {}
    seen = 0
    for k, n in items:
        if n < 0:
            raise ValueError("negative count for %r" % (k,))
        acc[k] = acc.get(k, base) + n
        seen += 1
    return sorted(acc.items())
"""

DIFFERENT = """
def combine(items, base=0):
    acc = {}
    for k, n in items:
        acc[k] = max(acc.get(k, base), n)
    return list(acc)
"""


def _deleted():
    return definitions_of_source(textwrap.dedent(ORIGINAL), "pkg/core.py")


def test_renamed_and_reformatted_copy_matches_exactly():
    a = definitions_of_source(textwrap.dedent(ORIGINAL), "a.py")[0]
    b = definitions_of_source(RENAMED, "b.py")[0]
    assert a.digest == b.digest and a.nodes >= 30
    copies = find_copies(_deleted(), [("vendor/util.py", RENAMED.encode())])
    assert [(c.path, c.qualname, c.how) for c in copies] == [("vendor/util.py", "combine", "exact")]


def test_partial_copy_matches_by_statements_and_different_code_does_not():
    (copy,) = find_copies(_deleted(), [("x.py", EDITED)])
    assert copy.how.endswith("statements")
    assert find_copies(_deleted(), [("x.py", DIFFERENT)]) == []


def test_copies_in_docs_changelogs_and_doctests_are_found():
    indented = textwrap.indent(textwrap.dedent(RENAMED), "    ")
    markdown = f"# Recipes\n\nCombine counts:\n\n```python\n{RENAMED}```\n"
    rst = f"Changelog\n=========\n\n1.2: the helper is now::\n\n{indented}\nMore text.\n"
    doctest_lines = ["Example:", ""]
    for i, line in enumerate(textwrap.dedent(RENAMED).strip().splitlines()):
        doctest_lines.append(("    >>> " if i == 0 else "    ... ") + line)
    doctest = "\n".join(doctest_lines) + "\n"
    files = [
        ("docs/recipes.md", markdown.encode()),
        ("CHANGELOG.rst", rst.encode()),
        ("README", doctest.encode()),
        ("data.bin", b"\0\1" + RENAMED.encode()),  # binary: not read as code
    ]
    found = {c.path for c in find_copies(_deleted(), files)}
    assert found == {"docs/recipes.md", "CHANGELOG.rst", "README"}
    assert len(list(code_blocks(markdown))) >= 2


def test_small_definitions_are_not_searched():
    getter = "class A:\n    def value(self):\n        return self._value\n"
    deleted = definitions_of_source(getter, "a.py", ["A.value"])
    assert deleted and all(d.nodes < 30 for d in deleted)
    assert find_copies(deleted, [("b.py", getter.replace("A", "B"))]) == []


def test_class_copy_matches_with_other_locals_but_not_with_another_interface():
    cls = (
        "class Bag:\n"
        "    def add(self, item, times=1):\n"
        "        for _ in range(times):\n"
        "            self.items.append(item)\n"
        "        return self\n"
    )
    renamed = (
        cls.replace("Bag", "Sack")
        .replace("(self, item,", "(self, x,")
        .replace("append(item)", "append(x)")
        .replace("times", "n")
    )
    other_api = cls.replace("def add", "def push")
    (bag,) = definitions_of_source(cls, "a.py", ["Bag"])[:1]
    sack = definitions_of_source(renamed, "b.py")[0]
    pushed = definitions_of_source(other_api, "c.py")[0]
    assert bag.qualname == "Bag" and bag.digest == sack.digest
    assert bag.digest != pushed.digest


def test_normalize_ignores_docstrings_and_annotations():
    import ast

    one = ast.parse('def f(a: int) -> int:\n    """Doc."""\n    return a + 1\n').body[0]
    two = ast.parse("def g(b):\n    return b + 1\n").body[0]
    assert normalize(one) == normalize(two)


def test_sandbox_filesystem_copy_of_a_stdlib_function_is_found():
    """The sandbox's interpreter can read the standard library: a deleted function that is a
    copy of ``shlex.quote`` is found there."""
    source = textwrap.dedent(inspect.getsource(shlex.quote))
    deleted = definitions_of_source(source, "pkg/quoting.py")
    sandbox = make_sandbox("auto", SandboxConfig(timeout_s=120))
    search = SandboxCopies(sandbox, min_nodes=20)
    found = search.copies_of(deleted)
    assert any(c.path.endswith("/shlex.py") and c.qualname == "quote" for c in found), found
    assert search.copies_of(deleted) == found and search.runs == 1  # cached by digest


SMALL = '''
def nth_or_last(iterable, n, default=_marker):
    """Return the nth or the last item of *iterable*, or *default* if it is empty."""
    return last(islice(iterable, n + 1), default=default)
'''


def test_small_definition_matches_only_itself_by_name_code_and_docstring():
    """A one-line function is too small to mean anything by its code alone, but the same
    function, name and docstring included, is a vendored copy (more-itertools 10.7.0's
    ``nth_or_last`` in setuptools' ``_vendor`` was accepted as a task before)."""
    (deleted,) = definitions_of_source(SMALL, "more_itertools/more.py")
    assert deleted.nodes < 30 and deleted.doc
    renamed = SMALL.replace("(iterable, n, default=_marker)", "(it, k, d=_marker)")
    renamed = renamed.replace("(iterable, n + 1), default=default", "(it, k + 1), default=d")
    undocumented = SMALL.replace('    """Return', "    # Return").replace('empty."""', "empty.")
    files = [
        ("vendor/more.py", SMALL),
        ("vendor/renamed.py", renamed),
        ("other_name.py", SMALL.replace("def nth_or_last", "def pick")),
        ("other_doc.py", SMALL.replace("Return the nth", "Give the nth")),
        ("no_doc.py", undocumented),
        ("other_code.py", SMALL.replace("n + 1", "n + 2")),
    ]
    found = find_copies([deleted], files, min_nodes=30)
    assert sorted(c.path for c in found) == ["vendor/more.py", "vendor/renamed.py"]
    assert {c.how for c in found} == {"exact, same name and docstring"}
    # without a docstring a small definition is not searched at all
    (bare,) = definitions_of_source(undocumented, "more_itertools/more.py")
    assert not bare.doc and find_copies([bare], files, min_nodes=30) == []


def test_sandbox_filesystem_copy_of_a_small_documented_function_is_found():
    """``shlex.join`` (19 AST nodes, documented) deleted from a package is found in the
    standard library the sandbox's interpreter reads, with the build's ``min_nodes``."""
    source = textwrap.dedent(inspect.getsource(shlex.join))
    (deleted,) = definitions_of_source(source, "pkg/quoting.py")
    assert deleted.nodes < 30
    search = SandboxCopies(make_sandbox("auto", SandboxConfig(timeout_s=120)), min_nodes=30)
    found = search.copies_of([deleted])
    assert [(c.path.rsplit("/", 1)[-1], c.qualname, c.how) for c in found] == [
        ("shlex.py", "join", "exact, same name and docstring")
    ]


VENDORED = {
    "minipkg/counting.py": '''\
        """Counting helpers."""


        def merge_counts(pairs, start=0):
            """Sum the counts of each key."""
            totals = {}
            for key, count in pairs:
                if count < 0:
                    raise ValueError("negative count for %r" % (key,))
                totals[key] = totals.get(key, start) + count
            return sorted(totals.items())
        ''',
    "minipkg/_vendor.py": '''\
        """A vendored copy of an old helper."""


        def combine(items, base=0):
            acc = {}
            for k, n in items:
                if n < 0:
                    raise ValueError("negative count for %r" % (k,))
                acc[k] = acc.get(k, base) + n
            return sorted(acc.items())
        ''',
    "tests/test_counting.py": """\
        import pytest

        from minipkg import counting


        def test_merge():
            assert counting.merge_counts([("a", 1), ("b", 2), ("a", 3)]) == [("a", 4), ("b", 2)]


        def test_negative():
            with pytest.raises(ValueError):
                counting.merge_counts([("a", -1)])
        """,
    "tests/test_vendor.py": """\
        from minipkg import _vendor


        def test_combine():
            assert _vendor.combine([("x", 2), ("x", 2)]) == [("x", 4)]
        """,
}


def _build(tmp_path, extra, **kwargs):
    repo = write_mini_repo(tmp_path / "repo", extra)
    cfg = TaskBuildConfig(
        workers=1,
        min_difficulty=0.0,
        proposals=ProposalConfig(
            include=("minipkg.counting.merge_counts",), modules=False, feature_groups=False
        ),
        **kwargs,
    )
    with TaskFactory(repo, tmp_path / "out", cfg) as factory:
        return factory.build()


def test_vendored_copy_in_the_package_is_deleted_with_the_feature(tmp_path):
    records, report = _build(tmp_path, VENDORED)
    assert len(records) == 1, report.rejected
    (record,) = records
    assert set(record.etude.symbols) == {
        "minipkg.counting.merge_counts",
        "minipkg._vendor.combine",
    }
    assert "tests/test_vendor.py::test_combine" in record.FAIL_TO_PASS
    assert "def combine" in record.patch and record.etude.leak_scan["clean"]


def test_vendored_copy_is_rejected_when_it_may_not_go(tmp_path):
    records, report = _build(tmp_path, VENDORED, delete_copies=False)
    assert records == []
    reason = report.rejected["counting.merge_counts"]
    assert reason.startswith("copy of the deleted code:") and "minipkg/_vendor.py" in reason


def test_copy_in_the_docs_rejects_the_task(tmp_path):
    extra = {k: v for k, v in VENDORED.items() if "vendor" not in k}
    extra["docs/howto.md"] = f"Recipe:\n\n```python\n{RENAMED}```\n"
    records, report = _build(tmp_path, extra)
    assert records == []
    assert "docs/howto.md" in report.rejected["counting.merge_counts"]
    assert report.reject_counts == {"copy elsewhere": 1}


@pytest.mark.parametrize("min_nodes", [4])
def test_config_refuses_a_trivial_copy_threshold(min_nodes):
    with pytest.raises(ValueError, match="copy_min_nodes"):
        TaskBuildConfig(copy_min_nodes=min_nodes)
