"""A bounded least-recently-used map with an eviction callback (the two LoRA cache levels)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["LRUCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """At most `capacity` entries; putting one more evicts the least recently used first and
    calls `on_evict(key, value)` for it (also for `pop`, so an owner can release what the entry
    held). `get` and `touch` make an entry the most recently used; `peek` does not.

    Raises:
        ValueError: a capacity below 1.
    """

    def __init__(self, capacity: int, on_evict: Callable[[K, V], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._on_evict = on_evict
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        """Keys from the least to the most recently used."""
        return iter(list(self._entries))

    def get(self, key: K) -> V | None:
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def peek(self, key: K) -> V | None:
        return self._entries.get(key)

    def touch(self, key: K) -> None:
        self._entries.move_to_end(key)

    def put(self, key: K, value: V) -> None:
        """Insert or replace `key` as the most recently used, evicting the LRU entry if full."""
        if key in self._entries:
            self._entries[key] = value
            self._entries.move_to_end(key)
            return
        if len(self._entries) >= self.capacity:
            self.pop(next(iter(self._entries)))
        self._entries[key] = value

    def pop(self, key: K) -> V | None:
        """Remove `key` (calling `on_evict`); None when absent."""
        if key not in self._entries:
            return None
        value = self._entries.pop(key)
        if self._on_evict is not None:
            self._on_evict(key, value)
        return value
