"""Sampler: processing order, greedy/random mixing, logprobs, seeded determinism (seed part 1 §4.43)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from fleetserve.engine.layers.sampler import (
    Sampler,
    SamplingMetadata,
    build_sampling_metadata,
    greedy_tokens,
    samples_by_argmax,
)
from fleetserve.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 7


def make_metadata(
    params: list[SamplingParams],
    *,
    vocab_size: int = 8,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    seeds: dict[int, int] | None = None,
    eos: tuple[int, ...] = (EOS,),
) -> SamplingMetadata:
    num_reqs = len(params)
    generators = {row: torch.Generator().manual_seed(seed) for row, seed in (seeds or {}).items()}
    return build_sampling_metadata(
        params,
        prompt_token_ids=prompts or [[0]] * num_reqs,
        output_token_ids=outputs or [[] for _ in range(num_reqs)],
        generators=generators,
        eos_token_ids=[eos] * num_reqs,
        vocab_size=vocab_size,
        device=CPU,
    )


def sp(**kwargs: Any) -> SamplingParams:
    return SamplingParams(**kwargs)


def final_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    sampler = Sampler()
    return sampler.compute_probs(sampler.apply_logits_processors(logits, metadata), metadata)


def test_temperature_zero_is_exact_argmax_without_nan() -> None:
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    metadata = make_metadata([sp(temperature=0.0)] * 5, vocab_size=64)
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None
    # A greedy row beside a random one divides by 1, not ~0: no inf/NaN reaches the argmax.
    mixed = make_metadata([sp(temperature=0.0), sp(temperature=1e-7), sp()], vocab_size=64)
    probs = final_probs(logits[:3], mixed)
    assert not probs.isnan().any()
    out = Sampler()(logits[:3], mixed)
    assert out.sampled_token_ids[:2].tolist() == logits[:2].argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": 0.7},
        {"logprobs": 0},
        {"structured_outputs": {"regex": "a+"}},
        {"allowed_token_ids": [3]},
        {"logit_bias": {3: 5.0}},
        {"min_tokens": 2},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.2},
    ],
)
def test_samples_by_argmax_only_when_nothing_edits_the_greedy_logits(
    changes: dict[str, Any],
) -> None:
    """The runner skips the sampler for rows this accepts: each option that makes the sampler
    differ from the raw argmax must turn it off (a new option belongs in this list)."""
    vocab_size = 64
    logits = torch.randn(1, vocab_size, generator=torch.Generator().manual_seed(1))
    plain = sp(temperature=0.0)
    assert samples_by_argmax(plain) and samples_by_argmax(sp(temperature=0.0, seed=3, n=2))
    assert Sampler()(logits, make_metadata([plain], vocab_size=vocab_size)).sampled_token_ids[
        0
    ] == int(logits.argmax())
    assert not samples_by_argmax(plain.clone(**changes))


def test_caller_logits_are_not_modified() -> None:
    logits = torch.zeros(1, 8)
    metadata = make_metadata(
        [sp(temperature=0.0, logit_bias={3: 5.0}, repetition_penalty=2.0)], outputs=[[1]]
    )
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [3]
    assert logits.eq(0).all()


def test_logprobs_are_raw_log_softmax_unaffected_by_processing() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0]])
    raw = torch.log_softmax(logits, dim=-1)
    params = sp(
        temperature=0.0,
        logprobs=3,
        repetition_penalty=1.9,
        frequency_penalty=2.0,
        logit_bias={4: 10.0},
    )
    metadata = make_metadata([params], outputs=[[0, 0, 1]])
    out = Sampler()(logits, metadata)
    # logit_bias pushes token 4 to the top: it is sampled, yet its rank is the raw one (5).
    assert out.sampled_token_ids.tolist() == [4]
    assert out.logprobs is not None
    assert out.logprobs.logprob_token_ids == [[4, 0, 1, 2]]
    assert out.logprobs.sampled_token_ranks == [5]
    expected = raw[0, [4, 0, 1, 2]].tolist()
    assert out.logprobs.logprobs[0] == pytest.approx(expected, abs=1e-6)


def test_penalty_has_same_relative_effect_at_any_temperature() -> None:
    # Penalties act on raw logits before temperature: log(p0/p1) * T = (l0 - penalty) - l1.
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    for temperature in (0.5, 2.0):
        metadata = make_metadata(
            [sp(temperature=temperature, frequency_penalty=0.5)], vocab_size=4, outputs=[[0]]
        )
        probs = final_probs(logits, metadata)[0]
        assert math.log(probs[0] / probs[1]) * temperature == pytest.approx(0.5, abs=1e-5)


def test_penalty_values() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 1.0]])
    # Token 0 in the prompt, token 1 in the prompt, tokens 4 (×2) and 5 in the output.
    params = sp(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    metadata = make_metadata([params], vocab_size=6, prompts=[[0, 1]], outputs=[[4, 4, 5]])
    processed = Sampler().apply_logits_processors(logits, metadata)
    expected = [1.0, -4.0, 2.0, -2.0, 0.5 - 1.0 - 0.25, 0.5 - 0.5 - 0.25]
    assert processed[0].tolist() == pytest.approx(expected)


def test_mixed_greedy_and_random_rows_in_one_batch() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0], [1.0, 1.0, -9e9, -9e9], [0.0, 0.0, 0.0, 9.0]])
    params = [sp(temperature=0.0), sp(temperature=1.0), sp(temperature=0.0)]
    metadata = make_metadata(params, vocab_size=4)
    sampler = Sampler(torch.Generator().manual_seed(0))
    seen_random: set[int] = set()
    for _ in range(40):
        out = sampler(logits, metadata).sampled_token_ids.tolist()
        assert out[0] == 1 and out[2] == 3
        seen_random.add(out[1])
    assert seen_random == {0, 1}


@pytest.mark.parametrize(("num_logprobs", "width"), [(None, None), (0, 1), (3, 4), (-1, 9)])
def test_num_logprobs_shapes(num_logprobs: int | None, width: int | None) -> None:
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    params = [sp(temperature=0.0), sp(temperature=0.0, logprobs=num_logprobs), sp()]
    out = Sampler()(logits, make_metadata(params))
    if width is None:
        assert out.logprobs is None
        return
    assert out.logprobs is not None
    assert [len(row) for row in out.logprobs.logprob_token_ids] == [width] * 3
    assert [len(row) for row in out.logprobs.logprobs] == [width] * 3
    sampled = out.sampled_token_ids.tolist()
    assert [row[0] for row in out.logprobs.logprob_token_ids] == sampled
    if num_logprobs == -1:
        raw = torch.log_softmax(logits, dim=-1)
        assert out.logprobs.logprob_token_ids[1][1:] == list(range(8))
        assert out.logprobs.logprobs[1][1:] == pytest.approx(raw[1].tolist(), abs=1e-6)


def test_min_tokens_blocks_eos_and_stop_ids_for_greedy() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0, 1.0, 0.0, 3.0]])  # EOS (7) best, then 3
    params = sp(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    blocked = make_metadata([params], outputs=[[1, 2]])
    assert blocked.min_tokens == {0: (3, {EOS, 3})}
    assert Sampler()(logits, blocked).sampled_token_ids.tolist() == [5]
    reached = make_metadata([params], outputs=[[1, 2, 4]])
    assert Sampler()(logits, reached).sampled_token_ids.tolist() == [EOS]
    ignore_eos = make_metadata([sp(temperature=0.0, min_tokens=3, ignore_eos=True)])
    assert ignore_eos.min_tokens == {}
    assert Sampler()(logits, ignore_eos).sampled_token_ids.tolist() == [EOS]


def test_min_tokens_blocks_every_eos_id() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0, 1.0, 3.0, 4.0]])  # 7 best, then 6, then 3
    both = make_metadata([sp(temperature=0.0, min_tokens=2)], eos=(6, 7))
    assert both.min_tokens == {0: (2, {6, 7})}
    assert Sampler()(logits, both).sampled_token_ids.tolist() == [3]


def test_min_p_applies_after_temperature() -> None:
    num_rows = 2000
    logits = torch.tensor([[0.0, -1.0]]).expand(num_rows, 2)
    sampler = Sampler(torch.Generator().manual_seed(0))
    # T=4: p1/p0 = e^-0.25 ≈ 0.78 ≥ 0.5 keeps token 1 (before temperature e^-1 < 0.5 would drop it).
    hot = make_metadata([sp(temperature=4.0, min_p=0.5)] * num_rows, vocab_size=2)
    assert 600 < int(sampler(logits, hot).sampled_token_ids.sum()) < 1200
    # T=0.25: p1/p0 = e^-4 ≈ 0.018 < 0.2 drops token 1 (before temperature e^-1 would keep it).
    cold = make_metadata([sp(temperature=0.25, min_p=0.2)] * num_rows, vocab_size=2)
    assert int(sampler(logits, cold).sampled_token_ids.sum()) == 0


def test_top_k_and_top_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).expand(4, 4)
    params = [sp(top_k=2), sp(top_p=0.75), sp(top_k=3, top_p=0.5), sp()]
    metadata = make_metadata(params, vocab_size=4)
    assert metadata.top_k is not None and metadata.top_k.tolist() == [2, 4, 3, 4]
    probs = final_probs(logits, metadata)
    support = [(row > 0).nonzero().flatten().tolist() for row in probs]
    assert support == [[0, 1], [0, 1, 2], [0, 1], [0, 1, 2, 3]]
    assert probs[0].tolist() == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0])
    assert probs[3].tolist() == pytest.approx([0.4, 0.3, 0.2, 0.1])
    unused = make_metadata([sp(), sp(top_k=8)])
    assert unused.top_k is None and unused.top_p is None and unused.min_p is None


def test_logit_bias_and_allowed_token_ids() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0]]).expand(3, 8)
    params = [
        sp(temperature=0.0, logit_bias={5: 5.5}),
        sp(temperature=0.0, allowed_token_ids=[2, 4]),
        sp(temperature=0.0),
    ]
    metadata = make_metadata(params)
    assert metadata.allowed_token_ids_mask is not None
    assert metadata.allowed_token_ids_mask[2].tolist() == [False] * 8
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [5, 2, 0]
    with pytest.raises(ValueError, match="logit_bias"):
        make_metadata([sp(logit_bias={8: 1.0})])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        make_metadata([sp(allowed_token_ids=[9])])


def _run_steps(positions: int, row: int, batch: int, seeds: dict[int, int]) -> list[int]:
    """Sample `positions` steps of a batch; return the tokens of `row`."""
    step_logits = torch.randn(positions, 50, generator=torch.Generator().manual_seed(3))
    params = [sp(temperature=1.0) for _ in range(batch)]
    generators = {r: torch.Generator().manual_seed(s) for r, s in seeds.items()}
    sampler = Sampler(torch.Generator().manual_seed(99))
    tokens = []
    for step in range(positions):
        logits = torch.randn(batch, 50)
        logits[row] = step_logits[step]
        metadata = build_sampling_metadata(
            params, [[0]] * batch, [[] for _ in range(batch)], generators, [None] * batch, 50, CPU
        )
        tokens.append(int(sampler(logits, metadata).sampled_token_ids[row]))
    return tokens


def test_seeded_row_is_independent_of_batch_composition() -> None:
    alone = _run_steps(8, row=0, batch=1, seeds={0: 1234})
    between = _run_steps(8, row=1, batch=3, seeds={1: 1234, 2: 7})
    last = _run_steps(8, row=3, batch=4, seeds={3: 1234})
    assert alone == between == last
    assert len(set(alone)) > 1


def test_unseeded_rows_reproducible_with_seeded_default_generator() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(5))
    metadata = make_metadata([sp()] * 6, vocab_size=100)
    first = Sampler(torch.Generator().manual_seed(11))(logits, metadata).sampled_token_ids
    again = Sampler(torch.Generator().manual_seed(11))(logits, metadata).sampled_token_ids
    other = Sampler(torch.Generator().manual_seed(12))(logits, metadata).sampled_token_ids
    assert first.tolist() == again.tolist()
    assert first.tolist() != other.tolist()


def test_exponential_race_matches_the_distribution() -> None:
    num_rows = 20000
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(num_rows, 3)
    metadata = make_metadata([sp()] * num_rows, vocab_size=3)
    sampled = Sampler(torch.Generator().manual_seed(0))(logits, metadata).sampled_token_ids
    freqs = torch.bincount(sampled, minlength=3).float() / num_rows
    assert freqs.tolist() == pytest.approx([0.5, 0.3, 0.2], abs=0.02)


def test_build_sampling_metadata_fields() -> None:
    params = [
        sp(temperature=0.0, logprobs=2, presence_penalty=0.5),
        sp(logprobs=-1),
        sp(temperature=0.7, min_p=0.1),
    ]
    metadata = make_metadata(params, prompts=[[1, 2, 3], [4], []])
    assert (metadata.all_greedy, metadata.all_random) == (False, False)
    assert metadata.max_num_logprobs == -1
    assert metadata.no_penalties is False
    assert metadata.prompt_token_ids is not None
    assert metadata.prompt_token_ids.tolist() == [[1, 2, 3], [4, 8, 8], [8, 8, 8]]
    assert metadata.min_p is not None and metadata.min_p.tolist() == pytest.approx([0, 0, 0.1])
    plain = make_metadata([sp(logprobs=1), sp(logprobs=4)])
    assert plain.max_num_logprobs == 4 and plain.no_penalties and plain.prompt_token_ids is None
    with pytest.raises(ValueError, match="output_token_ids"):
        build_sampling_metadata([sp()], [[0]], [], {}, [None], 8, CPU)


def test_low_precision_logits_are_processed_in_float32() -> None:
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    metadata = make_metadata([sp(temperature=0.0, logprobs=1), sp(temperature=0.5)])
    sampler = Sampler()
    assert sampler.apply_logits_processors(logits, metadata).dtype == torch.float32
    out = sampler(logits, metadata)
    assert out.sampled_token_ids[0] == logits[0].float().argmax()
    assert out.logprobs is not None
    expected = torch.log_softmax(logits.float(), dim=-1)[0].max().item()
    assert out.logprobs.logprobs[0][1] == pytest.approx(expected, abs=1e-6)


def test_greedy_tokens_is_argmax_with_its_ties_and_nans() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        logits = torch.randint(0, 4, (7, 300), generator=gen).float()  # many equal maxima
        if trial % 3 == 0:
            logits[2, torch.randint(0, 300, (3,), generator=gen)] = float("nan")
        if trial % 5 == 0:
            logits[3] = float("-inf")
        if trial % 7 == 0:
            logits[4] = float("nan")
        if trial % 11 == 0:
            logits[5, torch.randint(0, 300, (2,), generator=gen)] = float("inf")
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1)), trial
    wide = torch.randn(32, 49152, generator=gen)
    assert torch.equal(greedy_tokens(wide), wide.argmax(dim=-1))
    assert torch.equal(greedy_tokens(wide.bfloat16()), wide.bfloat16().argmax(dim=-1))
    # The engine's case: logits made under inference mode; also rows of a strided view.
    with torch.inference_mode():
        made = wide * 1.0
        assert torch.equal(greedy_tokens(made), made.argmax(dim=-1))
    assert torch.equal(greedy_tokens(wide[::3, ::2]), wide[::3, ::2].argmax(dim=-1))
