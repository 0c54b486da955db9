"""Structured output across P/D: a decode engine fed by a remote prefill constrains every
output token, the first one included (it computes the last prompt token and samples it
itself; the prefill leg's own token is discarded, so that leg compiles no grammar)."""

from __future__ import annotations

import re
from pathlib import Path

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.core.outputs import EngineCoreOutput
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.structured_output.params import StructuredOutputsParams
from tests.engine.tiny_models import make_tiny_model

REGEX = r"[a-d]{3,8}x"
EOS = (2,)


def _engine(model: Path, role: str) -> EngineCore:
    kv = {"connector": "tcp", "transfer_mode": "pull", "transfer_timeout_s": 20.0, "role": role}
    config = EngineConfig.create(
        str(model), dtype="float32", device="cpu", num_kv_blocks=64, kv_transfer_config=kv
    )
    return EngineCore(config)


def test_a_remotely_prefilled_request_follows_its_grammar_from_the_first_token(
    tmp_path: Path,
) -> None:
    from transformers import AutoTokenizer

    model = make_tiny_model(tmp_path, "llama")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in (
        "the quick brown fox jumps over the lazy dog " * 2, "seven wizards hex it ", "abc " * 9)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams.create(regex=REGEX))  # fmt: skip
    producer, consumer = _engine(model, "producer"), _engine(model, "consumer")
    try:
        for i, prompt in enumerate(prompts):
            producer.add_request(f"p{i}", prompt, params, eos_token_ids=EOS,
                                 kv_transfer_params={"do_remote_decode": True})  # fmt: skip
        assert producer.scheduler.structured_output.manager is not None
        assert producer.scheduler.structured_output.manager.backend is None  # no grammar here
        prefilled: dict[str, list[EngineCoreOutput]] = {}
        while producer.scheduler.has_unfinished_requests():
            for output in producer.step():
                prefilled.setdefault(output.req_id, []).append(output)
        for i, prompt in enumerate(prompts):
            (last,) = [o for o in prefilled[f"p{i}"] if o.finished]
            consumer.add_request(f"d{i}", prompt, params, eos_token_ids=EOS,
                                 kv_transfer_params=last.kv_transfer_params)  # fmt: skip
        results: dict[str, list[EngineCoreOutput]] = {}
        for _ in range(4000):
            if not consumer.scheduler.has_unfinished_requests():
                break
            for output in consumer.step():
                results.setdefault(output.req_id, []).append(output)
            producer.step()
            consumer.scheduler.check_invariants()
        for i, prompt in enumerate(prompts):
            outputs = results[f"d{i}"]
            assert outputs[-1].error is None and outputs[-1].finish_reason == "stop", outputs[-1]
            assert outputs[0].num_cached_tokens == len(prompt) - 1  # the prompt came from P
            tokens = [t for o in outputs for t in o.new_token_ids]
            assert tokens[-1] == EOS[0]
            assert re.fullmatch(REGEX, tokenizer.decode(tokens[:-1])), tokens
    finally:
        consumer.shutdown()
        producer.shutdown()
