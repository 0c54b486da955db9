"""`AsyncLLM` with a real engine-core process on a tiny random-weight model (issue 13): a fault
in the output task fails /health and every in-flight request (never a silent hang), a reader
that falls behind is aborted with an error and counted, whole-vocabulary logprobs are refused.

Faults are injected by replacing one method of the running engine client; the core process,
the sockets and the HTTP app are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from fleetserve.engine.async_llm import AsyncLLM
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.metrics import EngineMetrics
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.server.app import ENGINE_KEY, ServerConfig, create_app
from tests.engine.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 4096
"""Long enough that a request runs for seconds on the tiny model."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield make_tiny_model(
        tmp_path_factory.mktemp("tiny"), "llama", max_position_embeddings=MAX_MODEL_LEN
    )


@pytest.fixture(scope="module")
def config(tiny_model: Path) -> EngineConfig:
    return EngineConfig.create(str(tiny_model), device="cpu", max_model_len=MAX_MODEL_LEN)


def _long(max_tokens: int = MAX_MODEL_LEN - 16) -> dict[str, Any]:
    return {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}


async def _health(client: TestClient[Any, Any]) -> int:
    return (await client.get("/health")).status


def test_an_output_task_fault_fails_health_and_every_inflight_request(
    config: EngineConfig,
) -> None:
    server_config = ServerConfig(engine=config, served_model_name="tiny", stats_log_interval_s=0)

    async def scenario() -> tuple[float, Any, list[bytes], int]:
        app = create_app(server_config)
        async with TestClient(TestServer(app)) as client:
            engine = app[ENGINE_KEY]
            assert isinstance(engine, AsyncLLM)
            stream = await client.post("/v1/completions", json={**_long(), "stream": True})
            assert stream.status == 200
            await stream.content.readline()  # the stream is under way
            pending = asyncio.create_task(client.post("/v1/completions", json=_long()))
            while engine.stats_logger.last_stats.num_running_reqs < 2:
                await asyncio.sleep(0.01)
            assert await _health(client) == 200

            def broken(*_: Any) -> None:
                raise RuntimeError("injected fault in the metrics")

            engine.metrics.record_scheduler_stats = broken  # type: ignore[method-assign]
            start = time.monotonic()
            while await _health(client) == 200:
                assert time.monotonic() - start < 5, "/health still 200 after 5 s"
                await asyncio.sleep(0.05)
            unhealthy_after = time.monotonic() - start
            response = await asyncio.wait_for(pending, 5)
            body = await response.json()
            rest = await asyncio.wait_for(stream.content.read(), 5)
            status = (await client.post("/v1/completions", json={"prompt": [5]})).status
            return unhealthy_after, (response.status, body), rest.split(b"\n\n"), status

    unhealthy_after, (status, body), rest, later = asyncio.run(scenario())
    assert unhealthy_after < 5
    assert status == 503 and "output" in body["error"]["message"]
    events = [e for e in rest if e.strip()]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][len(b"data: ") :])["error"]
    assert error["code"] == "503" and "injected fault" in error["message"]
    assert later == 503  # and no new request is taken


async def _started(config: EngineConfig, **kwargs: Any) -> tuple[AsyncLLM, CollectorRegistry]:
    registry = CollectorRegistry()
    engine = AsyncLLM(
        config, metrics=EngineMetrics(registry, "tiny"), registry=registry,
        max_waiting_requests=8, **kwargs,
    )  # fmt: skip
    await engine.start(120)
    return engine, registry


def test_a_reader_that_falls_behind_is_aborted_with_an_error(config: EngineConfig) -> None:
    from fleetserve.engine.engine_client import SlowReaderError

    async def scenario() -> tuple[int, BaseException | None, float | None, int]:
        engine, registry = await _started(config, max_pending_outputs=8)
        try:
            params = SamplingParams(max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True)
            stream: AsyncIterator[Any] = engine.generate("slow", [5, 6, 7], params)
            await anext(stream)  # then stop reading while the engine runs on
            deadline = time.monotonic() + 10
            while engine.stats_logger.last_stats.num_running_reqs:
                assert time.monotonic() < deadline, "the slow reader was never aborted"
                await asyncio.sleep(0.02)
            received, error = 0, None
            try:
                async for _ in stream:
                    received += 1
            except SlowReaderError as exc:
                error = exc
            count = registry.get_sample_value(
                "fleetserve:slow_reader_aborts_total", {"model_name": "tiny"}
            )
            # The engine is fine: the next request is served to the end.
            short = [o async for o in engine.generate("next", [5], SamplingParams(max_tokens=3))]
            return received, error, count, sum(len(o.outputs[0].token_ids) for o in short)
        finally:
            await engine.shutdown()

    received, error, count, tokens = asyncio.run(scenario())
    assert received <= 8 and error is not None and "8" in str(error)
    assert count == 1
    assert tokens == 3


def test_whole_vocabulary_logprobs_are_refused(config: EngineConfig) -> None:
    async def scenario() -> list[str]:
        engine, _ = await _started(config)
        errors = []
        try:
            for params in (SamplingParams(logprobs=-1), SamplingParams(prompt_logprobs=-1)):
                with pytest.raises(ValueError) as info:
                    engine.generate("r", [5], params)
                errors.append(str(info.value))
        finally:
            await engine.shutdown()
        return errors

    errors = asyncio.run(scenario())
    assert errors[0].startswith("logprobs") and "20" in errors[0]
    assert errors[1].startswith("prompt_logprobs")
