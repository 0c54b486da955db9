"""The fused CPU backend: paged attention that reads K/V from the cache in place (C++/OpenMP).

The kernels (`fleetserve/kernels/cpu/paged_attention.cpp`) are built with the machine's compiler
at first use and cached; when they cannot be built, `is_available` says why and the selector
falls back to the torch reference (which stays the oracle in tests).

Rows of requests with short queries (decodes, speculative drafts: at most
`FUSED_MAX_QUERY_LEN` tokens) go through the kernel: each (query row, kv head) pair walks its
request's blocks with an online softmax, so nothing is gathered, padded or masked. Longer prefill
chunks are compute-bound, where SDPA's blocked matmuls beat a per-row walk, so they keep the torch
backend's path (gather the request's blocks once, one SDPA call); both run in the same step.
"""

from __future__ import annotations

import torch

from fleetserve.engine.layers.attention.metadata import AttentionMetadata
from fleetserve.engine.layers.attention.torch_backend import TorchAttentionBackend, _gather_blocks
from fleetserve.kernels.cpu.build import load_cpu_kernels

FUSED_MAX_QUERY_LEN = 8
"""Requests computing at most this many tokens in a step use the fused kernel."""


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
        torch.ops.fleetserve_cpu.paged_attention(
            query,
            kv_cache,
            metadata.query_start_loc[: num_reqs + 1],
            metadata.seq_lens[:num_reqs],
            metadata.block_table[:num_reqs],
            scale,
            FUSED_MAX_QUERY_LEN,
            output,
        )
        if metadata.max_query_len > FUSED_MAX_QUERY_LEN:
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
