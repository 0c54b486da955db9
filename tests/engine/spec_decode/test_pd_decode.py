"""Speculative decoding on a decode engine fed by a remote prefill: the colocated tokens.

The producer computes each prompt and its first token; the consumer loads the prompt's KV and
decodes with drafts (an oracle right on positions 0 and 1, wrong on 2), verified in its own
steps: drafts start only once the request has sampled there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.core.outputs import EngineCoreOutput
from fleetserve.engine.sampling_params import SamplingParams
from tests.engine.spec_decode.helpers import OracleProposer, spec_decoder
from tests.engine.tiny_models import make_prompts

K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engine(model: Path, kv: dict[str, Any] | None, **overrides: Any) -> EngineCore:
    args: dict[str, Any] = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64}
    return EngineCore(EngineConfig.create(str(model), kv_transfer_config=kv, **args, **overrides))


def _run(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.scheduler.has_unfinished_requests():
        for output in core.step():
            tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
    return tokens


def test_a_speculating_decode_engine_gives_the_colocated_tokens(tiny_llama_dir: Path) -> None:
    prompts = make_prompts(512, [3, 17, 40, 33], seed=3)
    colocated = _engine(tiny_llama_dir, None)
    for i, prompt in enumerate(prompts):
        colocated.add_request(f"r{i}", prompt, GREEDY, eos_token_ids=())
    expected = _run(colocated)
    colocated.shutdown()

    common = {"connector": "tcp", "transfer_mode": "pull", "transfer_timeout_s": 20.0}
    producer = _engine(tiny_llama_dir, {**common, "role": "producer"})
    consumer = _engine(
        tiny_llama_dir,
        {**common, "role": "consumer"},
        speculative_config={"method": "ngram", "num_speculative_tokens": K},
    )
    references = [p + expected[f"r{i}"] for i, p in enumerate(prompts)]
    spec_decoder(consumer).history_proposer = OracleProposer(
        references, K, 512, wrong_positions={2}
    )
    try:
        for i, prompt in enumerate(prompts):
            producer.add_request(f"p{i}", prompt, GREEDY, eos_token_ids=(),
                                 kv_transfer_params={"do_remote_decode": True})  # fmt: skip
        prefilled: dict[str, list[EngineCoreOutput]] = {}
        while producer.scheduler.has_unfinished_requests():
            for output in producer.step():
                prefilled.setdefault(output.req_id, []).append(output)
        for i, prompt in enumerate(prompts):
            params = prefilled[f"p{i}"][-1].kv_transfer_params
            assert params is not None
            consumer.add_request(f"d{i}", prompt, GREEDY, eos_token_ids=(),
                                 kv_transfer_params=params)  # fmt: skip
        results: dict[str, list[EngineCoreOutput]] = {}
        for _ in range(4000):
            if not consumer.scheduler.has_unfinished_requests():
                break
            for output in consumer.step():
                results.setdefault(output.req_id, []).append(output)
            consumer.scheduler.check_invariants()
            producer.step()
        for i, prompt in enumerate(prompts):
            outputs = results[f"d{i}"]
            assert outputs[-1].error is None, outputs[-1].error
            # The first decode step has no drafts yet: it computes the prompt's last token.
            assert len(outputs[0].new_token_ids) == 1
            assert outputs[0].num_cached_tokens == len(prompt) - 1
            assert [t for o in outputs for t in o.new_token_ids] == expected[f"r{i}"], i
        stats = consumer.make_stats().spec_decoding
        assert stats is not None
        first, second, third = stats.num_accepted_tokens_per_pos
        # Drafts cut short near max_tokens have fewer positions: position 1 counts fewer.
        assert first >= second > 0 and third == 0, stats
        assert consumer.make_stats().kv_cache_usage == 0.0
    finally:
        consumer.shutdown()
        producer.shutdown()
