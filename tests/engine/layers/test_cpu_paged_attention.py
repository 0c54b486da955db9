"""The fused CPU paged attention against the torch reference backend and the float64 oracle.

Odd shapes on purpose: partial last blocks, GQA groups of 1/2/3/4/6/8, a block size that is not
the usual 16, head sizes 32/64/80/128 (compiled-in variants exist for head sizes 32, 64 and 128
with groups 1, 2, 3, 4 and 8; the others take either at run time), scattered (non-contiguous)
block ids, and steps that mix chunked prefill rows with decodes; prefill rows in tiles (full,
partial, at the threshold, across odd blocks) beside rows the kernel walks one at a time; plus
the KV write (exact), results that do not depend on the thread count, and the selector's
fallback.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch

from fleetserve.engine.layers.attention import selector as selector_module
from fleetserve.engine.layers.attention.cpu_backend import CpuPagedAttentionBackend
from fleetserve.engine.layers.attention.metadata import build_attention_metadata
from fleetserve.engine.layers.attention.selector import select_attention_backend
from fleetserve.engine.layers.attention.torch_backend import TorchAttentionBackend
from fleetserve.kernels.cpu.build import CpuKernels, load_cpu_kernels
from fleetserve.kernels.reference import paged_attention_ref

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    not load_cpu_kernels().available, reason=str(load_cpu_kernels().error)
)


def _random_step(
    rng: random.Random,
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """A cache with every request's context already written at scattered blocks, this step's
    q/k/v, and its metadata inputs (the slot mapping continues each request's blocks)."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_needed) + 3
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    width = max(blocks_needed)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots: list[int] = []
    for r, (n, context, q) in enumerate(zip(blocks_needed, context_lens, query_lens, strict=True)):
        row = [ids.pop() for _ in range(n)]
        table[r, :n] = torch.tensor(row, dtype=torch.int32)
        slots += [
            row[p // block_size] * block_size + p % block_size for p in range(context, context + q)
        ]
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    cache[:, 0] = 0.0
    total = sum(query_lens)
    q = torch.randn(total, num_heads, head_size, generator=gen)
    k = torch.randn(total, num_kv_heads, head_size, generator=gen)
    v = torch.randn(total, num_kv_heads, head_size, generator=gen)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    return cache.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), table, slot_mapping


CASES = [
    # (query_lens, context_lens, heads, kv_heads, head_size, block_size)
    ([1] * 7, [0, 1, 15, 16, 17, 40, 99], 4, 2, 32, 16),  # uniform decode, partial blocks
    ([5, 1, 1, 9, 1], [0, 30, 7, 12, 64], 9, 3, 64, 16),  # chunked prefill mixed with decodes
    ([3, 1, 2], [5, 6, 0], 4, 4, 80, 5),  # MHA, odd block and head size
    ([1, 17], [33, 3], 8, 1, 32, 8),  # MQA (one kv head), a long chunk
    ([1, 2, 1], [20, 3, 130], 8, 2, 128, 16),  # head size 128 (its compiled-in variant)
    ([1, 4], [10, 50], 6, 6, 64, 16),  # MHA at a compiled-in head size (group 1 fixed too)
    ([1, 3, 1], [7, 0, 70], 12, 2, 32, 16),  # group 6: head size fixed, group at run time
    # Prefill tiles (float32 with AVX-512; rows per tile = 16 // group, from half a tile on):
    ([24, 1, 8, 1], [0, 40, 3, 17], 4, 4, 64, 16),  # MHA: a full and a partial tile of 16 rows
    # and a request at the threshold (8 rows)
    ([37, 2, 1], [100, 5, 60], 4, 2, 32, 5),  # tiles across blocks of 5; 2 rows: the row walk
    ([19, 3], [300, 0], 16, 2, 128, 16),  # group 8: tiles of 2 rows, the last one of 1
    ([6, 1], [0, 0], 9, 3, 64, 16),  # group 3: tiles of 5 rows, keys fewer than one chunk
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fused_equals_torch_reference_and_oracle(case: int, dtype: torch.dtype) -> None:
    query_lens, context_lens, heads, kv_heads, head_size, block_size = CASES[case]
    rng = random.Random(case)
    cache, q, k, v, table, slots = _random_step(
        rng, query_lens, context_lens, heads, kv_heads, head_size, block_size, dtype
    )
    seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    metadata = build_attention_metadata(query_lens, seq_lens, table, slots, block_size, CPU)
    scale = head_size**-0.5
    outs, caches = [], []
    for cls in (TorchAttentionBackend, CpuPagedAttentionBackend):
        kv_cache = cache.clone()
        outs.append(cls(heads, kv_heads, head_size).forward(q, k, v, kv_cache, metadata, scale))
        caches.append(kv_cache)
    torch.testing.assert_close(caches[1], caches[0], atol=0.0, rtol=0.0)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
    oracle = paged_attention_ref(
        q, caches[1], metadata.query_start_loc, metadata.seq_lens, table, scale
    )
    torch.testing.assert_close(outs[1], oracle, atol=tol, rtol=tol)
    # The kernel alone on every row (prefill chunks included, which the backend gives to SDPA).
    whole = torch.empty_like(q)
    torch.ops.fleetserve_cpu.paged_attention(
        q, caches[1], metadata.query_start_loc, metadata.seq_lens, table, scale, 1 << 30, whole
    )
    torch.testing.assert_close(whole, oracle, atol=tol, rtol=tol)


def test_tiles_and_rows_give_the_same_bits_on_one_thread_and_two() -> None:
    """Tiles and the row walk's rows are handed out longest first from a shared counter: which
    thread computes one must not change a bit of it (decode rows of 6 to 701 keys, a 3-row
    request below the tile threshold, prefill chunks in tiles)."""
    query_lens = [70, 1, 33, 9, 1, 1, 1, 3, 1]
    context_lens = [0, 200, 64, 500, 31, 700, 5, 90, 333]
    cache, q, _, _, table, slots = _random_step(
        random.Random(5), query_lens, context_lens, 4, 2, 32, 16, torch.float32
    )
    seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    metadata = build_attention_metadata(query_lens, seq_lens, table, slots, 16, CPU)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty_like(q)
            torch.ops.fleetserve_cpu.paged_attention(
                q, cache, metadata.query_start_loc, metadata.seq_lens, table, 32**-0.5, 1 << 30, out
            )
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    oracle = paged_attention_ref(
        q, cache, metadata.query_start_loc, metadata.seq_lens, table, 32**-0.5
    )
    torch.testing.assert_close(outs[0], oracle, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_size", "fused"),
    [
        (torch.float32, 4, 2, 32, True),  # float32 GQA: tiles
        (torch.float32, 12, 2, 64, True),  # group 6: no tiles, the row walk still beats SDPA
        (torch.float32, 4, 4, 32, True),  # no group, at a head size with tiles
        (torch.float32, 2, 2, 96, False),  # no group, no tiles: SDPA reuses key rows better
        (torch.float32, 6, 2, 40, False),  # head size not a multiple of 16
        (torch.bfloat16, 4, 2, 32, False),
    ],
)
def test_long_prefill_chunks_go_where_they_were_measured_faster(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_size: int,
    fused: bool,
) -> None:
    """A 40-token chunk beside a decode: through the kernel, or through the SDPA path."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        fused = False
    query_lens, context_lens = [40, 1], [20, 33]
    cache, q, k, v, table, slots = _random_step(
        random.Random(9), query_lens, context_lens, heads, kv_heads, head_size, 16, dtype
    )
    seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    metadata = build_attention_metadata(query_lens, seq_lens, table, slots, 16, CPU)
    backend = CpuPagedAttentionBackend(heads, kv_heads, head_size)
    sdpa_rows: list[int] = []
    reference_prefill = backend._prefill

    def counting_prefill(query: torch.Tensor, *args: Any) -> torch.Tensor:
        sdpa_rows.append(query.shape[0])
        return reference_prefill(query, *args)

    monkeypatch.setattr(backend, "_prefill", counting_prefill)
    out = backend.forward(q, k, v, cache, metadata, head_size**-0.5)
    assert sdpa_rows == ([] if fused else [40])
    oracle = paged_attention_ref(
        q, cache, metadata.query_start_loc, metadata.seq_lens, table, head_size**-0.5
    )
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, oracle, atol=tol, rtol=tol)


def test_padding_rows_write_nothing_and_read_as_zero() -> None:
    """Graph-style padding: slot -1 rows leave the cache alone; rows past the requests are 0."""
    cache, q, k, v, table, slots = _random_step(
        random.Random(5), [1, 1], [3, 20], 4, 2, 32, 16, torch.float32
    )
    metadata = build_attention_metadata([1, 1], [4, 21], table, slots, 16, CPU)
    padded_q = torch.cat([q, torch.randn(2, 4, 32)])
    padded_k = torch.cat([k, torch.randn(2, 2, 32)])
    before = cache.clone()
    out = CpuPagedAttentionBackend(4, 2, 32).forward(
        padded_q, padded_k, torch.cat([v, v]), cache, metadata, 32**-0.5
    )
    assert torch.equal(out[2:], torch.zeros(2, 4, 32))
    changed = (cache != before).flatten(2).any(-1)  # [2, blocks, block_size]
    assert int(changed.sum()) == 4  # two tokens, key and value each


def test_bad_block_table_is_refused_not_read_past() -> None:
    cache, q, _, _, table, slots = _random_step(
        random.Random(2), [1], [40], 4, 2, 32, 16, torch.float32
    )
    metadata = build_attention_metadata([1], [41], table, slots, 16, CPU)
    with pytest.raises(RuntimeError, match="block_table is too narrow"):
        torch.ops.fleetserve_cpu.paged_attention(
            q, cache, metadata.query_start_loc, metadata.seq_lens, table[:, :1], 1.0, 8, q.clone()
        )


def test_auto_on_cpu_picks_the_fused_backend() -> None:
    chosen = select_attention_backend("auto", 64, torch.float32, 16, CPU)
    assert chosen is CpuPagedAttentionBackend


def test_build_failure_falls_back_to_torch_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = CpuKernels(None, "the CPU kernels could not be built or loaded: g++ exploded")
    monkeypatch.setattr(
        "fleetserve.engine.layers.attention.cpu_backend.load_cpu_kernels", lambda: broken
    )
    with caplog.at_level(logging.INFO, logger=selector_module.__name__):
        chosen = select_attention_backend("auto", 64, torch.float32, 16, CPU)
    assert chosen is TorchAttentionBackend
    assert (
        "attention backend 'cpu_paged' skipped: the CPU kernels could not be built" in caplog.text
    )
    with pytest.raises(ValueError, match=r"'cpu_paged' cannot serve this model: .*g\+\+ exploded"):
        select_attention_backend("cpu_paged", 64, torch.float32, 16, CPU)
