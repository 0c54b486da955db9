"""Acceptance 1 (tensor-parallel part): greedy outputs of TP=2 (two worker processes over gloo,
the 'mp' executor) equal TP=1's and transformers' exactly in float32, on tiny Llama and Qwen2,
with chunked prefill and preemption active in the same run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve import LLM, SamplingParams
from fleetserve.engine.worker.multiproc_executor import MultiprocExecutor
from tests.engine.tiny_models import hf_greedy, make_prompts, make_tiny_model

MAX_TOKENS = 10
LENGTHS = [5, 17, 33, 8, 40, 21]
# Chunks of at most 16 tokens per step, 8 per prompt, and 10 blocks of 8 tokens for six
# prompts of up to 50 tokens: every long prompt is chunked and requests get preempted.
SETTINGS = {
    "dtype": "float32",
    "device": "cpu",
    "max_model_len": 128,
    "block_size": 8,
    "num_kv_blocks": 10,
    "max_num_batched_tokens": 16,
    "long_prefill_token_threshold": 8,
    "enable_prefix_caching": False,
}


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_equals_tp1_and_transformers(
    arch: str, tiny_llama_dir: Path, tiny_qwen2_dir: Path
) -> None:
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    prompts = make_prompts(512, LENGTHS, seed=3)
    single = LLM(str(model_dir), **SETTINGS)
    expected = _generate(single, prompts)
    assert expected == hf_greedy(model_dir, prompts, MAX_TOKENS)
    single.engine_core.shutdown()
    llm = LLM(str(model_dir), tensor_parallel_size=2, **SETTINGS)
    try:
        assert isinstance(llm.engine_core.executor, MultiprocExecutor)
        assert _generate(llm, prompts) == expected
        stats = llm.engine_core.make_stats()
        assert stats.num_preemptions > 0, "the small KV cache should have forced preemptions"
        # Each rank caches one of the two KV heads: the block count is per rank's memory.
        assert (
            llm.engine_core.executor.collective_rpc("get_kv_cache_block_bytes")
            == [2 * 2 * 8 * 1 * 32 * 4] * 2
        )
    finally:
        llm.engine_core.shutdown()


@pytest.mark.timeout(300)
def test_tp2_ranks_sample_the_same_tokens_without_the_scheduler_sending_them(
    tiny_llama_dir: Path,
) -> None:
    """Every rank samples for itself and feeds its own token to the next step (the scheduler
    sends running requests no tokens): at temperature 1, seeded and unseeded, TP=2 still gives
    TP=1's tokens. A rank that drew another token would feed the other rank's shards a different
    input, and the two ranks' sums would no longer be TP=1's."""
    prompts = make_prompts(512, LENGTHS, seed=4)
    params = [
        SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=11 + i if i % 2 else None)
        for i in range(len(prompts))
    ]

    def sample(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs]

    single = LLM(str(tiny_llama_dir), seed=7, **SETTINGS)
    expected = sample(single)
    single.engine_core.shutdown()
    llm = LLM(str(tiny_llama_dir), seed=7, tensor_parallel_size=2, **SETTINGS)
    try:
        assert sample(llm) == expected
        assert llm.engine_core.make_stats().num_preemptions > 0
    finally:
        llm.engine_core.shutdown()


@pytest.mark.timeout(600)
def test_tp4_replicates_kv_heads_and_pads_the_vocabulary(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Four ranks for two KV heads (each KV head cached by two ranks) and a vocabulary of 510
    (128 rows per rank, the last rank's two tail rows padding): still TP=1's tokens."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tp4"), "llama", vocab_size=510)
    prompts = make_prompts(510, LENGTHS[:4], seed=5)
    single = LLM(str(model_dir), **SETTINGS)
    expected = _generate(single, prompts)
    single.engine_core.shutdown()
    llm = LLM(str(model_dir), tensor_parallel_size=4, **SETTINGS)
    try:
        assert _generate(llm, prompts) == expected
        # One KV head per rank: the same block bytes as TP=2, so the same block count.
        assert llm.engine_core.executor.collective_rpc("get_kv_cache_block_bytes") == (
            [2 * 2 * 8 * 1 * 32 * 4] * 4
        )
    finally:
        llm.engine_core.shutdown()
