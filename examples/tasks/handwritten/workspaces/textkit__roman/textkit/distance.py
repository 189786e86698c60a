"""Edit distances between strings (or any sequences of comparable items)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def levenshtein(a: Sequence[Any], b: Sequence[Any], max_distance: int | None = None) -> int:
    """Number of single-item insertions, deletions and substitutions turning ``a`` into ``b``.

    Runs in O(len(a) * len(b)) time and O(min(len(a), len(b))) memory. With ``max_distance``
    the computation stops as soon as the distance is known to exceed it and returns
    ``max_distance + 1`` in that case, which makes "is it within k edits?" checks cheap.

    >>> levenshtein("kitten", "sitting")
    3
    >>> levenshtein("kitten", "sitting", max_distance=1)
    2

    Raises ``ValueError`` if ``max_distance`` is negative.
    """
    if max_distance is not None and max_distance < 0:
        raise ValueError(f"max_distance must be >= 0, got {max_distance}")
    if len(a) < len(b):
        a, b = b, a
    if max_distance is not None and len(a) - len(b) > max_distance:
        return max_distance + 1
    previous = list(range(len(b) + 1))
    for i, item_a in enumerate(a, start=1):
        current = [i]
        for j, item_b in enumerate(b, start=1):
            current.append(
                min(
                    previous[j] + 1,
                    current[j - 1] + 1,
                    previous[j - 1] + (item_a != item_b),
                )
            )
        # Every path to the final cell passes through this row, so its minimum bounds the answer.
        if max_distance is not None and min(current) > max_distance:
            return max_distance + 1
        previous = current
    distance = previous[-1]
    if max_distance is not None and distance > max_distance:
        return max_distance + 1
    return distance


def hamming(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Number of positions at which the equal-length sequences ``a`` and ``b`` differ.

    >>> hamming("karolin", "kathrin")
    3

    Raises ``ValueError`` if the lengths differ.
    """
    if len(a) != len(b):
        raise ValueError(f"hamming distance needs equal lengths, got {len(a)} and {len(b)}")
    return sum(x != y for x, y in zip(a, b, strict=True))
