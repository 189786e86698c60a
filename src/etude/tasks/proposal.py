"""What the miner proposes: the ``Feature`` record, ``ProposalConfig`` and ``Proposals``.

A feature is what one task deletes (definitions of modules that stay, modules removed whole) and
the tests expected to fail without it. ``ProposalConfig`` says which features ``Miner.propose``
offers (size budgets, kinds, include patterns, feature-sized groups) and validates itself;
``Proposals`` holds the offered features and the skipped symbols with reasons. ``combine`` joins
several features into one harder task.

What this module does not do: decide what is a feature (``etude.tasks.mine.Miner``), group tests
into feature-sized tasks (``etude.tasks.features``), delete (``etude.tasks.delete``) or validate
(``etude.tasks.validate``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Feature:
    """A deletable piece of the package and the tests expected to fail without it."""

    kind: str
    """``function``, ``class``, ``method``, ``module``, ``multi`` (several features) or ``helper``."""
    name: str
    """Short display name, e.g. ``case.slugify`` or ``roman`` (unique within a repository)."""
    symbols: tuple[str, ...]
    """Dotted names of what is deleted: the interface first, then private helpers."""
    interface: tuple[str, ...]
    """Dotted names of the public definitions the problem statement describes."""
    definitions: tuple[tuple[str, tuple[str, ...]], ...]
    """``(module path, qualnames)`` to remove from modules that stay."""
    files: tuple[str, ...]
    """Module paths removed whole."""
    tests: frozenset[str]
    """Candidate FAIL_TO_PASS tests (canonical ids)."""
    deleted_lines: int
    """Lines of the deleted definitions (the size budget's measure)."""
    parts: tuple[str, ...] = ()
    """For ``multi``: names of the component features."""


@dataclass(kw_only=True, slots=True)
class ProposalConfig:
    """Which features ``propose_features`` offers."""

    min_lines: int = 3
    """Smallest feature (lines of deleted definitions)."""
    max_lines: int = 150
    """Largest symbol feature (lines)."""
    max_module_lines: int = 400
    """Largest module feature (lines)."""
    max_test_fraction: float = 0.5
    """Skip features exercised by more than this share of the passing tests (core utilities)."""
    methods: bool = True
    """Offer public methods of classes as features."""
    modules: bool = True
    """Offer whole modules as features."""
    include: tuple[str, ...] = ()
    """Glob patterns over dotted names (``textkit.case.*``); empty: everything."""
    feature_groups: bool = True
    """Also offer feature-sized tasks: per test file, the code only its tests reach, across
    modules, deleted together (``etude.tasks.features``)."""
    max_feature_lines: int = 600
    """Largest feature-sized task (lines of deleted definitions)."""
    feature_max_test_files: int = 3
    """Most test files one feature-sized group spans (files joined by code only their tests
    run; 1: one group per test file only)."""

    def __post_init__(self) -> None:
        if self.feature_max_test_files < 1:
            raise ValueError(
                f"proposals.feature_max_test_files={self.feature_max_test_files} must be >= 1 "
                "(1: one feature-sized group per test file)"
            )
        if self.min_lines < 1:
            raise ValueError(f"min_lines={self.min_lines} must be >= 1")
        if self.max_lines < self.min_lines or self.max_module_lines < self.min_lines:
            raise ValueError(
                f"max_lines={self.max_lines} and max_module_lines={self.max_module_lines} must be "
                f">= min_lines={self.min_lines}"
            )
        if not 0.0 < self.max_test_fraction <= 1.0:
            raise ValueError(f"max_test_fraction={self.max_test_fraction} must be in (0, 1]")


@dataclass(kw_only=True, slots=True)
class Proposals:
    """Features worth validating and the symbols that were skipped, with reasons."""

    features: list[Feature] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    """Dotted name -> why it is not a feature."""


def combine(features: Iterable[Feature]) -> Feature:
    """Several features deleted together (a harder task): definitions, files and tests unite."""
    parts = sorted(features, key=lambda f: f.name)
    if len(parts) < 2:
        raise ValueError("combine needs at least two features")
    files = tuple(sorted({p for f in parts for p in f.files}))
    by_path: dict[str, list[str]] = {}
    for f in parts:
        for path, quals in f.definitions:
            if path in files:
                continue
            by_path.setdefault(path, [])
            by_path[path] += [q for q in quals if q not in by_path[path]]
    symbols: list[str] = []
    interface: list[str] = []
    for f in parts:
        symbols += [s for s in f.symbols if s not in symbols]
        interface += [s for s in f.interface if s not in interface]
    return Feature(
        kind="multi",
        name="+".join(f.name for f in parts),
        symbols=tuple(symbols),
        interface=tuple(interface),
        definitions=tuple((p, tuple(q)) for p, q in sorted(by_path.items())),
        files=files,
        tests=frozenset().union(*(f.tests for f in parts)),
        deleted_lines=sum(f.deleted_lines for f in parts),
        parts=tuple(f.name for f in parts),
    )
