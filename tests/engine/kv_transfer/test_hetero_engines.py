"""KV transfer between tensor-parallel engines: prefill TP=a → decode TP=b gives the colocated
(TP=1) greedy tokens exactly, with only the prompt's last token computed on the decode side.

Real `EngineCore`s with the `mp` executor (one worker process per rank, gloo), each rank with
its own KV cache, control channel and transport (tcp or Mooncake): same TP (rank r pulls from rank r), TP=2 → 1
(the decode rank reads head slices from both producer ranks into one block) and TP=1 → 2 (each
decode rank reads its slice of the producer's blocks). The HTTP test through the router is
tests/router/test_hetero_e2e.py.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.core.outputs import EngineCoreOutput
from fleetserve.engine.sampling_params import SamplingParams
from tests.engine.tiny_models import make_prompts, make_tiny_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
KV = {"connector": "tcp", "transfer_mode": "pull", "transfer_timeout_s": 30.0}


def _engine(model: Path, kv: dict[str, Any] | None, tp: int) -> EngineCore:
    return EngineCore(
        EngineConfig.create(
            str(model), dtype="float32", device="cpu", num_kv_blocks=48,
            tensor_parallel_size=tp, kv_transfer_config=kv,
        )
    )  # fmt: skip


def _run(core: EngineCore, max_steps: int = 2000) -> dict[str, list[EngineCoreOutput]]:
    results: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not core.scheduler.has_unfinished_requests():
            return results
        for output in core.step():
            results.setdefault(output.req_id, []).append(output)
    raise AssertionError("requests did not finish")


def _tokens(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def _prefill_then_decode(
    producer: EngineCore, consumer: EngineCore, prompts: list[list[int]]
) -> dict[str, list[EngineCoreOutput]]:
    """Prefill every prompt on the producer (`p{i}`), then decode it on the consumer (`d{i}`)
    from the producer's KV (`_decode_beside`)."""
    for i, prompt in enumerate(prompts):
        producer.add_request(f"p{i}", prompt, GREEDY, eos_token_ids=(),
                             kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    prefilled = _run(producer)
    for i, prompt in enumerate(prompts):
        (last,) = [o for o in prefilled[f"p{i}"] if o.finished]
        consumer.add_request(f"d{i}", prompt, GREEDY, eos_token_ids=(),
                             kv_transfer_params=last.kv_transfer_params)  # fmt: skip
    return _decode_beside(consumer, producer)


def _decode_beside(consumer: EngineCore, producer: EngineCore) -> dict[str, list[EngineCoreOutput]]:
    """Step the consumer until its requests end, stepping the producer too (it serves the
    reads and frees its blocks when told); the consumer's outputs by request id."""
    results: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(4000):
        if not consumer.scheduler.has_unfinished_requests():
            break
        for output in consumer.step():
            results.setdefault(output.req_id, []).append(output)
        producer.step()
    return results


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 KV heads: 2 per rank at TP=2, so a TP=1 block is two ranks' halves.
    return make_tiny_model(tmp_path_factory.mktemp("hetero"), "llama", num_key_value_heads=4)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(512, [5, 33, 47], seed=7)


@pytest.fixture(scope="module")
def colocated(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return _colocated(model, prompts)


@pytest.fixture(
    params=[
        ("tcp", 2, 2),
        ("tcp", 2, 1),
        ("tcp", 1, 2),
        ("mooncake", 2, 2),
        ("mooncake", 2, 1),
        ("mooncake", 1, 2),
    ],
    ids=lambda p: f"{p[0]}-tp{p[1]}-to-tp{p[2]}",
)
def pair(request: pytest.FixtureRequest, model: Path) -> Iterator[tuple[EngineCore, EngineCore]]:
    connector, producer_tp, consumer_tp = request.param
    kv = {**KV, "connector": connector}
    producer = _engine(model, {**kv, "role": "producer"}, producer_tp)
    try:
        consumer = _engine(model, {**kv, "role": "consumer"}, consumer_tp)
    except BaseException:
        producer.shutdown()
        raise
    try:
        yield producer, consumer
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_prefill_then_decode_across_tp_sizes_gives_the_colocated_tokens(
    pair: tuple[EngineCore, EngineCore], prompts: list[list[int]], colocated: list[list[int]]
) -> None:
    producer, consumer = pair
    results = _prefill_then_decode(producer, consumer, prompts)
    for i, prompt in enumerate(prompts):
        outputs = results[f"d{i}"]
        assert outputs[-1].error is None, outputs[-1].error
        assert _tokens(outputs) == colocated[i], i
        # Only the last prompt token was computed here: the rest came from the producer.
        assert outputs[0].num_cached_tokens == len(prompt) - 1, (i, outputs[0].num_cached_tokens)
    assert consumer.scheduler.remote_kv.num_failed_loads == 0
    for _ in range(400):  # the producer frees every held block once the consumer is done
        if not producer.scheduler.remote_kv.held:
            break
        producer.step()
    assert not producer.scheduler.remote_kv.held
    assert producer.make_stats().kv_cache_usage == 0.0


def test_a_load_every_rank_fails_is_reported_once_and_recomputed(
    model: Path, prompts: list[list[int]], colocated: list[list[int]]
) -> None:
    # The producer's leases expire before the TP=2 consumer asks: each consumer rank's check
    # fails, the ranks' votes agree, and the driver reports each load once as failed; under
    # `recompute` the blocks are recomputed and the tokens are still the colocated ones.
    producer = _engine(model, {**KV, "role": "producer", "lease_seconds": 0.5}, tp=1)
    consumer = _engine(model, {**KV, "role": "consumer", "load_failure_policy": "recompute"}, 2)
    try:
        for i, prompt in enumerate(prompts):
            producer.add_request(f"p{i}", prompt, GREEDY, eos_token_ids=(),
                                 kv_transfer_params={"do_remote_decode": True})  # fmt: skip
        prefilled = _run(producer)
        for _ in range(2000):  # nobody heartbeats: the reaper frees every held block
            if not producer.scheduler.remote_kv.held:
                break
            producer.step()
            time.sleep(0.005)
        assert not producer.scheduler.remote_kv.held
        for i, prompt in enumerate(prompts):
            (last,) = [o for o in prefilled[f"p{i}"] if o.finished]
            consumer.add_request(f"d{i}", prompt, GREEDY, eos_token_ids=(),
                                 kv_transfer_params=last.kv_transfer_params)  # fmt: skip
        results = _decode_beside(consumer, producer)
        for i in range(len(prompts)):
            outputs = results[f"d{i}"]
            assert outputs[-1].error is None, outputs[-1].error
            assert _tokens(outputs) == colocated[i], i
        assert consumer.scheduler.remote_kv.num_failed_loads == len(prompts)
        assert consumer.make_stats().kv_cache_usage == 0.0
    finally:
        consumer.shutdown()
        producer.shutdown()


def _colocated(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    core = _engine(model, None, tp=1)
    try:
        for i, prompt in enumerate(prompts):
            core.add_request(f"r{i}", prompt, GREEDY, eos_token_ids=())
        results = _run(core)
    finally:
        core.shutdown()
    return [_tokens(results[f"r{i}"]) for i in range(len(prompts))]


@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(2, 1), (1, 2)])
def test_replicated_kv_heads_map_between_tp_sizes(
    producer_tp: int, consumer_tp: int, tmp_path: Path, prompts: list[list[int]]
) -> None:
    # One KV head: at TP=2 both ranks hold (a replica of) it, so each consumer rank reads it
    # whole from the lowest producer rank that holds it.
    model = make_tiny_model(tmp_path, "llama", num_key_value_heads=1)
    expected = _colocated(model, prompts)
    producer = _engine(model, {**KV, "role": "producer"}, producer_tp)
    consumer = _engine(model, {**KV, "role": "consumer"}, consumer_tp)
    try:
        results = _prefill_then_decode(producer, consumer, prompts)
        for i, prompt in enumerate(prompts):
            outputs = results[f"d{i}"]
            assert outputs[-1].error is None, outputs[-1].error
            assert _tokens(outputs) == expected[i], i
            assert outputs[0].num_cached_tokens == len(prompt) - 1
        assert consumer.scheduler.remote_kv.num_failed_loads == 0
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_a_load_one_rank_fails_is_reported_only_once_that_rank_stopped(
    model: Path, prompts: list[list[int]], colocated: list[list[int]]
) -> None:
    # TP=2 -> TP=2 with the producer's rank 1 frozen (SIGSTOP): consumer rank 0 pulls its heads
    # from producer rank 0, but rank 1's pull cannot start. The driver must not report the load
    # until rank 1's transfer has failed and stopped (its vote names it), and under `fail` the
    # request ends with that error instead of decoding with half its heads missing. Once the
    # rank runs again, the next request hands over and decodes exactly.
    producer = _engine(model, {**KV, "role": "producer"}, 2)
    consumer = _engine(
        model, {**KV, "role": "consumer", "transfer_timeout_s": 3.0, "handshake_timeout_s": 2.0}, 2
    )
    frozen = producer.executor.worker_pids[1]  # type: ignore[attr-defined]
    try:
        params = []
        for i, prompt in enumerate(prompts[:2]):
            producer.add_request(f"p{i}", prompt, GREEDY, eos_token_ids=(),
                                 kv_transfer_params={"do_remote_decode": True})  # fmt: skip
        prefilled = _run(producer)
        for i in range(2):
            (last,) = [o for o in prefilled[f"p{i}"] if o.finished]
            params.append(last.kv_transfer_params)
        os.kill(frozen, signal.SIGSTOP)
        try:
            # The producer is not stepped while frozen (its rank 0 still serves the control
            # channel and its blocks from background threads).
            consumer.add_request("d0", prompts[0], GREEDY, eos_token_ids=(),
                                 kv_transfer_params=params[0])  # fmt: skip
            results = _run(consumer)
        finally:
            os.kill(frozen, signal.SIGCONT)
        (error,) = [o.error for o in results["d0"] if o.error is not None]
        assert "kv_transfer_failed" in error and "rank 1:" in error, error
        consumer.add_request("d1", prompts[1], GREEDY, eos_token_ids=(),
                             kv_transfer_params=params[1])  # fmt: skip
        results = _decode_beside(consumer, producer)
        assert results["d1"][-1].error is None, results["d1"][-1].error
        assert _tokens(results["d1"]) == colocated[1]
        assert results["d1"][0].num_cached_tokens == len(prompts[1]) - 1
    finally:
        consumer.shutdown()
        producer.shutdown()
