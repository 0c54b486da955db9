"""`tcp`: our own KV transport over TCP, with a shared-memory fast path on one machine.

Each engine runs a `TcpServer` over its registered regions and keeps `PeerLink`s (persistent
lanes) to the peers it pulls from or pushes to. A transfer is planned into runs (contiguous on
both sides), grouped per layer into requests of at most `chunk_bytes` (one request carries
many runs: scatter-gather), spread over the lanes and admitted under `max_inflight_tasks` /
`max_inflight_bytes`. Layers are queued in order, so layer 0 lands first and `wait_layer(0)`
returns while later layers still move. A push sends a NOTIFY per layer once the layer's writes
are acknowledged.

Same-host fast path: when the peer's `host_identity` equals ours and the peer's side of the
transfer (the source of a pull, the destination of a push) lives in a `SharedKVArena`, the lane
maps the peer's arena and copies each run with one memcpy. A push copies only after the peer
accepted a BEGIN (namespace, ranges, revocation) and ends with END. A pull copies after the peer
VALIDATEd namespace and ranges, or at once when the lane's connection already carried an answer
for that namespace (the connection cannot outlive the incarnation it reached), so that a
same-host pull needs no help from the peer's CPU. If the mapping cannot be opened, the link
falls back to the socket for good.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetserve.engine.kv_transfer.transport.base import (
    BlockCopy,
    EndpointDescriptor,
    FailureStage,
    KVTransport,
    PushNotification,
    TransferFailure,
    TransferStatus,
    TransportStats,
)
from fleetserve.engine.kv_transfer.transport.handle import (
    Admission,
    Tally,
    Task,
    Transfer,
    Watchdog,
    abort_task,
)
from fleetserve.engine.kv_transfer.transport.plan import (
    Direction,
    Region,
    Run,
    group_runs,
    make_region,
    plan_transfer,
)
from fleetserve.engine.kv_transfer.transport.shm import PeerArena, host_identity
from fleetserve.engine.kv_transfer.transport.tcp_lane import NetWork, NotifyWork, PeerLink, ShmWork
from fleetserve.engine.kv_transfer.transport.tcp_server import TcpServer
from fleetserve.engine.kv_transfer.transport.wire import Op

if TYPE_CHECKING:
    import torch

    from fleetserve.engine.kv_transfer.transport.shm import SharedKVArena

__all__ = ["TcpConfig", "TcpTransport"]

logger = logging.getLogger(__name__)

_MiB = 1 << 20
MAX_REQUEST_BYTES = 1 << 30
"""The largest request a server accepts (a sanity bound: nothing is allocated from it), so that
peers configured with different chunk sizes still understand each other."""


@dataclass(frozen=True, slots=True)
class TcpConfig:
    lanes_per_peer: int = 4
    """Connections (and threads) per peer; two or more beat one on loopback."""
    chunk_bytes: int = 4 * _MiB
    """Largest single request; a longer run is cut into chunks spread over the lanes."""
    same_host_chunk_bytes: int = 16 * _MiB
    """Largest single same-host copy task."""
    max_inflight_tasks: int = 64
    max_inflight_bytes: int = 256 * _MiB
    connect_timeout: float = 5.0
    progress_timeout: float = 10.0
    """A socket call that makes no progress for this long fails its task (TIMEOUT)."""
    transfer_timeout: float = 30.0
    """Default deadline of a transfer, from submission (pull/push `timeout` overrides it)."""
    same_host: bool = True
    """Use shared memory when the peer runs on this machine (and its memory allows)."""
    max_connections: int = 256
    """Connections the server accepts at once."""

    def __post_init__(self) -> None:
        for name in (
            "lanes_per_peer",
            "chunk_bytes",
            "same_host_chunk_bytes",
            "max_inflight_tasks",
            "max_inflight_bytes",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"TcpConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("connect_timeout", "progress_timeout", "transfer_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TcpConfig.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.chunk_bytes > MAX_REQUEST_BYTES:
            raise ValueError(
                f"TcpConfig.chunk_bytes must be <= {MAX_REQUEST_BYTES}, got {self.chunk_bytes}"
            )
        if max(self.chunk_bytes, self.same_host_chunk_bytes) > self.max_inflight_bytes:
            raise ValueError(
                f"TcpConfig.chunk_bytes ({self.chunk_bytes}) and same_host_chunk_bytes "
                f"({self.same_host_chunk_bytes}) must not exceed max_inflight_bytes "
                f"({self.max_inflight_bytes})"
            )


def _namespace_bytes(peer: EndpointDescriptor) -> bytes:
    try:
        namespace = bytes.fromhex(peer.namespace)
    except ValueError:
        namespace = b""
    if len(namespace) != 16:
        raise ValueError(
            f"peer {peer.engine_id!r}: namespace must be 32 hex digits, got {peer.namespace!r}"
        )
    return namespace


class TcpTransport(KVTransport):
    """See the module docstring. `host`/`port` are where the server binds (port 0: any free
    port); `advertise_host` is the address peers use (default: `host`)."""

    kind = "tcp"

    def __init__(
        self,
        engine_id: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        config: TcpConfig | None = None,
    ) -> None:
        super().__init__(engine_id)
        self.config = config or TcpConfig()
        self._namespace = secrets.token_bytes(16)
        self._host_identity = host_identity()
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}
        self._region_list: list[Region] = []
        self._links: dict[tuple[str, str, int], PeerLink] = {}
        self._ids = itertools.count(1)
        self._tally = Tally()
        self._admission = Admission(self.config.max_inflight_tasks, self.config.max_inflight_bytes)
        self._watchdog = Watchdog(f"kv-tcp-{engine_id}")
        self._server = TcpServer(
            host,
            port,
            namespace=self._namespace,
            regions=lambda: self._region_list,
            progress_timeout=self.config.progress_timeout,
            max_connections=self.config.max_connections,
            max_request_bytes=MAX_REQUEST_BYTES,
        )
        self._host = advertise_host or host

    # -- registration and descriptor -----------------------------------------------------------

    def register_region(
        self, name: str, tensor: torch.Tensor, *, layer: int, shared: SharedKVArena | None = None
    ) -> None:
        region = make_region(name, tensor, layer=layer, arena=shared)
        with self._lock:
            if name in self._regions:
                raise ValueError(f"region {name!r} is already registered")
            self._regions[name] = region
            self._region_list = [*self._region_list, region]

    def descriptor(self) -> EndpointDescriptor:
        regions = self._region_list
        files: list[dict[str, object]] = []
        placement: list[list[int] | None] = []
        index: dict[str, int] = {}
        for region in regions:
            if region.arena is None:
                placement.append(None)
                continue
            key = str(region.arena.path)
            if key not in index:
                index[key] = len(files)
                files.append(region.arena.describe())
            placement.append([index[key], region.arena.offset_of(region.base_ptr)])
        return EndpointDescriptor(
            transport=self.kind,
            engine_id=self.engine_id,
            host=self._host,
            port=self._server.port,
            namespace=self._namespace.hex(),
            host_identity=self._host_identity,
            regions=tuple(r.info() for r in regions),
            extra={"shm_files": files, "shm_regions": placement} if files else {},
        )

    # -- transfers -----------------------------------------------------------------------------

    def _start(
        self,
        direction: Direction,
        peer: EndpointDescriptor,
        copies: Sequence[BlockCopy],
        tag: str,
        timeout: float | None,
    ) -> Transfer:
        runs = plan_transfer(direction, self._regions, peer, copies)
        namespace = _namespace_bytes(peer)
        link = self._link(peer)  # counts this transfer in link.in_flight
        try:
            transfer = self._build(direction, link, peer, runs, namespace, tag.encode(), timeout)
        except BaseException:
            with self._lock:
                link.in_flight -= 1
            raise
        tasks = transfer.start()
        self._watchdog.add(transfer)
        self._admission.submit(tasks)
        return transfer

    def _build(
        self,
        direction: Direction,
        link: PeerLink,
        peer: EndpointDescriptor,
        runs: list[Run],
        namespace: bytes,
        tag: bytes,
        timeout: float | None,
    ) -> Transfer:
        arenas = self._peer_arenas(link, peer, runs)
        deadline = time.monotonic() + (
            timeout if timeout is not None else self.config.transfer_timeout
        )
        transfer = Transfer(
            next(self._ids),
            peer.engine_id,
            layers={r.layer for r in runs},
            total_bytes=sum(r.nbytes for r in runs),
            num_descriptors=len(runs),
            same_host=arenas is not None,
            deadline=deadline,
            admission=self._admission,
            on_finish=lambda t, status: self._finished(t, status, link),
        )
        if arenas is not None:
            self._add_same_host_tasks(
                transfer, link, peer, runs, arenas, direction == "push", tag, namespace
            )
        else:
            op = Op.READ if direction == "pull" else Op.WRITE
            for group in group_runs(runs, self.config.chunk_bytes):
                work = NetWork(namespace, op, group, tag)
                nbytes = sum(piece.nbytes for piece in group)
                transfer.add_task(Task(transfer, group[0].layer, nbytes, work, link.enqueue))
        if direction == "push":
            for layer in sorted({r.layer for r in runs}):
                seal = NotifyWork(namespace, tag, layer)
                transfer.add_seal(Task(transfer, layer, 0, seal, link.enqueue))
        return transfer

    def _add_same_host_tasks(
        self,
        transfer: Transfer,
        link: PeerLink,
        peer: EndpointDescriptor,
        runs: list[Run],
        arenas: dict[int, tuple[PeerArena, int]],
        push: bool,
        tag: bytes,
        namespace: bytes,
    ) -> None:
        """Group the runs of each layer into copy tasks of at most same_host_chunk_bytes."""
        groups = group_runs(runs, self.config.same_host_chunk_bytes)
        for group in groups:
            copies = []
            for piece in group:
                arena, offset = arenas[piece.remote_index]
                stride = peer.regions[piece.remote_index].block_stride
                remote = arena.base_ptr + offset + piece.remote_start * stride
                local = piece.local.base_ptr + piece.local_start * piece.local.block_stride
                span = (piece.num_blocks - 1) * stride + piece.local.block_bytes
                copies.append((remote, local, span) if push else (local, remote, span))
            ranges = [(p.remote_index, p.remote_start, p.num_blocks) for p in group]
            used = tuple(
                {id(arenas[p.remote_index][0]): arenas[p.remote_index][0] for p in group}.values()
            )
            work = ShmWork(namespace, push, copies, ranges, tag, used)
            nbytes = sum(p.nbytes for p in group)
            transfer.add_task(Task(transfer, group[0].layer, nbytes, work, link.enqueue))

    def _peer_arenas(
        self, link: PeerLink, peer: EndpointDescriptor, runs: list[Run]
    ) -> dict[int, tuple[PeerArena, int]] | None:
        """The peer's mapped arenas by region index, when the same-host path can carry `runs`."""
        if (
            not self.config.same_host
            or link.same_host_failed
            or not runs
            or peer.host_identity != self._host_identity
        ):
            return None
        files = peer.extra.get("shm_files") or []
        placement = peer.extra.get("shm_regions") or []
        needed = {r.remote_index for r in runs}
        if any(i >= len(placement) or placement[i] is None for i in needed):
            return None
        mapped: dict[int, tuple[PeerArena, int]] = {}
        for i in needed:
            file_index, offset = placement[i]
            spec = files[file_index]
            key = (spec["path"], spec["arena_id"])
            with self._lock:
                arena = link.arenas.get(key)
            if arena is None:
                try:
                    arena = PeerArena.open(spec["path"], spec["arena_id"], spec["size"])
                except (OSError, ValueError, RuntimeError) as e:
                    logger.warning(
                        "same-host path to %r unavailable (%s); using TCP", peer.engine_id, e
                    )
                    link.same_host_failed = True
                    return None
                with self._lock:
                    arena = link.arenas.setdefault(key, arena)
            info = peer.regions[i]
            if offset + (info.num_blocks - 1) * info.block_stride + info.block_bytes > arena.size:
                # The descriptor does not fit the file (it is stale or wrong): let the socket
                # path carry the transfer, where the peer itself refuses what is out of range.
                return None
            mapped[i] = (arena, offset)
        return mapped

    def _link(self, peer: EndpointDescriptor) -> PeerLink:
        """The peer's link, with one more transfer counted in flight (so that `forget_peer`
        cannot close it under the transfer)."""
        key = (peer.engine_id, peer.host, peer.port)
        with self._lock:
            if self.closed:
                raise RuntimeError(f"kv transport of {self.engine_id!r} is closed")
            link = self._links.get(key)
            if link is not None and link.peer.namespace != peer.namespace:
                # Same address, another incarnation: each task names the namespace its plan
                # was made against, so this only refreshes what new mappings are checked with.
                link.peer = peer
                link.same_host_failed = False
            if link is None:
                link = self._links[key] = PeerLink(
                    peer,
                    lanes=self.config.lanes_per_peer,
                    connect_timeout=self.config.connect_timeout,
                    progress_timeout=self.config.progress_timeout,
                )
            link.in_flight += 1
            return link

    def _finished(self, transfer: Transfer, status: TransferStatus, link: PeerLink) -> None:
        self._watchdog.discard(transfer)
        with self._lock:
            link.in_flight -= 1
            self._tally.record(status)

    # -- the receiving side ----------------------------------------------------------------------

    def drain_notifications(self) -> list[PushNotification]:
        return self._server.drain_notifications()

    def revoke_pushes(self, tag: str, timeout: float = 5.0) -> bool:
        return self._server.revoke(tag, timeout)

    def drop_connections(self) -> None:
        """Tear down the server's peer connections (operations and fault tests)."""
        self._server.drop_connections()

    # -- peers, stats, close ---------------------------------------------------------------------

    def in_flight(self, peer_engine_id: str) -> int:
        with self._lock:
            return sum(
                link.in_flight
                for (engine, _, _), link in self._links.items()
                if engine == peer_engine_id
            )

    def forget_peer(self, peer_engine_id: str) -> bool:
        with self._lock:
            keys = [key for key in self._links if key[0] == peer_engine_id]
            if any(self._links[key].in_flight for key in keys):
                return False
            links = [self._links.pop(key) for key in keys]
        for link in links:
            link.close()
        return True

    def stats(self) -> TransportStats:
        with self._lock:
            return self._tally.stats(
                self._admission, served=self._server.served, rejected=self._server.rejected
            )

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self._closed.set()
            links = list(self._links.values())
            self._links.clear()
        closed = TransferFailure(FailureStage.CLOSED, "the kv transport closed", quiesced=True)
        for transfer in self._watchdog.live():
            for task in transfer.fail(closed):
                abort_task(task)
        for link in links:
            link.close()  # joins the lanes: every running task has retired after this
        self._server.close()
        self._watchdog.stop()
