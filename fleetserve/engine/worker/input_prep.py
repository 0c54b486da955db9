"""Input preparation: one step's scheduled requests → flat device inputs and attention metadata.

For the scheduled rows of the persistent batch it computes, with numpy on the host, the flat
input ids, the positions (num_computed_tokens + i), the slot mapping (block_id * block_size +
offset) and the metadata's lengths, writes them into the persistent step buffers and copies the
used prefix to the device. When the batch is a uniform decode that a decode graph can serve, it is
padded to that graph's size: the padding rows are inert (token 0 at position 0, length 1 in the
null block 0, slot -1, which writes nothing), and the launch geometry depends on the size alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from fleetserve.engine.layers.attention.metadata import AttentionMetadata
from fleetserve.engine.worker.cuda_graphs import DecodeGraphs
from fleetserve.engine.worker.input_batch import InputBatch
from fleetserve.engine.worker.step_buffers import StepBuffers


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass
class StepInputs:
    """The device-side inputs of one step (views of the persistent step buffers)."""

    req_ids: list[str]
    """Scheduled requests in row order (the order of the flat token dimension)."""
    input_ids: torch.Tensor  # [num_tokens] int64 (padded tokens included)
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    padded_size: int | None
    """The decode-graph size this batch was padded to, or None (runs eagerly, unpadded)."""
    sample_req_indices: list[int]
    """Indices into `req_ids` of the requests that sample this step."""
    logits_indices: torch.Tensor  # [num_logits] int64: per sampling request, its drafts' and
    # its last token's rows in the flat batch (one row without drafts)
    num_draft_tokens: list[int] = field(default_factory=list)
    """Per sampling request (parallel to `sample_req_indices`): drafts verified this step."""
    logits_rows_lead: bool = False
    """`logits_indices` is 0, 1, ..., n - 1: every real row gets logits (a decode step without
    drafts), so the hidden states' first n rows are the logits' rows, with no gather."""


@dataclass
class PaddedInputs:
    """Device inputs of a padded uniform decode batch (what a decode graph reads)."""

    input_ids: torch.Tensor  # [size] int64
    positions: torch.Tensor  # [size] int64
    metadata: AttentionMetadata


class InputPreparer:
    """Writes each step's inputs into `buffers` and returns device views of them.

    Args:
        buffers: the persistent step buffers (sized for the largest step or padded batch).
        block_size: tokens per KV block.
        max_model_len: the longest sequence (a padded batch's metadata uses it as max_seq_len).
        device: where the model runs.
    """

    def __init__(
        self, buffers: StepBuffers, block_size: int, max_model_len: int, device: torch.device
    ) -> None:
        self.buffers = buffers
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device

    def prepare(
        self,
        batch: InputBatch,
        num_scheduled_tokens: dict[str, int],
        graphs: DecodeGraphs | None,
        num_draft_tokens: Mapping[str, int] | None = None,
    ) -> StepInputs:
        """The inputs of the requests scheduled this step (at least one token in total).

        Args:
            batch: the persistent batch, already updated for this step.
            num_scheduled_tokens: request id → tokens to compute this step.
            graphs: the decode graphs a uniform decode batch may be padded for; None = never pad.
            num_draft_tokens: request id → drafts at the end of its scheduled tokens (they are
                in its batch row); each gets a logits row besides the last token's.
        """
        scheduled = sorted(
            (r for r, n in num_scheduled_tokens.items() if n > 0),
            key=lambda r: batch.req_id_to_index[r],
        )
        num_reqs = len(scheduled)
        rows = np.array([batch.req_id_to_index[r] for r in scheduled], dtype=np.int64)
        query_lens = np.array([num_scheduled_tokens[r] for r in scheduled], dtype=np.int64)
        starts = batch.num_computed_tokens[rows].astype(np.int64)
        seq_lens = starts + query_lens
        assert (seq_lens <= batch.num_tokens[rows]).all(), "scheduled beyond the known tokens"
        cu_query = np.cumsum(query_lens)
        total = int(cu_query[-1])
        token_rows = np.repeat(rows, query_lens)
        offsets = np.arange(total) - np.repeat(cu_query - query_lens, query_lens)
        positions = np.repeat(starts, query_lens) + offsets
        block_ids = batch.block_table[token_rows, positions // self.block_size].astype(np.int64)

        buf = self.buffers
        buf.wait_for_copies()
        buf.input_ids.np[:total] = batch.token_ids[token_rows, positions]
        buf.positions.np[:total] = positions
        buf.slot_mapping.np[:total] = block_ids * self.block_size + positions % self.block_size
        buf.query_start_loc.np[0] = 0
        buf.query_start_loc.np[1 : num_reqs + 1] = cu_query
        buf.seq_lens.np[:num_reqs] = seq_lens
        buf.block_table.np[:num_reqs] = batch.block_table[rows]

        padded = graphs.padded_size(num_reqs, total == num_reqs) if graphs is not None else None
        if padded is not None:
            self._write_padding(num_reqs, padded)
            padded_inputs = self._padded_device_inputs(padded, seq_lens.tolist())
            ids, pos = padded_inputs.input_ids, padded_inputs.positions
            metadata = padded_inputs.metadata
        else:
            num_cols = cdiv(int(seq_lens.max()), self.block_size)
            metadata = AttentionMetadata(
                num_actual_tokens=total,
                query_start_loc=buf.query_start_loc.to_device(num_reqs + 1),
                seq_lens=buf.seq_lens.to_device(num_reqs),
                max_query_len=int(query_lens.max()),
                max_seq_len=int(seq_lens.max()),
                block_table=buf.block_table.to_device(num_reqs)[:, :num_cols],
                slot_mapping=buf.slot_mapping.to_device(total),
                block_size=self.block_size,
                query_lens_cpu=query_lens.tolist(),
                seq_lens_cpu=seq_lens.tolist(),
                is_uniform_decode=total == num_reqs,
            )
            ids, pos = buf.input_ids.to_device(total), buf.positions.to_device(total)
        buf.record_copies()
        sample_idx = [i for i, row in enumerate(rows) if seq_lens[i] == batch.num_tokens[row]]
        drafts = num_draft_tokens or {}
        num_drafts = [drafts.get(scheduled[i], 0) for i in sample_idx]
        ends = cu_query[sample_idx]
        if any(num_drafts):
            counts = np.array(num_drafts, dtype=np.int64) + 1
            # Each sampling request's last `count` rows: ..., end - 2, end - 1.
            within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
            logits_rows = np.repeat(ends - counts, counts) + within
        else:
            logits_rows = ends - 1
        return StepInputs(
            req_ids=scheduled,
            input_ids=ids,
            positions=pos,
            metadata=metadata,
            padded_size=padded,
            sample_req_indices=sample_idx,
            logits_indices=torch.from_numpy(logits_rows).to(self.device),
            num_draft_tokens=num_drafts,
            # NOTE: the rows ascend within 0..total - 1, so total of them are all of them.
            logits_rows_lead=len(logits_rows) == total,
        )

    def padding_only(self, size: int) -> PaddedInputs:
        """A batch of `size` padding rows (what graph capture records before any request)."""
        self.buffers.wait_for_copies()
        self._write_padding(0, size)
        inputs = self._padded_device_inputs(size, [])
        self.buffers.record_copies()
        return inputs

    def _write_padding(self, start: int, end: int) -> None:
        """Rows start..end-1 (one token each) become inert: token 0 at position 0, length 1 in
        the null block 0, slot -1 (writes nothing); the real rows 0..start-1 are untouched."""
        buf = self.buffers
        buf.input_ids.np[start:end] = 0
        buf.positions.np[start:end] = 0
        buf.slot_mapping.np[start:end] = -1
        buf.query_start_loc.np[start + 1 : end + 1] = np.arange(start + 1, end + 1)
        buf.seq_lens.np[start:end] = 1
        buf.block_table.np[start:end, 0] = 0

    def _padded_device_inputs(self, size: int, real_seq_lens: list[int]) -> PaddedInputs:
        """Device inputs of a padded uniform decode batch whose first rows are real.

        Launch geometry must depend on `size` alone (a graph replays it for any lengths), so the
        metadata's host-side maxima are the limits (query 1, sequence max_model_len) and the
        block table keeps its full width; the kernels stop at each row's own length.
        """
        buf = self.buffers
        num_padding = size - len(real_seq_lens)
        metadata = AttentionMetadata(
            num_actual_tokens=size,
            query_start_loc=buf.query_start_loc.to_device(size + 1),
            seq_lens=buf.seq_lens.to_device(size),
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_table=buf.block_table.to_device(size),
            slot_mapping=buf.slot_mapping.to_device(size),
            block_size=self.block_size,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[*real_seq_lens, *([1] * num_padding)],
            is_uniform_decode=True,
        )
        return PaddedInputs(buf.input_ids.to_device(size), buf.positions.to_device(size), metadata)
