"""The client side of the tcp transport: persistent lanes to one peer and the work they run.

A `PeerLink` holds a queue of admitted tasks and `lanes_per_peer` lanes; each lane is a thread
with its own connection (TCP_NODELAY), connected on first use and again after a failure, that
takes the next task, runs it to completion and takes another. A lane runs one request at a time.

Failures: any socket error fails the task with the stage it happened in (CONNECT, SEND,
RECEIVE, TIMEOUT for no progress) and closes the connection; nothing is retried, so a write
whose connection broke half-way is never replayed. A refused request (REJECTED) leaves the
connection usable. `abort(task)` (the watchdog, at the deadline) shuts the connection down so a
blocked call returns; it never interrupts a same-host copy, which cannot be stopped: a lane
copying into a peer's memory is only torn down after the copy and its END.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleetserve.engine.kv_transfer.transport.base import (
    EndpointDescriptor,
    FailureStage,
    TransferFailure,
)
from fleetserve.engine.kv_transfer.transport.handle import Task
from fleetserve.engine.kv_transfer.transport.plan import Run
from fleetserve.engine.kv_transfer.transport.shm import PeerArena
from fleetserve.engine.kv_transfer.transport.wire import (
    IOV_MAX,
    REQUEST,
    REQUEST_MAGIC,
    RESPONSE,
    RESPONSE_MAGIC,
    Op,
    Status,
    advance,
    pack_ranges,
    recv_exact,
    recv_views,
    send_all,
    set_kernel_timeouts,
)

__all__ = ["NetWork", "NotifyWork", "PeerLink", "ShmWork"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NetWork:
    """A READ (pull) or WRITE (push) of some runs of one layer, in one request."""

    namespace: bytes
    """The peer incarnation the plan was made against (never the link's latest)."""
    op: Op
    runs: Sequence[Run]
    tag: bytes = b""

    def describe(self) -> str:
        first = self.runs[0]
        more = f" and {len(self.runs) - 1} more runs" if len(self.runs) > 1 else ""
        return (
            f"region {first.local.name!r} peer blocks [{first.remote_start}, "
            f"{first.remote_start + first.num_blocks}){more}"
        )


@dataclass(frozen=True, slots=True)
class NotifyWork:
    """A push's per-layer notification, sent once the layer's writes are acknowledged."""

    namespace: bytes
    tag: bytes
    layer: int


@dataclass(frozen=True, slots=True)
class ShmWork:
    """Same-host copies: (destination address, source address, bytes) with the peer's ranges
    they touch. A pull VALIDATEs the ranges, then copies; a push brackets its copies with
    BEGIN and END."""

    namespace: bytes
    push: bool
    copies: Sequence[tuple[int, int, int]]
    ranges: Sequence[tuple[int, int, int]]
    tag: bytes = b""
    arenas: tuple[PeerArena, ...] = field(default=())
    """The mappings the addresses point into, kept alive while the work exists."""


class _Failed(Exception):
    def __init__(self, stage: FailureStage, message: str) -> None:
        super().__init__(message)
        self.stage = stage


class PeerLink:
    """Lanes and shared-memory mappings for one peer (engine id, host, port)."""

    def __init__(
        self,
        peer: EndpointDescriptor,
        *,
        lanes: int,
        connect_timeout: float,
        progress_timeout: float,
    ) -> None:
        self.peer = peer
        self.engine_id = peer.engine_id
        self.connect_timeout = connect_timeout
        self.progress_timeout = progress_timeout
        self.in_flight = 0
        """Transfers with this peer not finished (maintained by the transport)."""
        self.arenas: dict[tuple[str, str], PeerArena] = {}
        self.same_host_failed = False
        """Mapping the peer's memory failed once: use the socket from then on."""
        self._cond = threading.Condition()
        self._queue: deque[Task] = deque()
        self._closed = False
        self._request_ids = itertools.count(1)
        self._lanes = [_Lane(self, i) for i in range(lanes)]
        for lane in self._lanes:
            lane.thread.start()

    def enqueue(self, task: Task) -> None:
        with self._cond:
            closed = self._closed
            if not closed and isinstance(task.work, NotifyWork):
                self._queue.appendleft(task)  # a seal completes a layer someone waits for
            elif not closed:
                self._queue.append(task)
            self._cond.notify()
        if closed:  # raced with close(): nothing will run it
            failure = TransferFailure(FailureStage.CLOSED, "the peer link closed", quiesced=True)
            task.transfer.fail(failure)

    def take(self) -> Task | None:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed)
            return None if self._closed else self._queue.popleft()

    def next_request_id(self) -> int:
        return next(self._request_ids)

    def close(self) -> None:
        """Stop the lanes (the transport failed their transfers first) and drop mappings."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for lane in self._lanes:
            lane.close()
        for lane in self._lanes:
            lane.thread.join(timeout=10.0)
        self.arenas.clear()


class _Lane:
    def __init__(self, link: PeerLink, index: int) -> None:
        self.link = link
        self.thread = threading.Thread(
            target=self._loop, name=f"kv-tcp-lane-{link.engine_id}-{index}", daemon=True
        )
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._current: Task | None = None
        self._aborted = False
        self._copying = False
        self._header = bytearray(RESPONSE.size)
        self._confirmed_namespace: bytes | None = None
        """The namespace the peer behind the current connection answered a request for."""

    # -- control (other threads) ---------------------------------------------------------------

    def abort(self, task: Task) -> None:
        with self._lock:
            if self._current is not task:
                return
            self._aborted = True
            if not self._copying:
                _shutdown(self._sock)

    def close(self) -> None:
        with self._lock:
            if not self._copying:
                _shutdown(self._sock)

    # -- the lane's thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while (task := self.link.take()) is not None:
            if not task.transfer.claim(task, self):
                continue
            with self._lock:
                self._current, self._aborted = task, False
            failure, nbytes = None, None
            try:
                nbytes = self._run(task)
            except _Failed as e:
                failure = TransferFailure(e.stage, e.args[0], quiesced=True)
            except Exception as e:  # a bug must fail the transfer, not kill the lane
                logger.exception("kv tcp lane to %s: unexpected error", self.link.engine_id)
                failure = TransferFailure(FailureStage.TRANSPORT, repr(e), quiesced=True)
            with self._lock:
                self._current = None
            task.transfer.retire(task, failure, nbytes=nbytes)
        self._disconnect()

    def _run(self, task: Task) -> int | None:
        work = task.work
        deadline = task.transfer.deadline
        if isinstance(work, NetWork):
            data = [r.local.span(r.local_start, r.num_blocks) for r in work.runs]
            self._request(
                work.op,
                work.namespace,
                deadline,
                ranges=[(r.remote_index, r.remote_start, r.num_blocks) for r in work.runs],
                tag=work.tag,
                payload=data if work.op == Op.WRITE else (),
                into=data if work.op == Op.READ else None,
                what=work.describe(),
            )
            return None
        if isinstance(work, NotifyWork):
            self._request(
                Op.NOTIFY,
                work.namespace,
                deadline,
                layer=work.layer,
                tag=work.tag,
                what=f"layer {work.layer}",
            )
            return None
        assert isinstance(work, ShmWork)
        return self._run_same_host(work, deadline)

    def _run_same_host(self, work: ShmWork, deadline: float) -> int:
        """A push copies only once the peer accepted its BEGIN (the namespace, the ranges and
        revocation are checked first) and says END after. A pull copies once the peer VALIDATEd
        the namespace and ranges; after the peer answered a request naming that namespace on
        this connection, later pulls skip the round trip: a connection cannot outlive the
        incarnation it reached (`_connect` notices when it closed), and the mapping is of that
        incarnation's own file. Their ranges are then checked against the peer's descriptor
        only (it is the peer's own)."""
        what = "same-host ranges"
        ranges = work.ranges

        def copy() -> None:
            with self._lock:
                if self._aborted:  # torn down: the peer may have seen us go, so do not copy
                    raise _Failed(FailureStage.TIMEOUT, "aborted before the same-host copy")
                self._copying = True
            try:
                for dst, src, nbytes in work.copies:
                    ctypes.memmove(dst, src, nbytes)
            finally:
                with self._lock:
                    self._copying = False

        if work.push:
            self._request(
                Op.BEGIN, work.namespace, deadline, tag=work.tag, ranges=ranges, what=what
            )
            copy()
            self._request(Op.END, work.namespace, deadline, tag=work.tag, what=what)
        else:
            if not self._confirmed(work.namespace, deadline):
                self._request(Op.VALIDATE, work.namespace, deadline, ranges=ranges, what=what)
            copy()
        return sum(nbytes for _, _, nbytes in work.copies)

    def _request(
        self,
        op: Op,
        namespace: bytes,
        deadline: float,
        *,
        what: str,
        ranges: Sequence[tuple[int, int, int]] = (),
        layer: int = 0,
        tag: bytes = b"",
        payload: Sequence[memoryview] = (),
        into: Sequence[memoryview] | None = None,
    ) -> None:
        """Send one request and read its response; READ data lands in `into` directly."""
        sock = self._connect(deadline)
        request_id = self.link.next_request_id()
        payload_len = sum(len(p) for p in payload)
        header = REQUEST.pack(
            REQUEST_MAGIC, op, 0, len(tag), request_id, namespace, len(ranges), layer, payload_len
        )
        stage = FailureStage.SEND
        try:
            self._check_deadline(deadline)
            send_all(sock, [header, tag, pack_ranges(ranges), *payload])
            stage = FailureStage.RECEIVE
            status = self._response(sock, request_id, into)
        except (TimeoutError, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO/SO_SNDTIMEO
            self._disconnect()
            raise _Failed(
                FailureStage.TIMEOUT,
                f"{op.name} of {what} with {self.link.engine_id!r}: no progress within the timeout",
            ) from None
        except OSError as e:
            self._disconnect()
            doing = "sending" if stage is FailureStage.SEND else "receiving"
            raise _Failed(
                stage,
                f"{op.name} of {what} with {self.link.engine_id!r}: "
                f"connection failed while {doing} ({e}); not retried",
            ) from None
        if status is Status.OK:
            self._confirmed_namespace = namespace
        else:
            raise _Failed(
                FailureStage.REJECTED,
                f"peer {self.link.engine_id!r} refused {op.name} of {what}: {status.describe()}",
            )

    def _response(
        self, sock: socket.socket, request_id: int, into: Sequence[memoryview] | None
    ) -> Status:
        header = memoryview(self._header)
        if into is None:
            recv_exact(sock, header)
            rest: list[memoryview] = []
        else:
            # Header and data in one syscall when they are already there (a 4 KiB read). No
            # MSG_WAITALL: a refusal is a bare header, and nothing else is in flight on the lane.
            n = sock.recvmsg_into([header, *into[: IOV_MAX - 1]])[0]
            if n == 0:
                raise ConnectionError("connection closed by the peer")
            if n < RESPONSE.size:
                recv_exact(sock, header[n:])
            rest = advance(list(into), max(0, n - RESPONSE.size))
        magic, status, _flags, _reserved, echoed, payload_len = RESPONSE.unpack_from(header)
        if magic != RESPONSE_MAGIC or echoed != request_id:
            raise ConnectionError("malformed response (lane out of step)")
        if status == Status.OK and into is not None:
            expected = sum(len(v) for v in into)
            if payload_len != expected:
                raise ConnectionError(f"response of {payload_len} bytes, expected {expected}")
            recv_views(sock, rest)
        elif into is not None and sum(len(v) for v in rest) != sum(len(v) for v in into):
            raise ConnectionError("data after a refusal (lane out of step)")
        return Status(status)

    def _confirmed(self, namespace: bytes, deadline: float) -> bool:
        """Whether the open connection already proved the peer is that incarnation."""
        if self._sock is None or self._confirmed_namespace != namespace:
            return False
        self._connect(deadline)  # replaces the connection (unconfirmed) if the peer closed it
        return self._confirmed_namespace == namespace

    def _connect(self, deadline: float) -> socket.socket:
        if self._sock is not None:
            # An idle lane has nothing to read: readable means the peer closed it (it exited or
            # restarted). Reconnect before sending rather than fail a request that never left.
            poller = select.poll()
            poller.register(self._sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            if not poller.poll(0):
                return self._sock
            self._disconnect()
        peer = self.link.peer
        timeout = min(self.link.connect_timeout, max(0.001, deadline - time.monotonic()))
        try:
            sock = socket.create_connection((peer.host, peer.port), timeout=timeout)
        except OSError as e:
            raise _Failed(
                FailureStage.CONNECT,
                f"cannot connect to {peer.engine_id!r} at {peer.host}:{peer.port}: {e}",
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_kernel_timeouts(sock, self.link.progress_timeout)
        with self._lock:
            self._sock = sock
            if self._aborted:
                _shutdown(sock)
        return sock

    def _check_deadline(self, deadline: float) -> None:
        # Within a request the watchdog enforces the deadline (it shuts the socket down) and the
        # kernel the progress timeout; between requests, do not start one that is already late.
        if time.monotonic() > deadline:
            raise TimeoutError("deadline passed")

    def _disconnect(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
            self._confirmed_namespace = None
        if sock is not None:
            _shutdown(sock)
            sock.close()


def _shutdown(sock: socket.socket | None) -> None:
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
