"""The torch reference backend: gather K/V by block table, attend with torch SDPA.

It runs everywhere torch does and is the numerical reference the kernel backends are tested
against; 'auto' picks it on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.attention.metadata import AttentionMetadata

_DECODE_GATHER_BYTES = 4 << 20
"""Target size of one decode group's gathered K (V is the same): small enough to stay in cache.

Measured on this project's 2-core box (SmolLM2 heads, fp32, 64 rows of 300-640 tokens, median of
15 calls): one group 11.7-17.0 ms per layer; budget 16 MiB 12.1 ms, 8 MiB 8.4, 4 MiB 5.9,
2 MiB 6.4, 1 MiB 8.4.
"""


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Whole blocks of one cache half, back to back: [len(block_ids) * block_size, Hkv, D].

    NOTE: copying whole blocks with index_select is several times faster on the CPU than
    indexing token by token; padded block-table entries point at the null block 0, which stays
    zero and is masked out by the callers.
    """
    picked = cache.index_select(0, block_ids.to(torch.int64))  # [n, block_size, Hkv, D]
    return picked.view(-1, *cache.shape[2:])


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
