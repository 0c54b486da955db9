"""Local regions and transfer planning: validation, run coalescing and chunking.

Shared by every transport. A plan is a list of `Run`s, each a range of blocks contiguous on
both engines, ordered by layer so that layer 0 moves first.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from fleetserve.engine.kv_transfer.transport.base import BlockCopy, EndpointDescriptor, RegionInfo

if TYPE_CHECKING:
    import torch

    from fleetserve.engine.kv_transfer.transport.shm import SharedKVArena

__all__ = [
    "Direction",
    "Region",
    "Run",
    "coalesce",
    "group_runs",
    "make_region",
    "plan_transfer",
    "split_run",
]

Direction = Literal["pull", "push"]


@dataclass(frozen=True, eq=False)
class Region:
    """A registered local tensor and the raw view of its bytes.

    `view` is a writable memoryview over the region's whole span, built from its address (the
    tensor is kept alive by `tensor`): sockets send from and receive into slices of it, so no
    byte is copied through an intermediate buffer.
    """

    name: str
    layer: int
    tensor: torch.Tensor
    base_ptr: int
    num_blocks: int
    block_bytes: int
    block_stride: int
    view: memoryview
    arena: SharedKVArena | None
    """The shared-memory arena holding the tensor, when it was allocated from one."""

    @property
    def contiguous(self) -> bool:
        """Whether consecutive blocks are adjacent in memory (runs of blocks can coalesce)."""
        return self.block_stride == self.block_bytes

    def info(self) -> RegionInfo:
        return RegionInfo(
            name=self.name,
            layer=self.layer,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            block_stride=self.block_stride,
        )

    def span(self, start: int, num_blocks: int) -> memoryview:
        """The bytes of blocks [start, start + num_blocks) (one block unless contiguous)."""
        offset = start * self.block_stride
        return self.view[offset : offset + (num_blocks - 1) * self.block_stride + self.block_bytes]


def make_region(
    name: str, tensor: torch.Tensor, *, layer: int, arena: SharedKVArena | None
) -> Region:
    """Check that `tensor` can be served block by block and wrap it."""
    if not name or len(name.encode()) > 255:
        raise ValueError(f"region name must be 1-255 UTF-8 bytes, got {name!r}")
    if layer < 0:
        raise ValueError(f"region {name!r}: layer must be >= 0, got {layer}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"region {name!r}: this transport moves CPU tensors only, got device "
            f"{tensor.device} (stage GPU KV through a CPU buffer, or use the mooncake transport "
            "with its CUDA build)"
        )
    if tensor.dim() < 1 or tensor.shape[0] < 1:
        raise ValueError(
            f"region {name!r}: need a tensor with a block dimension, got shape "
            f"{tuple(tensor.shape)}"
        )
    element = tensor.element_size()
    block = tensor[0]
    if not block.is_contiguous():
        raise ValueError(f"region {name!r}: each block (tensor[b]) must be contiguous")
    block_bytes = block.numel() * element
    block_stride = tensor.stride(0) * element if tensor.shape[0] > 1 else block_bytes
    if block_bytes == 0 or block_stride < block_bytes:
        raise ValueError(
            f"region {name!r}: block stride {block_stride} B is smaller than a block "
            f"({block_bytes} B); blocks must not overlap"
        )
    num_blocks = int(tensor.shape[0])
    span = (num_blocks - 1) * block_stride + block_bytes
    base_ptr = tensor.data_ptr()
    view = memoryview((ctypes.c_char * span).from_address(base_ptr)).cast("B")
    if arena is not None and not arena.contains(base_ptr, span):
        raise ValueError(f"region {name!r} does not lie inside the shared arena {arena.path}")
    return Region(
        name=name,
        layer=layer,
        tensor=tensor,
        base_ptr=base_ptr,
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        block_stride=block_stride,
        view=view,
        arena=arena,
    )


@dataclass(frozen=True, slots=True)
class Run:
    """Blocks [local_start, +num_blocks) here and [remote_start, +num_blocks) on the peer."""

    local: Region
    remote_index: int
    """The region's index in the peer's descriptor (what requests name)."""
    local_start: int
    remote_start: int
    num_blocks: int

    @property
    def layer(self) -> int:
        return self.local.layer

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.local.block_bytes


_VECTOR_MIN = 256
"""From this many ids on, numpy beats a Python loop (below, its per-call cost dominates)."""


def coalesce(
    src: Sequence[int], dst: Sequence[int], *, allow: bool = True
) -> list[tuple[int, int, int]]:
    """Group (src[i], dst[i]) pairs into runs (src_start, dst_start, length), consecutive on
    both sides (sorted by source). With `allow=False` every pair is its own run.

    A 5k-token prompt in blocks of 16 is 10^4 ids per transfer, hence the vectorised path."""
    if len(src) >= _VECTOR_MIN:
        s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        order = np.lexsort((d, s))
        s, d = s[order], d[order]
        if allow:
            breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
        else:
            breaks = np.arange(1, s.size)
        starts = np.concatenate(([0], breaks))
        lengths = np.diff(np.concatenate((starts, [s.size])))
        return list(zip(s[starts].tolist(), d[starts].tolist(), lengths.tolist(), strict=True))
    runs: list[tuple[int, int, int]] = []
    for s0, d0 in sorted(zip(src, dst, strict=True)):
        if allow and runs:
            start_s, start_d, length = runs[-1]
            if s0 == start_s + length and d0 == start_d + length:
                runs[-1] = (start_s, start_d, length + 1)
                continue
        runs.append((s0, d0, 1))
    return runs


def _check_ids(ids: Sequence[int], num_blocks: int, what: str) -> None:
    """Ints in [0, num_blocks) (checked with C-level passes: min, max, the set of types)."""
    if not len(ids):
        return
    if isinstance(ids, range):
        if ids.step > 0 and ids.start >= 0 and ids[-1] < num_blocks:
            return
    elif set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < num_blocks:
        return
    for block in ids:
        if not isinstance(block, int) or isinstance(block, bool):
            raise ValueError(f"{what}: block ids must be ints, got {block!r}")
        if not 0 <= block < num_blocks:
            raise ValueError(f"{what}: block id {block} out of range [0, {num_blocks})")


def _consecutive(ids: Sequence[int]) -> int | None:
    """The first id when `ids` is first, first + 1, ... (non-negative ints), else None."""
    if not len(ids):
        return None
    if isinstance(ids, range):
        return ids.start if ids.step == 1 and ids.start >= 0 else None
    first = ids[0]
    if type(first) is not int or first < 0 or ids[-1] - first != len(ids) - 1:
        return None
    if list(ids) != list(range(first, first + len(ids))) or set(map(type, ids)) != {int}:
        return None
    return first


def plan_transfer(
    direction: Direction,
    regions: dict[str, Region],
    peer: EndpointDescriptor,
    copies: Sequence[BlockCopy],
) -> list[Run]:
    """Validate `copies` against the local regions and the peer's descriptor and coalesce them.

    Raises ValueError naming the region and the offending id for anything that cannot be valid.
    Returns the runs ordered by (layer, region, start).
    """
    runs: list[Run] = []
    destinations: dict[str, list[Sequence[int]]] = {}
    for copy in copies:
        local = regions.get(copy.local_name)
        if local is None:
            known = ", ".join(list(regions)[:8])
            raise ValueError(f"no local region {copy.local_name!r} (registered: {known or 'none'})")
        remote_index = peer.region_index(copy.region)
        remote = peer.regions[remote_index]
        if remote.block_bytes != local.block_bytes or remote.layer != local.layer:
            raise ValueError(
                f"region {copy.region!r}: local blocks are {local.block_bytes} B (layer "
                f"{local.layer}), the peer's {remote.block_bytes} B (layer {remote.layer})"
            )
        src_blocks, dst_blocks = (
            (remote.num_blocks, local.num_blocks)
            if direction == "pull"
            else (local.num_blocks, remote.num_blocks)
        )
        destinations.setdefault(copy.local_name if direction == "pull" else copy.region, []).append(
            copy.dst_block_ids
        )
        contiguous = local.contiguous and remote.block_stride == remote.block_bytes
        n = len(copy.src_block_ids)
        s0 = _consecutive(copy.src_block_ids) if contiguous else None
        d0 = _consecutive(copy.dst_block_ids) if s0 is not None else None
        if s0 is not None and d0 is not None and s0 + n <= src_blocks and d0 + n <= dst_blocks:
            # The common case (one run each side), checked in O(1) Python steps.
            pieces = [(s0, d0, n)]
        else:
            side = ("peer", "local") if direction == "pull" else ("local", "peer")
            _check_ids(copy.src_block_ids, src_blocks, f"region {copy.region!r} ({side[0]})")
            _check_ids(copy.dst_block_ids, dst_blocks, f"region {copy.region!r} ({side[1]})")
            pieces = coalesce(copy.src_block_ids, copy.dst_block_ids, allow=contiguous)
        for s, d, length in pieces:
            local_start, remote_start = (d, s) if direction == "pull" else (s, d)
            runs.append(Run(local, remote_index, local_start, remote_start, length))
    for region, lists in destinations.items():
        total = sum(len(ids) for ids in lists)
        if total > 1 and len(set().union(*lists)) != total:
            seen: set[int] = set()
            for block in (b for ids in lists for b in ids):
                if block in seen:
                    break
                seen.add(block)
            raise ValueError(f"region {region!r}: destination block {block} given twice")
    runs.sort(key=lambda r: (r.layer, r.remote_index, r.remote_start))
    return runs


def split_run(run: Run, max_bytes: int) -> list[Run]:
    """Cut a run into pieces of at most `max_bytes` (whole blocks; at least one block each)."""
    per_piece = max(1, max_bytes // run.local.block_bytes)
    if run.num_blocks <= per_piece:
        return [run]
    return [
        replace(
            run,
            local_start=run.local_start + offset,
            remote_start=run.remote_start + offset,
            num_blocks=min(per_piece, run.num_blocks - offset),
        )
        for offset in range(0, run.num_blocks, per_piece)
    ]


def group_runs(runs: list[Run], max_bytes: int, max_runs: int = 1024) -> list[list[Run]]:
    """Cut runs into pieces of at most `max_bytes` and group consecutive pieces of one layer
    into tasks of at most `max_bytes` and `max_runs` pieces (one request each)."""
    groups: list[list[Run]] = []
    size = 0
    for run in runs:
        for piece in split_run(run, max_bytes):
            if (
                not groups
                or groups[-1][0].layer != piece.layer
                or size + piece.nbytes > max_bytes
                or len(groups[-1]) >= max_runs
            ):
                groups.append([])
                size = 0
            groups[-1].append(piece)
            size += piece.nbytes
    return groups
