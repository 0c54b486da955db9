"""The grammar bitmask as the step contract carries it (torch-free: numpy only).

The scheduler fills it (`manager.StructuredOutputManager.grammar_bitmask`); the model runner
turns the rows it samples into a device tensor (`bitmask.batch_bitmask`) and the sampler masks
the logits with it (`bitmask.apply_token_bitmask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["GrammarBitmask", "bitmask_width"]


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row: one bit per token, token t in word t // 32, bit t % 32."""
    return -(-vocab_size // 32)


@dataclass
class GrammarBitmask:
    """One step's masks of the constrained requests that sample this step.

    A request's rows are `bitmask[row_of[req_id] : row_of[req_id] + num_rows[req_id]]`: one
    row, or 1 + k with k draft tokens (row i is the mask after drafts 0..i-1). A set bit means
    the token is allowed; a request without rows is unconstrained (the runner uses all ones).
    """

    row_of: dict[str, int]
    num_rows: dict[str, int]
    bitmask: np.ndarray
    """[total rows, bitmask_width(vocab_size)] int32."""
