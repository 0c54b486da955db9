"""CPU memory on transparent huge pages, for the weights a decode step streams.

A decode step at a small batch reads every weight once, from memory: SmolLM2's packed float32
weights are 513 MiB a step, 131,000 pages of 4 KiB, each a TLB miss and a page walk beside the
stream's loads; on 2 MiB pages the stream walks 256 times fewer. On the 2-core AVX2 box, a
SmolLM2 step's small-row GEMMs took 30.4-31.6 ms on huge pages instead of 33.2-35.6 at 1 row and
41.7 instead of 51.2 at 8 (level at 32 rows, where they compute longer than they read), and a
batch-1 decode step 3-5% less (docs/cpu-performance.md, "Packed weights on huge pages"). The KV
cache on huge pages changed nothing: attention reads whole blocks, few pages each.

Torch can advise its own allocations (`THP_MEM_ALLOC_ENABLE=1`), but only those of 2 MiB and more,
each at a 4 KiB boundary: a huge page then covers only the 2 MiB-aligned inside of each buffer,
none of a 1.3 MiB `o_proj`. So the weights are gathered into one private anonymous mapping,
advised before anything touches it and used from a 2 MiB boundary: every page of it but the
last can be huge. Where the kernel's mode is `never` (or there is no such kernel), nothing is
gathered.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["HUGE_PAGE_BYTES", "huge_page_bytes", "huge_page_views", "thp_mode"]

HUGE_PAGE_BYTES = 2 << 20
"""x86-64's transparent huge page."""

_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(enabled: Path = _THP_ENABLED) -> str:
    """The kernel's transparent huge page mode: 'always', 'madvise' or 'never', or 'unavailable'
    where the kernel has none (or mmap here cannot advise it)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "unavailable"
    try:
        match = re.search(r"\[(\w+)\]", enabled.read_text())
    except OSError:
        return "unavailable"
    return match.group(1) if match else "unavailable"


def huge_page_views(
    layouts: Sequence[tuple[torch.Size, torch.dtype]], *, align: int = 4096
) -> list[torch.Tensor]:
    """Zeroed contiguous CPU tensors of these shapes and dtypes, back to back in one private
    anonymous mapping advised for transparent huge pages, the first at a 2 MiB boundary and each
    at an `align`-byte one. Nothing touches the memory yet: a page becomes resident (a huge one
    where the kernel can give it) when it is first written. The mapping lives while any of the
    tensors does.

    Raises:
        ValueError: `align` is not a power of two, or a layout has a negative dimension.
    """
    if align < 1 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    sizes: list[int] = []
    for shape, dtype in layouts:
        if any(d < 0 for d in shape):
            raise ValueError(f"layouts must have dimensions >= 0, got {tuple(shape)}")
        sizes.append(torch.Size(shape).numel() * dtype.itemsize)
    spans = [(n + align - 1) // align * align for n in sizes]
    total = sum(spans)
    # NOTE: private, not mmap's default shared mapping: shared anonymous memory is shmem, whose
    # huge pages follow shmem_enabled (usually never), not the mode above.
    mapping = mmap.mmap(
        -1, max(total, 1) + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping alive
    offset = -whole.data_ptr() % HUGE_PAGE_BYTES
    views = []
    for (shape, dtype), nbytes, span in zip(layouts, sizes, spans, strict=True):
        views.append(whole[offset : offset + nbytes].view(dtype).view(shape))
        offset += span
    return views


def huge_page_bytes(tensor: torch.Tensor, smaps: Path = Path("/proc/self/smaps")) -> int:
    """Bytes on huge pages in the mapping that holds `tensor`'s first byte (its
    `AnonHugePages`), 0 where the kernel does not say."""
    address = tensor.data_ptr()
    inside = False
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            low, _, high = head.partition("-")
            inside = int(low, 16) <= address < int(high, 16)
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0
