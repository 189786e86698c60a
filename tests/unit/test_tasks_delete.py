"""LibCST deletion: references (the hand-made textkit tasks), formatting, imports, __all__, stubs."""

import ast
import difflib
import subprocess
from pathlib import Path

import pytest

from etude.tasks.delete import (
    DeletionError,
    Removal,
    apply_removal,
    read_source,
    remove_definitions,
    write_source,
)
from etude.tasks.mine import detect_layout
from etude.tasks.patches import (
    apply_patch,
    patch_added_text,
    patch_paths,
    stub_definitions,
    unified_patch,
)
from etude.tasks.record import load_tasks

ROOT = Path(__file__).resolve().parents[2]
TEXTKIT = ROOT / "examples" / "repos" / "textkit"
HANDWRITTEN = ROOT / "examples" / "tasks" / "handwritten"


def _textkit_sources():
    layout = detect_layout(TEXTKIT)
    return layout, {p: (TEXTKIT / p).read_text() for p in layout.modules.values()}


def _gold(edit):
    return unified_patch({p: edit.changed.get(p) for p in edit.original}, edit.original)


@pytest.mark.parametrize(
    "instance_id, removal",
    [
        (
            "textkit__case.slugify",
            Removal(
                definitions=(("textkit/case.py", ("slugify", "_fold_accents", "_TRANSLITERATION")),)
            ),
        ),
        (
            "textkit__containers.RingBuffer",
            Removal(definitions=(("textkit/containers.py", ("RingBuffer",)),)),
        ),
        ("textkit__roman", Removal(files=("textkit/roman.py",))),
    ],
)
def test_gold_patch_matches_hand_made_task(instance_id, removal):
    layout, sources = _textkit_sources()
    reference = {r.instance_id: r for r in load_tasks(HANDWRITTEN)}[instance_id]
    edit = apply_removal(sources, removal, layout.modules)
    assert _gold(edit) == reference.patch
    assert edit.deleted_lines() == reference.etude.difficulty["deleted_lines"]


def test_deleting_definitions_only_removes_lines():
    """Every surviving line is byte-identical and in order: the diff has only deletions."""
    _, sources = _textkit_sources()
    original = sources["textkit/wrap.py"]
    broken = remove_definitions(original, ["justify", "_pack_lines", "_spread"])
    sm = difflib.SequenceMatcher(
        None, original.splitlines(True), broken.splitlines(True), autojunk=False
    )
    assert {tag for tag, *_ in sm.get_opcodes()} <= {"equal", "delete"}
    tree = ast.parse(broken)
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert names == {"wrap", "truncate"}


SAMPLE = '''"""Sample."""

from __future__ import annotations

import os
import re as regex
from typing import (
    Any,
    Callable,
)
from json import dumps  # re-export: unused before and after

__all__ = [
    "keep",
    "drop",
]
__all__ += ["gone"]
__all__.append("gone")
__all__.extend(["keep", "gone"])
PAIR = ("keep", "drop")


# helper comment travels with the helper
_TABLE = {"a": 1}


def keep(x: int) -> int:
    return x + 1


@staticmethod
def drop(path: Any) -> Callable:
    """Dropped."""
    return os.path.join(path, regex.escape("x"), str(_TABLE))


def gone():
    pass


class Holder:
    """Holds."""

    def method(self):
        return keep(1)
'''


def test_imports_all_and_comments():
    out = remove_definitions(SAMPLE, ["drop", "gone", "_TABLE"])
    assert "import os" not in out and "regex" not in out and "Callable" not in out
    assert "from json import dumps" in out  # was unused before: not ours to remove
    assert "from __future__ import annotations" in out
    assert "helper comment" not in out and "Dropped." not in out
    module = ast.parse(out)
    namespace: dict = {}
    exec(compile(module, "<sample>", "exec"), namespace)
    assert namespace["__all__"] == ["keep", "keep"]
    assert namespace["PAIR"] == ("keep", "drop")  # not __all__: left alone
    assert namespace["keep"](1) == 2
    # the surviving statements keep their exact text
    assert "def keep(x: int) -> int:\n    return x + 1\n" in out
    assert '__all__ = [\n    "keep",\n]\n' in out


def test_one_element_tuple_keeps_its_comma():
    out = remove_definitions(
        '__all__ = ("a", "b")\n\n\ndef a():\n    pass\n\n\ndef b():\n    pass\n', ["b"]
    )
    namespace: dict = {}
    exec(out, namespace)
    assert namespace["__all__"] == ("a",)


def test_method_removal_leaves_pass_in_empty_class():
    src = "class A:\n    def m(self):\n        return 1\n\n\nclass B:\n    x = 1\n\n    def m(self):\n        return 2\n\n    def n(self):\n        return 3\n"
    out = remove_definitions(src, ["A.m", "B.m"])
    namespace: dict = {}
    exec(out, namespace)
    assert not hasattr(namespace["A"], "m") and namespace["B"]().n() == 3
    assert "class A:\n    pass\n" in out


def test_missing_definition_is_an_error():
    with pytest.raises(DeletionError, match="not found"):
        remove_definitions("def a():\n    pass\n", ["b"])


