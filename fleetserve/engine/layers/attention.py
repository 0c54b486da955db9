"""Paged attention: per-step metadata, the backend interface, the torch reference backend.

Lifecycle: the model runner builds one `AttentionMetadata` per step over its persistent step
buffers (`build_attention_metadata` builds one from host lists), shared by every layer. Each attention layer holds a backend instance (chosen once at load time by
`select_attention_backend`) and calls `forward(query, key, value, kv_cache, metadata, scale)`, which
first writes this step's K/V into the paged cache through `slot_mapping` (`write_kv`), then
attends over the cache (`attend`, the part each backend implements). Kernel backends ("triton", "flash_attn") register in `attention_backend_registry()`; model
code never changes when they do.

KV cache layout, one tensor per layer: `[2, num_blocks, block_size, num_kv_heads, head_size]`
(index 0 = keys, 1 = values). Token slot `s` is block `s // block_size`, offset `s % block_size`.
Block 0 is the null block: it is never written and must hold finite values (caches start zeroed),
because padded gathers read it under a mask and NaN * 0 would still poison the output.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property

import torch
import torch.nn.functional as F

from fleetserve.kernels.reference import reshape_and_cache_ref

logger = logging.getLogger(__name__)

_DECODE_GATHER_BYTES = 4 << 20
"""Target size of one decode group's gathered K (V is the same): small enough to stay in cache.

