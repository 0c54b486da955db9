"""The scheduler's side of speculative decoding: which drafts a step verifies, and the rollback.

Drafts come back from the runner with each step's output (`ModelRunnerOutput.spec_token_ids`)
and wait here until the request is scheduled next. A request verifies drafts only while it is
decoding (everything but its last sampled token computed); the scheduler adds them to that
request's new tokens, and cuts them when the budget, `max_model_len` or `max_tokens` leave less
room. After the step, the drafts the target rejected are rolled back: `num_computed_tokens`
loses them (their KV slots are rewritten by the next steps; the prefix cache only ever hashes
accepted tokens, since drafts never enter `Request.all_token_ids`).
"""

from __future__ import annotations

from collections.abc import Callable

from fleetserve.engine.config import SpeculativeConfig
from fleetserve.engine.request import Request
from fleetserve.engine.spec_decode.stats import SpecDecodingStats

DraftFilter = Callable[[Request, list[int]], list[int]]
"""(request, its drafts) → the prefix of them to verify. The seam for structured output: a
grammar keeps only the longest prefix it accepts (seed notes part 2 §2.2, `validate_tokens`),
so the target never verifies a draft the grammar forbids."""


class SpecScheduling:
    """Pending drafts per request and the acceptance counters."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.num_lookahead_tokens = config.num_lookahead_tokens
        """Extra KV slots every allocation reserves (a draft model's own KV positions)."""
        self.stats = SpecDecodingStats()
        self.draft_filter: DraftFilter | None = None
        """Applied to each request's drafts before they are scheduled (None: keep all)."""
        self._drafts: dict[str, list[int]] = {}

    def pending_drafts(self, request: Request) -> list[int]:
        """The drafts `request` would verify now: none unless it is decoding, at most as many
        as can still become outputs (the target adds one token of its own)."""
        drafts = self._drafts.get(request.request_id)
        if not drafts or request.num_computed_tokens != request.num_tokens - 1:
            return []
        if request.max_tokens is not None:
            room = request.max_tokens - request.num_output_tokens - 1
            drafts = drafts[: max(room, 0)]
        if drafts and self.draft_filter is not None:
            kept = self.draft_filter(request, drafts)
            if kept != drafts[: len(kept)]:
                raise ValueError(
                    f"a draft filter must return a prefix of the drafts, got {kept} for {drafts}"
                )
            drafts = kept
        return drafts

    @staticmethod
    def cut(request: Request, drafts: list[int], num_new_tokens: int) -> list[int]:
        """The drafts that fit in `num_new_tokens` scheduled tokens (after the real ones)."""
        num_real = request.num_tokens - request.num_computed_tokens
        return drafts[: max(num_new_tokens - num_real, 0)]

    def set_drafts(self, request_id: str, drafts: list[int]) -> None:
        """Drafts proposed for the request's next step (replacing any older ones)."""
        if drafts:
            self._drafts[request_id] = list(drafts[: self.num_speculative_tokens])
        else:
            self._drafts.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: its drafts are void."""
        self._drafts.pop(request_id, None)

    def num_rejected(self, num_scheduled_drafts: int, num_sampled: int) -> int:
        """Count one verification (`num_sampled` tokens came back for `num_scheduled_drafts`
        drafts: the accepted ones plus the target's own) and return the rejected count."""
        num_accepted = num_sampled - 1
        if not 0 <= num_accepted <= num_scheduled_drafts:
            raise ValueError(
                f"a verification of {num_scheduled_drafts} drafts must return 1.."
                f"{num_scheduled_drafts + 1} tokens, got {num_sampled}"
            )
        self.stats.observe(num_scheduled_drafts, num_accepted)
        return num_scheduled_drafts - num_accepted
