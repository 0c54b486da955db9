"""The paged torch backend equals dense causal attention; the KV write honours slot_mapping."""

from __future__ import annotations

import pytest
import torch

from fleetserve.engine.layers.attention import torch_backend
from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.attention.cpu_backend import CpuPagedAttentionBackend
from fleetserve.engine.layers.attention.metadata import build_attention_metadata
from fleetserve.engine.layers.attention.selector import select_attention_backend
from fleetserve.engine.layers.attention.torch_backend import TorchAttentionBackend
from fleetserve.kernels.reference import reshape_and_cache_ref

BLOCK_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 32
CPU = torch.device("cpu")


def _dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [L, H, D] for the last L positions of k/v [S, Hkv, D]; float64 softmax attention."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * scale
    query_len, seq_len = q.shape[0], k.shape[0]
    q_pos = torch.arange(seq_len - query_len, seq_len)
    mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


def _run_batch(
    requests: list[tuple[int, int, list[int]]],
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
    zero_owned_blocks: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """requests: (context_len, query_len, block_ids). Returns (ours, reference, kv_cache).

    `zero_owned_blocks=False` keeps NaN in the requests' own blocks too, to see exactly which
    offsets a write touched (the attention output is then not meaningful).
    """
    torch.manual_seed(0)
    num_blocks = max(16, 1 + max(max(ids) for _, _, ids in requests))
    kv_cache = torch.full((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), float("nan"))
    kv_cache = kv_cache.to(dtype)
    kv_cache[:, 0] = 0.0  # the null block is zero (padding gathers read it); the rest is stale NaN
    queries, keys, values, slots, references = [], [], [], [], []
    scale = HEAD_SIZE**-0.5
    max_blocks = max(len(b) for _, _, b in requests)
    table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    for i, (context_len, query_len, block_ids) in enumerate(requests):
        table[i, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        # Like the runner, which zeroes every newly allocated block before its first write;
        # blocks no request owns stay NaN, so any read outside the block table shows up.
        if zero_owned_blocks:
            kv_cache[:, block_ids] = 0.0
        seq_len = context_len + query_len
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE).to(dtype)
        q = torch.randn(query_len, NUM_HEADS, HEAD_SIZE).to(dtype)
        all_slots = [
            block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)
        ]
        # The context is already cached by earlier steps.
        reshape_and_cache_ref(
            k[:context_len],
            v[:context_len],
            kv_cache,
            torch.tensor(all_slots[:context_len], dtype=torch.int64),
        )
        queries.append(q)
        keys.append(k[context_len:])
        values.append(v[context_len:])
        slots.extend(all_slots[context_len:])
        references.append(_dense_reference(q, k, v, scale))
    metadata = build_attention_metadata(
        [q for _, q, _ in requests],
        [c + q for c, q, _ in requests],
        table,
        torch.tensor(slots, dtype=torch.int64),
        BLOCK_SIZE,
        device,
    )
    backend = TorchAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE)
    kv_cache = kv_cache.to(device)
    out = backend.forward(
        torch.cat(queries).to(device),
        torch.cat(keys).to(device),
        torch.cat(values).to(device),
        kv_cache,
        metadata,
        scale,
    )
    return out.cpu(), torch.cat(references), kv_cache.cpu()


@pytest.mark.parametrize(
    "device", [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.gpu)], ids=str
)
def test_mixed_batch_matches_dense_reference(device: torch.device) -> None:
    requests = [
        (5, 6, [7, 2, 9]),  # prefill chunk starting mid-block, ending in a partial block
        (9, 1, [4, 11, 1]),  # decode into a partial block
        (0, 3, [5]),  # fresh prefill, one partial block
        (0, 1, [12]),  # one-token prompt
        (8, 1, [3, 6, 14]),  # decode that opens a new block
    ]
    ours, reference, _ = _run_batch(requests, device=device)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "device", [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.gpu)], ids=str
)
def test_uniform_decode_batch_matches_dense_reference(device: torch.device) -> None:
    requests = [(9, 1, [4, 11, 1]), (0, 1, [12]), (3, 1, [8]), (11, 1, [3, 6, 14])]
    ours, reference, _ = _run_batch(requests, device=device)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-5)


