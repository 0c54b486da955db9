"""The persistent batch: per-request runner state and the row buffers that survive across steps.

Each running request owns one row of host-side buffers (token ids, computed-token count, block
table). Steps only patch what changed (new tokens, appended blocks) instead of rebuilding the batch;
removing finished or preempted requests leaves holes that `condense()` fills by moving the last
rows down, so rows `0 .. num_reqs - 1` are always the live ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fleetserve.engine.lora.request import LoRARequest
from fleetserve.engine.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """Everything the runner keeps about one request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    """Seeded from `sampling_params.seed`; survives preemption so random draws continue."""
    block_ids: list[int]
    num_computed_tokens: int
    num_synced_tokens: int = 0
    """Tokens the scheduler had sent as of its last message (its `new_token_ids` follow these)."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end the request (min_tokens blocks them until it is reached)."""
    num_prompt_logprobs: int = 0
    """Prompt positions whose next-token logprobs were reported (kept across preemption, so a
    recomputed prompt reports none twice)."""
    lora_request: LoRARequest | None = None
    """The adapter it runs under (None: the base model)."""
    by_argmax: bool = False
    """Its token is the argmax of its raw logits (`samples_by_argmax` of its sampling params)."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class InputBatch:
    """Row-major host buffers for up to `max_num_reqs` requests.

    Args:
        max_num_reqs: rows (the scheduler's max_num_seqs).
        max_model_len: token capacity of a row.
        max_num_blocks_per_req: block-table width of a row.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self._num_rows = 0
        """Rows in use including holes (holes exist only between a removal and `condense`)."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState) -> int:
        """Place a request in the first free row (after `condense`, the end); returns the row.

        Raises:
            ValueError: the batch is full, the request is already in it, or it exceeds a row.
        """
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        if self.num_reqs >= self.max_num_reqs:
            raise ValueError(f"the batch holds at most max_num_seqs={self.max_num_reqs} requests")
        row = self.req_ids.index(None)
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        self._num_rows = max(self._num_rows, row + 1)
        self.num_tokens[row] = 0
        self.num_blocks[row] = 0
        self.set_tokens(state.req_id, 0, state.all_token_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.append_block_ids(state.req_id, state.block_ids)
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Free the request's row (leaving a hole); returns the row, or None if absent."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            self.req_ids[row] = None
        return row

    def condense(self) -> None:
        """Move the last live rows into the holes so that rows 0 .. num_reqs - 1 are live."""
        last = self._num_rows - 1
        for hole in range(self.num_reqs):
            if self.req_ids[hole] is not None:
                continue
            while self.req_ids[last] is None:
                last -= 1
            self._move_row(last, hole)
            last -= 1
        self._num_rows = self.num_reqs

    def set_tokens(self, req_id: str, start: int, token_ids: list[int]) -> None:
        """Write `token_ids` at positions start.. of the row; the row then ends after them."""
        row = self.req_id_to_index[req_id]
        end = start + len(token_ids)
        if end > self.max_model_len:
            raise ValueError(
                f"request {req_id!r} reaches {end} tokens; max_model_len is {self.max_model_len}"
            )
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end

    def set_last_tokens(self, rows: list[int], positions: list[int], token_ids: list[int]) -> None:
        """`set_tokens` of one token for each of `rows` at once: token i at positions[i] of
        rows[i], which then ends after it (a step's sampled tokens, one numpy write).

        Raises:
            ValueError: a position at or past max_model_len (nothing is written then).
        """
        if not rows:
            return
        where = np.asarray(positions, dtype=np.int64)
        if int(where.max()) >= self.max_model_len:
            raise ValueError(f"a token position reaches max_model_len={self.max_model_len}")
        index = np.asarray(rows, dtype=np.int64)
        self.token_ids[index, where] = token_ids
        self.num_tokens[index] = where + 1

    def append_block_ids(self, req_id: str, block_ids: list[int]) -> None:
        row = self.req_id_to_index[req_id]
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        assert end <= self.block_table.shape[1], "block table row overflow"
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None, "moving an empty row"
        num_tokens, num_blocks = int(self.num_tokens[src]), int(self.num_blocks[src])
        self.token_ids[dst, :num_tokens] = self.token_ids[src, :num_tokens]
        self.block_table[dst, :num_blocks] = self.block_table[src, :num_blocks]
        self.num_tokens[dst] = num_tokens
        self.num_blocks[dst] = num_blocks
        self.num_computed_tokens[dst] = self.num_computed_tokens[src]
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = dst
