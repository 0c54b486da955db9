"""Acceptance counters of speculative decoding (cumulative; exported under vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Cumulative since the engine started.

    A "draft" is one request's proposal verified in one step (of 1..k tokens).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    """Index i: drafts whose token at position i was accepted (length k)."""

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: `num_draft_tokens` scheduled, the first
        `num_accepted_tokens` of them accepted."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(
                f"num_accepted_tokens must be in [0, {num_draft_tokens}], got {num_accepted_tokens}"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        missing = num_draft_tokens - len(self.num_accepted_tokens_per_pos)
        if missing > 0:
            self.num_accepted_tokens_per_pos.extend([0] * missing)
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )
