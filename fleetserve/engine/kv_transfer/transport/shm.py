"""Shared-memory KV caches, for the same-host fast path of the tcp transport.

When both engines run on one machine (a local fleet), the consumer maps the producer's KV cache
and copies blocks with one memcpy per run instead of sending them through a socket. That needs
the producer's KV tensors to live in a shared-memory file; `SharedKVArena.create` allocates them
there. Contract for the Worker (it calls this when the connector asks, instead of torch.zeros):

    arena = SharedKVArena.create([shape] * num_layers, dtype)
    kv_caches = arena.tensors                # zero-filled CPU tensors, contiguous, in order
    transport.register_kv_caches(kv_caches, shared=arena)
    ...
    transport.close(); arena.close()         # close unlinks the file

- One file per arena under /dev/shm, named after the owning process (pid namespace, pid and
  start time) and a random arena id. The tensors stay valid until dropped, even after close.
- Cleanup: `close()` unlinks the file; so does a finalizer at garbage collection and interpreter
  exit. A process killed outright cannot clean up, so every `create` first removes the arenas
  of processes of the same pid namespace that no longer exist.
- The memory is ordinary shared memory: it counts against the pod's /dev/shm size (the operator
  renders a memory-backed /dev/shm sized for the KV cache).

Same-host detection compares `host_identity()`: the machine id, the kernel boot id and the
device of /dev/shm, so two containers on one node with separate /dev/shm mounts do not match.
If mapping the peer's file still fails, the transport falls back to TCP for that peer.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import secrets
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["PeerArena", "SharedKVArena", "host_identity", "sweep_stale_arenas"]

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "fleetserve-kv"
_MAGIC = b"FLEETSERVE-KV-ARENA-1\n"
_HEADER_BYTES = 4096
_ALIGN = 4096


def host_identity() -> str:
    """Equal for two processes exactly when they share a machine (and its /dev/shm)."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            parts.append(Path(path).read_text().strip())
        except OSError:
            parts.append("")
    try:
        parts.append(str(SHM_DIR.stat().st_dev))
    except OSError:
        parts.append("")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/pid/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_tag() -> str:
    pid = os.getpid()
    return f"{_pid_namespace()}-{pid}-{_start_time(pid) or 0}"


def sweep_stale_arenas(directory: Path = SHM_DIR) -> int:
    """Unlink arenas whose owner (same pid namespace) has exited; returns how many."""
    namespace = _pid_namespace()
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX + "-"):
            continue
        fields = name[len(PREFIX) + 1 :].split("-")
        if len(fields) != 4 or fields[0] != namespace or not fields[1].isdigit():
            continue
        if _start_time(int(fields[1])) == fields[2]:
            continue
        try:
            os.unlink(directory / name)
            removed += 1
        except OSError:
            continue
    if removed:
        logger.info("removed %d shared-memory KV arenas left by exited processes", removed)
    return removed


def _header(arena_id: str, size: int) -> bytes:
    return _MAGIC + f"{arena_id} {size}\n".encode()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SharedKVArena:
    """Tensors carved out of one shared-memory file (see the module docstring)."""

    def __init__(
        self, path: Path, arena_id: str, size: int, base: torch.Tensor, tensors: list[torch.Tensor]
    ) -> None:
        self.path = path
        self.arena_id = arena_id
        self.size = size
        self.tensors = tensors
        self._base = base
        self._base_ptr = base.data_ptr()
        self._finalizer = weakref.finalize(self, _unlink, str(path))

    @classmethod
    def create(
        cls,
        shapes: Sequence[Sequence[int]],
        dtype: torch.dtype,
        *,
        directory: Path | str = SHM_DIR,
    ) -> SharedKVArena:
        """Allocate one zero-filled tensor per shape in a new shared-memory file."""
        directory = Path(directory)
        sweep_stale_arenas(directory)
        element = torch.empty((), dtype=dtype).element_size()
        offsets, offset = [], _HEADER_BYTES
        for shape in shapes:
            if any(d < 1 for d in shape):
                raise ValueError(f"arena tensor shapes must be positive, got {tuple(shape)}")
            offsets.append(offset)
            offset += -(-math.prod(shape) * element // _ALIGN) * _ALIGN
        size = offset
        arena_id = secrets.token_hex(8)
        path = directory / f"{PREFIX}-{_owner_tag()}-{arena_id}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, _header(arena_id, size), 0)
        finally:
            os.close(fd)
        try:
            base = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        except BaseException:
            _unlink(str(path))
            raise
        tensors = [
            base[off : off + math.prod(shape) * element].view(dtype).view(tuple(shape))
            for off, shape in zip(offsets, shapes, strict=True)
        ]
        return cls(path, arena_id, size, base, tensors)

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self._base_ptr <= ptr and ptr + nbytes <= self._base_ptr + self.size

    def offset_of(self, ptr: int) -> int:
        return ptr - self._base_ptr

    def describe(self) -> dict[str, Any]:
        """What a peer needs to map it (carried in the tcp descriptor)."""
        return {"path": str(self.path), "arena_id": self.arena_id, "size": self.size}

    def close(self) -> None:
        """Unlink the file (mappings, here and in peers, stay valid until dropped)."""
        self._finalizer()


class PeerArena:
    """A same-host peer's arena mapped into this process, read-write."""

    def __init__(self, base: torch.Tensor) -> None:
        self._base = base
        self.base_ptr = base.data_ptr()
        self.size = base.numel()

    @classmethod
    def open(cls, path: str, arena_id: str, size: int) -> PeerArena:
        """Map the peer's file; OSError when it cannot be opened here, ValueError when it is
        not the arena the descriptor names (a stale descriptor)."""
        with open(path, "rb") as f:
            header = f.read(len(_header(arena_id, size)))
            actual = os.fstat(f.fileno()).st_size
        if header != _header(arena_id, size) or actual != size:
            raise ValueError(f"{path} is not arena {arena_id} of {size} bytes")
        return cls(torch.from_file(path, shared=True, size=size, dtype=torch.uint8))
