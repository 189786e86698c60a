"""Bounded containers: a least-recently-used cache and a fixed-size ring buffer."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
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


class RingBuffer:
    """A fixed-capacity sequence that overwrites its oldest item when full.

    Iteration and indexing go from the oldest to the newest item; negative indices count from
    the newest. Appending is O(1).

    >>> ring = RingBuffer(3)
    >>> ring.extend([1, 2, 3, 4])
    >>> list(ring)
    [2, 3, 4]
    >>> ring[-1]
    4

    Raises ``ValueError`` if ``capacity`` is below 1.
    """

    def __init__(self, capacity: int, items: Iterable[Any] = ()) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._slots: list[Any] = [None] * capacity
        self._start = 0
        self._size = 0
        self.extend(items)

    def append(self, item: Any) -> Any:
        """Add ``item`` as the newest element; return the element it overwrote, else ``None``."""
        end = (self._start + self._size) % self.capacity
        if self._size < self.capacity:
            self._slots[end] = item
            self._size += 1
            return None
        dropped = self._slots[self._start]
        self._slots[self._start] = item
        self._start = (self._start + 1) % self.capacity
        return dropped

    def extend(self, items: Iterable[Any]) -> None:
        """Append every item of ``items`` in order."""
        for item in items:
            self.append(item)

    def popleft(self) -> Any:
        """Remove and return the oldest item; ``IndexError`` if the buffer is empty."""
        if not self._size:
            raise IndexError("pop from an empty RingBuffer")
        item = self._slots[self._start]
        self._slots[self._start] = None
        self._start = (self._start + 1) % self.capacity
        self._size -= 1
        return item

    def is_full(self) -> bool:
        """Whether the next ``append`` will overwrite the oldest item."""
        return self._size == self.capacity

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> Any:
        if index < 0:
            index += self._size
        if not 0 <= index < self._size:
            raise IndexError("RingBuffer index out of range")
        return self._slots[(self._start + index) % self.capacity]

    def __iter__(self) -> Iterator[Any]:
        for i in range(self._size):
            yield self._slots[(self._start + i) % self.capacity]

    def __repr__(self) -> str:
        return f"RingBuffer({self.capacity}, {list(self)!r})"
