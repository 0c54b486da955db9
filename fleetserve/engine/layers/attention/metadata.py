"""Per-step attention metadata: what every attention layer needs to know about one batch.

The model runner builds one `AttentionMetadata` per step over its persistent step buffers (tests
and tools build one from host lists with `build_attention_metadata`); every layer of the step
shares it. KV cache layout, one tensor per layer: `[2, num_blocks, block_size, num_kv_heads,
head_size]` (index 0 = keys, 1 = values); token slot `s` is block `s // block_size`, offset
`s % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


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
