"""Faults between a prefill and a decode engine, under both load-failure policies: a producer
that is gone or restarted, a consumer stalled past the lease, incompatible engines. Under
`recompute` every request completes with exactly the colocated tokens; under `fail` it ends at
once with the classified error; nothing hangs, and the producer's KV returns to idle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.core.outputs import EngineCoreOutput
from fleetserve.engine.sampling_params import SamplingParams
from tests.engine.tiny_models import make_prompts, make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(512, [20, 45, 70], seed=11)


def _engine(model: Path, role: str, **kv: Any) -> EngineCore:
    overrides = {k: kv.pop(k) for k in ("block_size",) if k in kv}
    config = {"connector": "tcp", "role": role, "transfer_timeout_s": 3.0, **kv}
    return EngineCore(
        EngineConfig.create(
            str(model),
            dtype="float32",
            device="cpu",
            num_kv_blocks=64,
            kv_transfer_config=config,
            **overrides,
        )
    )


def _colocated(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    core = EngineCore(EngineConfig.create(str(model), dtype="float32", device="cpu"))
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, GREEDY, eos_token_ids=())
    tokens = _drive(core)
    core.shutdown()
    return [tokens[f"r{i}"][0] for i in range(len(prompts))]


def _drive(
    core: EngineCore, also: Callable[[], object] = lambda: None, max_steps: int = 20000
) -> dict[str, tuple[list[int], str | None]]:
    """Step until every request finished; request id → (tokens, error)."""
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not core.scheduler.has_unfinished_requests():
            break
        for output in core.step():
            outputs.setdefault(output.req_id, []).append(output)
        also()
    else:
        raise AssertionError("requests did not finish: something hangs")
    return {
        rid: ([t for o in outs for t in o.new_token_ids], outs[-1].error)
        for rid, outs in outputs.items()
    }


def _prefill(producer: EngineCore, prompts: list[list[int]]) -> list[dict[str, Any]]:
    for i, prompt in enumerate(prompts):
        producer.add_request(f"p{i}", prompt, GREEDY, eos_token_ids=(),
                             kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    params: dict[str, dict[str, Any]] = {}
    while producer.scheduler.has_unfinished_requests():
        for output in producer.step():
            if output.finished and output.kv_transfer_params is not None:
                params[output.req_id] = output.kv_transfer_params
    return [params[f"p{i}"] for i in range(len(prompts))]


def _decode(
    consumer: EngineCore,
    prompts: list[list[int]],
    params: list[dict[str, Any]],
    also: Callable[[], object] = lambda: None,
) -> list[tuple[list[int], str | None]]:
    for i, prompt in enumerate(prompts):
        consumer.add_request(f"d{i}", prompt, GREEDY, eos_token_ids=(),
                             kv_transfer_params=params[i])  # fmt: skip
    results = _drive(consumer, also)
    return [results[f"d{i}"] for i in range(len(prompts))]


def _check(
    results: list[tuple[list[int], str | None]],
    policy: str,
    expected: list[list[int]],
    stage: str,
) -> None:
    if policy == "recompute":
        assert [(tokens, error) for tokens, error in results] == [(t, None) for t in expected]
        return
    for tokens, error in results:
        assert tokens == [] and error is not None, error
        assert error.startswith(f"kv_transfer_failed: {stage}:"), error


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_producer_that_is_gone(model: Path, prompts: list[list[int]], policy: str) -> None:
    expected = _colocated(model, prompts) if policy == "recompute" else []
    producer = _engine(model, "producer")
    consumer = _engine(model, "consumer", load_failure_policy=policy, handshake_timeout_s=1.0)
    params = _prefill(producer, prompts)
    producer.shutdown()  # killed between the prefill and the decode
    try:
        _check(_decode(consumer, prompts, params), policy, expected, "handshake")
        assert consumer.make_stats().kv_cache_usage == 0.0
    finally:
        consumer.shutdown()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_restarted_producer_never_serves_stale_blocks(
    model: Path, prompts: list[list[int]], policy: str
) -> None:
    expected = _colocated(model, prompts) if policy == "recompute" else []
    producer = _engine(model, "producer")
    params = _prefill(producer, prompts)
    port = producer.connector_identity.port  # type: ignore[union-attr]
    producer.shutdown()
    # A new incarnation on the same address: its blocks are not the ones the params name.
    restarted = _engine(model, "producer", side_channel_port=port)
    consumer = _engine(model, "consumer", load_failure_policy=policy)
    try:
        results = _decode(consumer, prompts, params, restarted.step)
        _check(results, policy, expected, "handshake")
        if policy == "fail":
            assert "it restarted" in (results[0][1] or "")
    finally:
        consumer.shutdown()
        restarted.shutdown()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_consumer_stalled_past_the_lease(
    model: Path, prompts: list[list[int]], policy: str
) -> None:
    expected = _colocated(model, prompts) if policy == "recompute" else []
    producer = _engine(model, "producer", lease_seconds=0.5)
    consumer = _engine(model, "consumer", load_failure_policy=policy, transfer_timeout_s=1.0)
    try:
        params = _prefill(producer, prompts)
        import time

        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # the producer runs on; the consumer is stalled
            producer.step()
        assert producer.make_stats().kv_cache_usage == 0.0, "expired leases free the blocks"
        (stats,) = producer.executor.collective_rpc("kv_connector_stats")
        assert stats.lease_expirations == len(prompts)
        _check(_decode(consumer, prompts, params, producer.step), policy, expected,
               "registration")  # fmt: skip
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_incompatible_engines_fail_naming_both_hashes(
    model: Path, prompts: list[list[int]]
) -> None:
    producer = _engine(model, "producer")
    consumer = _engine(model, "consumer", block_size=8)
    mine = consumer.connector_identity.compatibility_hash  # type: ignore[union-attr]
    theirs = producer.connector_identity.compatibility_hash  # type: ignore[union-attr]
    assert mine != theirs
    try:
        (params,) = _prefill(producer, prompts[:1])
        # The producer's hash travels in the params: refused at once (a 400 over HTTP).
        with pytest.raises(ValueError, match=rf"compatibility_hash {theirs}.*this engine's {mine}"):
            consumer.add_request("d", prompts[0], GREEDY, eos_token_ids=(),
                                 kv_transfer_params=params)  # fmt: skip
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_a_hash_mismatch_found_at_handshake_names_both_hashes(
    model: Path, prompts: list[list[int]]
) -> None:
    # Params without the producer's hash (another router, or a vLLM producer): the handshake
    # refuses, naming both hashes and what differs (here: pull against push).
    producer = _engine(model, "producer", transfer_mode="pull")
    consumer = _engine(model, "consumer", transfer_mode="push")
    mine = consumer.connector_identity.compatibility_hash  # type: ignore[union-attr]
    theirs = producer.connector_identity.compatibility_hash  # type: ignore[union-attr]
    try:
        (params,) = _prefill(producer, prompts[:1])
        del params["compatibility_hash"]
        ((tokens, error),) = _decode(consumer, prompts[:1], [params], producer.step)
        assert tokens == [] and error is not None
        assert error.startswith("kv_transfer_failed: handshake:"), error
        assert mine in error and theirs in error and "transfer_mode" in error
    finally:
        consumer.shutdown()
        producer.shutdown()
