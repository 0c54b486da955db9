"""`mooncake`: the KV transport interface over Mooncake's transfer engine.

Package `mooncake-transfer-engine-non-cuda` on CPU hosts (it needs Debian's `libibverbs1` even
without RDMA hardware), `mooncake-transfer-engine` where GPU memory is registered. The engine is
initialised with `P2PHANDSHAKE` metadata (no etcd): its session id ("host:rpc_port") and the
regions' addresses travel in our descriptor, exchanged by the connector's handshake.
`protocol` is "tcp" here and "rdma" where the hardware has it.

How the interface's rules are kept on top of an engine that knows no namespaces:
- Namespace: every engine registers a small *cell* holding its random namespace. Each task first
  reads the peer's cell and compares it with the descriptor's: a restarted peer (another cell
  content, or no cell at that address) is refused before any data moves. Mooncake's own server
  also refuses addresses outside registered memory, and we check ranges against the
  descriptor before submitting.
- One task per layer and transfer: a batch of the layer's coalesced runs, run synchronously by
  a worker thread (Mooncake releases the GIL and polls for completion itself).
- Failures after data was submitted are reported with `quiesced=False`: Mooncake frees a failed
  or timed-out batch while its slices may still be in flight, so the caller must keep those
  blocks out of use. The engine's own timeout is `MC_TRANSFER_TIMEOUT` (>= 5 s), read when the
  engine is built; our deadline fails the handle earlier, equally unquiesced.
- Push notifications: after a layer's write batch completed, a read of the peer's cell carries a
  `TransferNotify(tag, {"ns", "layer"})`; the receiving side turns those into
  `PushNotification`s. `revoke_pushes` cannot stop Mooncake's server from writing, so it only
  drops later notifications and returns False.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

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
)
from fleetserve.engine.kv_transfer.transport.plan import Direction, Region, Run, make_region
from fleetserve.engine.kv_transfer.transport.plan import plan_transfer as _plan
from fleetserve.engine.kv_transfer.transport.shm import host_identity

if TYPE_CHECKING:
    from fleetserve.engine.kv_transfer.transport.shm import SharedKVArena

__all__ = ["MooncakeTransport"]

logger = logging.getLogger(__name__)

_CELL_BYTES = 64
_NS = 16


@dataclass(frozen=True, slots=True)
class _Work:
    session: str
    namespace: bytes
    cell_addr: int
    push: bool
    local: list[int]
    remote: list[int]
    lengths: list[int]
    tag: str
    layer: int


class MooncakeTransport(KVTransport):
    """See the module docstring. `workers` Mooncake calls run at once (each polls a core while
    it waits); `engine_timeout_s` sets MC_TRANSFER_TIMEOUT for engines built afterwards."""

    kind = "mooncake"

    def __init__(
        self,
        engine_id: str,
        *,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        workers: int = 2,
        max_inflight_tasks: int = 64,
        max_inflight_bytes: int = 1 << 30,
        transfer_timeout: float = 30.0,
        engine_timeout_s: int | None = None,
    ) -> None:
        super().__init__(engine_id)
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if workers < 1 or not transfer_timeout > 0:
            raise ValueError(
                f"need workers >= 1 and transfer_timeout > 0, got {workers}, {transfer_timeout}"
            )
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ImportError(
                "the mooncake transport needs mooncake-transfer-engine-non-cuda (CPU) or "
                "mooncake-transfer-engine (CUDA), and libibverbs1"
            ) from e
        if engine_timeout_s is not None:
            # Mooncake reads it in the engine's constructor (process-wide, minimum 5 s).
            os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, engine_timeout_s))
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(
                f"mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, "
                f"{protocol!r}) failed with {rc}"
            )
        self._host = host
        self._rpc_port = int(self._engine.get_rpc_port())
        self._transfer_timeout = transfer_timeout
        self._namespace = secrets.token_bytes(_NS)
        # Our cell, then one scratch cell per worker for reading peers' cells.
        self._cells = torch.zeros((workers + 1) * _CELL_BYTES, dtype=torch.uint8)
        self._cells[:_NS] = torch.frombuffer(bytearray(self._namespace), dtype=torch.uint8)
        self._register(self._cells.data_ptr(), self._cells.numel(), "namespace cells")
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}
        self._region_list: list[Region] = []
        self._spans: list[tuple[int, int]] = []
        self._revoked: set[str] = set()
        self._in_flight: dict[str, int] = {}
        self._tally = Tally()
        self._ids = itertools.count(1)
        self._admission = Admission(max_inflight_tasks, max_inflight_bytes)
        self._watchdog = Watchdog(f"kv-mooncake-{engine_id}")
        self._cond = threading.Condition()
        self._queue: deque[Task] = deque()
        self._workers = [
            threading.Thread(
                target=self._work_loop, args=(i,), daemon=True, name=f"kv-mooncake-{engine_id}-{i}"
            )
            for i in range(workers)
        ]
        for thread in self._workers:
            thread.start()

    def _register(self, ptr: int, nbytes: int, what: str) -> None:
        rc = self._engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_memory of {what} ({nbytes} B) failed: {rc}")

    # -- registration and descriptor -----------------------------------------------------------

    def register_region(
        self, name: str, tensor: torch.Tensor, *, layer: int, shared: SharedKVArena | None = None
    ) -> None:
        region = make_region(name, tensor, layer=layer, arena=shared)
        with self._lock:
            if name in self._regions:
                raise ValueError(f"region {name!r} is already registered")
            self._register_span(region.base_ptr, region.base_ptr + len(region.view), name)
            self._regions[name] = region
            self._region_list = [*self._region_list, region]

    def _register_span(self, start: int, end: int, name: str) -> None:
        """Register [start, end) with Mooncake, which refuses overlapping registrations (the
        keys and values of an interleaved layout overlap): merge with what overlaps it."""
        overlapping = [(s, e) for s, e in self._spans if s < end and start < e]
        for s, e in overlapping:
            self._engine.unregister_memory(s)
            self._spans.remove((s, e))
        start = min([start, *(s for s, _ in overlapping)])
        end = max([end, *(e for _, e in overlapping)])
        self._register(start, end - start, f"region {name!r}")
        self._spans.append((start, end))

    def descriptor(self) -> EndpointDescriptor:
        regions = self._region_list
        return EndpointDescriptor(
            transport=self.kind,
            engine_id=self.engine_id,
            host=self._host,
            port=self._rpc_port,
            namespace=self._namespace.hex(),
            host_identity=host_identity(),
            regions=tuple(r.info() for r in regions),
            extra={
                "session": f"{self._host}:{self._rpc_port}",
                "cell_addr": self._cells.data_ptr(),
                "region_addrs": [r.base_ptr for r in regions],
            },
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
        session, cell_addr, addrs = _peer_fields(peer)
        runs = _plan(direction, self._regions, peer, copies)
        deadline = time.monotonic() + (timeout if timeout is not None else self._transfer_timeout)
        transfer = Transfer(
            next(self._ids),
            peer.engine_id,
            layers={r.layer for r in runs},
            total_bytes=sum(r.nbytes for r in runs),
            num_descriptors=len(runs),
            same_host=False,
            deadline=deadline,
            admission=self._admission,
            on_finish=self._finished,
        )
        by_layer: dict[int, list[Run]] = {}
        for run in runs:
            by_layer.setdefault(run.layer, []).append(run)
        namespace = bytes.fromhex(peer.namespace)
        for layer, layer_runs in by_layer.items():
            local, remote, lengths = [], [], []
            for run in layer_runs:
                stride = peer.regions[run.remote_index].block_stride
                local.append(run.local.base_ptr + run.local_start * run.local.block_stride)
                remote.append(addrs[run.remote_index] + run.remote_start * stride)
                lengths.append((run.num_blocks - 1) * stride + run.local.block_bytes)
            work = _Work(
                session,
                namespace,
                cell_addr,
                direction == "push",
                local,
                remote,
                lengths,
                tag,
                layer,
            )
            nbytes = sum(r.nbytes for r in layer_runs)
            transfer.add_task(
                Task(transfer, layer, nbytes, work, self._enqueue, abortable=False, bounded=False)
            )
        with self._lock:
            self._in_flight[peer.engine_id] = self._in_flight.get(peer.engine_id, 0) + 1
        tasks = transfer.start()
        self._watchdog.add(transfer)
        self._admission.submit(tasks)
        return transfer

    def _enqueue(self, task: Task) -> None:
        with self._cond:
            self._queue.append(task)
            self._cond.notify()

    def _work_loop(self, index: int) -> None:
        scratch = self._cells.data_ptr() + (index + 1) * _CELL_BYTES
        view = self._cells[(index + 1) * _CELL_BYTES : (index + 1) * _CELL_BYTES + _NS]
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self.closed)
                if self.closed:
                    return
                task = self._queue.popleft()
            if not task.transfer.claim(task, None):
                continue
            failure = None
            try:
                failure = self._run(task.work, scratch, view)
            except Exception as e:  # a bug must fail the transfer, not kill the worker
                logger.exception("mooncake worker: unexpected error")
                failure = TransferFailure(FailureStage.TRANSPORT, repr(e), quiesced=False)
            task.transfer.retire(task, failure)

    def _run(self, work: _Work, scratch: int, view: torch.Tensor) -> TransferFailure | None:
        from mooncake.engine import TransferNotify, TransferOpcode

        failure = self._check_namespace(work, scratch, view)
        if failure is not None:
            return failure
        if work.push:
            rc = self._engine.batch_transfer_sync_write(
                work.session, work.local, work.remote, work.lengths
            )
        else:
            rc = self._engine.batch_transfer_sync_read(
                work.session, work.local, work.remote, work.lengths
            )
        if rc != 0:
            stage = FailureStage.SEND if work.push else FailureStage.RECEIVE
            return TransferFailure(
                stage,
                f"mooncake batch {'write' if work.push else 'read'} "
                f"of layer {work.layer} ({len(work.lengths)} runs) with "
                f"{work.session} failed ({rc}); not retried",
                quiesced=False,
            )
        if work.push:
            # Sent once the write completed, so the peer never sees it before the bytes.
            notify = TransferNotify(
                work.tag, json.dumps({"ns": work.namespace.hex(), "layer": work.layer})
            )
            rc = self._engine.transfer_sync(
                work.session, scratch, work.cell_addr, _NS, TransferOpcode.Read, notify
            )
            if rc != 0:
                return TransferFailure(
                    FailureStage.SEND,
                    f"mooncake notification of layer {work.layer} to {work.session} failed ({rc})",
                    quiesced=True,
                )
        return None

    def _check_namespace(
        self, work: _Work, scratch: int, view: torch.Tensor
    ) -> TransferFailure | None:
        view.zero_()
        rc = self._engine.batch_transfer_sync_read(work.session, [scratch], [work.cell_addr], [_NS])
        if rc != 0:
            return TransferFailure(
                FailureStage.CONNECT,
                f"cannot read the namespace of {work.session} ({rc})",
                quiesced=True,
            )
        if bytes(view.tolist()) != work.namespace:
            return TransferFailure(
                FailureStage.REJECTED,
                f"peer at {work.session} has another "
                "namespace (it restarted since the handshake): stale "
                "descriptor refused",
                quiesced=True,
            )
        return None

    def _finished(self, transfer: Transfer, status: TransferStatus) -> None:
        self._watchdog.discard(transfer)
        with self._lock:
            self._in_flight[transfer.peer_engine_id] -= 1
            if not self._in_flight[transfer.peer_engine_id]:
                del self._in_flight[transfer.peer_engine_id]
            self._tally.record(status)

    # -- the receiving side ----------------------------------------------------------------------

    def drain_notifications(self) -> list[PushNotification]:
        mine = self._namespace.hex()
        drained = []
        for note in self._engine.get_notifies():
            try:
                body = json.loads(note.msg)
                layer, namespace = int(body["layer"]), body["ns"]
            except (ValueError, KeyError, TypeError):
                continue  # not one of ours
            if namespace == mine and note.name not in self._revoked:
                drained.append(PushNotification(note.name, layer))
        return drained

    def revoke_pushes(self, tag: str, timeout: float = 5.0) -> bool:
        with self._lock:
            self._revoked.add(tag)
        return False

    # -- peers, stats, close ---------------------------------------------------------------------

    def in_flight(self, peer_engine_id: str) -> int:
        with self._lock:
            return self._in_flight.get(peer_engine_id, 0)

    def forget_peer(self, peer_engine_id: str) -> bool:
        # Mooncake keeps its segment handles itself; nothing of ours is per peer.
        return self.in_flight(peer_engine_id) == 0

    def stats(self) -> TransportStats:
        with self._lock:
            return self._tally.stats(self._admission, served=0, rejected=0)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self._closed.set()
        closed = TransferFailure(FailureStage.CLOSED, "the kv transport closed", quiesced=False)
        for transfer in self._watchdog.live():
            transfer.fail(closed)
        with self._cond:
            self._cond.notify_all()
        for thread in self._workers:
            thread.join(timeout=60.0)
        self._watchdog.stop()
        engine, self._engine = self._engine, None
        for start, _ in self._spans:
            engine.unregister_memory(start)
        engine.unregister_memory(self._cells.data_ptr())
        # Mooncake's engine shuts down in its destructor, holding the GIL for about half a
        # second: do it here, where the caller expects to wait, not at a random collection.
        del engine


def _peer_fields(peer: EndpointDescriptor) -> tuple[str, int, list[int]]:
    extra: dict[str, Any] = dict(peer.extra)
    session, cell, addrs = extra.get("session"), extra.get("cell_addr"), extra.get("region_addrs")
    if not isinstance(session, str) or not isinstance(cell, int) or not isinstance(addrs, list):
        raise ValueError(
            f"peer {peer.engine_id!r}: a mooncake descriptor needs extra.session, "
            f"extra.cell_addr and extra.region_addrs, got {sorted(extra)}"
        )
    if len(addrs) != len(peer.regions):
        raise ValueError(
            f"peer {peer.engine_id!r}: {len(addrs)} region addresses for "
            f"{len(peer.regions)} regions"
        )
    return session, cell, addrs
