"""The rejection sampler keeps the target distribution exactly (statistical tests with power).

Every request's rows share one target distribution p, its drafts come from a draft distribution
q far from p (total variation 0.6), and the tokens that come out are counted: at each position
their frequencies must match p within sampling noise (TV < 0.02 over 40 000 requests; the noise is
about 0.005). The same check applied to a sampler that breaks the acceptance rule (accepting
every draft, or ignoring q) fails by a wide margin, so the check can fail.
"""

from __future__ import annotations

import torch

from fleetserve.engine.layers.sampler import Sampler, build_sampling_metadata
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.spec_decode.rejection_sampler import DraftRows, RejectionSampler

VOCAB = 6
NUM_REQUESTS = 40_000
TV_THRESHOLD = 0.02
P = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.15, 0.05])
Q = torch.tensor([0.40, 0.05, 0.30, 0.05, 0.10, 0.10])


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def _metadata(num_rows: int, temperature: float = 1.0, seed: int | None = None) -> object:
    params = [SamplingParams(temperature=temperature, seed=seed)] * num_rows
    generators: dict[int, torch.Generator] = {}
    return build_sampling_metadata(
        params, [[]] * num_rows, [[]] * num_rows, generators, [()] * num_rows, VOCAB,
        torch.device("cpu"),
    )  # fmt: skip


def _run(
    sampler: RejectionSampler, num_drafts: int, one_hot: bool, seed: int = 0
) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    rows_per_request = num_drafts + 1
    logits = P.log().repeat(NUM_REQUESTS * rows_per_request, 1)
    if one_hot:
        # n-gram drafts: fixed tokens, no distribution (q is one-hot at the draft).
        drafts = torch.full((NUM_REQUESTS * num_drafts,), 1, dtype=torch.int64)
        draft_probs = None
    else:
        drafts = torch.multinomial(Q, NUM_REQUESTS * num_drafts, True, generator=generator)
        draft_probs = Q.repeat(NUM_REQUESTS * num_drafts, 1)
    rows = DraftRows([num_drafts] * NUM_REQUESTS, drafts.tolist(), draft_probs)
    metadata = _metadata(NUM_REQUESTS * rows_per_request)
    return sampler(logits, metadata, rows).token_ids  # type: ignore[arg-type]


def _position_counts(outputs: list[list[int]], position: int) -> torch.Tensor:
    tokens = [out[position] for out in outputs if len(out) > position]
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).to(torch.float64)


def _sampler(cls: type[RejectionSampler] = RejectionSampler) -> RejectionSampler:
    return cls(Sampler(torch.Generator().manual_seed(1234)))


def test_draft_model_drafts_keep_the_target_distribution() -> None:
    outputs = _run(_sampler(), num_drafts=2, one_hot=False)
    for position in range(3):
        counts = _position_counts(outputs, position)
        assert counts.sum() > 2000, position
        assert _tv(counts, P) < TV_THRESHOLD, (position, counts)
    # The expected acceptance of one draft is sum(min(p, q)) = 1 - TV(p, q) = 0.4.
    accepted = sum(len(out) - 1 for out in outputs)
    first_accepted = sum(len(out) > 1 for out in outputs) / NUM_REQUESTS
    assert abs(first_accepted - 0.4) < 0.02 and accepted > 0


def test_one_hot_drafts_keep_the_target_distribution() -> None:
    outputs = _run(_sampler(), num_drafts=3, one_hot=True)
    # Position j is reached with probability p[1]^j (6400 requests reach position 2).
    for position in range(3):
        counts = _position_counts(outputs, position)
        assert _tv(counts, P) < TV_THRESHOLD, (position, counts)
    # A one-hot draft of token 1 is accepted with probability p[1].
    first_accepted = sum(len(out) > 1 for out in outputs) / NUM_REQUESTS
    assert abs(first_accepted - float(P[1])) < 0.01


class _AcceptEverything(RejectionSampler):
    def _verify_random(self, target, draft_ids, draft_probs, metadata, layout):  # type: ignore[no-untyped-def]
        recovered, accepted = super()._verify_random(
            target, draft_ids, draft_probs, metadata, layout
        )
        return recovered, torch.ones_like(accepted)


class _ResampleFromTarget(RejectionSampler):
    """Draws a rejected position's token from p instead of norm(max(0, p - q))."""

    def _verify_random(self, target, draft_ids, draft_probs, metadata, layout):  # type: ignore[no-untyped-def]
        _, accepted = super()._verify_random(target, draft_ids, draft_probs, metadata, layout)
        return target, accepted


def test_the_check_fails_a_broken_acceptance_rule() -> None:
    for broken in (_AcceptEverything, _ResampleFromTarget):
        outputs = _run(_sampler(broken), num_drafts=2, one_hot=False)
        worst = max(_tv(_position_counts(outputs, position), P) for position in range(2))
        assert worst > 5 * TV_THRESHOLD, broken.__name__


def test_greedy_rows_accept_exactly_the_argmax_prefix() -> None:
    logits = torch.tensor(
        [[0.0, 5.0, 0.0], [4.0, 0.0, 0.0], [0.0, 0.0, 3.0], [1.0, 2.0, 0.0], [0.0, 0.0, 9.0]]
    )
    # Request 0: drafts [1, 0] (both right) → [1, 0, 2]; request 1: draft [0] (wrong) → [1].
    rows = DraftRows([2, 1], [1, 0, 0])
    params = [SamplingParams(temperature=0.0)] * 5
    metadata = build_sampling_metadata(
        params, [[]] * 5, [[]] * 5, {}, [()] * 5, 3, torch.device("cpu")
    )
    sampler = RejectionSampler(Sampler())
    assert sampler(logits, metadata, rows).token_ids == [[1, 0, 2], [1]]


def test_a_seeded_request_draws_the_same_tokens_whatever_its_neighbours() -> None:
    def first_request_tokens(num_neighbours: int) -> list[int]:
        num_requests = 1 + num_neighbours
        logits = P.log().repeat(3 * num_requests, 1)
        rows = DraftRows([2] * num_requests, [0, 2] * num_requests)
        generator = torch.Generator().manual_seed(99)
        params = [SamplingParams(temperature=1.0, seed=99)] * 3 + [
            SamplingParams(temperature=1.0)
        ] * (3 * num_neighbours)
        metadata = build_sampling_metadata(
            params, [[]] * len(params), [[]] * len(params), {0: generator, 1: generator,
            2: generator}, [()] * len(params), VOCAB, torch.device("cpu"),
        )  # fmt: skip
        return RejectionSampler(Sampler())(logits, metadata, rows).token_ids[0]

    assert first_request_tokens(0) == first_request_tokens(5)
