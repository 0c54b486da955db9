"""The scheduler's side of structured output: the requests waiting for their grammar, each
step's bitmask, and advancing grammars by the tokens a step kept.

The scheduler calls it at four points (`add_request`, the start of `schedule`, building the
step's output, `update_from_output`), so its own code only says where.
"""

from __future__ import annotations

import logging

from fleetserve.common.error_codes import INVALID_GRAMMAR
from fleetserve.engine.request import Request, RequestStatus
from fleetserve.engine.structured_output.manager import StructuredOutputManager
from fleetserve.engine.structured_output.speculative import valid_draft_prefix
from fleetserve.engine.structured_output.step_bitmask import GrammarBitmask

__all__ = ["StructuredOutputScheduling"]

logger = logging.getLogger(__name__)


class StructuredOutputScheduling:
    """Holds the WAITING_FOR_GRAMMAR requests (outside the waiting queue, so that a compile
    never blocks the queue) and drives the manager for the scheduler.

    Args:
        manager: the engine's manager, or None for a scheduler without a tokenizer (then a
            structured request is refused).
    """

    def __init__(self, manager: StructuredOutputManager | None) -> None:
        self.manager = manager
        self.waiting: dict[str, Request] = {}
        """Requests whose grammar is compiling, by id."""

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, request: Request) -> bool:
        """Start the request's compile and hold it in WAITING_FOR_GRAMMAR; False (nothing
        done) for an unconstrained request.

        Raises:
            ValueError: the request is constrained but this engine has no manager.
        """
        params = request.sampling_params.structured_outputs
        if params is None:
            return False
        if self.manager is None:
            raise ValueError(
                "structured_outputs needs a tokenizer, and this engine runs without one"
            )
        request.structured_output = self.manager.init_request(params)
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.waiting[request.request_id] = request
        return True

    def remove(self, request_id: str) -> None:
        del self.waiting[request_id]

    def take_compiled(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The requests whose compile finished, taken out: (ready ones, (failed one, error))."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for request_id, request in list(self.waiting.items()):
            grammar = request.structured_output
            assert grammar is not None, f"{request} waits for no grammar"
            if not grammar.is_compiled:
                continue
            del self.waiting[request_id]
            if grammar.resolve():
                ready.append(request)
            else:
                prefix = INVALID_GRAMMAR if grammar.is_invalid else "structured output failed"
                failed.append((request, f"{prefix}: {grammar.error}"))
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for a compile to finish (the engine has nothing else to do)."""
        if self.manager is not None and self.waiting:
            grammars = [r.structured_output for r in self.waiting.values()]
            self.manager.wait_for_compile([g for g in grammars if g is not None], timeout_s)

    def bitmask(
        self,
        scheduled: list[Request],
        num_scheduled: dict[str, int],
        draft_token_ids: dict[str, list[int]] | None = None,
    ) -> GrammarBitmask | None:
        """This step's masks: rows for each constrained request that samples this step (its
        scheduled tokens, drafts excluded, reach the end of its known tokens): one, or 1 + k
        with k drafts in `draft_token_ids` (see `speculative.fill_draft_rows`). Called before
        the scheduled tokens are added to `num_computed_tokens`."""
        if self.manager is None:
            return None
        drafts = draft_token_ids or {}
        rows = []
        for request in scheduled:
            so = request.structured_output
            if so is None or so.grammar is None:
                continue
            num_new = num_scheduled[request.request_id] - len(drafts.get(request.request_id, ()))
            if request.num_computed_tokens + num_new < request.num_tokens:
                continue  # a prefill chunk short of the end: nothing is sampled
            rows.append((request.request_id, so.grammar))
        sampling = {req_id for req_id, _ in rows}
        return self.manager.grammar_bitmask(
            rows, {r: d for r, d in drafts.items() if r in sampling} or None
        )

    @staticmethod
    def valid_drafts(request: Request, draft_token_ids: list[int]) -> list[int]:
        """The longest prefix of a constrained request's drafts its grammar allows (all of them
        for an unconstrained request), so that no draft the grammar rejects is verified."""
        so = request.structured_output
        if so is None or so.grammar is None:
            return draft_token_ids
        return valid_draft_prefix(so.grammar, draft_token_ids)

    @staticmethod
    def accept(request: Request, token_ids: list[int]) -> str | None:
        """Advance the request's grammar by the tokens it kept; an error text when the grammar
        rejects them (the caller fails the request)."""
        so = request.structured_output
        if so is None or so.grammar is None or not token_ids or so.grammar.is_terminated():
            return None
        if so.grammar.accept_tokens(token_ids):
            return None
        logger.error("request %s sampled tokens %s its grammar rejects", request, token_ids)
        return f"structured output: the grammar rejected the sampled tokens {token_ids}"
