"""The grammar bitmask in the sampler's fixed order: after the raw-logprobs snapshot (logprobs
report the model's distribution), before sampling (greedy and random rows only draw allowed
tokens); rows without a constraint are untouched."""

from __future__ import annotations

import torch

from fleetserve.engine.layers.sampler import Sampler, build_sampling_metadata
from fleetserve.engine.sampling_params import SamplingParams

VOCAB = 70  # three words, the last one partly padding


def _mask(allowed: list[set[int] | None]) -> torch.Tensor:
    rows = torch.full((len(allowed), 3), -1, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        if tokens is None:
            continue
        rows[row] = 0
        for token in tokens:
            word, bit = divmod(token, 32)
            value = int(rows[row, word]) | (1 << bit)
            rows[row, word] = value - (1 << 32) if value >= 1 << 31 else value
    return rows


def test_greedy_and_random_rows_draw_only_allowed_tokens_and_logprobs_stay_raw() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    allowed = [{5, 40, 69}, None, {31, 63}]
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=1.0, seed=7, logprobs=2),
    ]
    generator = torch.Generator().manual_seed(7)
    metadata = build_sampling_metadata(
        params, [[1]] * 3, [[]] * 3, {2: generator}, [()] * 3, VOCAB, torch.device("cpu")
    )
    metadata.grammar_bitmask = _mask(allowed)
    for _ in range(20):
        output = Sampler()(logits, metadata)
        sampled = output.sampled_token_ids.tolist()
        assert sampled[0] == max(allowed[0], key=lambda t: float(logits[0, t]))
        assert sampled[1] == int(logits[1].argmax())
        assert sampled[2] in allowed[2]
    assert output.logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)
    row0 = output.logprobs.logprobs[0]
    assert abs(row0[0] - float(raw[0, sampled[0]])) < 1e-5  # the raw, unmasked distribution