def test_other_modules_lose_their_imports_and_stubs_follow():
    files = {
        "pkg/__init__.py": 'from pkg.core import area, volume\nfrom . import extra\n\n__all__ = ["area", "volume", "extra"]\n',
        "pkg/core.py": "def area(r):\n    return r * r\n\n\ndef volume(r):\n    return r ** 3\n",
        "pkg/core.pyi": "def area(r: float) -> float: ...\ndef volume(r: float) -> float: ...\n",
        "pkg/extra.py": "X = 1\n",
        "pkg/user.py": "from .core import area as _area\n\n\ndef double(r):\n    return 2 * _area(r)\n",
    }
    modules = {
        "pkg": "pkg/__init__.py",
        "pkg.core": "pkg/core.py",
        "pkg.extra": "pkg/extra.py",
        "pkg.user": "pkg/user.py",
    }
    edit = apply_removal(
        files,
        Removal(definitions=(("pkg/core.py", ("volume",)),), files=("pkg/extra.py",)),
        modules,
    )
    assert edit.changed["pkg/__init__.py"] == 'from pkg.core import area\n\n__all__ = ["area"]\n'
    assert edit.changed["pkg/core.pyi"] == "def area(r: float) -> float: ...\n"
    assert edit.removed == ("pkg/extra.py",)
    assert "pkg/user.py" not in edit.changed
    with pytest.raises(DeletionError, match="still uses"):
        apply_removal(files, Removal(definitions=(("pkg/core.py", ("area",)),)), modules)
    starred = {**files, "pkg/__init__.py": "from .core import *\nfrom .extra import *\n"}
    edit = apply_removal(starred, Removal(definitions=(("pkg/core.py", ("volume",)),)), modules)
    assert "pkg/__init__.py" not in edit.changed  # core's __all__-less names just shrink
    with pytest.raises(DeletionError, match="star import of .extra"):
        apply_removal(starred, Removal(files=("pkg/extra.py",)), modules)
    # importing pkg.extra bound ``extra`` in pkg: an __init__ that deletes it needs the import
    tidy = {**files, "pkg/__init__.py": "from .extra import X\n\ndel extra\n"}
    with pytest.raises(DeletionError, match="still uses"):
        apply_removal(tidy, Removal(files=("pkg/extra.py",)), modules)


def test_stubs_replace_bodies_but_keep_docstrings():
    src = 'def f(x):\n    """Doc."""\n    return x\n\n\nclass C:\n    def a(self):\n        return 1\n\n    def b(self): return 2\n\n\ndef g():\n    return 3\n'
    raising = stub_definitions(src, ["f", "C"], "raise")
    ns: dict = {}
    exec(raising, ns)
    assert ns["f"].__doc__ == "Doc." and ns["g"]() == 3
    for call in (lambda: ns["f"](1), lambda: ns["C"]().a(), lambda: ns["C"]().b()):
        with pytest.raises(NotImplementedError):
            call()
    passing = stub_definitions(src, None, "pass")
    ns = {}
    exec(passing, ns)
    assert ns["f"](1) is None and ns["g"]() is None and ns["C"]().b() is None


def test_unified_patch_applies_with_git(tmp_path):
    before = {"a.py": "x = 1\ny = 2\n", "gone.py": None, "tail.py": "no newline"}
    after = {
        "a.py": "x = 1\n",
        "gone.py": "def back():\n    pass\n",
        "tail.py": "no newline\nnow two",
    }
    patch = unified_patch(before, after)
    for path, text in before.items():
        if text is not None:
            (tmp_path / path).write_text(text)
    apply_patch(tmp_path, patch)
    for path, text in after.items():
        assert (tmp_path / path).read_text() == text
    assert sorted(patch_paths(patch)) == ["a.py", "gone.py", "tail.py"]
    assert "def back():" in patch_added_text(patch)
    # the same diff through plain `git apply --check` on a fresh copy
    for path, text in before.items():
        if text is not None:
            (tmp_path / path).write_text(text)
    (tmp_path / "gone.py").unlink()
    (tmp_path / "p.diff").write_text(patch)
    subprocess.run(["git", "apply", "--check", "p.diff"], cwd=tmp_path, check=True)


def test_apply_patch_reports_conflicts(tmp_path):
    (tmp_path / "a.py").write_text("different\n")
    with pytest.raises(ValueError, match="does not apply"):
        apply_patch(tmp_path, unified_patch({"a.py": "x\n"}, {"a.py": "y\n"}))


def test_crlf_sources_round_trip_byte_for_byte(tmp_path):
    original = "import os\r\n\r\n\r\ndef keep():\r\n    return 1\r\n\r\n\r\ndef drop():\r\n    return os.sep\r\n"
    broken = remove_definitions(original, ["drop"])
    assert broken == "\r\n\r\ndef keep():\r\n    return 1\r\n"  # os was used by drop alone
    assert "\n" not in broken.replace("\r\n", "")
    path = tmp_path / "mod.py"
    write_source(path, broken)
    assert read_source(path) == broken
    apply_patch(tmp_path, unified_patch({"mod.py": broken}, {"mod.py": original}))
    assert path.read_bytes() == original.encode()
