"""A peer engine in its own process, driven over a pipe: the other end of every transport test.

`Peer.start(kind, ...)` spawns a process that builds a transport, registers a small KV cache
(`layers` tensors of shape [2, num_blocks, 4, 2, 8] int16, 128 B blocks) filled from `seed`,
and answers commands: its blocks, its notifications, its stats, revoke, drop connections.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any

import torch

from fleetserve.engine.kv_transfer.transport import (
    EndpointDescriptor,
    KVTransport,
    SharedKVArena,
    TcpConfig,
    make_transport,
)

BLOCK_SHAPE = (4, 2, 8)
DTYPE = torch.int16


def kv_shape(num_blocks: int) -> tuple[int, ...]:
    return (2, num_blocks, *BLOCK_SHAPE)


def random_kv(
    layers: int, num_blocks: int, seed: int, shared: bool = False, interleaved: bool = False
):
    """(kv caches, arena or None): random int16 tensors, in shared memory when `shared`.

    Interleaved: each layer is allocated [num_blocks, 2, ...] (a block's keys next to its
    values) and returned as a [2, num_blocks, ...] view, whose block stride is two blocks."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, *BLOCK_SHAPE) if interleaved else kv_shape(num_blocks)
    arena = SharedKVArena.create([shape] * layers, DTYPE) if shared else None
    tensors = arena.tensors if arena else [torch.zeros(shape, dtype=DTYPE) for _ in range(layers)]
    for tensor in tensors:
        tensor.copy_(torch.randint(-30000, 30000, shape, generator=generator, dtype=DTYPE))
    caches = [t.transpose(0, 1) for t in tensors] if interleaved else tensors
    return caches, arena


def build_transport(kind: str, engine_id: str, options: dict[str, Any]) -> KVTransport:
    if kind == "mooncake":
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        return make_transport("mooncake", engine_id, **options)
    options = dict(options)
    config = TcpConfig(**options.pop("config", {}))
    return make_transport("tcp", engine_id, config=config, **options)


def _drop_after(transport, served: int) -> None:
    """Tear the server's connections down once it answered `served` requests."""
    while transport.stats().served_requests < served:
        time.sleep(0)  # yield the GIL to the serving threads, then look again
    transport.drop_connections()


def _serve(conn, kind, engine_id, options, layers, num_blocks, seed, shared, interleaved) -> None:
    try:
        transport = build_transport(kind, engine_id, options)
        caches, arena = random_kv(layers, num_blocks, seed, shared, interleaved)
        transport.register_kv_caches(caches, shared=arena)
    except Exception as e:
        conn.send(("error", repr(e)))
        raise
    conn.send(("ready", transport.descriptor().to_dict()))
    while True:
        command, *args = conn.recv()
        if command == "exit":
            transport.close()
            if arena is not None:
                arena.close()
            conn.send(None)
            return
        if command == "caches":
            conn.send([c.clone() for c in caches])
        elif command == "notifications":
            conn.send([(n.tag, n.layer) for n in transport.drain_notifications()])
        elif command == "stats":
            conn.send(dataclasses.asdict(transport.stats()))
        elif command == "revoke":
            conn.send(transport.revoke_pushes(*args))
        elif command == "drop_after":
            threading.Thread(target=_drop_after, args=(transport, args[0]), daemon=True).start()
            conn.send(None)
        elif command == "arena_path":
            conn.send(str(arena.path) if arena else None)


class Peer:
    """The parent's handle on a peer process."""

    def __init__(self, process: mp.Process, conn, descriptor: EndpointDescriptor) -> None:
        self.process = process
        self.conn = conn
        self.descriptor = descriptor

    @classmethod
    def start(
        cls,
        kind: str,
        *,
        engine_id: str = "peer",
        layers: int = 3,
        num_blocks: int = 24,
        seed: int = 1,
        shared: bool = False,
        interleaved: bool = False,
        options: dict[str, Any] | None = None,
    ) -> Peer:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=_serve,
            args=(
                child,
                kind,
                engine_id,
                options or {},
                layers,
                num_blocks,
                seed,
                shared,
                interleaved,
            ),
            daemon=True,
        )
        process.start()
        if not parent.poll(60):
            process.kill()
            raise TimeoutError("peer did not start within 60 s")
        outcome, payload = parent.recv()
        if outcome != "ready":
            process.join(10)
            raise RuntimeError(f"peer failed to start: {payload}")
        return cls(process, parent, EndpointDescriptor.from_dict(payload))

    def call(self, *command: Any, timeout: float = 30.0) -> Any:
        self.conn.send(command)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {command[0]!r}")
        return self.conn.recv()

    def caches(self) -> list[torch.Tensor]:
        return self.call("caches")

    def pause(self) -> None:
        """SIGSTOP, and wait until every thread of the peer is stopped (delivery is async)."""
        os.kill(self.process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            states = []
            for task in os.listdir(f"/proc/{self.process.pid}/task"):
                try:
                    with open(f"/proc/{self.process.pid}/task/{task}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                states.append(stat.rsplit(")", 1)[1].split()[0])
            if states and all(state in "tT" for state in states):
                return
            time.sleep(0.001)
        raise TimeoutError("peer did not stop")

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.resume()
                self.call("exit", timeout=30)
            except (TimeoutError, OSError, EOFError):
                self.process.kill()
            self.process.join(10)
