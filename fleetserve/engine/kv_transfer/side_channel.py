"""The connector's control channel between engines: handshakes, heartbeats, completions, pushes.

Every engine with a connector runs one `ControlServer` (a ZMQ ROUTER bound to the engine's host
and its `side_channel_port`) in a background thread, straight between the engines' connectors
(never through the API servers). Messages are msgspec msgpack structs:

- `Handshake` → `HandshakeReply`: the producer's identity, compatibility hash (and the key it
  covers, for a readable mismatch error), lease length, KV layout (TP size, heads, blocks) and
  every rank's transport descriptor (the driver rank answers for all of them);
- `Heartbeat(keys)`: extend the producer's leases on those transfers;
- `Done(keys)`: the consumer has its KV (pull), the producer may free the blocks;
- `PushRequest`: the consumer's blocks for a transfer (push mode);
- `PushDone(key, ok, message)`: the producer finished (or failed) writing them.

Requests that want an answer (`request`) are bounded by a timeout, so a dead or unreachable peer
is a failure within that time, never a hang. Notifications (`notify`) are queued without
blocking; a notification that cannot be queued is dropped and counted (heartbeats are
idempotent, and a lost `Done` only delays the producer's free until its lease ends).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

__all__ = [
    "ControlClient",
    "ControlMessage",
    "ControlServer",
    "Done",
    "Handshake",
    "HandshakeReply",
    "Heartbeat",
    "PushDone",
    "PushRequest",
]

logger = logging.getLogger(__name__)


class Handshake(msgspec.Struct, tag="handshake"):
    engine_id: str
    """The asking (consumer) engine."""


class HandshakeReply(msgspec.Struct, tag="handshake_reply"):
    engine_id: str
    compatibility_hash: str
    compatibility_key: dict[str, Any]
    lease_seconds: float
    transport: dict[str, Any]
    """The engine's transport descriptor (regions, endpoint, incarnation namespace)."""
    error: str | None = None
    layout: dict[str, Any] | None = None
    """The engine's KV layout (`head_map.KVLayout.to_dict`); None from a one-rank engine that
    predates it (then: TP=1, `transport` is its only rank)."""
    rank_transports: list[dict[str, Any]] = msgspec.field(default_factory=list)
    """Every tensor-parallel rank's transport descriptor, in rank order (rank 0's is also
    `transport`); empty means one rank."""


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    keys: list[str]


class Done(msgspec.Struct, tag="done"):
    keys: list[str]


class PushRequest(msgspec.Struct, tag="push_request"):
    key: str
    consumer_engine_id: str
    consumer_host: str
    consumer_port: int
    """The consumer's control channel (where `PushDone` goes)."""
    consumer_transport: dict[str, Any]
    block_ids: list[int]
    """The consumer's blocks for the prompt's blocks `first_block ..`, in prompt order."""
    first_block: int = 0
    """The prompt block the consumer's range starts at (it hit the ones before locally)."""


class PushDone(msgspec.Struct, tag="push_done"):
    key: str
    ok: bool
    message: str = ""


class _Reply(msgspec.Struct, tag="reply"):
    known: list[str] = msgspec.field(default_factory=list)
    """Keys whose lease the producer holds (now extended, for a heartbeat)."""
    gone: dict[str, str] = msgspec.field(default_factory=dict)
    """Keys the producer no longer holds, with why (released, lease expired)."""


ControlMessage = Handshake | HandshakeReply | Heartbeat | Done | PushRequest | PushDone | _Reply


class ControlServer:
    """A ROUTER socket served by one thread; `handler(message) -> reply or None`.

    The handler runs on the server thread: it must be quick and thread-safe (it hands events to
    the connector through a lock or a queue). A malformed message is logged and dropped.
    """

    def __init__(
        self, host: str, port: int, handler: Callable[[ControlMessage], ControlMessage | None]
    ) -> None:
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, 10_000)
        self._socket.setsockopt(zmq.SNDHWM, 10_000)
        if port == 0:
            self.port = self._socket.bind_to_random_port(f"tcp://{host}")
        else:
            self._socket.bind(f"tcp://{host}:{port}")
            self.port = port
        self.host = host
        self._handler = handler
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ControlMessage)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            identity, payload = self._socket.recv_multipart()
            try:
                message = self._decoder.decode(payload)
                reply = self._handler(message)
            except Exception:
                logger.exception("dropping a malformed or failing control message")
                continue
            if reply is not None:
                try:
                    self._socket.send_multipart(
                        [identity, self._encoder.encode(reply)], flags=zmq.NOBLOCK
                    )
                except zmq.Again:
                    logger.warning("control reply dropped: the peer is not reading")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(linger=0)
        self._ctx.term()


class ControlClient:
    """Sends to other engines' control servers (thread-safe)."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._notifiers: dict[str, zmq.Socket[bytes]] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ControlMessage)
        self.num_dropped = 0

    def request(self, host: str, port: int, message: ControlMessage) -> ControlMessage:
        """Send and wait for the reply.

        Raises:
            TimeoutError: no reply within `timeout_s` (the peer is dead, unreachable or stuck).
        """
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(f"tcp://{host}:{port}")
            socket.send(self._encoder.encode(message))
            if not socket.poll(int(self.timeout_s * 1000)):
                raise TimeoutError(f"no reply from {host}:{port} within {self.timeout_s:.1f} s")
            reply: ControlMessage = self._decoder.decode(socket.recv())
            return reply
        finally:
            socket.close(linger=0)

    def notify(self, host: str, port: int, message: ControlMessage) -> bool:
        """Queue a one-way message; False (and counted) when it could not be queued."""
        address = f"tcp://{host}:{port}"
        with self._lock:
            socket = self._notifiers.get(address)
            if socket is None:
                socket = self._ctx.socket(zmq.DEALER)
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.SNDHWM, 1000)
                socket.connect(address)
                self._notifiers[address] = socket
            try:
                socket.send(self._encoder.encode(message), flags=zmq.NOBLOCK)
            except zmq.Again:
                self.num_dropped += 1
                return False
            return True

    def forget(self, host: str, port: int) -> None:
        """Close the notifier of a peer that is gone (bounded state)."""
        with self._lock:
            socket = self._notifiers.pop(f"tcp://{host}:{port}", None)
        if socket is not None:
            socket.close(linger=0)

    def close(self) -> None:
        with self._lock:
            for socket in self._notifiers.values():
                socket.close(linger=0)
            self._notifiers.clear()
        self._ctx.term()
