"""Remote engines a consumer talks to: one handshake each, bounded state, safe eviction.

`PeerRegistry.connect(engine_id, ...)` returns a future of the peer's handshake result. However
many requests name a new engine at once, exactly one handshake runs (in a worker thread, bounded
by the handshake function's own timeout); every request shares its future, and a failed
handshake fails all of them (the entry is dropped, so a later request tries again).

Per-peer state is bounded: when a new engine appears (the only moment the state grows), peers
idle for longer than `ttl_s` are evicted, and so is the least recently active idle peer when
`max_peers` would be exceeded. A peer with a transfer in flight (`busy`) is never evicted: its
lane may still be writing into our blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["PeerRegistry"]

T = TypeVar("T")


@dataclass
class _Peer(Generic[T]):
    future: Future[T]
    last_active: float
    in_flight: int = 0


@dataclass
class PeerRegistry(Generic[T]):
    """Handshakes and lifetimes of remote engines, keyed by engine id."""

    handshake: Callable[[str], T]
    """Runs one handshake with the engine id (raises on failure; bounded by its own timeout)."""
    ttl_s: float = 600.0
    max_peers: int = 256
    clock: Callable[[], float] = time.monotonic
    _peers: dict[str, _Peer[T]] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="kv-handshake"),
        init=False,
    )
    num_handshakes: int = field(default=0, init=False)

    def connect(self, engine_id: str) -> Future[T]:
        """The (shared) handshake future of `engine_id`, starting the handshake if needed."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is not None:
                peer.last_active = self.clock()
                return peer.future
            self._evict_locked(self.clock())
            future: Future[T] = self._executor.submit(self.handshake, engine_id)
            self.num_handshakes += 1
            self._peers[engine_id] = _Peer(future, self.clock())
        future.add_done_callback(lambda f: self._drop_if_failed(engine_id, f))
        return future

    def begin_transfer(self, engine_id: str) -> None:
        with self._lock:
            peer = self._peers[engine_id]
            peer.in_flight += 1
            peer.last_active = self.clock()

    def end_transfer(self, engine_id: str) -> None:
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is not None:
                peer.in_flight = max(0, peer.in_flight - 1)
                peer.last_active = self.clock()

    def busy(self, engine_id: str) -> bool:
        with self._lock:
            peer = self._peers.get(engine_id)
            return peer is not None and peer.in_flight > 0

    def __contains__(self, engine_id: str) -> bool:
        with self._lock:
            return engine_id in self._peers

    def __len__(self) -> int:
        with self._lock:
            return len(self._peers)

    def forget(self, engine_id: str) -> None:
        """Drop a peer (it restarted, or its handshake result is stale) unless it is busy."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is not None and peer.in_flight == 0:
                del self._peers[engine_id]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _drop_if_failed(self, engine_id: str, future: Future[T]) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                peer = self._peers.get(engine_id)
                if peer is not None and peer.future is future:
                    del self._peers[engine_id]

    def _evict_locked(self, now: float) -> None:
        idle = {k: p for k, p in self._peers.items() if p.in_flight == 0}
        for key, peer in idle.items():
            if now - peer.last_active > self.ttl_s:
                del self._peers[key]
        while len(self._peers) >= self.max_peers:
            candidates = [(p.last_active, k) for k, p in self._peers.items() if p.in_flight == 0]
            if not candidates:
                return  # every peer is busy: grow past the bound rather than cut a transfer
            del self._peers[min(candidates)[1]]
