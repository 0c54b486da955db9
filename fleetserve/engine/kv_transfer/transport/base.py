"""The KV transport interface: moving KV-cache blocks between two engine processes.

A transport is the data plane under a KV connector (issue 14). It knows nothing of requests,
leases or scheduling: it moves blocks between *regions* and reports, per transfer, whether the
bytes landed.

Terms
- **Region**: one registered CPU tensor whose first dimension is the block, e.g. "layer.3.k" is
  `kv_caches[3][0]` of shape `[num_blocks, block_size, num_kv_heads, head_size]`. Block `b`
  is `block_bytes` contiguous bytes at `b * block_stride` from the region's start (the stride is
  larger than `block_bytes` only in interleaved layouts). Every region belongs to a *layer*, the
  unit of per-layer completion.
- **Descriptor** (`EndpointDescriptor`): what one engine's transport tells its peers in the
  connector's handshake: engine id, address, a random *namespace* drawn per incarnation, the
  regions, a host identity (for the same-host fast path) and transport-specific fields. It is
  plain data: `to_dict()` / `from_dict()` round-trip through JSON.
- **Pull** reads a peer's blocks into local blocks (the consumer of a prefill); **push** writes
  local blocks into a peer's blocks (the producer, layer by layer as it computes). A transfer is
  a list of `BlockCopy(region, src_block_ids, dst_block_ids)`; block ids on the two engines
  differ. Contiguous runs (consecutive on both sides) are coalesced into one descriptor each.
- **Handle**: what pull/push return at once. `poll()` never blocks; `wait_layer(layer)` lets a
  consumer start layer L while later layers are still moving.

Safety contract (what the connector builds on)
1. No operation waits unboundedly: connects, progress and each transfer's deadline are bounded
   by the transport's timeouts (or the `timeout` argument), after which the handle fails with
   stage TIMEOUT.
2. A handle reports FAILED with `failure.quiesced == True` only once every piece of it has
   retired: each one either completed, or the lane carrying it was torn down and the thread that
   was writing into local memory has returned. After that nothing of the transfer can write into
   the local blocks, so the caller may reuse them. A transport that cannot stop work in flight
   (Mooncake) reports `quiesced == False` at once instead: the caller must then keep the
   destination blocks out of use (leak them) rather than risk a late write, as vLLM's NIXL
   connector does.
3. Nothing is retried behind the caller's back. A push whose connection is lost after part of
   it was sent is ambiguous: it fails (stage SEND or RECEIVE) and is never replayed.
4. The serving side rejects (stage REJECTED) a request naming a namespace that is not its own (a
   stale descriptor from before a restart), an unknown region or an out-of-range block, before
   it reads or writes any byte of it.
5. On the receiving side of a push, `revoke_pushes(tag)` returns True once no write carrying that
   tag can touch local memory any more (later ones are refused); only then may the consumer
   reuse blocks it had offered to a push that never completed.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from fleetserve.engine.kv_transfer.transport.plan import Direction
    from fleetserve.engine.kv_transfer.transport.shm import SharedKVArena

__all__ = [
    "BlockCopy",
    "EndpointDescriptor",
    "FailureStage",
    "KVTransport",
    "PushNotification",
    "RegionInfo",
    "TransferFailure",
    "TransferHandle",
    "TransferState",
    "TransferStatus",
    "TransportStats",
    "kv_region_name",
]


def kv_region_name(layer: int, kind: str) -> str:
    """The region name of a layer's keys ("k") or values ("v"): "layer.3.k"."""
    if kind not in ("k", "v"):
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    return f"layer.{layer}.{kind}"


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class FailureStage(enum.Enum):
    """Where a transfer failed. The connector maps these onto its ledger's stages: CONNECT to
    handshake, REJECTED to registration, SEND/RECEIVE as they are, TIMEOUT to watchdog."""

    CONNECT = "connect"
    """The peer could not be reached (refused, unreachable, connect timeout)."""
    REJECTED = "rejected"
    """The peer refused the request: stale namespace, unknown region, out-of-range block, or a
    revoked push tag. Nothing of the request was read or written."""
    SEND = "send"
    """The connection failed while this side was sending (for a push: an ambiguous write)."""
    RECEIVE = "receive"
    """The connection failed while this side was receiving data or an acknowledgement."""
    TIMEOUT = "timeout"
    """No progress within the progress timeout, or the transfer's deadline passed."""
    CLOSED = "closed"
    """The local transport was closed with the transfer still in flight."""
    TRANSPORT = "transport"
    """The underlying transfer engine (Mooncake) reported a failure without more detail."""


@dataclass(frozen=True, slots=True)
class TransferFailure:
    stage: FailureStage
    message: str
    quiesced: bool
    """True when nothing of the transfer can write into local memory any more (see the module
    docstring, rule 2); False means: keep the destination blocks out of use."""


