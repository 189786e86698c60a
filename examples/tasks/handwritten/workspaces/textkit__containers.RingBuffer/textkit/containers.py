"""Bounded containers: a least-recently-used cache and a fixed-size ring buffer."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any


class LRUCache:
    """A mapping of at most ``capacity`` entries that evicts the least recently used one.

    ``get`` and ``put`` both count as a use; ``in`` and ``len`` do not. ``hits``, ``misses``
    and ``evictions`` count what happened since creation (or the last ``clear``).

    >>> cache = LRUCache(2)
    >>> cache.put("a", 1); cache.put("b", 2); cache.get("a")
    1
    >>> cache.put("c", 3)  # evicts "b", the least recently used
    >>> "b" in cache
    False

    Raises ``ValueError`` if ``capacity`` is below 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value stored under ``key`` (marking it most recently used), else ``default``."""
        if key not in self._entries:
            self.misses += 1
            return default
        self.hits += 1
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: Hashable, value: Any) -> None:
        """Store ``value`` under ``key``, evicting the least recently used entry if full."""
        if key in self._entries:
            self._entries.move_to_end(key)
        elif len(self._entries) >= self.capacity:
            self._entries.popitem(last=False)
            self.evictions += 1
        self._entries[key] = value

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        self._entries.clear()
        self.hits = self.misses = self.evictions = 0

    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"LRUCache(capacity={self.capacity}, size={len(self)})"
