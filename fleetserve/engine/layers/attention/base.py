"""The attention backend interface: capabilities, validation and the write-then-attend forward.

A backend class declares what it can serve (dtypes, head sizes, block sizes, CUDA graph support);
`validate_configuration` turns that into a reason string, so selection (`selector.py`) fails or
falls back at start-up, never mid-run. An instance serves one layer. `forward` is a template
method: it writes this step's K/V into the paged cache (`write_kv`), then attends over the cache
(`attend`, the part each backend implements). It is pure device work with no host-side
callbacks, which is what lets a decode step be captured as a CUDA graph; per-layer hooks (the KV
connector's) run around it in the `Attention` layer (`layer.py`), never inside it.

Block 0 of every cache is the null block: it is never written and must hold finite values
(caches start zeroed), because padded gathers read it under a mask and NaN * 0 would still
poison the output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import IntEnum

import torch

from fleetserve.engine.layers.attention.metadata import AttentionMetadata
from fleetserve.kernels.reference import reshape_and_cache_ref


class CudaGraphSupport(IntEnum):
    """Which batches a backend's forward can be captured for as a CUDA graph (higher = more).

    Capturable means: no host synchronisation, no data-dependent shapes, and launch geometry fixed
    by the padded batch size alone (the metadata's host-side lengths are upper bounds there).
    """

    NEVER = 0
    UNIFORM_DECODE = 1
    """Batches where every request computes exactly one token."""


class AttentionBackend(ABC):
    """One attention implementation; an instance serves one layer.

    Subclasses declare their capabilities as class attributes; `validate_configuration` turns them
    into a reason string so selection fails (or falls back) at startup, never mid-run.
    """

    name: str = ""
    supported_dtypes: tuple[torch.dtype, ...] = ()
    supported_head_sizes: tuple[int, ...] | None = None
    """None = any head size."""
    supported_block_sizes: tuple[int, ...] | None = None
    """None = any block size."""
    cuda_graph_support: CudaGraphSupport = CudaGraphSupport.NEVER

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int) -> None:
        assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size

    @classmethod
    def is_available(cls) -> str | None:
        """None when the backend's libraries and hardware are present, else why not."""
        return None

    @classmethod
    def validate_configuration(
        cls, head_size: int, dtype: torch.dtype, block_size: int, device: torch.device
    ) -> str | None:
        """None when this backend can serve the combination, else a human-readable reason."""
        unavailable = cls.is_available()
        if unavailable is not None:
            return unavailable
        if dtype not in cls.supported_dtypes:
            return f"dtype {dtype} is not one of {cls.supported_dtypes}"
        if cls.supported_head_sizes is not None and head_size not in cls.supported_head_sizes:
            return f"head_size {head_size} is not one of {cls.supported_head_sizes}"
        if cls.supported_block_sizes is not None and block_size not in cls.supported_block_sizes:
            return f"block_size {block_size} is not one of {cls.supported_block_sizes}"
        return cls.validate_device(device)

    @classmethod
    def validate_device(cls, device: torch.device) -> str | None:
        """None when the backend can run on the model's `device`, else why not (asked by
        `validate_configuration` once everything else fits)."""
        return None

    @classmethod
    def auto_selectable(cls, device: torch.device) -> str | None:
        """None when 'auto' may pick this backend on `device`, else why not.

        Only 'auto' asks: a backend that can serve a configuration but should not be chosen for
        it unasked (e.g. an interpreted kernel on the CPU) still works when named explicitly.
        """
        return None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write K/V through `metadata.slot_mapping`, then attend over the paged cache.

        Args:
            query: [num_tokens, num_heads, head_size].
            key, value: [num_tokens, num_kv_heads, head_size] (already rotated).
            kv_cache: this layer's [2, num_blocks, block_size, num_kv_heads, head_size].
            metadata: the step's shared metadata.
            scale: softmax scale (usually head_size ** -0.5).

        Returns:
            [num_tokens, num_heads, head_size]; rows past `num_actual_tokens` are unspecified,
            and a batch without requests (padding tokens only) gives zeros.
        """
        num_tokens = metadata.num_actual_tokens
        self.write_kv(
            key[:num_tokens], value[:num_tokens], kv_cache, metadata.slot_mapping[:num_tokens]
        )
        if metadata.num_reqs == 0:
            # NOTE: zeros, not empty_like: uninitialised memory may hold NaN or Inf, which would
            # flow on through o_proj into the padding rows' hidden states (and any check on them).
            return torch.zeros_like(query)
        return self.attend(query, kv_cache, metadata, scale)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter key/value [T, Hkv, D] into the cache at `slot_mapping` [T] (-1 = skip)."""
        reshape_and_cache_ref(key, value, kv_cache, slot_mapping)

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of `query` over the cache (this step's K/V already written); only
        called with at least one request.

        Returns a new [num_tokens, num_heads, head_size] tensor (see `forward`).
        """
