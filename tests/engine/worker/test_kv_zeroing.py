"""Zeroing new KV blocks: the CPU kernel's one call for all layers against index_put per cache,
on caches of two layouts, a thread count that splits the spans, and a bad id that writes nothing."""

from __future__ import annotations

import pytest
import torch

from fleetserve.engine.worker import kv_zeroing
from fleetserve.engine.worker.kv_zeroing import zero_kv_blocks
from fleetserve.kernels.cpu.build import load_cpu_kernels

needs_kernels = pytest.mark.skipif(
    not load_cpu_kernels().available, reason=str(load_cpu_kernels().error)
)


def _caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, 9, 4, 2, 32, generator=gen),  # [K/V, blocks, block size, kv heads, head]
        torch.randn(2, 9, 4, 2, 32, generator=gen),
        torch.randn(1, 9, 4, 96, generator=gen),  # another layout: blocks at dim 1 too
    ]


def _expected(caches: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    out = [c.clone() for c in caches]
    for c in out:
        c[:, block_ids] = 0
    return out


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_zeroes_exactly_the_listed_blocks_of_every_layer(threads: int) -> None:
    caches = _caches(0)
    for c in caches:
        c[:, 3] = float("nan")
    block_ids = [3, 8, 0, 3]  # repeated ids are harmless
    expected = _expected(caches, block_ids)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        zero_kv_blocks(caches, block_ids)
    finally:
        torch.set_num_threads(before)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)


@needs_kernels
def test_a_large_zeroing_spreads_over_threads_with_the_same_result() -> None:
    """Above the kernel's grain (256 KiB a thread) the spans are split between threads."""
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(2, 64, 16, 4, 64, generator=gen) for _ in range(6)]  # 32 KiB blocks
    block_ids = list(range(0, 64, 3))
    expected = _expected(caches, block_ids)
    zero_kv_blocks(caches, block_ids)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)


@needs_kernels
def test_a_block_id_outside_a_cache_is_refused_before_anything_is_written() -> None:
    caches = _caches(2)
    snapshot = [c.clone() for c in caches]
    with pytest.raises(RuntimeError, match="block id 9 is outside the cache's 9 blocks"):
        zero_kv_blocks(caches, [1, 9])
    with pytest.raises(RuntimeError, match="block id -1"):
        zero_kv_blocks(caches, [-1])
    for got, want in zip(caches, snapshot, strict=True):
        assert torch.equal(got, want)


def test_without_the_kernels_index_put_gives_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    class _Missing:
        available = False

    monkeypatch.setattr(kv_zeroing, "load_cpu_kernels", lambda: _Missing())
    caches = _caches(3)
    block_ids = [2, 5]
    expected = _expected(caches, block_ids)
    zero_kv_blocks(caches, block_ids)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)
    zero_kv_blocks(caches, [])  # nothing to zero: no call at all
