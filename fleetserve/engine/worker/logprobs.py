"""Worker-side logprobs: each sampling request's own top-k row, and prompt logprobs.

The sampler computes one batch of logprobs for the largest k any row asked for; `logprobs_row`
cuts a request's row down to its own k. `prompt_logprobs` scores the prompt positions computed
this step for the requests that asked (`SamplingParams.prompt_logprobs`).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

import torch

from fleetserve.engine.core.outputs import LogprobsLists, concat_logprobs_rows
from fleetserve.engine.layers.sampler import gather_logprobs
from fleetserve.engine.models.interface import CausalLM
from fleetserve.engine.worker.input_batch import CachedRequestState

PROMPT_LOGITS_ROWS = 256
"""Prompt positions whose logits are materialised at once (bounds rows x vocab floats)."""


def logprobs_row(lists: LogprobsLists, row: int, k: int, vocab_size: int) -> LogprobsLists:
    """One request's row, cut to its own k (the batch computed the largest k asked for)."""
    token_ids, values = lists.logprob_token_ids[row], lists.logprobs[row]
    num_listed = len(token_ids) - 1
    if k != -1 and k < num_listed:
        if num_listed == vocab_size:
            # NOTE: a batch that asked for the whole vocabulary lists it in id order, not by rank.
            top = heapq.nlargest(k, zip(values[1:], token_ids[1:], strict=True))
            token_ids = [token_ids[0], *(t for _, t in top)]
            values = [values[0], *(v for v, _ in top)]
        else:
            token_ids, values = token_ids[: k + 1], values[: k + 1]
    return LogprobsLists(
        logprob_token_ids=[list(token_ids)],
        logprobs=[list(values)],
        sampled_token_ranks=[lists.sampled_token_ranks[row]],
    )


def prompt_logprobs(
    model: CausalLM,
    hidden_states: torch.Tensor,
    req_ids: list[str],
    requests: Mapping[str, CachedRequestState],
    num_scheduled_tokens: Mapping[str, int],
    device: torch.device,
) -> dict[str, LogprobsLists]:
    """Logprobs of each prompt token given the ones before it, for the prompt positions computed
    this step by requests that asked (`prompt_logprobs`).

    A position is reported once, even when preemption makes the prompt be computed again.

    Args:
        model: computes the logits of the selected hidden states.
        hidden_states: this step's [num_tokens, hidden] (requests back to back in `req_ids` order).
        req_ids: the scheduled requests in row order.
        requests: their states, read before this step's `num_computed_tokens` update.
        num_scheduled_tokens: request id → tokens computed this step.
        device: where the model runs.

    Side effects:
        advances `num_prompt_logprobs` of each request that reported positions.
    """
    result: dict[str, LogprobsLists] = {}
    row = 0
    for req_id in req_ids:
        state = requests[req_id]
        num_scheduled = num_scheduled_tokens[req_id]
        chunk_row, row = row, row + num_scheduled
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        # Position p's logits give the probability of prompt token p + 1.
        start = state.num_computed_tokens
        first = max(start, state.num_prompt_logprobs)
        last = min(start + num_scheduled, len(state.prompt_token_ids) - 1)
        if first >= last:
            continue
        rows = torch.arange(chunk_row + first - start, chunk_row + last - start)
        targets = torch.tensor(state.prompt_token_ids[first + 1 : last + 1])
        pieces = []
        for i in range(0, len(rows), PROMPT_LOGITS_ROWS):
            part = rows[i : i + PROMPT_LOGITS_ROWS].to(device)
            logits = model.compute_logits(hidden_states[part])
            raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
            target = targets[i : i + PROMPT_LOGITS_ROWS].to(device)
            pieces.append(gather_logprobs(raw, target, k))
        merged = pieces[0]
        for piece in pieces[1:]:
            merged = concat_logprobs_rows(merged, piece)
        result[req_id] = merged
        state.num_prompt_logprobs = last
    return result
