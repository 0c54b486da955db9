"""The n-gram (prompt lookup) proposer: latest match of the longest suffix n-gram."""

from __future__ import annotations

import numpy as np

from fleetserve.engine.config import SpeculativeConfig
from fleetserve.engine.spec_decode.ngram import NgramProposer


def _proposer(k: int = 3, lo: int = 1, hi: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, prompt_lookup_max=hi, prompt_lookup_min=lo))


def _ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def test_proposes_what_followed_the_suffix() -> None:
    assert _proposer().propose(_ids(1, 2, 3, 4, 5, 9, 1, 2, 3)) == [4, 5, 9]


def test_the_longest_n_gram_wins_over_a_later_shorter_one() -> None:
    # Suffix [7, 8]: the 2-gram occurs at 0 (then 1, 2), the 1-gram [8] also at 5 (then 4).
    tokens = _ids(7, 8, 1, 2, 3, 8, 4, 7, 8)
    assert _proposer(hi=2).propose(tokens) == [1, 2, 3]
    assert _proposer(hi=1).propose(tokens) == [4, 7, 8]  # only 1-grams: the latest [8] is at 5


def test_the_latest_occurrence_is_used() -> None:
    assert _proposer(k=2).propose(_ids(5, 6, 1, 5, 6, 2, 5, 6)) == [2, 5]


def test_continuations_are_cut_at_the_history_end_and_max_tokens() -> None:
    assert _proposer(k=5).propose(_ids(4, 4)) == [4]
    assert _proposer(k=5).propose(_ids(1, 2, 3, 1, 2, 3), max_tokens=2) == [1, 2]


def test_nothing_is_proposed_without_a_match_or_below_min_n() -> None:
    assert _proposer().propose(_ids(1, 2, 3, 4)) == []
    assert _proposer(lo=2).propose(_ids(1, 2, 3, 1)) == []
    assert _proposer().propose(_ids(1)) == []
    assert _proposer().propose(_ids(1, 2, 1), max_tokens=0) == []


def test_a_long_history_is_searched_without_python_loops_over_it() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=200_000)
    tokens[1000:1006] = [*tokens[-3:].tolist(), 11, 12, 13]
    assert _proposer().propose(tokens) == [11, 12, 13]
