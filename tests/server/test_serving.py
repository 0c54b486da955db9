"""The shared pipeline in-process: bad input gets an OpenAI-shaped 400 naming the field,
admission answers 429 with Retry-After, a dead engine 503 (before and during a response), and
every engine request that did not finish is aborted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from fleetserve.engine.engine_client import EngineDeadError
from fleetserve.engine.request_output import RequestOutput
from fleetserve.engine.validation import KVCapacity
from tests.server.fake_engine import (
    FakeEngineClient,
    GenerateCall,
    run_client,
    sse_events,
    token_outputs,
)

MakeApp = Callable[..., web.Application]


def _post(make_app: MakeApp, path: str, body: object) -> Any:
    async def scenario(client: TestClient[Any, Any]) -> Any:
        data = body if isinstance(body, str) else None
        json_body = None if isinstance(body, str) else body
        response = await client.post(path, data=data, json=json_body)
        return response.status, await response.text(), response.headers

    return run_client(make_app(), scenario)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", "{not json", None),
        ("/v1/chat/completions", "[1, 2]", None),
        ("/v1/chat/completions", {"max_tokens": 3}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -2}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 7}, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hello " * 600, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 600}, "max_tokens"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": [10**7]}, "prompt_token_ids"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, "model"),
    ],
)
def test_bad_input_gets_openai_shaped_error(
    make_app: MakeApp,
    fake_engine: FakeEngineClient,
    path: str,
    body: object,
    param: str | None,
) -> None:
    status, text, _ = _post(make_app, path, body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if param is not None:
        assert param in error["message"]
    assert "Traceback" not in text
    assert fake_engine.live == set()  # nothing was left running in the engine


def test_unknown_model_has_openais_code(make_app: MakeApp) -> None:
    _, text, _ = _post(make_app, "/v1/completions", {"prompt": "x", "model": "gpt-9"})
    assert json.loads(text)["error"]["code"] == "model_not_found"


def test_overload_gets_429_with_retry_after(
    make_app: MakeApp, fake_engine: FakeEngineClient
) -> None:
    fake_engine.waiting = fake_engine.max_waiting_requests
    for path, body in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        status, text, headers = _post(make_app, path, body)
        assert status == 429 and headers["Retry-After"] == "1"
        error = json.loads(text)["error"]
        assert error["type"] == "rate_limit_error" and "overloaded" in error["message"]
    assert fake_engine.calls == []


def test_a_batch_is_admitted_once_and_a_refused_prompt_aborts_the_others(
    make_app: MakeApp, fake_engine: FakeEngineClient
) -> None:
    status, text, _ = _post(make_app, "/v1/completions", {"prompt": ["fine", "x " * 200]})
    assert status == 400 and json.loads(text)["error"]["param"] == "prompt"
    # The long prompt fails the length check before anything reaches the engine.
    assert fake_engine.calls == []
    status, text, _ = _post(make_app, "/v1/completions", {"prompt": [[5, 6], [10**7]]})
    assert status == 400 and json.loads(text)["error"]["param"] == "prompt_token_ids"
    assert fake_engine.calls == []  # the front end's own checks run before the engine's
    # Only the engine knows its KV capacity: the second prompt is refused after the first
    # was added, which is then aborted.
    fake_engine.kv_capacity = KVCapacity(num_blocks=3, block_size=16)  # 32 tokens
    status, text, _ = _post(make_app, "/v1/completions", {"prompt": [[5, 6], [7] * 40]})
    assert status == 400 and json.loads(text)["error"]["param"] == "prompt"
    assert "KV cache" in json.loads(text)["error"]["message"]
    assert [c.request_id for c in fake_engine.calls] == [fake_engine.aborted[0]]
    assert fake_engine.live == set()


def test_dead_engine_gets_503(make_app: MakeApp, fake_engine: FakeEngineClient) -> None:
    fake_engine.healthy = False

    async def scenario(client: TestClient[Any, Any]) -> Any:
        response = await client.post("/v1/completions", json={"prompt": "x"})
        health = await client.get("/health")
        return response.status, await response.json(), response.headers, health.status

    status, body, headers, health = run_client(make_app(), scenario)
    assert status == 503 and headers["Retry-After"] == "5"
    assert body["error"]["type"] == "service_unavailable"
    assert "engine core" in body["error"]["message"]
    assert health == 503
    assert body["error"]["code"] == "503"


def _dies_after_one_output(tokenizer: Any) -> Callable[[GenerateCall], list[Any]]:
    def script(call: GenerateCall) -> list[RequestOutput | BaseException]:
        first: list[RequestOutput | BaseException] = list(
            token_outputs(call, [[100, 101, 102]], tokenizer)[:1]
        )
        return [*first, EngineDeadError("the engine core process died")]

    return script


def test_engine_death_mid_response_gets_503(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    fake_engine.script = _dies_after_one_output(tokenizer)
    status, text, headers = _post(make_app, "/v1/completions", {"prompt": "x"})
    assert status == 503 and headers["Retry-After"] == "5"
    assert "died" in json.loads(text)["error"]["message"]


def test_engine_death_mid_stream_ends_it_with_an_error_event(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    fake_engine.script = _dies_after_one_output(tokenizer)
    status, text, _ = _post(make_app, "/v1/completions", {"prompt": "x", "stream": True})
    assert status == 200  # already sent when the engine died
    events = sse_events(text)  # ... and it still ends with [DONE]
    assert events[0]["choices"][0]["text"] == str(tokenizer.decode([100]))
    assert events[-1]["error"]["code"] == "503"
    assert events[-1]["error"]["type"] == "service_unavailable"


def test_one_failed_prompt_fails_a_batch_and_aborts_the_rest(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    def script(call: GenerateCall) -> list[RequestOutput | BaseException]:
        outputs: list[RequestOutput | BaseException] = list(
            token_outputs(call, [[100] * 50], tokenizer)
        )
        if call.request_id.endswith("-1"):
            return [*outputs[:1], EngineDeadError("the engine core process died")]
        return outputs

    fake_engine.script = script
    status, _, _ = _post(make_app, "/v1/completions", {"prompt": ["a", "b"]})
    assert status == 503
    assert fake_engine.live == set()
    assert any(rid.endswith("-0") for rid in fake_engine.aborted)  # the sibling, mid-way


def test_finished_requests_need_no_abort(make_app: MakeApp, fake_engine: FakeEngineClient) -> None:
    assert _post(make_app, "/v1/completions", {"prompt": "x"})[0] == 200
    assert fake_engine.aborted == [] and fake_engine.live == set()


def test_client_disconnect_aborts_the_request(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    def script(call: GenerateCall) -> list[RequestOutput]:
        return token_outputs(call, [list(range(100, 100 + 60))], tokenizer)

    fake_engine.script = script
    fake_engine.step_delay_s = 0.01

    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
        await response.content.readline()  # the stream is under way
        response.close()
        for _ in range(100):
            if fake_engine.aborted:
                return
            await asyncio.sleep(0.01)

    run_client(make_app(), scenario)
    assert [c.request_id for c in fake_engine.calls] == fake_engine.aborted
