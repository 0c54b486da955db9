"""Fidelity: greedy token ids equal Hugging Face transformers' `generate`, exactly.

Each model runs a batch of prompts of different lengths under four engine settings — defaults,
chunked prefill on every prompt, a KV cache small enough to force preemptions, and prefix caching
with shared prefixes — and every setting must reproduce transformers token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve import LLM, SamplingParams
from tests.engine.tiny_models import hf_greedy, hf_model, make_prompts, make_tiny_model

MAX_TOKENS = 12


def generate_ids(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


LENGTHS = [5, 17, 33, 8, 64, 21, 47, 90, 3, 40]

SETTINGS = {
    "defaults": {},
    "chunked": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
    "preempt": {"num_kv_blocks": 12, "block_size": 16, "max_num_batched_tokens": 64},
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_tiny_models_match_transformers(tiny_model: Path, setting: str) -> None:
    vocab = int(hf_model(str(tiny_model)).config.vocab_size)
    prompts = make_prompts(vocab, LENGTHS, seed=1)
    expected = hf_greedy(tiny_model, prompts, MAX_TOKENS)
    llm = LLM(str(tiny_model), dtype="float32", max_model_len=256, **SETTINGS[setting])
    assert generate_ids(llm, prompts, MAX_TOKENS) == expected
    stats = llm.engine_core.make_stats()
    if setting == "preempt":
        assert stats.num_preemptions > 0, "the small KV cache should have forced preemptions"


def test_prefix_caching_hits_and_keeps_outputs(tiny_model: Path) -> None:
    vocab = int(hf_model(str(tiny_model)).config.vocab_size)
    shared = make_prompts(vocab, [48], seed=7)[0]
    prompts = [shared + tail for tail in make_prompts(vocab, [3, 9, 17, 1, 30, 5, 12, 2], seed=8)]
    expected = hf_greedy(tiny_model, prompts, MAX_TOKENS)
    llm = LLM(str(tiny_model), dtype="float32", max_model_len=256, enable_prefix_caching=True)
    first = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
    )
    repeat = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
    )
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in repeat] == expected
    assert all(o.num_cached_tokens > 0 for o in repeat)
    # Shared 48-token prefix = 3 full blocks of 16: every repeat hits at least those.
    assert min(o.num_cached_tokens for o in repeat) >= 48


SHARED_INSTRUCTION = (
    "You are a careful assistant. Continue the text below in plain English, "
    "keeping the same style and the same tone, and do not add any commentary, notes, "
    "headings or explanations of your own. Write only the continuation.\n\n"
)


@pytest.mark.slow
def test_bundled_smollm2_matches_transformers() -> None:
    from fleetserve.engine.models.bundled import bundled_model_path

    path = bundled_model_path()
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea,",
        "1, 2, 3, 4,",
        "The three primary colors are",
        "Water boils at",
        "In machine learning, a transformer is a model that",
        "Paris, London, Berlin and",
    ]
    llm = LLM(str(path), dtype="float32", max_model_len=512)
    prompts = [llm.tokenizer.encode(SHARED_INSTRUCTION + t) for t in texts]
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    assert generate_ids(llm, prompts, MAX_TOKENS) == expected
    # The same prompts again: the shared instruction (>= 2 full blocks) now comes from the cache.
    repeat = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
    )
    assert [o.outputs[0].token_ids for o in repeat] == expected
    assert all(o.num_cached_tokens >= 32 for o in repeat)
    del llm
    for setting in ("chunked", "preempt"):
        llm = LLM(str(path), dtype="float32", max_model_len=512, **SETTINGS[setting])
        assert generate_ids(llm, prompts, MAX_TOKENS) == expected, setting
        if setting == "preempt":
            assert llm.engine_core.make_stats().num_preemptions > 0
