"""Speculation under per-request sampling settings: penalties, logit_bias and min_tokens apply
row by row as if the drafts were outputs already; logprobs come per returned token, equal to
the plain run's."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve import LLM, SamplingParams
from tests.engine.spec_decode.helpers import generate_ids
from tests.engine.tiny_models import make_prompts


def _llm(model: Path, speculative: bool) -> LLM:
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    return LLM(
        str(model),
        dtype="float32",
        max_model_len=256,
        speculative_config=spec if speculative else None,
    )


PARAMS = {
    "penalties": SamplingParams(
        temperature=0.0, max_tokens=16, repetition_penalty=1.4, presence_penalty=0.5,
        frequency_penalty=0.3,
    ),
    "logit_bias_min_tokens": SamplingParams(
        temperature=0.0, max_tokens=16, min_tokens=10, logit_bias={7: 3.0, 9: -2.0},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_greedy_settings_are_applied_per_draft_row(tiny_llama_dir: Path, name: str) -> None:
    prompts = make_prompts(512, [6, 19, 33, 4], seed=11)
    expected = generate_ids(_llm(tiny_llama_dir, False), prompts, PARAMS[name])
    llm = _llm(tiny_llama_dir, True)
    assert generate_ids(llm, prompts, PARAMS[name]) == expected
    stats = llm.engine_core.make_stats().spec_decoding
    assert stats is not None and stats.num_accepted_tokens > 0


def test_logprobs_match_the_plain_run(tiny_llama_dir: Path) -> None:
    prompts = make_prompts(512, [6, 19, 33], seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)
    plain = _llm(tiny_llama_dir, False).generate([{"prompt_token_ids": p} for p in prompts], params)
    llm = _llm(tiny_llama_dir, True)
    spec = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine_core.make_stats().spec_decoding.num_accepted_tokens > 0  # type: ignore[union-attr]
    for a, b in zip(plain, spec, strict=True):
        out_a, out_b = a.outputs[0], b.outputs[0]
        assert out_a.token_ids == out_b.token_ids
        assert out_a.logprobs is not None and out_b.logprobs is not None
        assert len(out_b.logprobs) == len(out_b.token_ids)
        for row_a, row_b in zip(out_a.logprobs, out_b.logprobs, strict=True):
            assert list(row_a) == list(row_b)  # the same token ids, in the same order
            for token_id, entry in row_a.items():
                assert row_b[token_id].rank == entry.rank
                assert row_b[token_id].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_a_stop_token_inside_accepted_drafts_ends_the_output_there(tiny_llama_dir: Path) -> None:
    prompts = make_prompts(512, [9, 25], seed=13)
    long_run = generate_ids(_llm(tiny_llama_dir, False), prompts, SamplingParams(max_tokens=16,
                            temperature=0.0))  # fmt: skip
    # Stop at each prompt's 6th output token: with the target drafting for itself, that token
    # arrives inside a run of accepted drafts.
    params = SamplingParams(temperature=0.0, max_tokens=16,
                            stop_token_ids=[long_run[0][5], long_run[1][5]])  # fmt: skip
    expected = generate_ids(_llm(tiny_llama_dir, False), prompts, params)
    llm = _llm(tiny_llama_dir, True)
    assert generate_ids(llm, prompts, params) == expected
    assert all(len(e) <= 6 for e in expected)
    stats = llm.engine_core.make_stats().spec_decoding
    assert stats is not None and stats.num_accepted_tokens > 0
    assert llm.engine_core.make_stats().kv_cache_usage == 0.0
