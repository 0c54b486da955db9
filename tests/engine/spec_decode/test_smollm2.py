"""On the bundled SmolLM2-135M: greedy outputs with speculation equal those without, with
chunked prefill and with preemption (a small KV cache).

Draft models: a tiny random-weight Llama with SmolLM2's vocabulary (49 152 ids; its drafts are
nearly always rejected, so this exercises rejection and rollback on real text), and SmolLM2
itself (its drafts nearly always accepted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleetserve import LLM, SamplingParams
from tests.engine.spec_decode.helpers import generate_ids
from tests.engine.tiny_models import make_tiny_model

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "chunked": {"max_num_batched_tokens": 32, "long_prefill_token_threshold": 16},
    "preempt": {"num_kv_blocks": 8, "block_size": 16, "max_num_batched_tokens": 128},
}
TEXTS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\nRewrite the function above with type hints.",
    "The capital of France is",
    "List the numbers 1, 2, 3, 4, 5, 6, 7, 8 and continue:",
    "Once upon a time, in a small village by the sea,",
    "Copy this list: apples, pears, plums, apples, pears, plums.",
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]], Any]:
    from fleetserve.engine.models.bundled import bundled_model_path

    path = bundled_model_path()
    llm = LLM(str(path), dtype="float32", max_model_len=512)
    prompts = [llm.tokenizer.encode(text) for text in TEXTS]
    expected = generate_ids(llm, prompts, GREEDY)
    draft = make_tiny_model(
        tmp_path_factory.mktemp("smol-draft"), "llama", vocab_size=49152,
        max_position_embeddings=512,
    )  # fmt: skip
    return path, draft, prompts, expected


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("method", ["ngram", "draft_tiny"])
def test_smollm2_greedy_is_unchanged(smollm2: Any, method: str, setting: str) -> None:
    path, draft, prompts, expected = smollm2
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 4}
    if method == "draft_tiny":
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(
        str(path), dtype="float32", max_model_len=512, speculative_config=spec,
        **SETTINGS[setting],
    )  # fmt: skip
    assert generate_ids(llm, prompts, GREEDY) == expected
    stats = llm.engine_core.make_stats()
    assert stats.spec_decoding is not None and stats.spec_decoding.num_draft_tokens > 0
    if method == "ngram":
        assert stats.spec_decoding.num_accepted_tokens > 0  # real text repeats its prompt
    if setting == "preempt":
        assert stats.num_preemptions > 0


@pytest.mark.slow
def test_smollm2_drafting_for_itself_is_accepted(smollm2: Any) -> None:
    path, _, prompts, expected = smollm2
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    llm = LLM(str(path), dtype="float32", max_model_len=512, speculative_config=spec)
    assert generate_ids(llm, prompts, GREEDY) == expected
    stats = llm.engine_core.make_stats().spec_decoding
    assert stats is not None and stats.acceptance_rate > 0.9, stats
