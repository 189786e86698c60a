"""Propose deletable features of a mined repository (the miner).

Mining takes three steps: ``layout.detect_layout`` (where the package and its tests are),
``baseline.run_baseline`` (the suite's outcomes and a per-test coverage map) and
``symbols.index_package``/``index_test_imports`` (a static index). ``Miner`` combines them to
answer "what is a feature?": a public function, class or method together with the private
helpers only it uses, or a whole module; its candidate F2P tests are the tests that executed its
body. A symbol is skipped (with the reason) when it is needed at import time, used by code
outside the feature (another definition, another module of the package), needed to collect a
test file that also tests something else (imported by name at its top, or used in a class body
or decorator), defined more than once, exercised by no passing test, or outside the size budget.
The records it answers with (``Feature``, ``ProposalConfig``, ``Proposals``) and ``combine``
(several features deleted together) live in ``proposal``.

The names of the three mining modules stay importable from here.

What this module does not do: define the feature record (``proposal``), delete (``delete``), run
the per-task validation (``validate``), or see dynamic uses (``getattr``, string-based registries,
entry points): the validation's test runs catch what the static analysis misses.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

from etude.tasks.baseline import (  # noqa: F401 (re-exported)
    Baseline,
    canonical_outcomes,
    junit_address,
    probe_imports,
    run_baseline,
)
from etude.tasks.delete import DeletionError, Removal, apply_removal, unlink_imports
from etude.tasks.layout import Layout, detect_layout, is_test_path  # noqa: F401 (re-exported)
from etude.tasks.proposal import Feature, ProposalConfig, Proposals
from etude.tasks.symbols import (  # noqa: F401 (re-exported)
    ImportRef,
    ModuleIndex,
    TestImports,
    Unit,
    index_module,
    index_package,
    index_test_imports,
    tests_in_files,
)


class Miner:
    """Static facts about a package plus its baseline, answering "what is a feature?"."""

    def __init__(
        self,
        layout: Layout,
        index: Mapping[str, ModuleIndex],
        baseline: Baseline,
        test_imports: TestImports,
    ) -> None:
        self.layout = layout
        self.index = dict(index)
        self.baseline = baseline
        self.test_imports = test_imports
        self.passing = frozenset(baseline.passing)
        self._without_cache: dict[tuple[str, tuple[str, ...]], ModuleIndex | Exception] = {}
        self._unlink_cache: dict[tuple[str, str, str, frozenset[str]], bool] = {}

    # -- helpers ---------------------------------------------------------------------------

    def _units_of(self, mod: ModuleIndex, qualnames: Iterable[str]) -> set[str]:
        """Qualnames plus the methods of listed classes."""
        out = set(qualnames)
        for q in list(out):
            if mod.units.get(q) is not None and mod.units[q].kind == "class":
                out |= {u for u in mod.units if u.startswith(q + ".")}
        return out

    def _users(self, mod: ModuleIndex, name: str) -> set[str]:
        """Units (top-level or methods) of ``mod`` whose references include ``name``."""
        return {q for q, u in mod.units.items() if name in u.refs and u.kind != "class"} | {
            q for q, u in mod.units.items() if u.kind == "class" and name in u.import_refs
        }

    def _attr_users(self, mod: ModuleIndex, attr: str) -> set[str]:
        return {q for q, u in mod.units.items() if attr in u.attr_refs and u.kind != "class"}

    def tests_of(self, path: str, mod: ModuleIndex, qualnames: Iterable[str]) -> set[str]:
        """Passing tests that executed the body of one of ``qualnames`` (methods of classes too)."""
        lines = self.baseline.line_tests.get(path, {})
        out: set[str] = set()
        for q in self._units_of(mod, qualnames):
            unit = mod.units[q]
            if unit.body is None:
                continue
            lo, hi = unit.body
            for line in range(lo, hi + 1):
                out |= lines.get(line, frozenset())
        return out & self.passing

    def _without(self, other: ModuleIndex, qualnames: Iterable[str]) -> ModuleIndex:
        """``other`` as it will read once ``qualnames`` (deleted in the same task) are gone.

        Computed once per module and set of names: the feature groups ask again for every
        candidate subset of another module (a LibCST deletion of a 5,000-line module each
        time, tens of minutes per build on more-itertools before this cache).
        """
        key = (other.path, tuple(sorted(set(qualnames))))
        if key not in self._without_cache:
            try:
                edit = apply_removal(
                    {other.path: other.source},
                    Removal(definitions=((other.path, key[1]),), files=()),
                    {other.module: other.path},
                )
                text = edit.changed.get(other.path, other.source)
                self._without_cache[key] = index_module(
                    other.module, other.path, text, is_package=other.path.endswith("__init__.py")
                )
            except (DeletionError, SyntaxError, ValueError) as exc:
                self._without_cache[key] = exc
        found = self._without_cache[key]
        if isinstance(found, Exception):
            raise found
        return found

    def _external_users(
        self,
        mod: ModuleIndex,
        names: set[str],
        also_deleted: Mapping[str, Iterable[str]] | None = None,
    ) -> list[str]:
        """Other package modules that use ``names`` of ``mod`` beyond re-exporting them.

        ``also_deleted``: module -> qualnames deleted in the same task; their uses do not count.
        """
        users = []
        for original in self.index.values():
            if original.module == mod.module:
                continue
            other = original
            if also_deleted and also_deleted.get(original.module):
                try:
                    other = self._without(original, also_deleted[original.module])
                except (DeletionError, SyntaxError, ValueError):
                    users.append(original.module)
                    continue
            imported = frozenset(
                i.name
                for i in other.imports
                if i.module == mod.module and i.name is not None and i.name in names
            )
            imports_names = bool(imported)
            imports_module = any(
                i.module == mod.module
                or (i.name is not None and f"{i.module}.{i.name}" == mod.module)
                for i in other.imports
            )
            if imports_module and not imports_names and names & other.module_attr_refs:
                users.append(other.module)
                continue
            if imports_names and self._still_used(other, mod.module, imported):
                users.append(other.module)
        return users

    def _still_used(self, other: ModuleIndex, module: str, names: frozenset[str]) -> bool:
        """Whether ``other`` still uses one of ``names`` (which it imports from ``module``) once
        their imports are removed. A name still used alone is still used beside others (removing
        more imports takes no use away), so each name is tried alone first and the set only when
        none is; each answer is computed once (LibCST on the whole module: the feature groups
        ask again for every candidate subset, minutes per build on more-itertools otherwise)."""
        if any(self._unlink_fails(other, module, frozenset({n})) for n in sorted(names)):
            return True
        return len(names) > 1 and self._unlink_fails(other, module, names)

    def _unlink_fails(self, other: ModuleIndex, module: str, names: frozenset[str]) -> bool:
        key = (other.path, other.source, module, names)
        if key not in self._unlink_cache:
            try:
                unlink_imports(
                    other.source,
                    importer=other.module,
                    importer_is_package=other.path.endswith("__init__.py"),
                    removed_names={module: set(names)},
                    removed_modules=set(),
                )
                self._unlink_cache[key] = False
            except DeletionError:
                self._unlink_cache[key] = True
        return self._unlink_cache[key]

    def _module_importers(self, module: str) -> list[str]:
        users = []
        last = module.rsplit(".", 1)[-1]
        for other in self.index.values():
            if other.module == module or other.module.startswith(module + "."):
                continue
            if last not in other.source:  # cannot import it without naming it
                continue
            try:
                unlink_imports(
                    other.source,
                    importer=other.module,
                    importer_is_package=other.path.endswith("__init__.py"),
                    removed_names={},
                    removed_modules={module},
                )
            except DeletionError:
                users.append(other.module)
        return users

    def _grow(self, mod: ModuleIndex, feature: set[str]) -> set[str]:
        """Add private helpers (module-level and, for methods, private methods of the class)
        that only the feature uses."""
        changed = True
        while changed:
            changed = False
            units = self._units_of(mod, feature)
            referenced: set[str] = set()
            attrs: set[str] = set()
            for q in units:
                referenced |= mod.units[q].refs
                attrs |= mod.units[q].attr_refs
            for name in sorted(referenced):
                unit = mod.units.get(name)
                if (
                    unit is None
                    or name in feature
                    or not name.startswith("_")
                    or name.startswith("__")
                ):
                    continue
                if mod.bindings.get(name, 0) != 1 and name not in mod.overloads:
                    continue
                if name in mod.module_refs or name in mod.exported:
                    continue
                if not self._users(mod, name) <= units | self._units_of(mod, [name]):
                    continue
                if self._external_users(mod, {name}) or self._imported_elsewhere(mod, name):
                    continue
                feature.add(name)
                changed = True
            classes = {q.split(".")[0] for q in feature if "." in q}
            for cls in classes:
                for q, unit in mod.units.items():
                    if not q.startswith(cls + ".") or q in feature or unit.kind != "method":
                        continue
                    attr = unit.name
                    if not attr.startswith("_") or attr.startswith("__") or attr not in attrs:
                        continue
                    if self._attr_users(mod, attr) - self._units_of(mod, feature) - {q}:
                        continue
                    if any(
                        attr in o.module_attr_refs
                        for o in self.index.values()
                        if o.module != mod.module
                    ):
                        continue
                    feature.add(q)
                    changed = True
        return feature

    def _imported_elsewhere(self, mod: ModuleIndex, name: str) -> bool:
        return any(
            i.module == mod.module and i.name == name
            for other in self.index.values()
            if other.module != mod.module
            for i in other.imports
        )

    def _test_file_conflicts(self, mod: ModuleIndex, names: set[str], tests: set[str]) -> list[str]:
        """Test files that import one of ``names`` at module level and hold other passing tests."""
        parents = {mod.module}
        parts = mod.module.split(".")
        parents |= {".".join(parts[:i]) for i in range(1, len(parts))}
        top = mod.module.split(".")[0]
        out = []
        for rel, pairs in self.test_imports.names.items():
            # ``from pkg import case`` names a module, not a definition called ``case``
            by_name = any(
                m in parents and n in names and f"{m}.{n}" not in self.layout.modules
                for m, n in pairs
            )
            # ``DECORATOR = staticmethod(pkg.func.cached)`` in a class body of the test file
            imports_package = any(
                m == top or m.startswith(top + ".") for m in self.test_imports.modules.get(rel, ())
            )
            by_attribute = imports_package and names & self.test_imports.collection_names.get(
                rel, set()
            )
            if not (by_name or by_attribute):
                continue
            in_file = tests_in_files(self.passing, [rel])
            if in_file - tests:
                out.append(rel)
        return out

    def _budget(self, mod: ModuleIndex, units: set[str]) -> int:
        tops = {q for q in units if "." not in q}
        lines = sum(mod.units[q].end - mod.units[q].start + 1 for q in tops)
        lines += sum(
            mod.units[q].end - mod.units[q].start + 1
            for q in units
            if "." in q and q.split(".")[0] not in tops
        )
        return lines

    # -- proposals -------------------------------------------------------------------------

    def symbol_feature(
        self, module: str, qualname: str, cfg: ProposalConfig, *, kind: str | None = None
    ) -> Feature | str:
        """The feature rooted at ``module.qualname``, or why there is none."""
        mod = self.index.get(module)
        if mod is None or qualname not in mod.units:
            return "not a definition at module or class level"
        if module not in self.baseline.importable:
            return "its module does not import in the sandbox"
        unit = mod.units[qualname]
        top = qualname.split(".")[0]
        if mod.bindings.get(top, 0) != 1 and top not in mod.overloads:
            return f"{top} is bound more than once at module scope"
        if unit.kind == "method":
            cls = mod.units[top]
            if unit.name.startswith("__") or qualname.count(".") != 1:
                return "dunder or nested method"
            feature = self._grow(mod, {qualname})
            outside = self._attr_users(mod, unit.name) - self._units_of(mod, feature)
            if outside:
                return f"used by {sorted(outside)[0]}"
            others = [
                o.module
                for o in self.index.values()
                if o.module != module and unit.name in o.module_attr_refs
            ]
            if others:
                return f"attribute {unit.name!r} is used by module {others[0]}"
            if unit.name in cls.import_refs:
                return "needed at import time by its class"
        else:
            feature = self._grow(mod, {qualname})
            units = self._units_of(mod, feature)
            if top in mod.module_refs:
                return "needed at import time by module-level code"
            at_import = sorted(
                q for q, u in mod.units.items() if top in u.import_refs and q not in units
            )
            if at_import:
                return f"needed at import time by {at_import[0]}"
            outside = self._users(mod, top) - units
            if outside:
                return f"used by {sorted(outside)[0]}"
            external = self._external_users(mod, {q for q in feature if "." not in q})
            if external:
                return f"used by module {external[0]}"
        units = self._units_of(mod, feature)
        tests = self.tests_of(mod.path, mod, feature)
        if not tests:
            return "no passing test executes it"
        if len(tests) > cfg.max_test_fraction * max(1, len(self.passing)):
            return f"exercised by {len(tests)} of {len(self.passing)} tests (a core utility)"
        conflicts = self._test_file_conflicts(mod, {q for q in feature if "." not in q}, tests)
        if conflicts:
            return f"needed to collect {conflicts[0]}, which also tests other code"
        lines = self._budget(mod, units)
        if not cfg.min_lines <= lines <= cfg.max_lines:
            return f"{lines} lines, outside the budget [{cfg.min_lines}, {cfg.max_lines}]"
        ordered = [qualname] + sorted(feature - {qualname})
        return Feature(
            kind=kind or unit.kind,
            name=f"{_short(module, self.layout)}.{qualname}",
            symbols=tuple(f"{module}.{q}" for q in ordered),
            interface=(f"{module}.{qualname}",),
            definitions=((mod.path, tuple(ordered)),),
            files=(),
            tests=frozenset(tests),
            deleted_lines=lines,
        )

    def module_feature(self, module: str, cfg: ProposalConfig) -> Feature | str:
        """The whole module as a feature, or why not."""
        mod = self.index.get(module)
        if mod is None:
            return "not a module of the package"
        if mod.path.endswith("__init__.py") or module.endswith("__main__"):
            return "package __init__ and __main__ modules are not deleted whole"
        if module not in self.baseline.importable:
            return "does not import in the sandbox"
        importers = self._module_importers(module)
        if importers:
            return f"imported by {importers[0]}"
        lines = len(mod.source.splitlines())
        if not cfg.min_lines <= lines <= cfg.max_module_lines:
            return f"{lines} lines, outside the budget [{cfg.min_lines}, {cfg.max_module_lines}]"
        covered: set[str] = set()
        for ids in self.baseline.line_tests.get(mod.path, {}).values():
            covered |= ids
        importing = [
            rel
            for rel, mods in self.test_imports.modules.items()
            if module in mods or any(m.startswith(module + ".") for m in mods)
        ]
        importing += [
            rel
            for rel, pairs in self.test_imports.names.items()
            if any(f"{m}.{n}" == module for m, n in pairs)
        ]
        tests = (covered | tests_in_files(self.passing, importing)) & self.passing
        if not tests:
            return "no passing test executes or imports it"
        if len(tests) > cfg.max_test_fraction * max(1, len(self.passing)):
            return f"exercised by {len(tests)} of {len(self.passing)} tests (a core module)"
        public = [
            f"{module}.{q}" for q, u in mod.units.items() if "." not in q and not q.startswith("_")
        ]
        return Feature(
            kind="module",
            name=_short(module, self.layout),
            symbols=(module,),
            interface=tuple(public),
            definitions=(),
            files=(mod.path,),
            tests=frozenset(tests),
            deleted_lines=lines,
        )

    def propose(self, cfg: ProposalConfig) -> Proposals:
        """Every feature of the package (symbols first, then modules), and the skipped ones."""
        out = Proposals()

        def included(dotted: str) -> bool:
            return not cfg.include or any(fnmatch.fnmatchcase(dotted, p) for p in cfg.include)

        seen: set[tuple[str, ...]] = set()
        for module, mod in sorted(self.index.items()):
            for q, unit in mod.units.items():
                dotted = f"{module}.{q}"
                if not included(dotted) or any(part.startswith("_") for part in q.split(".")):
                    continue
                if unit.kind == "assignment" or (unit.kind == "method" and not cfg.methods):
                    continue
                result = self.symbol_feature(module, q, cfg)
                if isinstance(result, str):
                    out.rejected[dotted] = result
                elif result.symbols not in seen:
                    seen.add(result.symbols)
                    out.features.append(result)
        if cfg.modules:
            for module in sorted(self.index):
                if not included(module) or module in self.layout.packages:
                    continue
                result = self.module_feature(module, cfg)
                if isinstance(result, str):
                    out.rejected[module] = result
                else:
                    out.features.append(result)
        return out

    def custom_feature(
        self,
        module: str,
        qualnames: Iterable[str],
        cfg: ProposalConfig,
        *,
        also_deleted: Mapping[str, Iterable[str]] | None = None,
    ) -> Feature | str:
        """A feature made of exactly ``qualnames`` (e.g. proposed by a model), or why not.

        The same checks as ``symbol_feature`` apply, without growing the set: nothing outside it
        may use its definitions, at import time or at run time. ``also_deleted`` (module ->
        qualnames of other modules deleted in the same task): uses of the definitions by those
        do not count.
        """
        mod = self.index.get(module)
        if mod is None:
            return "not a module of the package"
        if module not in self.baseline.importable:
            return "its module does not import in the sandbox"
        names = list(dict.fromkeys(qualnames))
        missing = [q for q in names if q not in mod.units]
        if missing:
            return f"{missing[0]} is not a definition of {module}"
        units = self._units_of(mod, names)
        tops = {q for q in names if "." not in q}
        for q in names:
            top = q.split(".")[0]
            if mod.bindings.get(top, 0) != 1 and top not in mod.overloads:
                return f"{top} is bound more than once at module scope"
            if "." in q:
                cls = mod.units.get(top)
                name = q.split(".")[-1]
                if top not in names and cls is not None and name in cls.import_refs:
                    return f"{q} is needed at import time by its class"
                outside = self._attr_users(mod, name) - units
            else:
                if q in mod.module_refs:
                    return f"{q} is needed at import time by module-level code"
                at_import = sorted(
                    u for u, unit in mod.units.items() if q in unit.import_refs and u not in units
                )
                if at_import:
                    return f"{q} is needed at import time by {at_import[0]}"
                outside = self._users(mod, q) - units
            if outside:
                return f"{q} is used by {sorted(outside)[0]}"
        external = self._external_users(mod, tops, also_deleted)
        if external:
            return f"used by module {external[0]}"
        tests = self.tests_of(mod.path, mod, names)
        if not tests:
            return "no passing test executes it"
        if len(tests) > cfg.max_test_fraction * max(1, len(self.passing)):
            return f"exercised by {len(tests)} of {len(self.passing)} tests"
        conflicts = self._test_file_conflicts(mod, tops, tests)
        if conflicts:
            return f"needed to collect {conflicts[0]}, which also tests other code"
        lines = self._budget(mod, units)
        if not cfg.min_lines <= lines <= cfg.max_lines:
            return f"{lines} lines, outside the budget [{cfg.min_lines}, {cfg.max_lines}]"
        public = [q for q in names if not any(p.startswith("_") for p in q.split("."))]
        return Feature(
            kind="agent",
            name=f"{_short(module, self.layout)}.{'+'.join(public or names[:1])}",
            symbols=tuple(f"{module}.{q}" for q in names),
            interface=tuple(f"{module}.{q}" for q in (public or names)),
            definitions=((mod.path, tuple(names)),),
            files=(),
            tests=frozenset(tests),
            deleted_lines=lines,
        )

    def helper_feature(self, module: str, qualname: str, cfg: ProposalConfig) -> Feature | str:
        """A private helper alone as a feature (a smaller task than its public user)."""
        mod = self.index.get(module)
        if mod is None or qualname not in mod.units:
            return "not a definition"
        unit = mod.units[qualname]
        if unit.kind not in ("function", "method") or unit.body is None:
            return "only functions and methods with a body are helper features"
        tests = self.tests_of(mod.path, mod, [qualname])
        if not tests:
            return "no passing test executes it"
        lines = unit.end - unit.start + 1
        if not cfg.min_lines <= lines <= cfg.max_lines:
            return f"{lines} lines, outside the budget"
        return Feature(
            kind="helper",
            name=f"{_short(module, self.layout)}.{qualname}",
            symbols=(f"{module}.{qualname}",),
            interface=(f"{module}.{qualname}",),
            definitions=((mod.path, (qualname,)),),
            files=(),
            tests=frozenset(tests),
            deleted_lines=lines,
        )


def _short(module: str, layout: Layout) -> str:
    """Module name without the top-level package (``textkit.case`` -> ``case``)."""
    for top in layout.packages:
        if module.startswith(top + "."):
            return module[len(top) + 1 :]
    return module
