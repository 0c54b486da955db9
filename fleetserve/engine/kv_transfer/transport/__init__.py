"""KV transports: the data plane under the KV connector (see `base` for the interface).

- `tcp` (`TcpTransport`): our own TCP transport, with a shared-memory fast path on one machine
  (`SharedKVArena` allocates KV caches the peer can map).
- `mooncake` (`MooncakeTransport`): Mooncake's transfer engine (TCP here, RDMA where present).

`make_transport(kind, engine_id, **options)` builds either by name.
"""

from __future__ import annotations

from typing import Any

from fleetserve.engine.kv_transfer.transport.base import (
    BlockCopy,
    EndpointDescriptor,
    FailureStage,
    KVTransport,
    PushNotification,
    RegionInfo,
    TransferFailure,
    TransferHandle,
    TransferState,
    TransferStatus,
    TransportStats,
    kv_region_name,
)
from fleetserve.engine.kv_transfer.transport.shm import SharedKVArena, host_identity
from fleetserve.engine.kv_transfer.transport.tcp import TcpConfig, TcpTransport

__all__ = [
    "TRANSPORTS",
    "BlockCopy",
    "EndpointDescriptor",
    "FailureStage",
    "KVTransport",
    "PushNotification",
    "RegionInfo",
    "SharedKVArena",
    "TcpConfig",
    "TcpTransport",
    "TransferFailure",
    "TransferHandle",
    "TransferState",
    "TransferStatus",
    "TransportStats",
    "host_identity",
    "kv_region_name",
    "make_transport",
]

TRANSPORTS = ("tcp", "mooncake")


def make_transport(kind: str, engine_id: str, **options: Any) -> KVTransport:
    """`TcpTransport(engine_id, **options)` or `MooncakeTransport(engine_id, **options)`."""
    if kind == "tcp":
        return TcpTransport(engine_id, **options)
    if kind == "mooncake":
        from fleetserve.engine.kv_transfer.transport.mooncake import MooncakeTransport

        return MooncakeTransport(engine_id, **options)
    raise ValueError(f"unknown kv transport {kind!r}; expected one of {', '.join(TRANSPORTS)}")
