"""Zeroing the KV-cache blocks a step newly allocated (the seed's `new_block_ids_to_zero`).

New blocks must read as zero before first use: stale values (NaN or Inf from an earlier
request) would poison attention that computes masked positions and multiplies them by zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fleetserve.kernels.cpu.build import load_cpu_kernels


def zero_kv_blocks(kv_caches: Sequence[torch.Tensor], block_ids: list[int]) -> None:
    """Zero blocks `block_ids` of every cache in `kv_caches` (dim 1 indexes blocks; all of dim 0
    is zeroed, K and V).

    CPU caches take one C++ call for all layers (`zero_blocks` in `paged_attention.cpp`): an
    index_put per layer cost a SmolLM2 decode step about 0.3 ms, and as a parallel region after
    the engine core's pause it waited for the sleeping OpenMP worker. Other devices, and a
    machine without the kernels, index_put per cache.

    Raises:
        RuntimeError: a block id outside a cache (nothing is written then, on the CPU path).
    """
    if not block_ids or not kv_caches:
        return
    ids = torch.tensor(block_ids, dtype=torch.int64)
    on_cpu = all(c.device.type == "cpu" and c.is_contiguous() for c in kv_caches)
    if on_cpu and load_cpu_kernels().available:
        torch.ops.fleetserve_cpu.zero_blocks(list(kv_caches), ids)
        return
    for cache in kv_caches:
        cache[:, ids.to(cache.device)] = 0