def test_large_decode_batch_in_length_groups_matches_dense_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 24 decodes of lengths 1..47 in shuffled order; a tiny gather budget (the tuning constant,
    # 4 MiB in production) splits them into many length groups.
    monkeypatch.setattr(torch_backend, "_DECODE_GATHER_BYTES", 8 * 1024)
    lengths = [1 + (i * 17) % 47 for i in range(24)]
    requests, next_block = [], 1
    for length in lengths:
        num_blocks = -(-length // BLOCK_SIZE)
        requests.append((length - 1, 1, list(range(next_block, next_block + num_blocks))))
        next_block += num_blocks
    ours, reference, _ = _run_batch(requests)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-5)


def test_bfloat16_batch_close_to_reference() -> None:
    ours, reference, _ = _run_batch([(5, 6, [7, 2, 9]), (9, 1, [4, 11, 1])], torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.double(), reference, rtol=2e-2, atol=2e-2)


def test_write_lands_at_block_times_size_plus_offset() -> None:
    _, _, kv_cache = _run_batch([(2, 5, [9, 4])], zero_owned_blocks=False)
    # positions 0..6 → block 9 offsets 0..3, block 4 offsets 0..2; block 4 offset 3 untouched
    assert not kv_cache[:, 9].isnan().any()
    assert not kv_cache[:, 4, :3].isnan().any()
    assert kv_cache[:, 4, 3].isnan().all()
    touched = {0, 9, 4}
    for block in range(kv_cache.shape[1]):
        if block not in touched:
            assert kv_cache[:, block].isnan().all()


def test_slot_minus_one_writes_nothing() -> None:
    kv_cache = torch.zeros(2, 3, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    key = torch.ones(3, NUM_KV_HEADS, HEAD_SIZE)
    reshape_and_cache_ref(key, 2 * key, kv_cache, torch.tensor([5, -1, 0]))
    flat = kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_SIZE)
    assert flat[0, 5].eq(1).all() and flat[1, 5].eq(2).all()
    assert flat[0, 0].eq(1).all()
    assert flat[:, [1, 2, 3, 4, 6, 7, 8, 9, 10, 11]].eq(0).all()


def test_select_auto_returns_torch_without_the_fused_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fused CPU kernel goes first on the CPU; when it cannot serve, torch is next."""
    monkeypatch.setattr(CpuPagedAttentionBackend, "supported_dtypes", ())
    backend = select_attention_backend("auto", HEAD_SIZE, torch.float32, BLOCK_SIZE, CPU)
    assert backend is TorchAttentionBackend


def test_select_unknown_name_lists_allowed() -> None:
    with pytest.raises(ValueError, match=r"\['auto', 'cpu_paged', 'torch'"):
        select_attention_backend("paged_magic", HEAD_SIZE, torch.float32, BLOCK_SIZE, CPU)


def test_select_explicit_backend_that_cannot_serve_gives_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(TorchAttentionBackend, "supported_block_sizes", (16,))
    monkeypatch.setattr(CpuPagedAttentionBackend, "supported_block_sizes", (16,))
    with pytest.raises(ValueError, match="block_size 4 is not one of"):
        select_attention_backend("torch", HEAD_SIZE, torch.float32, BLOCK_SIZE, CPU)
    with pytest.raises(ValueError, match="no attention backend"):
        select_attention_backend("auto", HEAD_SIZE, torch.float32, BLOCK_SIZE, CPU)


def test_validate_configuration_reports_dtype() -> None:
    class Fp16Only(TorchAttentionBackend):
        supported_dtypes: tuple[torch.dtype, ...] = (torch.float16,)

    reason = Fp16Only.validate_configuration(HEAD_SIZE, torch.float32, 16, CPU)
    assert reason is not None and "torch.float32" in reason
    assert issubclass(Fp16Only, AttentionBackend)
