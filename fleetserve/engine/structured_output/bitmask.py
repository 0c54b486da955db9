"""Device side of the grammar bitmask: gather a step's rows, mask the logits.

Pure tensor operations on any device (no backend kernel), so the sampler stays a stateless
function of (logits, metadata) and the same code runs on the CPU in tests and on a GPU.
"""

from __future__ import annotations

import torch

from fleetserve.engine.structured_output.step_bitmask import GrammarBitmask

__all__ = ["apply_token_bitmask", "batch_bitmask", "draft_rows_bitmask", "unpack_bitmask"]


def batch_bitmask(
    grammar_bitmask: GrammarBitmask | None, req_ids: list[str], device: torch.device
) -> torch.Tensor | None:
    """[len(req_ids), words] int32: each sampling row's mask (first row of its request), all
    ones (-1) for unconstrained rows; None when no row is constrained."""
    if grammar_bitmask is None or not any(r in grammar_bitmask.row_of for r in req_ids):
        return None
    masks = torch.from_numpy(grammar_bitmask.bitmask)
    rows = torch.full((len(req_ids), masks.shape[1]), -1, dtype=torch.int32)
    for i, req_id in enumerate(req_ids):
        row = grammar_bitmask.row_of.get(req_id)
        if row is not None:
            rows[i] = masks[row]
    return rows.to(device, non_blocking=True)


def draft_rows_bitmask(
    grammar_bitmask: GrammarBitmask | None,
    req_ids: list[str],
    num_drafts: list[int],
    device: torch.device,
) -> torch.Tensor | None:
    """[sum(1 + k_i), words] int32 in the verification layout (request i's 1 + k_i rows, in
    order): a constrained request's rows from the step's mask (row j = after drafts 0..j-1),
    all ones (-1) for the others; None when no row is constrained.

    Raises:
        ValueError: a constrained request's row count differs from its drafts + 1 (the
            scheduler filled its rows for other drafts than the runner verifies).
    """
    if grammar_bitmask is None or not any(r in grammar_bitmask.row_of for r in req_ids):
        return None
    masks = torch.from_numpy(grammar_bitmask.bitmask)
    rows = torch.full((sum(1 + k for k in num_drafts), masks.shape[1]), -1, dtype=torch.int32)
    out = 0
    for req_id, k in zip(req_ids, num_drafts, strict=True):
        first = grammar_bitmask.row_of.get(req_id)
        if first is not None:
            if grammar_bitmask.num_rows[req_id] != 1 + k:
                raise ValueError(
                    f"request {req_id!r} has {grammar_bitmask.num_rows[req_id]} mask rows but "
                    f"{k} drafts to verify (rows must be drafts + 1)"
                )
            rows[out : out + 1 + k] = masks[first : first + 1 + k]
        out += 1 + k
    return rows.to(device, non_blocking=True)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place ([rows, vocab] and [rows, words]).

    Raises:
        ValueError: the shapes do not match (other rows, or too few words for the vocabulary).
    """
    num_rows, vocab_size = logits.shape
    if bitmask.shape[0] != num_rows or bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(
            f"bitmask must be [{num_rows}, >= {-(-vocab_size // 32)}] for logits "
            f"{list(logits.shape)}, got {list(bitmask.shape)}"
        )
    logits.masked_fill_(~unpack_bitmask(bitmask, vocab_size), float("-inf"))
