"""Harder and easier variants of a built task, for the curriculum.

``VariantMaker`` is the part of the task factory the curriculum calls: ``harder(record)`` (less
detail in the statement, a partner feature deleted too, the whole module) and ``easier(record)``
(more detail, a smaller part of the feature). Each variant is validated like any task and its
record's ``etude.parent`` names the task it came from. A record of another session is mapped back
to its feature from its symbols (``feature_for``).

What this module does not do: decide when a variant is wanted (``etude.tasks.curriculum``).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path
from typing import Any

from etude.tasks.proposal import Feature, ProposalConfig, combine
from etude.tasks.record import TaskRecord
from etude.tasks.statement import DETAIL_RANK


class VariantMaker:
    """Variants of built tasks; mixed into ``etude.tasks.build.TaskFactory``, whose miner,
    proposals and ``run_features`` it uses."""

    _features: dict[str, Feature]
    cfg: Any
    layout: Any
    miner: Any
    out_dir: Path

    def feature_for(self, record: TaskRecord) -> Feature | None:
        """The feature a record deleted: remembered from this session, or rebuilt from its symbols."""
        if record.instance_id in self._features:
            return self._features[record.instance_id]
        if record.etude is None or record.repo != self.layout.name:
            return None
        modules = self.layout.modules
        files = [p for p in record.etude.deleted_files if p.endswith(".py")]
        module_of_path = {p: m for m, p in modules.items()}
        parts: list[Feature] = []
        by_module: dict[str, list[str]] = {}
        for symbol in record.etude.symbols:
            if symbol in modules and modules[symbol] in files:
                found = self.miner.module_feature(symbol, _relaxed(self.cfg.proposals))
                if isinstance(found, Feature):
                    parts.append(found)
                continue
            module = max((m for m in modules if symbol.startswith(m + ".")), key=len, default=None)
            if module is None or modules[module] in files:
                continue
            by_module.setdefault(module, []).append(symbol[len(module) + 1 :])
        for module, quals in by_module.items():
            found = self.miner.custom_feature(module, quals, _relaxed(self.cfg.proposals))
            if isinstance(found, str):
                return None
            parts.append(
                dataclasses.replace(
                    found, kind=str(record.etude.extra.get("feature_kind", "function"))
                )
            )
        if not parts or any(module_of_path.get(p) is None for p in files):
            return None
        return parts[0] if len(parts) == 1 else combine(parts)

    def _variant_records(
        self, record: TaskRecord, attempts: list[tuple[Feature, str]]
    ) -> list[TaskRecord]:
        unique: dict[tuple[tuple[str, ...], str], tuple[Feature, str]] = {}
        for feature, detail in attempts:
            unique.setdefault((feature.symbols, detail), (feature, detail))
        features = [f for f, _ in unique.values()]
        options = [{"detail": d} for _, d in unique.values()]
        outcomes = self.run_features(
            features,
            limit=self.cfg.variants_per_task,
            options=options,
            parent=record.instance_id,
            relative=False,
        )
        records = [o.record for o in outcomes if o.record is not None]
        for extra in records[self.cfg.variants_per_task :]:
            remove_workspace(self.out_dir, extra)
        return records[: self.cfg.variants_per_task]

    def harder(self, record: TaskRecord) -> list[TaskRecord]:
        """Validated harder variants of ``record``: less detail, a partner feature deleted too,
        the whole module. [] for a record of another repository."""
        feature = self.feature_for(record)
        if feature is None or record.etude is None:
            return []
        detail = record.etude.detail_level
        attempts: list[tuple[Feature, str]] = []
        rank = DETAIL_RANK[detail]
        if rank < 2:
            attempts.append((feature, _detail_at(rank + 1)))
        used = {p for p, _ in feature.definitions} | set(feature.files)
        partners = [
            f
            for f in self.proposed()
            if f.kind != "module" and not ({p for p, _ in f.definitions} | set(f.files)) & used
        ]
        random.Random(f"{self.cfg.seed}:{record.instance_id}").shuffle(partners)
        for partner in partners[:3]:
            attempts.append((combine([feature, partner]), detail))
        if feature.kind not in ("module", "multi"):
            path = feature.definitions[0][0]
            module = {p: m for m, p in self.layout.modules.items()}[path]
            found = self.miner.module_feature(module, _relaxed(self.cfg.proposals))
            if isinstance(found, Feature):
                attempts.append((found, detail))
        return self._variant_records(record, attempts)

    def easier(self, record: TaskRecord) -> list[TaskRecord]:
        """Validated easier variants of ``record``: more detail, a smaller part of the feature.
        [] for a record of another repository."""
        feature = self.feature_for(record)
        if feature is None or record.etude is None:
            return []
        detail = record.etude.detail_level
        attempts: list[tuple[Feature, str]] = []
        rank = DETAIL_RANK[detail]
        if rank > 0:
            attempts.append((feature, _detail_at(rank - 1)))
        for smaller in sorted(self._smaller(feature), key=lambda f: f.deleted_lines):
            attempts.append((smaller, detail))
        return self._variant_records(record, attempts)

    def _smaller(self, feature: Feature) -> list[Feature]:
        cfg = _relaxed(self.cfg.proposals)
        proposed = self.proposed()
        by_name = {f.name: f for f in proposed}
        if feature.kind == "multi":
            return [by_name[n] for n in feature.parts if n in by_name]
        out: list[Feature] = []
        if feature.kind == "module":
            module = {p: m for m, p in self.layout.modules.items()}[feature.files[0]]
            for f in proposed:
                if f.kind != "module" and f.symbols[0].startswith(module + "."):
                    out.append(f)
            return out
        path, quals = feature.definitions[0]
        module = {p: m for m, p in self.layout.modules.items()}[path]
        mod = self.miner.index[module]
        head = quals[0]
        if feature.kind == "class":
            for q, unit in mod.units.items():
                if (
                    q.startswith(head + ".")
                    and unit.kind == "method"
                    and not unit.name.startswith("_")
                ):
                    found = self.miner.symbol_feature(module, q, cfg)
                    if isinstance(found, Feature):
                        out.append(found)
        for helper in quals[1:]:
            found = self.miner.helper_feature(module, helper, cfg)
            if isinstance(found, Feature):
                out.append(found)
        return out


def _relaxed(cfg: ProposalConfig) -> ProposalConfig:
    """Proposal limits for variants: any size up to the module budget, any test share."""
    return dataclasses.replace(
        cfg, max_lines=max(cfg.max_lines, cfg.max_module_lines), max_test_fraction=1.0, include=()
    )


def _detail_at(rank: int) -> str:
    return next(level for level, r in DETAIL_RANK.items() if r == rank)


def remove_workspace(out_dir: Path, record: TaskRecord) -> None:
    assert record.etude is not None
    path = Path(record.etude.workspace)
    path = path if path.is_absolute() else out_dir / path
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
