"""The tcp transport's frames, and socket helpers that move bytes without intermediate copies.

A lane carries one request at a time: the client sends a request, the server answers with one
response, then the next request may follow. Every request names the server's namespace.

    request  = REQUEST header, tag (tag_len bytes), ranges (num_ranges x RANGE), payload
    response = RESPONSE header, payload (payload_len: a READ's blocks, nothing otherwise)

A range is (region index, block_start, num_blocks) on the server. Data requests carry many
ranges (scatter-gather: one request per chunk of runs however fragmented the blocks are), and
the server checks all of them before it moves a byte.

Responses carry a status code and no text: the client knows what it asked for and words the
error itself, and a READ's payload can then be received straight into the destination blocks
together with the header (one `recvmsg_into`), since an error response has no bytes after it.

Ops
- READ (ranges): the server answers with the ranges' bytes, in order.
- WRITE (tag, ranges) + the bytes: the server receives them straight into its regions and
  answers once they are in memory. A refused WRITE's payload is drained into scratch, never
  into a region.
- NOTIFY (tag, layer): a push's layer landed; the server queues a PushNotification.
- VALIDATE (ranges): the server checks its namespace and the ranges without moving data (the
  same-host path asks this before copying from the peer's mapped memory).
- BEGIN (tag, ranges) / END (tag): bracket a same-host push's copies into the server's memory,
  so that the server knows when a revoked tag can no longer write.
"""

from __future__ import annotations

import enum
import socket
import struct
from collections.abc import Sequence

__all__ = [
    "REQUEST",
    "RESPONSE",
    "Op",
    "Status",
    "advance",
    "pack_ranges",
    "recv_exact",
    "recv_views",
    "send_all",
    "set_kernel_timeouts",
    "unpack_ranges",
]

REQUEST_MAGIC = b"FKQ1"
RESPONSE_MAGIC = b"FKR1"

# magic, op, flags, tag_len, request id, namespace, num_ranges, layer, payload_len
REQUEST = struct.Struct("!4sBBHQ16sIIQ")
# magic, status, flags, reserved, request id, payload_len
RESPONSE = struct.Struct("!4sBBHQQ")
RANGE = struct.Struct("!III")
MAX_RANGES = 1 << 16
IOV_MAX = 1024
"""Buffers one sendmsg/recvmsg_into takes (Linux's UIO_MAXIOV)."""


class Op(enum.IntEnum):
    READ = 1
    WRITE = 2
    NOTIFY = 3
    VALIDATE = 4
    BEGIN = 5
    END = 6


class Status(enum.IntEnum):
    OK = 0
    STALE_NAMESPACE = 1
    UNKNOWN_REGION = 2
    OUT_OF_RANGE = 3
    BAD_REQUEST = 4
    REVOKED = 5

    def describe(self) -> str:
        return {
            Status.OK: "ok",
            Status.STALE_NAMESPACE: "stale namespace (the peer restarted since the handshake)",
            Status.UNKNOWN_REGION: "unknown region",
            Status.OUT_OF_RANGE: "block range out of range",
            Status.BAD_REQUEST: "malformed request",
            Status.REVOKED: "the push tag was revoked by the peer",
        }[self]


def pack_ranges(ranges: Sequence[tuple[int, int, int]]) -> bytes:
    """(region index, block_start, num_blocks) triples, for VALIDATE and BEGIN."""
    return b"".join(RANGE.pack(*r) for r in ranges)


def unpack_ranges(data: bytes | bytearray) -> list[tuple[int, int, int]]:
    return [RANGE.unpack_from(data, off) for off in range(0, len(data), RANGE.size)]


def set_kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Blocking mode with SO_RCVTIMEO/SO_SNDTIMEO: a call that moves nothing for `seconds`
    fails (TimeoutError from `recv_exact`/`send_all`). The kernel enforces it, so a large
    receive is one MSG_WAITALL syscall instead of Python polling before every piece."""
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (into the caller's memory, no copy); ConnectionError on EOF,
    TimeoutError when the kernel timeout passes without the bytes."""
    got, size = 0, len(view)
    while got < size:
        try:
            n = sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
        except BlockingIOError:
            raise TimeoutError("no progress within the socket timeout") from None
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        got += n


def recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill the views in order, straight from the socket (MSG_WAITALL, up to IOV_MAX at once)."""
    pending = [v for v in views if len(v)]
    while pending:
        batch = pending[:IOV_MAX]
        try:
            n = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        except BlockingIOError:
            raise TimeoutError("no progress within the socket timeout") from None
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        pending = advance(pending, n)


def advance(views: list[memoryview], n: int) -> list[memoryview]:
    """What is left of `views` once `n` bytes of them were moved."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    rest = views[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def send_all(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """Send the parts in order with as few syscalls as possible (one `sendmsg` when the kernel
    takes everything: a header never leaves on its own to wait for a delayed ACK)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        try:
            sent = sock.sendmsg(views[:IOV_MAX])
        except BlockingIOError:
            raise TimeoutError("no progress within the socket timeout") from None
        views = advance(views, sent)
