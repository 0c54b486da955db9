"""The serving side of the tcp transport: reads from and writes into the registered regions.

One thread per connection (a peer's lane) answers its requests in order. Every request is
checked before any byte of a region is touched: the namespace must be this incarnation's, the
region must exist and the blocks must be in range; a refused WRITE's payload is drained into
scratch. Bytes go straight between the socket and the region (`sendmsg` of a slice of the
region's memoryview, `recv_into` a slice of it).

Bounds: at most `max_connections` connections (more are closed at once); each carries one
request at a time, of at most `max_request_bytes`; a request stalled mid-way for longer than
`progress_timeout` drops its connection.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections import OrderedDict, deque
from collections.abc import Callable

from fleetserve.engine.kv_transfer.transport.base import PushNotification
from fleetserve.engine.kv_transfer.transport.plan import Region
from fleetserve.engine.kv_transfer.transport.wire import (
    MAX_RANGES,
    RANGE,
    REQUEST,
    REQUEST_MAGIC,
    RESPONSE,
    RESPONSE_MAGIC,
    Op,
    Status,
    recv_exact,
    recv_views,
    send_all,
    set_kernel_timeouts,
    unpack_ranges,
)

__all__ = ["TcpServer"]

logger = logging.getLogger(__name__)

_MAX_REVOKED = 65536
_MAX_INBOX = 1 << 20


class TcpServer:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        namespace: bytes,
        regions: Callable[[], list[Region]],
        progress_timeout: float,
        max_connections: int,
        max_request_bytes: int,
    ) -> None:
        self._namespace = namespace
        self._regions = regions
        self._progress_timeout = progress_timeout
        self._max_connections = max_connections
        self._max_request_bytes = max_request_bytes
        self._cond = threading.Condition()
        self._conns: dict[int, socket.socket] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._writing: dict[int, str] = {}
        """Connection -> tag of the push it is receiving into a region now (or bracketing with
        BEGIN/END on the same-host path)."""
        self._receiving: set[int] = set()
        """Connections of `_writing` that receive through the socket (a revoke may tear them
        down); the others copy through shared memory, which only their END or exit stops."""
        self._revoked: OrderedDict[str, None] = OrderedDict()
        self._inbox: deque[PushNotification] = deque(maxlen=_MAX_INBOX)
        self._next_conn = 0
        self._closing = False
        self.served = 0
        self.rejected = 0
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"kv-tcp-accept-{self.port}", daemon=True
        )
        self._acceptor.start()

    # -- control -------------------------------------------------------------------------------

    def drain_notifications(self) -> list[PushNotification]:
        with self._cond:
            drained = list(self._inbox)
            self._inbox.clear()
        return drained

    def revoke(self, tag: str, timeout: float) -> bool:
        """Refuse writes tagged `tag` from now on; tear down connections receiving one now and
        wait for same-host pushes bracketed by BEGIN to reach END (or their peer to go)."""
        with self._cond:
            self._revoked[tag] = None
            self._revoked.move_to_end(tag)
            while len(self._revoked) > _MAX_REVOKED:
                self._revoked.popitem(last=False)
            for conn_id, writing in self._writing.items():
                if writing == tag and conn_id in self._receiving:
                    _shutdown(self._conns.get(conn_id))
            return self._cond.wait_for(lambda: tag not in self._writing.values(), timeout)

    def drop_connections(self, *, same_host_writers: bool = False) -> None:
        """Tear down peer connections (their requests in flight fail on the peer). Those of
        same-host pushes between BEGIN and END are kept unless `same_host_writers`: their
        copies go on regardless, and only their END or exit tells when they stopped."""
        with self._cond:
            conns = [
                conn
                for conn_id, conn in self._conns.items()
                if same_host_writers or conn_id not in self._writing or conn_id in self._receiving
            ]
        for conn in conns:
            _shutdown(conn)

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
        _shutdown(self._listener)
        self._listener.close()
        self._acceptor.join(timeout=5.0)
        self.drop_connections(same_host_writers=True)
        with self._cond:
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout=5.0)

    # -- connections ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._cond:
                if self._closing or len(self._conns) >= self._max_connections:
                    conn.close()
                    continue
                conn_id = self._next_conn
                self._next_conn += 1
                self._conns[conn_id] = conn
                thread = threading.Thread(
                    target=self._serve,
                    args=(conn_id, conn),
                    name=f"kv-tcp-serve-{conn_id}",
                    daemon=True,
                )
                self._threads[conn_id] = thread
            thread.start()

    def _serve(self, conn_id: int, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_kernel_timeouts(conn, self._progress_timeout)
        header = bytearray(REQUEST.size)
        view = memoryview(header)
        try:
            while not self._closing:
                try:
                    n = conn.recv_into(view, REQUEST.size)
                except (TimeoutError, BlockingIOError):
                    continue  # an idle lane: keep waiting for its next request
                if n == 0:
                    return
                if n < REQUEST.size:
                    recv_exact(conn, view[n:])
                if not self._handle(conn_id, conn, header):
                    return
        except OSError as e:
            logger.debug("kv tcp connection %d ended: %s", conn_id, e)
        finally:
            with self._cond:
                self._conns.pop(conn_id, None)
                self._threads.pop(conn_id, None)
                self._writing.pop(conn_id, None)
                self._receiving.discard(conn_id)
                self._cond.notify_all()
            conn.close()

    def _handle(self, conn_id: int, conn: socket.socket, header: bytearray) -> bool:
        """Answer one request; False to drop the connection (a protocol error)."""
        (magic, op, _flags, tag_len, request_id, namespace, num_ranges, layer, payload_len) = (
            REQUEST.unpack_from(header)
        )
        if (
            magic != REQUEST_MAGIC
            or payload_len > self._max_request_bytes
            or num_ranges > MAX_RANGES
        ):
            logger.warning("kv tcp connection %d: malformed request, dropping it", conn_id)
            return False
        tag = bytes(_recv(conn, tag_len)).decode(errors="replace") if tag_len else ""
        ranges = unpack_ranges(_recv(conn, num_ranges * RANGE.size)) if num_ranges else []
        status = Status.OK if namespace == self._namespace else Status.STALE_NAMESPACE
        spans: list[memoryview] = []
        if status is Status.OK and op in (Op.READ, Op.WRITE, Op.VALIDATE, Op.BEGIN):
            status, spans = self._spans(ranges)
        if op == Op.READ:
            if status is Status.OK:
                total = sum(len(v) for v in spans)
                send_all(conn, [_response(Status.OK, request_id, total), *spans])
                return self._count(status)
        elif op == Op.WRITE:
            if status is Status.OK and sum(len(v) for v in spans) != payload_len:
                status = Status.BAD_REQUEST
            if status is Status.OK and not self._begin_write(conn_id, tag, receiving=True):
                status = Status.REVOKED
            if status is not Status.OK:
                _drain(conn, payload_len)
            else:
                try:
                    recv_views(conn, spans)
                finally:
                    self._end_write(conn_id)
        elif op == Op.BEGIN:
            if status is Status.OK and not self._begin_write(conn_id, tag):
                status = Status.REVOKED
        elif op == Op.END:
            self._end_write(conn_id)
        elif op == Op.NOTIFY:
            with self._cond:
                if status is Status.OK and tag in self._revoked:
                    status = Status.REVOKED
                if status is Status.OK:
                    self._inbox.append(PushNotification(tag, layer))
        elif op != Op.VALIDATE:
            return False
        send_all(conn, [_response(status, request_id, 0)])
        return self._count(status)

    def _spans(self, ranges: list[tuple[int, int, int]]) -> tuple[Status, list[memoryview]]:
        """The bytes of every range, or the first reason one is refused (then none)."""
        regions = self._regions()
        spans = []
        for index, start, count in ranges:
            if index >= len(regions):
                return Status.UNKNOWN_REGION, []
            region = regions[index]
            if count < 1 or start + count > region.num_blocks:
                return Status.OUT_OF_RANGE, []
            if count > 1 and not region.contiguous:
                return Status.BAD_REQUEST, []
            spans.append(region.span(start, count))
        return Status.OK, spans

    def _begin_write(self, conn_id: int, tag: str, *, receiving: bool = False) -> bool:
        with self._cond:
            if tag in self._revoked:
                return False
            self._writing[conn_id] = tag
            if receiving:
                self._receiving.add(conn_id)
            return True

    def _end_write(self, conn_id: int) -> None:
        with self._cond:
            self._writing.pop(conn_id, None)
            self._receiving.discard(conn_id)
            self._cond.notify_all()

    def _count(self, status: Status) -> bool:
        with self._cond:
            if status is Status.OK:
                self.served += 1
            else:
                self.rejected += 1
        return True


def _response(status: Status, request_id: int, payload_len: int) -> bytes:
    return RESPONSE.pack(RESPONSE_MAGIC, status, 0, 0, request_id, payload_len)


def _recv(conn: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    recv_exact(conn, memoryview(data))
    return data


def _drain(conn: socket.socket, size: int) -> None:
    """Read and discard a refused payload so the lane stays in step."""
    scratch = memoryview(bytearray(min(size, 1 << 20)))
    left = size
    while left:
        piece = min(left, len(scratch))
        recv_exact(conn, scratch[:piece])
        left -= piece


def _shutdown(sock: socket.socket | None) -> None:
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
