"""`SpecDecoder`: what the model runner holds for speculative decoding.

Per step the runner asks it to (1) place the scheduled drafts after each request's real tokens
in the persistent batch (the inputs of the verification pass), (2) verify them
(`verify.verify_drafts`) and (3) after the forward pass, propose the next drafts for the
requests that sampled: by n-gram lookup over their history, or with the draft model (which
first catches up on the step's tokens, see `draft_model`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.outputs import LogprobsLists
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.sampler import Sampler
from fleetserve.engine.spec_decode.draft_model import DraftModelProposer
from fleetserve.engine.spec_decode.ngram import NgramProposer
from fleetserve.engine.spec_decode.verify import RowLogitsHook, verify_drafts
from fleetserve.engine.structured_output.bitmask import apply_token_bitmask, draft_rows_bitmask
from fleetserve.engine.structured_output.step_bitmask import GrammarBitmask
from fleetserve.engine.worker.input_batch import CachedRequestState, InputBatch
from fleetserve.engine.worker.input_prep import StepInputs


class HistoryProposer(Protocol):
    """Drafts from a request's token history alone (the n-gram lookup; tests plug others)."""

    def propose(self, token_ids: np.ndarray, max_tokens: int | None = None) -> list[int]: ...


class SpecDecoder:
    """Speculative decoding inside one model runner (see module doc).

    Args:
        config: the engine config (`config.speculative` set).
        context: the target's layer context (a draft model is built with it).
        sampler: the runner's sampler (verification and draft draws use its generators).
        vocab_size: the target's vocabulary (the logits' width).
    """

    def __init__(
        self, config: EngineConfig, context: LayerContext, sampler: Sampler, vocab_size: int
    ) -> None:
        spec = config.speculative
        assert spec is not None, "SpecDecoder needs config.speculative"
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.max_model_len = config.model.max_model_len
        self.block_size = config.cache.block_size
        self.history_proposer: HistoryProposer | None = None
        self.draft: DraftModelProposer | None = None
        if spec.method == "ngram":
            self.history_proposer = NgramProposer(spec)
        else:
            self.draft = DraftModelProposer(config, context, sampler)
        self._draft_probs: dict[str, torch.Tensor] = {}
        """Draft model: each request's latest drafts' distributions [n, vocab]."""
        self.row_logits_hook: RowLogitsHook | None = None
        """Edits each verification's processed logits (structured output's per-row masks)."""

    # -- setup ---------------------------------------------------------------------------------

    def load_model(self) -> None:
        if self.draft is not None:
            self.draft.load()

    def bind_kv_caches(self, num_blocks: int) -> None:
        if self.draft is not None:
            self.draft.bind_kv_caches(num_blocks)

    def zero_blocks(self, block_ids: list[int]) -> None:
        if self.draft is not None:
            self.draft.zero_blocks(block_ids)

    # -- step ----------------------------------------------------------------------------------

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
        grammar_bitmask: GrammarBitmask | None = None,
    ) -> tuple[list[list[int]], dict[str, LogprobsLists]]:
        """See `verify.verify_drafts`; n-gram drafts are one-hot (no draft distributions).
        Constrained requests' rows are masked by `grammar_bitmask` (row j of a request: its
        grammar after drafts 0..j-1), before `row_logits_hook`."""
        draft_probs = None
        if self.draft is not None and any(drafts):
            pieces = []
            for state, request_drafts in zip(states, drafts, strict=True):
                if not request_drafts:
                    continue
                probs = self._draft_probs.get(state.req_id)
                assert probs is not None and probs.shape[0] >= len(request_drafts), (
                    f"drafts of {state.req_id} verified without their distributions"
                )
                pieces.append(probs[: len(request_drafts)])
            draft_probs = torch.cat(pieces)
        hook = self.row_logits_hook
        rows = draft_rows_bitmask(
            grammar_bitmask, [s.req_id for s in states], [len(d) for d in drafts], logits.device
        )
        if rows is not None:
            outer = hook

            def hook(
                processed: torch.Tensor,
                states: Sequence[CachedRequestState],
                drafts: Sequence[list[int]],
            ) -> None:
                apply_token_bitmask(processed, rows)
                if outer is not None:
                    outer(processed, states, drafts)

        return verify_drafts(
            self.sampler, logits, states, drafts, draft_probs, self.vocab_size, hook
        )

    def propose(
        self, batch: InputBatch, inputs: StepInputs, states: Sequence[CachedRequestState]
    ) -> dict[str, list[int]]:
        """After the step's forward pass: drafts for the next step of each request in `states`
        (those that sampled; their new tokens are appended). A draft model first writes its KV
        for every token of the step (`inputs`)."""
        if self.draft is not None:
            self.draft.catch_up(inputs)
        limits = [self._max_drafts(state) for state in states]
        proposing = [(state, n) for state, n in zip(states, limits, strict=True) if n > 0]
        if not proposing:
            return {}
        if self.draft is not None:
            drafts, probs = self.draft.propose(
                batch, [s for s, _ in proposing], [n for _, n in proposing]
            )
            for (state, _), request_probs in zip(proposing, probs, strict=True):
                self._draft_probs[state.req_id] = request_probs
            return {state.req_id: d for (state, _), d in zip(proposing, drafts, strict=True) if d}
        assert self.history_proposer is not None
        result: dict[str, list[int]] = {}
        for state, n in proposing:
            row = batch.req_id_to_index[state.req_id]
            proposal = self.history_proposer.propose(batch.token_ids[row, : state.num_tokens], n)
            if proposal:
                result[state.req_id] = proposal
        return result

    def forget(self, req_id: str) -> None:
        """The request left the runner (finished or preempted)."""
        self._draft_probs.pop(req_id, None)

    def _max_drafts(self, state: CachedRequestState) -> int:
        """Drafts that fit: verified, they must end before max_model_len; a draft model also
        writes KV at positions num_tokens - 1 .. num_tokens + n - 2, inside the request's
        allocated slots (its lookahead)."""
        limit = min(self.num_speculative_tokens, self.max_model_len - state.num_tokens)
        if self.draft is not None:
            num_slots = len(state.block_ids) * self.block_size
            limit = min(limit, num_slots - state.num_tokens + 1)
        return max(limit, 0)
