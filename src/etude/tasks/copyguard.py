"""The factory's answer to a copy of the deleted code: delete it with the feature, or reject.

``etude.tasks.copies`` finds copies (AST-normalized). This module applies it to a feature:

- ``deleted_definitions``: the normalized definitions a feature deletes (from the original
  sources: its definitions and every definition of its deleted files);
- ``workspace_copies``: copies of them in every file of a broken workspace (source, tests, docs,
  stubs, changelogs, vendored code, the installed test dependencies);
- ``SandboxCopies``: copies on the filesystem the sandbox's interpreter can read (its
  ``sys.path`` outside the workspace), found by running the search inside the sandbox, once per
  batch of definitions, with the results cached by definition key (code, name, docstring);
- ``extend_with_copies``: a feature that also deletes the copies that lie in modules of the
  package, when the miner's static checks allow it (nothing else uses them), or the one-line
  reason why the task must be rejected (a copy in a test, a doc, another distribution, or one
  the package needs).

What this module does not do: find copies itself, or validate the extended feature (the factory
builds and validates it like any other).
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from etude.tasks import copies as copies_module
from etude.tasks.copies import Copy, Definition, definition_to_json, definitions_of_source
from etude.tasks.mine import Miner
from etude.tasks.proposal import Feature, ProposalConfig, combine


def deleted_definitions(sources: Mapping[str, str], feature: Feature) -> list[Definition]:
    """Normalized definitions that ``feature`` deletes (searchable or not)."""
    out: list[Definition] = []
    for path, quals in feature.definitions:
        out += definitions_of_source(sources[path], path, quals)
    for path in feature.files:
        if path.endswith(".py"):
            out += definitions_of_source(sources[path], path)
    return out


def workspace_copies(
    deleted: Iterable[Definition], files: Iterable[tuple[str, bytes]], *, min_nodes: int
) -> list[Copy]:
    """Copies of ``deleted`` among ``files`` (``(relative path, bytes)``, ``.git`` excluded)."""
    return copies_module.find_copies(deleted, files, min_nodes=min_nodes)


# The sandbox's filesystem outside the workspace is the interpreter's installation, the same
# for every factory of this process: results are shared by (backend, interpreter, key).
_PROCESS_CACHE: dict[tuple[str, str, str], list[Copy]] = {}
_PROCESS_LOCK = threading.Lock()


class SandboxCopies:
    """Copies on the sandbox-visible filesystem, cached by the deleted definition's key (for
    the life of the process: an interpreter's installation does not change during a build)."""

    def __init__(self, sandbox: Any, *, min_nodes: int, timeout: float = 300.0) -> None:
        self.sandbox = sandbox
        self.min_nodes = min_nodes
        self.timeout = timeout
        self._key = (type(sandbox).__name__, sys.executable)
        self._found = _ProcessView(self._key)
        self._lock = _PROCESS_LOCK
        self.seconds = 0.0
        self.runs = 0

    def prefetch(self, definitions: Iterable[Definition]) -> None:
        """Search for every definition not searched yet, in one sandboxed run."""
        with self._lock:
            todo = {
                d.key: d
                for d in copies_module.searchable(definitions, self.min_nodes)
                if d.key not in self._found
            }
            if not todo:
                return
            script = Path(copies_module.__file__).read_text(encoding="utf-8")
            with tempfile.TemporaryDirectory(prefix="etude-copies-") as empty:
                wanted = {
                    "min_nodes": self.min_nodes,
                    "definitions": [definition_to_json(d) for d in todo.values()],
                }
                (Path(empty) / copies_module.WANTED_FILE).write_text(json.dumps(wanted))
                result = self.sandbox.run(
                    ["python", "-I", "-c", script], empty, timeout=self.timeout
                )
            self.runs += 1
            self.seconds += result.duration
            if result.exit_code != 0 or result.timed_out:
                raise RuntimeError(
                    "the copy search on the sandbox's filesystem failed "
                    f"(exit {result.exit_code}): {result.stderr[-1000:]}"
                )
            found = json.loads(result.stdout.strip().splitlines()[-1])
            by_key = {f"{d.path}:{d.qualname}": d.key for d in todo.values()}
            for key in todo:
                self._found[key] = []
            for item in found:
                key = by_key.get(str(item["deleted"]))
                if key is not None:
                    self._found[key].append(Copy(**item))  # type: ignore[arg-type]

    def copies_of(self, definitions: Iterable[Definition]) -> list[Copy]:
        """Sandbox-filesystem copies of ``definitions`` (searching for new ones first)."""
        definitions = list(definitions)
        self.prefetch(definitions)
        out: list[Copy] = []
        for d in copies_module.searchable(definitions, self.min_nodes):
            out += self._found.get(d.key, [])
        return out


class _ProcessView:
    """The process cache seen through one (backend, interpreter) key, as a dict of digests."""

    def __init__(self, key: tuple[str, str]) -> None:
        self.key = key

    def __contains__(self, digest: str) -> bool:
        return (*self.key, digest) in _PROCESS_CACHE

    def __getitem__(self, digest: str) -> list[Copy]:
        return _PROCESS_CACHE[(*self.key, digest)]

    def __setitem__(self, digest: str, value: list[Copy]) -> None:
        _PROCESS_CACHE[(*self.key, digest)] = value

    def get(self, digest: str, default: list[Copy]) -> list[Copy]:
        return _PROCESS_CACHE.get((*self.key, digest), default)


def _unit_of_copy(miner: Miner, module: str, qualname: str) -> str | None:
    """The miner unit (``f``, ``C`` or ``C.m``) that holds the definition ``qualname``."""
    units = miner.index[module].units
    parts = qualname.split(".")
    if len(parts) > 1 and f"{parts[0]}.{parts[1]}" in units:
        method = f"{parts[0]}.{parts[1]}"
        return method if units[parts[0]].kind == "class" else parts[0]
    return parts[0] if parts[0] in units else None


def extend_with_copies(
    feature: Feature,
    copies: list[Copy],
    miner: Miner,
    cfg: ProposalConfig,
) -> Feature | str:
    """``feature`` plus every copy in a package module, or why the task cannot be made.

    Copies in deleted files do not count. A copy outside the package's modules (a test, a doc,
    an installed distribution) or one the package still needs gives a rejection reason.
    """
    path_to_module = {p: m for m, p in miner.layout.modules.items()}
    wanted: dict[str, list[str]] = {}
    for c in copies:
        if c.path in feature.files:
            continue
        module = path_to_module.get(c.path)
        if module is None or module not in miner.index:
            return f"copy of the deleted code: {c.describe()}"
        unit = _unit_of_copy(miner, module, c.qualname)
        if unit is None:
            return f"copy of the deleted code: {c.describe()} (not a definition the miner knows)"
        deleted = dict(feature.definitions).get(c.path, ())
        if unit in deleted or unit.split(".")[0] in deleted:
            continue
        if unit not in wanted.setdefault(module, []):
            wanted[module].append(unit)
    if not wanted:
        return feature
    parts = [feature]
    for module, units in sorted(wanted.items()):
        extra = miner.custom_feature(module, units, cfg)
        if isinstance(extra, str):
            first = next(c for c in copies if path_to_module.get(c.path) == module)
            return f"copy of the deleted code: {first.describe()}; it cannot go with the feature: {extra}"
        parts.append(extra)
    return combine(parts)
