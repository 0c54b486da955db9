"""The router's approximate picture of each engine's prefix cache: block hashes it sent there.

The router cannot see an engine's cache, so, like vllm-router's and llm-d's approximate prefix
scorers, it remembers which prompt block hashes (`fleetserve.common.block_hash`, the engines' own
hashing) it routed to which engine. Each engine's memory is an LRU bounded to `capacity` hashes;
a hash the engine has since evicted is a wrong guess that costs only a less good placement. Pure
data structure: no I/O, no asyncio, not thread-safe (the router uses it from its event loop).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from fleetserve.common.block_hash import BlockHash

__all__ = ["ApproxPrefixCache"]


class ApproxPrefixCache:
    """Per-engine LRU sets of block hashes, keyed by the engine's URL."""

    def __init__(self, capacity: int) -> None:
        """Args:
        capacity: hashes remembered per engine (>= 1); the least recently used go first.
        """
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._engines: dict[str, OrderedDict[BlockHash, None]] = {}

    def record(self, url: str, hashes: Sequence[BlockHash]) -> None:
        """Remember that `url` computed (or received) the blocks `hashes`, most recent last."""
        if not hashes:
            return
        lru = self._engines.setdefault(url, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def match(self, url: str, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` `url` is believed to hold.

        Each hash chains on its parent, so the run stops at the first unknown hash. A lookup
        changes nothing (the router asks every candidate); `record` on the chosen engine
        refreshes its entries.
        """
        lru = self._engines.get(url)
        if lru is None:
            return 0
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def forget(self, url: str) -> None:
        """Drop everything known about `url` (it restarted or left the fleet)."""
        self._engines.pop(url, None)

    def size(self, url: str) -> int:
        """Hashes remembered for `url`."""
        lru = self._engines.get(url)
        return 0 if lru is None else len(lru)
