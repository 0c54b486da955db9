"""The tcp transport's frames, and socket helpers that move bytes without intermediate copies.

A lane carries one request at a time: the client sends a request, the server answers with one
response, then the next request may follow. Every request names the server's namespace.

    request  = REQUEST header, tag bytes (tag_len), payload (payload_len)
    response = RESPONSE header, payload (payload_len; a READ's blocks, nothing otherwise)

Responses carry a status code and no text: the client knows what it asked for and words the
error itself, and a READ's payload can then be received straight into the destination blocks
together with the header (one `recvmsg_into`), since an error response has no bytes after it.

Ops
- READ (region, block_start, num_blocks): the server answers with the blocks.
- WRITE (region, block_start, num_blocks, tag) + the blocks: the server receives them straight
  into its region and answers once they are in memory. A refused WRITE's payload is drained
  into scratch, never into the region.
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
    "pack_ranges",
    "recv_exact",
    "send_all",
    "unpack_ranges",
]

REQUEST_MAGIC = b"FKQ1"
RESPONSE_MAGIC = b"FKR1"

# magic, op, flags, tag_len, request id, namespace, region, block_start, num_blocks, layer,
# payload_len
REQUEST = struct.Struct("!4sBBHQ16sIIIIQ")
# magic, status, flags, reserved, request id, payload_len
RESPONSE = struct.Struct("!4sBBHQQ")
RANGE = struct.Struct("!III")
MAX_RANGES = 1 << 20


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


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (into the caller's memory, no copy); ConnectionError on EOF."""
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        got += n


def send_all(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """Send the parts in order with as few syscalls as possible (one `sendmsg` when the kernel
    takes everything: a header never leaves on its own to wait for a delayed ACK)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
        if len(views) == 1 and len(views[0]) > 65536:
            sock.sendall(views[0])
            return
