"""A shared-memory all-reduce for the small tensors of decode steps, among ranks of one host.

gloo's all-reduce of a few KiB costs tens of microseconds of socket round trips; ranks on one
machine can instead each copy their tensor into a shared slot, raise a flag, wait for every
flag and sum the slots. In the spirit of the seed's custom all-reduce (notes part 2 §2.5):

- One buffer, allocated once when the group is created: two banks (alternate calls use
  alternate banks) of one `max_bytes` slot per rank, plus one 64-bit flag per rank holding the
  number of the last call whose input that rank has written. A rank starts writing call g + 2
  into a bank only after it saw every flag reach g + 1, i.e. after every rank finished reading
  call g from that bank, so no slot is overwritten while it is read.
- Every rank sums the slots in rank order, so all ranks hold bitwise the same result (with two
  ranks that is also gloo's: float addition is commutative).
- `accepts` declines what it cannot take (a non-CPU tensor, another dtype, more than
  `max_bytes`); the caller then uses gloo. Whether the buffer exists at all is agreed by every
  rank (a MIN over the CPU group), so all ranks take the same path for every call.
- Waiting spins briefly then yields the CPU, bounded by `timeout_s` (a dead peer is an error,
  not a hang).
- x86 only (the flag protocol needs stores to become visible in program order); the file is
  unlinked as soon as every rank has mapped it, so a killed group leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import platform
import secrets
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_MAX_BYTES", "ShmAllReduce"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 << 10
"""Largest tensor taken (bigger ones go to gloo): a decode batch's hidden states, not prefill."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SPINS = 16
"""Flag polls before each yield of the CPU while waiting for the peers (few: on a host with
more runnable processes than cores, a spinning rank keeps its peer from running)."""
_FLAG_BYTES = 64
"""One cache line per rank's flag, so that ranks do not write the same line."""


class ShmAllReduce:
    """Sum over `world_size` ranks on one host through a shared-memory file.

    Build it with `create` (a collective over the group's CPU channel).
    """

    def __init__(
        self, buffer: torch.Tensor, rank: int, world_size: int, max_bytes: int, timeout_s: float
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        flag_area = world_size * _FLAG_BYTES
        # NOTE: a numpy view: reading the flags is the hot loop, and numpy's min is cheaper.
        self._flags = buffer[:flag_area].view(torch.int64)[:: _FLAG_BYTES // 8].numpy()
        data = buffer[flag_area:]
        self._banks = [
            data[bank * world_size * max_bytes : (bank + 1) * world_size * max_bytes]
            for bank in range(2)
        ]
        self._calls = 0

    @classmethod
    def create(
        cls,
        cpu_group: Any,
        rank_in_group: int,
        world_size: int,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        timeout_s: float = 60.0,
    ) -> ShmAllReduce | None:
        """Map one buffer shared by the group's ranks, or None (on every rank alike) when any
        rank cannot: another host, no /dev/shm, a failed mapping.

        Collective: every rank of the group calls it with the same arguments.
        """
        from fleetserve.engine.kv_transfer.transport.shm import SHM_DIR, host_identity

        size = world_size * _FLAG_BYTES + 2 * world_size * max_bytes
        hosts: list[Any] = [None] * world_size
        dist.all_gather_object(hosts, host_identity(), group=cpu_group)
        name = [f"fleetserve-allreduce-{os.getpid()}-{secrets.token_hex(4)}"]
        dist.broadcast_object_list(name, src=dist.get_global_rank(cpu_group, 0), group=cpu_group)
        path = SHM_DIR / name[0]
        buffer: torch.Tensor | None = None
        # NOTE: the flag protocol relies on stores becoming visible in program order (x86's
        # TSO); elsewhere, gloo.
        if len(set(hosts)) == 1 and platform.machine() in ("x86_64", "AMD64"):
            try:
                if rank_in_group == 0:
                    with path.open("wb") as f:
                        f.truncate(size)
                dist.barrier(group=cpu_group)
                buffer = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
            except (OSError, RuntimeError) as exc:
                logger.warning("shared-memory all-reduce unavailable: %s", exc)
                buffer = None
        ok = torch.tensor([1 if buffer is not None else 0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group)
        dist.barrier(group=cpu_group)  # every rank mapped (or gave up) before the unlink
        if rank_in_group == 0:
            Path(path).unlink(missing_ok=True)
        if not ok.item() or buffer is None:
            return None
        return cls(buffer, rank_in_group, world_size, max_bytes, timeout_s)

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether this communicator takes `tensor` (else the caller uses gloo)."""
        return (
            tensor.device.type == "cpu"
            and tensor.dtype in _DTYPES
            and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() <= self.max_bytes
        )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group in place and return it.

        Raises:
            RuntimeError: a peer did not arrive within `timeout_s`.
        """
        self._calls += 1
        call = self._calls
        bank = self._banks[call % 2]
        nbytes = tensor.numel() * tensor.element_size()
        slots = [
            bank[r * self.max_bytes : r * self.max_bytes + nbytes] for r in range(self.world_size)
        ]
        slots[self.rank].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        # NOTE: on x86 the data is visible before the flag (stores in order); readers check
        # the flag before they read the data.
        self._flags[self.rank] = call
        self._wait_for(call)
        parts = [slot.view(tensor.dtype) for slot in slots]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        tensor.copy_(total.view(tensor.shape))
        return tensor

    def _wait_for(self, call: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            for _ in range(_SPINS):
                if self._flags.min() >= call:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"shared-memory all-reduce: peers did not arrive within {self.timeout_s} s"
                )
            os.sched_yield()