@dataclass(frozen=True, slots=True)
class TransferStatus:
    """A snapshot of one transfer (what `TransferHandle.poll` returns)."""

    state: TransferState
    failure: TransferFailure | None
    layers_done: frozenset[int]
    """Layers whose blocks have all landed (for a push: and the peer was notified)."""
    layers: frozenset[int]
    """Every layer the transfer covers."""
    bytes_done: int
    total_bytes: int
    num_descriptors: int
    """Coalesced runs: what a block-by-block transfer would have needed len(block ids) for."""
    same_host: bool
    """Whether the shared-memory fast path carries it."""
    elapsed_s: float


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """One region as the peers see it."""

    name: str
    layer: int
    num_blocks: int
    block_bytes: int
    block_stride: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layer": self.layer,
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "block_stride": self.block_stride,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RegionInfo:
        return cls(
            name=_field(data, "name", str, "region"),
            layer=_field(data, "layer", int, "region"),
            num_blocks=_field(data, "num_blocks", int, "region"),
            block_bytes=_field(data, "block_bytes", int, "region"),
            block_stride=_field(data, "block_stride", int, "region"),
        )


@dataclass(frozen=True, slots=True)
class EndpointDescriptor:
    """One engine incarnation's transport endpoint, exchanged in the connector's handshake."""

    transport: str
    """"tcp" or "mooncake": a transport only talks to descriptors of its own kind."""
    engine_id: str
    host: str
    port: int
    namespace: str
    """Random per incarnation (hex): every request names it, and a restarted engine rejects the
    old one, so a stale block id is never read."""
    host_identity: str
    """Equal on two engines exactly when they share a machine and its /dev/shm."""
    regions: tuple[RegionInfo, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Transport-specific, JSON-safe (tcp: the shared-memory files; mooncake: its session id and
    the regions' addresses)."""
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {r.name: i for i, r in enumerate(self.regions)})

    def region_index(self, name: str) -> int:
        index = self._index.get(name)
        if index is not None:
            return index
        known = ", ".join(r.name for r in self.regions[:8])
        raise ValueError(
            f"peer engine {self.engine_id!r} has no region {name!r} (it has {known}"
            f"{', ...' if len(self.regions) > 8 else ''})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "transport": self.transport,
            "engine_id": self.engine_id,
            "host": self.host,
            "port": self.port,
            "namespace": self.namespace,
            "host_identity": self.host_identity,
            "regions": [r.to_dict() for r in self.regions],
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EndpointDescriptor:
        """Parse a descriptor received from a peer; a missing or mistyped field is a ValueError
        naming it."""
        regions = data.get("regions")
        if not isinstance(regions, list):
            raise ValueError("descriptor field 'regions' must be a list of regions")
        extra = data.get("extra", {})
        if not isinstance(extra, dict):
            raise ValueError("descriptor field 'extra' must be an object")
        return cls(
            transport=_field(data, "transport", str, "descriptor"),
            engine_id=_field(data, "engine_id", str, "descriptor"),
            host=_field(data, "host", str, "descriptor"),
            port=_field(data, "port", int, "descriptor"),
            namespace=_field(data, "namespace", str, "descriptor"),
            host_identity=_field(data, "host_identity", str, "descriptor"),
            regions=tuple(RegionInfo.from_dict(r) for r in regions),
            extra=extra,
        )


def _field(data: Mapping[str, Any], name: str, kind: type, what: str) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{what} field {name!r} must be {kind.__name__}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy `src_block_ids[i]` to `dst_block_ids[i]` within the region named `region` (the
    same name on both engines unless `local_region` names the local one). For a pull the
    source is the peer, for a push it is local."""

    region: str
    src_block_ids: Sequence[int]
    dst_block_ids: Sequence[int]
    local_region: str | None = None
    """The local region when it is named differently (a consumer's staging buffer for a
    peer's head slice); None: `region` on both engines."""

    @property
    def local_name(self) -> str:
        return self.region if self.local_region is None else self.local_region

    def __post_init__(self) -> None:
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise ValueError(
                f"region {self.region!r}: {len(self.src_block_ids)} source block ids but "
                f"{len(self.dst_block_ids)} destination block ids"
            )


@dataclass(frozen=True, slots=True)
class PushNotification:
    """A push's layer landed in this engine's blocks (drained by `drain_notifications`)."""

    tag: str
    layer: int


@dataclass(frozen=True, slots=True)
class TransportStats:
    inflight_tasks: int
    inflight_bytes: int
    peak_inflight_tasks: int
    peak_inflight_bytes: int
    transfers_done: int
    transfers_failed: int
    bytes_moved: int
    served_requests: int
    """Requests this engine's server side answered (reads, writes, notifications)."""
    rejected_requests: int
    """Requests it refused (stale namespace, unknown region, out of range, revoked)."""


class TransferHandle(ABC):
    """One transfer in flight. Thread-safe; `poll` never blocks."""

    transfer_id: int
    peer_engine_id: str

    @abstractmethod
    def poll(self) -> TransferStatus:
        """The transfer's state now."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> TransferStatus:
        """Block until DONE or FAILED, or `timeout` seconds; returns the status then."""

    @abstractmethod
    def layer_state(self, layer: int) -> TransferState:
        """DONE once the layer's blocks landed; FAILED once the transfer failed (and retired)
        without them; PENDING otherwise."""

    @abstractmethod
    def wait_layer(self, layer: int, timeout: float | None = None) -> TransferState:
        """Block until `layer_state(layer)` is not PENDING, or `timeout` seconds."""


class KVTransport(ABC):
    """The transport of one engine: it serves its registered regions to peers and moves blocks
    to and from them. Thread-safe. Use as a context manager or call `close()`."""

    kind: ClassVar[str]

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._closed = threading.Event()

    @abstractmethod
    def register_region(
        self,
        name: str,
        tensor: torch.Tensor,
        *,
        layer: int,
        shared: SharedKVArena | None = None,
    ) -> None:
        """Serve `tensor` (first dimension: the block; each block contiguous) as region `name`.

        `shared` is the arena the tensor was allocated from, when it was: a same-host peer then
        maps it directly. Register every region before sending `descriptor()` to peers.
        """

    def register_kv_caches(
        self, kv_caches: Sequence[torch.Tensor], *, shared: SharedKVArena | None = None
    ) -> None:
        """Register the engine's KV cache: per layer `i` a `[2, num_blocks, ...]` tensor gives
        regions "layer.i.k" (index 0) and "layer.i.v" (index 1)."""
        for layer, cache in enumerate(kv_caches):
            if cache.dim() < 2 or cache.shape[0] != 2:
                raise ValueError(
                    f"kv_caches[{layer}] must have shape [2, num_blocks, ...], got "
                    f"{tuple(cache.shape)}"
                )
            self.register_region(kv_region_name(layer, "k"), cache[0], layer=layer, shared=shared)
            self.register_region(kv_region_name(layer, "v"), cache[1], layer=layer, shared=shared)

    @abstractmethod
    def descriptor(self) -> EndpointDescriptor:
        """This endpoint, for the peers."""

    def pull(
        self,
        peer: EndpointDescriptor,
        copies: Sequence[BlockCopy],
        *,
        timeout: float | None = None,
    ) -> TransferHandle:
        """Start reading the peer's `src_block_ids` into the local `dst_block_ids`.

        Raises ValueError at once for a request that cannot be valid against the descriptor
        (unknown region, block sizes that differ, out-of-range or duplicate destination ids);
        everything else is reported through the handle."""
        self._check_peer(peer)
        return self._start("pull", peer, copies, "", timeout)

    def push(
        self,
        peer: EndpointDescriptor,
        copies: Sequence[BlockCopy],
        *,
        tag: str,
        timeout: float | None = None,
    ) -> TransferHandle:
        """Start writing the local `src_block_ids` into the peer's `dst_block_ids`.

        `tag` (the request id, at most 255 UTF-8 bytes) names the push on the peer: each layer
        that lands is announced there as a `PushNotification(tag, layer)`, and the peer can
        `revoke_pushes(tag)`. The handle's layer is DONE once the peer holds the bytes and has
        queued the notification."""
        if not 1 <= len(tag.encode()) <= 255:
            raise ValueError(f"push tag must be 1-255 UTF-8 bytes, got {tag!r}")
        self._check_peer(peer)
        return self._start("push", peer, copies, tag, timeout)

    def _check_peer(self, peer: EndpointDescriptor) -> None:
        """What every transfer checks first: this transport is open and speaks the peer's kind."""
        if self.closed:
            raise RuntimeError(f"kv transport of {self.engine_id!r} is closed")
        if peer.transport != self.kind:
            raise ValueError(
                f"peer {peer.engine_id!r} speaks {peer.transport!r}, not {self.kind!r}"
            )

    @abstractmethod
    def _start(
        self,
        direction: Direction,
        peer: EndpointDescriptor,
        copies: Sequence[BlockCopy],
        tag: str,
        timeout: float | None,
    ) -> TransferHandle:
        """Plan and submit a transfer `pull`/`push` has validated (`tag` is "" for a pull)."""

    @abstractmethod
    def drain_notifications(self) -> list[PushNotification]:
        """Layers that peers' pushes landed here since the last call (in arrival order)."""

    @abstractmethod
    def revoke_pushes(self, tag: str, timeout: float = 5.0) -> bool:
        """Refuse any further write tagged `tag` into this engine and wait up to `timeout` for
        writes in progress to stop. True when no write with that tag can touch local memory any
        more; False when that cannot be guaranteed (then keep the blocks out of use)."""

    @abstractmethod
    def in_flight(self, peer_engine_id: str) -> int:
        """Transfers to or from that peer not yet DONE or FAILED (a busy peer must not be
        evicted)."""

    @abstractmethod
    def forget_peer(self, peer_engine_id: str) -> bool:
        """Drop the lanes and mappings kept for a peer. False (and nothing dropped) while a
        transfer with it is in flight."""

    @abstractmethod
    def stats(self) -> TransportStats: ...

    @abstractmethod
    def close(self) -> None:
        """Stop serving, fail what is in flight (stage CLOSED) once it retired, release
        everything. Idempotent."""

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
