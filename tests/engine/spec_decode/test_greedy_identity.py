"""Greedy decoding with speculative decoding equals greedy decoding without it, token for token.

Tiny random-weight Llama and Qwen2 models, under the fidelity tests' settings (defaults, chunked
prefill on every prompt, a KV cache small enough to force preemptions), with every proposer:
n-gram lookup, a draft model that is the target itself (drafts accepted), a different random
draft model (drafts rejected), and an oracle that is right on some positions and wrong on others
(partial acceptance and the rollback after it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleetserve import LLM, SamplingParams
from tests.engine.spec_decode.helpers import OracleProposer, generate_ids, spec_decoder
from tests.engine.tiny_models import make_prompts, make_tiny_model

MAX_TOKENS = 16
K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "chunked": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
    "preempt": {"num_kv_blocks": 12, "block_size": 16, "max_num_batched_tokens": 64},
}


def prompts() -> list[list[int]]:
    random = make_prompts(512, [5, 17, 33, 8, 64, 21, 47, 3], seed=1)
    # Prompts that repeat themselves: the n-gram lookup finds matches in them.
    repeating = [(p * 6)[:50] for p in make_prompts(512, [4, 7], seed=2)]
    return random + repeating


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp(request.param)
    target = make_tiny_model(root, request.param, seed=0)
    other = make_tiny_model(root, request.param, seed=7)
    llm = LLM(str(target), dtype="float32", max_model_len=256)
    expected = generate_ids(llm, prompts(), GREEDY)
    return target, other, expected


def _speculative(method: str, target: Path, other: Path) -> dict[str, Any]:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}
    model = target if method == "draft_self" else other
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": K}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_other"])
def test_greedy_outputs_are_unchanged(models: Any, method: str, setting: str) -> None:
    target, other, expected = models
    llm = LLM(
        str(target),
        dtype="float32",
        max_model_len=256,
        speculative_config=_speculative(method, target, other),
        **SETTINGS[setting],
    )
    assert generate_ids(llm, prompts(), GREEDY) == expected
    stats = llm.engine_core.make_stats()
    spec = stats.spec_decoding
    assert spec is not None and spec.num_draft_tokens > 0, "no draft was ever verified"
    if method == "draft_self":
        # The target drafting for itself: nearly every draft is right (float noise aside).
        assert spec.acceptance_rate > 0.9, spec
    if setting == "preempt":
        assert stats.num_preemptions > 0, "the small KV cache should have forced preemptions"


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_partial_acceptance_rolls_back_exactly(models: Any, setting: str) -> None:
    target, _, expected = models
    llm = LLM(
        str(target),
        dtype="float32",
        max_model_len=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": K},
        **SETTINGS[setting],
    )
    references = [p + e for p, e in zip(prompts(), expected, strict=True)]
    oracle = OracleProposer(references, K, 512, wrong_positions={1})
    spec_decoder(llm.engine_core).history_proposer = oracle
    assert generate_ids(llm, prompts(), GREEDY) == expected
    stats = llm.engine_core.make_stats().spec_decoding
    assert stats is not None
    # Position 0 right, position 1 wrong: exactly one accepted per verified multi-token draft.
    assert stats.num_accepted_tokens_per_pos[0] > 0
    assert stats.num_accepted_tokens_per_pos[1:] == [0] * (K - 1)


@pytest.mark.parametrize("method", ["ngram", "draft_self"])
def test_prefix_cache_hits_keep_outputs_and_draft_kv(models: Any, method: str) -> None:
    target, other, _ = models
    shared = make_prompts(512, [48], seed=9)[0]
    cached_prompts = [shared + tail for tail in make_prompts(512, [3, 9, 17, 30], seed=10)]
    plain = LLM(str(target), dtype="float32", max_model_len=256)
    expected = generate_ids(plain, cached_prompts, GREEDY)
    llm = LLM(
        str(target),
        dtype="float32",
        max_model_len=256,
        speculative_config=_speculative(method, target, other),
    )
    assert generate_ids(llm, cached_prompts, GREEDY) == expected
    before = llm.engine_core.make_stats().spec_decoding
    assert before is not None
    repeat = llm.generate([{"prompt_token_ids": p} for p in cached_prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in repeat] == expected
    assert min(o.num_cached_tokens for o in repeat) >= 48
    after = llm.engine_core.make_stats().spec_decoding
    assert after is not None
    if method == "draft_self":
        # The draft's own KV in the hit blocks was written with the target's: still accepted.
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        assert drafted > 0 and accepted / drafted > 0.9
