"""Front-end logprob shaping (`engine/logprobs.py`): core rows → entries, and top-k selection."""

from __future__ import annotations

from fleetserve.engine.core.outputs import LogprobsLists
from fleetserve.engine.logprobs import (
    logprob_entries,
    prompt_logprobs_entries,
    sampled_logprob_sum,
    top_logprobs,
)
from fleetserve.engine.request_output import Logprob


class _Tokenizer:
    """Decodes id i to "<i>" (every text length is visible in the offsets)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


TOKENIZER = _Tokenizer()


def _entry(*ranked: tuple[int, float, int]) -> dict[int, Logprob]:
    return {tid: Logprob(value, rank, f"t{tid}") for tid, value, rank in ranked}


def test_entries_keep_the_own_token_first_with_its_rank() -> None:
    rows = LogprobsLists([[5, 8, 5]], [[-3.0, -0.1, -3.0]], [4])
    assert logprob_entries(rows, TOKENIZER) == [  # type: ignore[arg-type]
        {5: Logprob(-3.0, 4, "<5>"), 8: Logprob(-0.1, 1, "<8>")}
    ]
    assert sampled_logprob_sum(LogprobsLists([[1], [2]], [[-1.0], [-0.5]], [1, 1])) == -1.5
    assert prompt_logprobs_entries(None, TOKENIZER) == [None]  # type: ignore[arg-type]


def test_top_logprobs_are_by_rank_and_at_most_k() -> None:
    entry = _entry((5, -3.0, 4), (8, -0.1, 1), (9, -0.7, 2))
    assert [tid for tid, _ in top_logprobs(entry, 2)] == [8, 9]
    assert [tid for tid, _ in top_logprobs(entry, 5)] == [8, 9, 5]
    assert top_logprobs(entry, 0) == []
