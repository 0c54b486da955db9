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
    REQUEST,
    REQUEST_MAGIC,
    RESPONSE,
    RESPONSE_MAGIC,
    Op,
    Status,
    recv_exact,
    send_all,
)

__all__ = ["NetWork", "NotifyWork", "PeerLink", "ShmWork"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NetWork:
    """A READ (pull) or WRITE (push) of one run through the socket."""

    namespace: bytes
    """The peer incarnation the plan was made against (never the link's latest)."""
    op: Op
    run: Run
    tag: bytes = b""


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
    ranges: bytes
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
            if isinstance(task.work, NotifyWork):
                self._queue.appendleft(task)  # a seal completes a layer someone waits for
            else:
                self._queue.append(task)
            self._cond.notify()

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
            run = work.run
            data = run.local.span(run.local_start, run.num_blocks)
            self._request(
                work.op,
                work.namespace,
                deadline,
                region=run.remote_index,
                start=run.remote_start,
                count=run.num_blocks,
                tag=work.tag,
                payload=data if work.op == Op.WRITE else None,
                into=data if work.op == Op.READ else None,
                what=f"region {run.local.name!r} peer blocks "
                f"[{run.remote_start}, {run.remote_start + run.num_blocks})",
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
        what = "same-host ranges"
        op = Op.BEGIN if work.push else Op.VALIDATE
        self._request(
            op, work.namespace, deadline, tag=work.tag, payload=memoryview(work.ranges), what=what
        )
        with self._lock:
            if self._aborted:  # torn down after the check: do not copy (the peer saw us go)
                raise _Failed(FailureStage.TIMEOUT, "aborted before the same-host copy")
            self._copying = True
        try:
            total = 0
            for dst, src, nbytes in work.copies:
                ctypes.memmove(dst, src, nbytes)
                total += nbytes
        finally:
            with self._lock:
                self._copying = False
        if work.push:
            self._request(Op.END, work.namespace, deadline, tag=work.tag, what=what)
        return total

    def _request(
        self,
        op: Op,
        namespace: bytes,
        deadline: float,
        *,
        what: str,
        region: int = 0,
        start: int = 0,
        count: int = 0,
        layer: int = 0,
        tag: bytes = b"",
        payload: memoryview | None = None,
        into: memoryview | None = None,
    ) -> None:
        """Send one request and read its response; READ data lands in `into` directly."""
        sock = self._connect(deadline)
        request_id = self.link.next_request_id()
        payload_len = len(payload) if payload is not None else 0
        header = REQUEST.pack(
            REQUEST_MAGIC,
            op,
            0,
            len(tag),
            request_id,
            namespace,
            region,
            start,
            count,
            layer,
            payload_len,
        )
        stage = FailureStage.SEND
        try:
            self._set_timeout(sock, deadline)
            send_all(sock, [header, tag] if payload is None else [header, tag, payload])
            stage = FailureStage.RECEIVE
            status = self._response(sock, request_id, into, deadline)
        except TimeoutError:
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
        if status is not Status.OK:
            raise _Failed(
                FailureStage.REJECTED,
                f"peer {self.link.engine_id!r} refused {op.name} of {what}: {status.describe()}",
            )

    def _response(
        self, sock: socket.socket, request_id: int, into: memoryview | None, deadline: float
    ) -> Status:
        header = memoryview(self._header)
        if into is None:
            recv_exact(sock, header)
            got = 0
        else:
            # Header and data in one syscall when they are already there (a 4 KiB read).
            n, _, _, _ = sock.recvmsg_into([header, into])
            if n == 0:
                raise ConnectionError("connection closed by the peer")
            if n < RESPONSE.size:
                recv_exact(sock, header[n:])
            got = max(0, n - RESPONSE.size)
        magic, status, _flags, _reserved, echoed, payload_len = RESPONSE.unpack_from(header)
        if magic != RESPONSE_MAGIC or echoed != request_id:
            raise ConnectionError("malformed response (lane out of step)")
        if status == Status.OK and into is not None:
            if payload_len != len(into):
                raise ConnectionError(f"response of {payload_len} bytes, expected {len(into)}")
            while got < len(into):
                self._set_timeout(sock, deadline)
                recv_exact(sock, into[got:])
                got = len(into)
        elif got:
            raise ConnectionError("data after a refusal (lane out of step)")
        return Status(status)

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
        with self._lock:
            self._sock = sock
            if self._aborted:
                _shutdown(sock)
        return sock

    def _set_timeout(self, sock: socket.socket, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(min(self.link.progress_timeout, left))

    def _disconnect(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            _shutdown(sock)
            sock.close()


def _shutdown(sock: socket.socket | None) -> None:
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
