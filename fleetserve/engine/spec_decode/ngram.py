"""The n-gram (prompt lookup) proposer: no model, just the request's own history.

For the request's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) it finds
the latest earlier occurrence in the prompt + output and proposes the (up to) k tokens that
followed it. Text that quotes its prompt (summaries, code edits, extraction) repeats long spans,
so the drafts are often right; on text that does not repeat, nothing matches and nothing is
proposed (the step costs what a plain decode costs).

The search is vectorised with NumPy: candidate starts are the positions holding the n-gram's
first token, filtered by each following token in turn (one array comparison per n-gram token,
never a Python loop over the history).
"""

from __future__ import annotations

import numpy as np

from fleetserve.engine.config import SpeculativeConfig


class NgramProposer:
    """Proposes by prompt lookup (`SpeculativeConfig.method == "ngram"`)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Drafts following the latest earlier match of the longest matching suffix n-gram.

        Args:
            token_ids: the request's prompt + output tokens (1-D).
            max_tokens: propose at most this many (default: num_speculative_tokens).

        Returns:
            0..k token ids (empty when no suffix n-gram of length >= min_n recurs).
        """
        k = self.num_speculative_tokens if max_tokens is None else max_tokens
        num_tokens = len(token_ids)
        if k <= 0:
            return []
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            start = _latest_match(token_ids, n)
            if start is not None:
                follow = start + n
                return [int(t) for t in token_ids[follow : follow + k]]
        return []


def _latest_match(token_ids: np.ndarray, n: int) -> int | None:
    """Start of the latest occurrence of the last `n` tokens that ends before the last token
    (so at least one token follows it), or None."""
    num_tokens = len(token_ids)
    suffix = token_ids[num_tokens - n :]
    # Starts 0 .. num_tokens - n - 1: the occurrence ends at or before index num_tokens - 2.
    candidates = np.flatnonzero(token_ids[: num_tokens - n] == suffix[0])
    for offset in range(1, n):
        if candidates.size == 0:
            return None
        candidates = candidates[token_ids[candidates + offset] == suffix[offset]]
    return int(candidates[-1]) if candidates.size else None