Measured on this project's 2-core box (SmolLM2 heads, fp32, 64 rows of 300-640 tokens, median of
15 calls): one group 11.7-17.0 ms per layer; budget 16 MiB 12.1 ms, 8 MiB 8.4, 4 MiB 5.9,
2 MiB 6.4, 1 MiB 8.4.
"""


class CudaGraphSupport(IntEnum):
    """Which batches a backend's forward can be captured for as a CUDA graph (higher = more).

    Capturable means: no host synchronisation, no data-dependent shapes, and launch geometry fixed
    by the padded batch size alone (the metadata's host-side lengths are upper bounds there).
    """

    NEVER = 0
    UNIFORM_DECODE = 1
    """Batches where every request computes exactly one token."""


@dataclass
class AttentionMetadata:
    """What every attention layer needs to know about one step's batch (shared by all layers).

    Requests are laid out back to back in the token dimension; request i owns tokens
    `query_start_loc[i]:query_start_loc[i + 1]`, whose positions are
    `seq_lens[i] - query_len_i ... seq_lens[i] - 1` (the context comes from the cache).
    """

    num_actual_tokens: int
    """Tokens of real requests (tensors may be padded beyond this)."""
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context + this step's query
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, null block 0 as padding
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = write nothing
    block_size: int
    query_lens_cpu: list[int]
    """Host copies of the query lengths, so backends can loop without a device sync."""
    seq_lens_cpu: list[int]
    is_uniform_decode: bool
    """Every request computes exactly one token (the batched decode path applies)."""

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @cached_property
    def kv_gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache slot of every (request, kv position) and its validity, computed once per step.

        Returns:
            slots [num_reqs, max_seq_len] int64 (0 where invalid) and
            valid [num_reqs, max_seq_len] bool (position < seq_len).
        """
        device = self.block_table.device
        positions = torch.arange(self.max_seq_len, device=device)
        block_ids = self.block_table[:, positions // self.block_size].to(torch.int64)
        slots = block_ids * self.block_size + positions % self.block_size
        valid = positions[None, :] < self.seq_lens[:, None]
        return torch.where(valid, slots, 0), valid


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Whole blocks of one cache half, back to back: [len(block_ids) * block_size, Hkv, D].

    NOTE: copying whole blocks with index_select is several times faster on the CPU than
    indexing token by token; padded block-table entries point at the null block 0, which stays
    zero and is masked out by the callers.
    """
    picked = cache.index_select(0, block_ids.to(torch.int64))  # [n, block_size, Hkv, D]
    return picked.view(-1, *cache.shape[2:])


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Assemble the step's metadata from host-side values and move the tensors to `device`.

    Args:
        query_lens: tokens computed per request this step (all >= 1).
        seq_lens: context + query length per request.
        block_table: [num_reqs, max_blocks] int32 CPU tensor, wide enough for max(seq_lens).
        slot_mapping: [num_tokens] int64 CPU tensor.
        block_size: tokens per KV block.
        device: where the model runs.
    """
    assert len(query_lens) == len(seq_lens), "query_lens and seq_lens must be parallel"
    assert all(q >= 1 for q in query_lens), "every scheduled request computes >= 1 token"
    max_seq_len = max(seq_lens, default=0)
    assert block_table.shape[1] * block_size >= max_seq_len, "block table too narrow"
    start_loc = [0]
    for q in query_lens:
        start_loc.append(start_loc[-1] + q)
    non_blocking = device.type == "cuda"
    return AttentionMetadata(
        num_actual_tokens=start_loc[-1],
        query_start_loc=torch.tensor(start_loc, dtype=torch.int32).to(device, non_blocking=True),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max_seq_len,
        block_table=block_table.to(device, non_blocking=non_blocking),
        slot_mapping=slot_mapping.to(device, non_blocking=non_blocking),
        block_size=block_size,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        is_uniform_decode=bool(query_lens) and all(q == 1 for q in query_lens),
    )


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
            [num_tokens, num_heads, head_size]; rows past `num_actual_tokens` are unspecified.
        """
        num_tokens = metadata.num_actual_tokens
        self.write_kv(
            key[:num_tokens], value[:num_tokens], kv_cache, metadata.slot_mapping[:num_tokens]
        )
        if metadata.num_reqs == 0:
            return torch.empty_like(query)
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


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: gather K/V by block table, attend with torch SDPA.

    Uniform decode steps run one padded, masked SDPA call for the whole batch; steps with prefill
    chunks run one call per request (causal, with query positions offset by the context length).
    K/V are gathered a whole block at a time, so positions past a request's length inside its own
    blocks are read (then masked): the runner zeroes every block when it is allocated, which
    keeps them finite (a stale NaN there would survive the mask as 0 * NaN).
    GQA uses SDPA's grouped heads (kv head j serves query heads j*G .. j*G+G-1, like HF's repeat_kv).
    """

    name = "torch"
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        output = torch.empty_like(query)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if metadata.is_uniform_decode:
            output[:num_tokens] = self._decode(
                query[:num_tokens], key_cache, value_cache, metadata, scale
            )
            return output
        start = 0
        for i, (query_len, seq_len) in enumerate(
            zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
        ):
            end = start + query_len
            blocks = metadata.block_table[i, : -(-seq_len // metadata.block_size)]
            output[start:end] = self._prefill(
                query[start:end],
                _gather_blocks(key_cache, blocks)[:seq_len],
                _gather_blocks(value_cache, blocks)[:seq_len],
                seq_len - query_len,
                scale,
            )
            start = end
        return output

    def _decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """One query token per request; rows are attended in groups of similar length.

        NOTE: the gathered K/V of a whole batch (tens of MiB) falls out of the CPU caches and
        every row is padded to the longest one; length-sorted groups of about
        `_DECODE_GATHER_BYTES` each avoid both, at the price of a few more SDPA calls.
        """
        seq_lens = metadata.seq_lens_cpu
        order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
        bytes_per_token = self.num_kv_heads * self.head_size * key_cache.element_size()
        groups: list[list[int]] = [[]]
        for row in order:
            padded = -(-seq_lens[row] // metadata.block_size) * metadata.block_size
            if (
                groups[-1]
                and (len(groups[-1]) + 1) * padded * bytes_per_token > _DECODE_GATHER_BYTES
            ):
                groups.append([])
            groups[-1].append(row)
        if len(groups) == 1:
            return self._decode_rows(query, key_cache, value_cache, metadata, None, scale)
        output = torch.empty_like(query)
        for group in groups:
            rows = torch.tensor(group, device=query.device)
            output[rows] = self._decode_rows(
                query[rows], key_cache, value_cache, metadata, rows, scale
            )
        return output

    def _decode_rows(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rows: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """Padded, masked SDPA for `rows` of the batch (all rows when None)."""
        block_table = metadata.block_table if rows is None else metadata.block_table[rows]
        seq_lens = metadata.seq_lens if rows is None else metadata.seq_lens[rows]
        max_seq_len = int(seq_lens.max())
        num_blocks = -(-max_seq_len // metadata.block_size)
        blocks = block_table[:, :num_blocks].reshape(-1)
        padded_len = num_blocks * metadata.block_size
        shape = (query.shape[0], padded_len, self.num_kv_heads, self.head_size)
        q = query.unsqueeze(2)  # [B, H, 1, D]
        k = _gather_blocks(key_cache, blocks).view(shape).transpose(1, 2)  # [B, Hkv, S, D]
        v = _gather_blocks(value_cache, blocks).view(shape).transpose(1, 2)
        positions = torch.arange(padded_len, device=query.device)
        mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, S]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return out.squeeze(2)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        context_len: int,
        scale: float,
    ) -> torch.Tensor:
        """query [L, H, D] at positions context_len.. ; key/value [context_len + L, Hkv, D]."""
        query_len, seq_len = query.shape[0], key.shape[0]
        q = query.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        k = key.transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        v = value.transpose(0, 1).unsqueeze(0)
        gqa = self.num_heads != self.num_kv_heads
        if context_len == 0:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=query_len > 1, scale=scale, enable_gqa=gqa
            )
        else:
            # NOTE: SDPA's is_causal aligns the mask top-left; with a cached context the query
            # rows sit at the bottom of the key range, so the offset mask is built explicitly.
            q_pos = torch.arange(context_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        return out.squeeze(0).transpose(0, 1)


def attention_backend_registry() -> dict[str, type[AttentionBackend]]:
    """Known backends, best first ('auto' tries them in this order).

    Kernel backends are added here by name; each guards its own imports in `is_available`.
    """
    from fleetserve.engine.layers.attention_flash import FlashAttentionBackend
    from fleetserve.engine.layers.attention_triton import TritonAttentionBackend

    kernels: list[type[AttentionBackend]] = [FlashAttentionBackend, TritonAttentionBackend]
    # NOTE: without CUDA the kernels run only in Triton's interpreter, far slower than torch:
    # torch is the best there, so it goes first (and the kernels decline 'auto' on the CPU).
    ordered: list[type[AttentionBackend]] = [*kernels, TorchAttentionBackend]
    if not torch.cuda.is_available():
        ordered = [TorchAttentionBackend, *kernels]
    return {backend.name: backend for backend in ordered}


def select_attention_backend(
    requested: str,
    head_size: int,
    dtype: torch.dtype,
    block_size: int,
    device: torch.device,
) -> type[AttentionBackend]:
    """Pick the backend for a model.

    Args:
        requested: 'auto' or a backend name from the registry.

    Raises:
        ValueError: unknown name, or the requested backend cannot serve the configuration
            (the message carries the backend's reason), or no backend can serve it under 'auto'.
    """
    registry = attention_backend_registry()
    if requested != "auto":
        if requested not in registry:
            allowed = ["auto", *registry]
            raise ValueError(f"attention_backend must be one of {allowed}, got {requested!r}")
        reason = registry[requested].validate_configuration(head_size, dtype, block_size, device)
        if reason is not None:
            raise ValueError(f"attention_backend {requested!r} cannot serve this model: {reason}")
        return registry[requested]
    reasons: list[str] = []
    for name, backend in registry.items():
        reason = backend.validate_configuration(head_size, dtype, block_size, device)
        if reason is None:
            reason = backend.auto_selectable(device)
        if reason is None:
            return backend
        logger.info("attention backend %r skipped: %s", name, reason)
        reasons.append(f"{name}: {reason}")
    raise ValueError(f"no attention backend can serve this model ({'; '.join(reasons)})")
