"""The runner's side of verification: a step's sampling requests with drafts → accepted tokens.

Each sampling request with n drafts gets n + 1 logits rows (its real last token's and each
draft's position). The sampling metadata is expanded to match: row j of a request sees the
request's outputs followed by drafts 0..j-1, so penalties, min_tokens and friends apply exactly
as they would have, token by token, without speculation. Logprobs of every returned token are
gathered from the raw (unprocessed) distribution of its own row, as the plain sampler does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fleetserve.engine.core.outputs import LogprobsLists, concat_logprobs_rows
from fleetserve.engine.layers.sampler import (
    Sampler,
    SamplingMetadata,
    build_sampling_metadata,
    gather_logprobs,
)
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.spec_decode.rejection_sampler import DraftRows, RejectionSampler
from fleetserve.engine.worker.input_batch import CachedRequestState
from fleetserve.engine.worker.logprobs import logprobs_row

RowLogitsHook = Callable[[torch.Tensor, Sequence[CachedRequestState], Sequence[list[int]]], None]
"""(processed logits in the row layout, the requests, their drafts) → None, editing the logits
in place. The seam for structured output: row j of a request must be masked with the grammar's
bitmask after its drafts 0..j-1 (seed notes part 2 §2.2); -inf entries are never sampled."""


def expanded_metadata(
    states: Sequence[CachedRequestState],
    drafts: Sequence[list[int]],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Sampling metadata with `len(drafts[i]) + 1` rows per request (see module doc)."""
    params: list[SamplingParams] = []
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    eos: list[tuple[int, ...]] = []
    generators: dict[int, torch.Generator] = {}
    for state, request_drafts in zip(states, drafts, strict=True):
        for j in range(len(request_drafts) + 1):
            if state.generator is not None:
                generators[len(params)] = state.generator
            params.append(state.sampling_params)
            prompts.append(state.prompt_token_ids)
            outputs.append(state.output_token_ids + request_drafts[:j])
            eos.append(state.eos_token_ids)
    return build_sampling_metadata(params, prompts, outputs, generators, eos, vocab_size, device)


def verify_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    states: Sequence[CachedRequestState],
    drafts: Sequence[list[int]],
    draft_probs: torch.Tensor | None,
    vocab_size: int,
    row_logits_hook: RowLogitsHook | None = None,
) -> tuple[list[list[int]], dict[str, LogprobsLists]]:
    """Accepted drafts + the target's own token per request, and their logprobs rows.

    Args:
        sampler: the runner's sampler (its processors, probabilities and default generator).
        logits: [sum(len(d) + 1), vocab] raw logits in the row layout of `rejection_sampler`.
        states: the sampling requests, in row order.
        drafts: each request's drafts (possibly empty).
        draft_probs: [sum(len(d)), vocab] the draft distributions, or None (one-hot drafts).
        vocab_size: the logits' width.
        row_logits_hook: edits the processed logits before verification (grammar masks).
    """
    metadata = expanded_metadata(states, drafts, vocab_size, logits.device)
    raw_logprobs = None
    if metadata.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    processed = sampler.apply_logits_processors(logits, metadata)
    if row_logits_hook is not None:
        row_logits_hook(processed, states, drafts)
    rows = DraftRows(
        num_draft_tokens=[len(d) for d in drafts],
        draft_token_ids=[t for d in drafts for t in d],
        draft_probs=draft_probs,
    )
    result = RejectionSampler(sampler)(processed, metadata, rows)
    logprobs: dict[str, LogprobsLists] = {}
    if raw_logprobs is not None:
        assert metadata.max_num_logprobs is not None
        lists = gather_logprobs(raw_logprobs, result.row_token_ids, metadata.max_num_logprobs)
        start = 0
        for state, request_drafts, tokens in zip(states, drafts, result.token_ids, strict=True):
            k = state.sampling_params.logprobs
            if k is not None:
                merged: LogprobsLists | None = None
                for row in range(start, start + len(tokens)):
                    merged = concat_logprobs_rows(merged, logprobs_row(lists, row, k, vocab_size))
                assert merged is not None
                logprobs[state.req_id] = merged
            start += len(request_drafts) + 1
    return result.token_ids, logprobs
