"""The fused CPU backend: paged attention that reads K/V from the cache in place (C++/OpenMP).

The kernels (`fleetserve/kernels/cpu/paged_attention.cpp`) are built with the machine's compiler
at first use and cached; when they cannot be built, `is_available` says why and the selector
falls back to the torch reference (which stays the oracle in tests).

The kernel reads the request's blocks in place, so nothing is gathered, padded or masked:
short queries (decodes, speculative drafts) row by row, longer ones in tiles of consecutive rows
(float32, AVX-512). Rows of requests with short queries (at most `FUSED_MAX_QUERY_LEN` tokens)
always go through it. Longer prefill chunks are compute-bound: they go through it too where it
was measured faster than SDPA (`fused_takes_long_queries`), and otherwise keep the torch
backend's path (gather the request's blocks once, one SDPA call); both run in the same step.
"""

from __future__ import annotations

from functools import cache

import torch

from fleetserve.engine.layers.attention.metadata import AttentionMetadata
from fleetserve.engine.layers.attention.torch_backend import TorchAttentionBackend, _gather_blocks
from fleetserve.kernels.cpu.build import load_cpu_kernels

FUSED_MAX_QUERY_LEN = 8
"""Requests computing at most this many tokens in a step use the fused kernel on any shape."""


@cache
def fused_takes_long_queries(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int
) -> bool:
    """Whether prefill chunks of any length go through the fused kernel rather than SDPA.

    Float32 on an AVX-512 build only (bfloat16 rows lost to SDPA, 0.3-0.8). There the kernel
    computes prefill rows in tiles where it has a variant for the shape (its `prefill_tile_rows`:
    head sizes 32, 64, 128 with groups 1, 2, 3, 4, 8; each 16-key chunk loaded once for up to 16
    query vectors), and `fleetserve bench attention` put it ahead of SDPA's gather + causal call
    on a 2048-token step of prompts of 32-512 tokens: 2.05x with 4 heads of 32 in 2 KV heads,
    1.71x with 9 of 64 in 3; and without a group (MHA, where the row-at-a-time walk had lost at
    0.3-0.8) 2.21x at 4 x 32, 1.55x at 8 x 64, 1.14x at 16 x 128. Other head sizes that are a
    multiple of 16 keep the row walk, which beat SDPA only when each key row serves a group of
    two or more query heads (1.08-1.54 per request at 300, 512 and 256 after 512 tokens).
    Cached: it depends on the model's shape and the machine only, and the backend asks it in
    every attention call.
    """
    if dtype != torch.float32 or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    group = num_heads // num_kv_heads
    if torch.ops.fleetserve_cpu.prefill_tile_rows(head_size, group) > 0:
        return True
    return head_size % 16 == 0 and group >= 2


class CpuPagedAttentionBackend(TorchAttentionBackend):
    """Fused paged attention for the CPU (fp32, bf16, fp16; any head and block size)."""

    name = "cpu_paged"
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

    @classmethod
    def is_available(cls) -> str | None:
        return load_cpu_kernels().error

    @classmethod
    def validate_device(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"it runs on the CPU only, not {device.type}"
        return None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        if key.stride(1) != key.shape[2] or key.stride(2) != 1:
            key = key.contiguous()
        if value.stride(1) != value.shape[2] or value.stride(2) != 1:
            value = value.contiguous()
        torch.ops.fleetserve_cpu.reshape_and_cache(key, value, kv_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if query.stride(2) != 1:
            query = query.contiguous()
        # NOTE: zeros, not empty: rows past num_actual_tokens (graph padding) are not written.
        if len(query) > metadata.num_actual_tokens:
            output = torch.zeros_like(query)
        else:
            output = torch.empty_like(query)
        num_reqs = metadata.num_reqs
        max_query_len = FUSED_MAX_QUERY_LEN
        if fused_takes_long_queries(query.dtype, self.num_heads, self.num_kv_heads, self.head_size):
            max_query_len = max(metadata.max_query_len, FUSED_MAX_QUERY_LEN)
        torch.ops.fleetserve_cpu.paged_attention(
            query,
            kv_cache,
            metadata.query_start_loc[: num_reqs + 1],
            metadata.seq_lens[:num_reqs],
            metadata.block_table[:num_reqs],
            scale,
            max_query_len,
            output,
        )
        if metadata.max_query_len > max_query_len:
            self._long_prefills(query, kv_cache, metadata, scale, output)
        return output

    def _long_prefills(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """The rows the kernel left: requests computing more than FUSED_MAX_QUERY_LEN tokens."""
        start = 0
        for i, (query_len, seq_len) in enumerate(
            zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
        ):
            end = start + query_len
            if query_len > FUSED_MAX_QUERY_LEN:
                blocks = metadata.block_table[i, : -(-seq_len // metadata.block_size)]
                output[start:end] = self._prefill(
                    query[start:end],
                    _gather_blocks(kv_cache[0], blocks)[:seq_len],
                    _gather_blocks(kv_cache[1], blocks)[:seq_len],
                    seq_len - query_len,
                    scale,
                )
            start = end
