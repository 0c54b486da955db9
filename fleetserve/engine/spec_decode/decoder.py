"""`SpecDecoder`: what the model runner holds for speculative decoding.

Per step the runner asks it to (1) place the scheduled drafts after each request's real tokens
in the persistent batch (the inputs of the verification pass), (2) verify them
(`verify.verify_drafts`) and (3) propose the next drafts for the requests that sampled, with the
configured proposer. A proposer is anything with `propose(request_inputs) -> drafts`; the
n-gram lookup needs only the token history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from fleetserve.engine.config import SpeculativeConfig
from fleetserve.engine.core.outputs import LogprobsLists
from fleetserve.engine.layers.sampler import Sampler
from fleetserve.engine.spec_decode.ngram import NgramProposer
from fleetserve.engine.spec_decode.verify import verify_drafts
from fleetserve.engine.worker.input_batch import CachedRequestState, InputBatch


@dataclass
class ProposalRequest:
    """One request that sampled this step and may get drafts for its next one."""

    state: CachedRequestState
    token_ids: np.ndarray
    """Its prompt + outputs, the tokens sampled this step included (a view of its batch row)."""
    max_drafts: int
    """At most this many drafts fit before max_model_len."""


class Proposer(Protocol):
    def propose(self, requests: Sequence[ProposalRequest]) -> dict[str, list[int]]:
        """Drafts per request id (requests without drafts may be left out)."""
        ...


class NgramBatchProposer:
    """The n-gram lookup over each request's own history."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer(config)

    def propose(self, requests: Sequence[ProposalRequest]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for request in requests:
            proposal = self.ngram.propose(request.token_ids, request.max_drafts)
            if proposal:
                drafts[request.state.req_id] = proposal
        return drafts


class SpecDecoder:
    """Speculative decoding inside one model runner (see module doc).

    Args:
        config: the speculative config.
        sampler: the runner's sampler (verification draws with its generators).
        vocab_size: the target's vocabulary (the logits' width).
        max_model_len: no draft may sit at or past this position.
    """

    def __init__(
        self, config: SpeculativeConfig, sampler: Sampler, vocab_size: int, max_model_len: int
    ) -> None:
        if config.method != "ngram":
            raise ValueError(f"speculative_config.method {config.method!r} needs a draft model")
        self.config = config
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.proposer: Proposer = NgramBatchProposer(config)

    def write_drafts(
        self,
        batch: InputBatch,
        states: Mapping[str, CachedRequestState],
        scheduled: Mapping[str, list[int]],
    ) -> None:
        """Put each request's scheduled drafts right after its real tokens (its row then ends
        after them, so the verification pass reads them as inputs)."""
        for req_id, drafts in scheduled.items():
            batch.set_tokens(req_id, states[req_id].num_tokens, drafts)

    def verify(
        self,
        logits: torch.Tensor,
        states: Sequence[CachedRequestState],
        drafts: Sequence[list[int]],
    ) -> tuple[list[list[int]], dict[str, LogprobsLists]]:
        """See `verify.verify_drafts` (n-gram drafts are one-hot: no draft probabilities)."""
        return verify_drafts(self.sampler, logits, states, drafts, None, self.vocab_size)

    def propose(
        self, batch: InputBatch, states: Sequence[CachedRequestState]
    ) -> dict[str, list[int]]:
        """Drafts for the next step of each request in `states` (they sampled this step)."""
        requests = []
        for state in states:
            num_tokens = state.num_tokens
            max_drafts = min(self.config.num_speculative_tokens, self.max_model_len - num_tokens)
            if max_drafts <= 0:
                continue
            row = batch.req_id_to_index[state.req_id]
            requests.append(ProposalRequest(state, batch.token_ids[row, :num_tokens], max_drafts))
        return self.proposer.propose(requests) if requests else {}

    def forget(self, req_id: str) -> None:
        """The request left the runner (finished or preempted)."""
