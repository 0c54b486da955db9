"""A plain socket for `fleetserve bench kv-transfer`: one TCP stream, no protocol, for reference.

Not a transport: the producer process sends N bytes from one buffer with `sendall`, the consumer
reads them with `recv_into` into one buffer, on one persistent connection with `TCP_NODELAY`.
Measured in the same passes as the transports, it tells what one socket moves on this machine at
that moment, so a ratio between two transports can be read against what the loopback carries
(the `tcp` transport's layer-pipelined lanes can move more than one stream).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable

__all__ = ["SocketSink", "SocketSource"]

_REQUEST = struct.Struct("!Q")


class SocketSource:
    """Serves byte counts from one buffer on 127.0.0.1 (one connection at a time, in a thread)."""

    def __init__(self, max_bytes: int) -> None:
        self._buffer = memoryview(bytearray(max_bytes))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="socket-source", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while (request := _recv_exactly(conn, _REQUEST.size)) is not None:
                    (nbytes,) = _REQUEST.unpack(request)
                    conn.sendall(self._buffer[: min(nbytes, len(self._buffer))])

    def close(self) -> None:
        self._listener.close()


class SocketSink:
    """The consumer side: `reader(n)` returns a call that fetches n bytes over the connection."""

    def __init__(self, port: int, max_bytes: int) -> None:
        self._conn = socket.create_connection(("127.0.0.1", port), timeout=60)
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = memoryview(bytearray(max_bytes))

    def reader(self, nbytes: int) -> Callable[[], None]:
        if not 0 < nbytes <= len(self._buffer):
            raise ValueError(f"nbytes must be in 1..{len(self._buffer)}, got {nbytes}")
        request = _REQUEST.pack(nbytes)

        def read() -> None:
            self._conn.sendall(request)
            got = 0
            while got < nbytes:
                n = self._conn.recv_into(self._buffer[got:nbytes])
                if n == 0:
                    raise ConnectionError("the socket source closed the connection")
                got += n

        return read

    def close(self) -> None:
        self._conn.close()


def _recv_exactly(conn: socket.socket, size: int) -> bytes | None:
    """`size` bytes, or None when the peer closed the connection first."""
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)
