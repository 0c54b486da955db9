"""The grammar side of speculative decoding (seed notes part 2 §2.2, "speculative mask fill").

A request with k draft tokens gets 1 + k bitmask rows: row i is the mask after drafts 0..i-1
(row 0 the mask now, row k the mask for the bonus token after every draft). Filling them walks
the grammar through the drafts and rolls it back, so the grammar state after the fill equals the
state before; after the first draft the grammar rejects, the later rows copy the mask at the
point of rejection (those positions are never accepted: verification stops there). Only the
tokens the target model verified are then accepted (`Grammar.accept_tokens`).
"""

from __future__ import annotations

import torch

from fleetserve.engine.structured_output.backend import Grammar

__all__ = ["DRAFT_PADDING", "fill_draft_rows", "valid_draft_prefix"]

DRAFT_PADDING = -1
"""The id that pads a request's draft list to the batch's k; never shown to the grammar."""


def fill_draft_rows(
    grammar: Grammar, draft_token_ids: list[int], bitmask: torch.Tensor, first_row: int
) -> int:
    """Fill rows `first_row .. first_row + len(drafts)` of `bitmask`; returns the row count.

    Side effects: none on `grammar` (it is advanced through the valid drafts and rolled back).
    Padding ids (`DRAFT_PADDING`) end the drafts like a rejection does.
    """
    num_advanced = 0
    failed_row: int | None = None
    for i in range(len(draft_token_ids) + 1):
        row = first_row + i
        if failed_row is not None:
            bitmask[row].copy_(bitmask[failed_row])
            continue
        grammar.fill_bitmask(bitmask, row)
        if i == len(draft_token_ids):
            break
        token_id = draft_token_ids[i]
        if (
            token_id == DRAFT_PADDING
            or grammar.is_terminated()
            or not grammar.accept_tokens([token_id])
        ):
            failed_row = row
            continue
        num_advanced += 1
    grammar.rollback(num_advanced)
    return len(draft_token_ids) + 1


def valid_draft_prefix(grammar: Grammar, draft_token_ids: list[int]) -> list[int]:
    """The longest prefix of the drafts the grammar allows (padding stripped first); the
    grammar's state is unchanged. Drafts [a, b, c] with b invalid give [a]."""
    drafts = [t for t in draft_token_ids if t != DRAFT_PADDING]
    return grammar.validate_tokens(drafts)
