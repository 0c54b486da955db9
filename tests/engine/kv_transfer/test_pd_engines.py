"""Prefill on one engine, decode on another: exactly the colocated tokens, with only the prompt's
tail computed on the decode side (both connectors, pull and push).

Two real `EngineCore`s run in this process, each with its own KV cache, control channel and
transport; the bytes really move (over loopback TCP, through the shared-memory fast path, or
through Mooncake). The HTTP-level tests with two `fleetserve serve` processes live with the
server tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.core.outputs import EngineCoreOutput
from fleetserve.engine.sampling_params import SamplingParams
from tests.engine.tiny_models import make_prompts, make_tiny_model

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _engine(model: Path, kv: dict[str, Any] | None, **overrides: Any) -> EngineCore:
    args: dict[str, Any] = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64}
    args.update(overrides)
    return EngineCore(EngineConfig.create(str(model), kv_transfer_config=kv, **args))


def _run(core: EngineCore, max_steps: int = 2000) -> dict[str, list[EngineCoreOutput]]:
    results: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not core.scheduler.has_unfinished_requests():
            return results
        for output in core.step():
            results.setdefault(output.req_id, []).append(output)
        core.scheduler.check_invariants()
    raise AssertionError("requests did not finish")


def _tokens(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # Short, a few blocks long, and two sharing a 32-token prefix.
    base = make_prompts(512, [3, 17, 40, 64, 33], seed=3)
    shared = make_prompts(512, [32], seed=4)[0]
    return [*base, [*shared, 7, 8, 9], shared + list(range(20, 41))]


@pytest.fixture(scope="module")
def colocated(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    core = _engine(model, None)
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, GREEDY, eos_token_ids=())
    results = _run(core)
    core.shutdown()
    return [_tokens(results[f"r{i}"]) for i in range(len(prompts))]


@pytest.fixture(params=["tcp-pull", "tcp-push", "mooncake-pull", "mooncake-push"])
def pair(request: pytest.FixtureRequest, model: Path) -> Iterator[tuple[EngineCore, EngineCore]]:
    connector, mode = request.param.split("-")
    common = {"connector": connector, "transfer_mode": mode, "transfer_timeout_s": 20.0}
    producer = _engine(model, {**common, "role": "producer"})
    consumer = _engine(model, {**common, "role": "consumer"})
    try:
        yield producer, consumer
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_prefill_then_decode_gives_the_colocated_tokens(
    pair: tuple[EngineCore, EngineCore], prompts: list[list[int]], colocated: list[list[int]]
) -> None:
    producer, consumer = pair
    for i, prompt in enumerate(prompts):
        producer.add_request(f"p{i}", prompt, GREEDY, eos_token_ids=(),
                             kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    prefilled = _run(producer)
    for i, prompt in enumerate(prompts):
        (last,) = [o for o in prefilled[f"p{i}"] if o.finished]
        assert len(_tokens(prefilled[f"p{i}"])) == 1, "a prefill leg makes one token"
        params = last.kv_transfer_params
        assert params is not None and params["do_remote_prefill"] is True
        consumer.add_request(f"d{i}", prompt, GREEDY, eos_token_ids=(),
                             kv_transfer_params=params)  # fmt: skip
    # The producer keeps stepping (it serves reads and frees blocks when told) while the
    # consumer loads and decodes.
    results: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(4000):
        if not consumer.scheduler.has_unfinished_requests():
            break
        for output in consumer.step():
            results.setdefault(output.req_id, []).append(output)
        producer.step()
    for i, prompt in enumerate(prompts):
        outputs = results[f"d{i}"]
        assert outputs[-1].error is None, outputs[-1].error
        assert _tokens(outputs) == colocated[i], i
        # Only the last prompt token was computed here: the rest is "cached" (remote or, for
        # the second of the shared-prefix pair, partly local).
        assert outputs[0].num_cached_tokens == len(prompt) - 1, (i, outputs[0].num_cached_tokens)
    stats = consumer.make_stats()
    assert stats.kv_cache_usage == 0.0
    assert consumer.scheduler.remote_kv.num_failed_loads == 0
    for _ in range(200):  # the producer frees every held block once its consumer is done
        if not producer.scheduler.remote_kv.held:
            break
        producer.step()
    assert not producer.scheduler.remote_kv.held
    assert producer.make_stats().kv_cache_usage == 0.0


@pytest.mark.parametrize("connector", ["tcp", "mooncake"])
def test_push_during_a_chunked_prefill_when_both_legs_start_together(
    connector: str, model: Path, prompts: list[list[int]], colocated: list[list[int]]
) -> None:
    # A router that dispatches both legs at once: the decode leg names the producer and a
    # transfer id before the prefill runs, so the producer writes each layer's blocks into the
    # consumer's as its (chunked) prefill computes them, not after.
    common = {"connector": connector, "transfer_mode": "push", "transfer_timeout_s": 20.0}
    producer = _engine(model, {**common, "role": "producer"}, max_num_batched_tokens=16,
                       long_prefill_token_threshold=16)  # fmt: skip
    consumer = _engine(model, {**common, "role": "consumer"})
    try:
        identity = producer.connector_identity
        assert identity is not None
        for i, prompt in enumerate(prompts):
            consumer.add_request(f"d{i}", prompt, GREEDY, eos_token_ids=(), kv_transfer_params={
                "do_remote_prefill": True,
                "remote_engine_id": identity.engine_id,
                "remote_host": identity.host,
                "remote_port": identity.port,
                "remote_request_id": f"t{i}",
            })  # fmt: skip
        for _ in range(50):  # handshakes done and push requests sent before the prefill
            consumer.step()
        for i, prompt in enumerate(prompts):
            producer.add_request(f"p{i}", prompt, GREEDY, eos_token_ids=(), kv_transfer_params={
                "do_remote_decode": True, "transfer_id": f"t{i}",
            })  # fmt: skip
        results: dict[str, list[EngineCoreOutput]] = {}
        for _ in range(4000):
            if not consumer.scheduler.has_unfinished_requests():
                break
            producer.step()
            for output in consumer.step():
                results.setdefault(output.req_id, []).append(output)
        for i in range(len(prompts)):
            assert results[f"d{i}"][-1].error is None, results[f"d{i}"][-1].error
            assert _tokens(results[f"d{i}"]) == colocated[i], i
        # Layers were written while the prefill still computed (not only after it finished).
        (connector,) = producer.executor.collective_rpc("kv_connector_stats")
        assert connector.layer_pushes > 0
        for _ in range(200):
            if not producer.scheduler.remote_kv.held:
                break
            producer.step()
        assert producer.make_stats().kv_cache_usage == 0.0
    finally:
        consumer.shutdown()
        producer.shutdown()
