"""Liveness of the ranks a leader drives on other pods, from their control connections.

A local worker's death is its process exiting; a remote rank's is its pod's TCP connection to
the leader's control socket going away. ZMQ reports that as a disconnect event on the socket's
monitor: at once when the peer process dies (its kernel closes the connection), and within
`HEARTBEAT_TIMEOUT_MS` when the peer's host or network vanishes silently (ZMTP heartbeats,
which the peer's ZMQ answers by itself). `RemoteRanks.lost()` turns the first disconnect of a
rank that had connected into the reason the executor dies with, and so is a rank whose pod has
not connected within `JOIN_TIMEOUT_S` of the start.
"""

from __future__ import annotations

import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from fleetserve.engine.distributed.pod_group import PodGroup

__all__ = [
    "HEARTBEAT_IVL_MS",
    "HEARTBEAT_TIMEOUT_MS",
    "JOIN_TIMEOUT_S",
    "RemoteRanks",
    "heartbeats",
]

HEARTBEAT_IVL_MS = 1000
"""ZMTP ping period on the control connections between pods."""
HEARTBEAT_TIMEOUT_MS = 3000
"""A peer silent for this long counts as disconnected."""
JOIN_TIMEOUT_S = 60.0
"""Bound on a remote rank's first connection (the ranks' rendezvous has the same bound)."""


def heartbeats(sock: zmq.Socket[Any]) -> None:
    """Enable ZMTP heartbeats on a TCP control socket (set before bind or connect)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class RemoteRanks:
    """Watches the leader's request sockets of the ranks on other pods (rank → socket)."""

    def __init__(
        self,
        sockets: dict[int, zmq.Socket[Any]],
        group: PodGroup,
        *,
        join_timeout_s: float = JOIN_TIMEOUT_S,
    ) -> None:
        self._group = group
        self._join_deadline = time.monotonic() + join_timeout_s
        self._join_timeout_s = join_timeout_s
        self._joined: set[int] = set()
        self._sockets = sockets
        self._monitors = {
            rank: sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            for rank, sock in sockets.items()
        }
        self.connected: set[int] = set()
        """Ranks whose pod has connected (and not disconnected since)."""
        self._lost: str | None = None

    def lost(self) -> str | None:
        """Why a remote rank counts as dead (its pod disconnected), or None; never blocks."""
        for rank, monitor in self._monitors.items():
            while self._lost is None and monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_ACCEPTED:
                    self.connected.add(rank)
                    self._joined.add(rank)
                elif event == zmq.EVENT_DISCONNECTED and rank in self.connected:
                    self._lost = (
                        f"worker rank {rank} on pod {self._group.pod_of(rank)} of the group "
                        "disconnected (its process or pod went away)"
                    )
        missing = sorted(set(self._monitors) - self._joined)
        if self._lost is None and missing and time.monotonic() > self._join_deadline:
            pods = sorted({self._group.pod_of(r) for r in missing})
            self._lost = (
                f"pod(s) {pods} of the group (ranks {missing}) did not connect to the leader "
                f"within {self._join_timeout_s:g} s"
            )
        return self._lost

    def flush(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for queued messages to leave (before a shutdown closes)."""
        deadline = time.monotonic() + timeout_s
        for sock in self._sockets.values():
            while time.monotonic() < deadline and not sock.poll(0, zmq.POLLOUT):
                time.sleep(0.01)
        # NOTE: POLLOUT says the queue has room, not that it is empty; a short linger on close
        # lets the last stop message go out.
        for sock in self._sockets.values():
            sock.setsockopt(zmq.LINGER, int(max(0.0, deadline - time.monotonic()) * 1000))

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.disable_monitor()
        for monitor in self._monitors.values():
            monitor.close(linger=0)
