"""Errors that reach a response after it started (issue 13): the engine refusing or failing one
request, or anything else going wrong mid-way, is an OpenAI-shaped error for that request: a
JSON error with the right status before the headers, an error event then `data: [DONE]` in a
stream. Never a cut stream, never a normal completion."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from fleetserve.engine.request_output import RequestOutput
from tests.server.fake_engine import FakeEngineClient, GenerateCall, run_client, token_outputs

MakeApp = Callable[..., web.Application]

REJECTED = "request needs 19 KV blocks of 16 tokens but the cache holds 11"
FAILED = "the engine failed this request: RuntimeError: CUDA error: an illegal memory access"


def _post(app: web.Application, body: object) -> tuple[int, str]:
    async def scenario(client: TestClient[Any, Any]) -> tuple[int, str]:
        response = await client.post("/v1/completions", json=body)
        return response.status, await response.text()

    return run_client(app, scenario)


def _fails_after_one_output(tokenizer: Any, error: BaseException) -> Callable[..., Any]:
    def script(call: GenerateCall) -> list[RequestOutput | BaseException]:
        first: list[RequestOutput | BaseException] = list(
            token_outputs(call, [[100, 101, 102]], tokenizer)[:1]
        )
        return [*first, error]

    return script


def _engine_request_error(message: str) -> BaseException:
    from fleetserve.engine.engine_client import EngineRequestError

    return EngineRequestError(message)


CASES = [
    (lambda: ValueError(REJECTED), 400, "invalid_request_error", REJECTED),
    (lambda: _engine_request_error(FAILED), 500, "internal_server_error", FAILED),
    (lambda: KeyError("oops"), 500, "internal_server_error", "internal server error"),
]


@pytest.mark.parametrize(("make_error", "status", "kind", "message"), CASES)
def test_an_error_mid_response_is_an_openai_error(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any,
    make_error: Callable[[], BaseException], status: int, kind: str, message: str,
) -> None:  # fmt: skip
    fake_engine.script = _fails_after_one_output(tokenizer, make_error())
    got, text = _post(make_app(), {"prompt": "x"})
    assert got == status, text
    error = json.loads(text)["error"]
    assert (error["type"], error["code"]) == (kind, str(status))
    assert message in error["message"]
    assert "Traceback" not in text and fake_engine.live == set()


@pytest.mark.parametrize(("make_error", "status", "kind", "message"), CASES)
def test_an_error_mid_stream_is_an_error_event_then_done(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any,
    make_error: Callable[[], BaseException], status: int, kind: str, message: str,
) -> None:  # fmt: skip
    fake_engine.script = _fails_after_one_output(tokenizer, make_error())
    got, text = _post(make_app(), {"prompt": "x", "stream": True})
    assert got == 200  # the headers went out with the first token
    events = [line[len("data: ") :] for line in text.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]", events
    assert json.loads(events[0])["choices"][0]["text"] == str(tokenizer.decode([100]))
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == (kind, str(status))
    assert message in error["message"]
    assert fake_engine.live == set()


def test_a_failed_prompt_of_a_batch_fails_the_batch_with_its_error(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    def script(call: GenerateCall) -> list[RequestOutput | BaseException]:
        outputs: list[RequestOutput | BaseException] = list(
            token_outputs(call, [[100] * 50], tokenizer)
        )
        if call.request_id.endswith("-1"):
            return [*outputs[:1], _engine_request_error(FAILED)]
        return outputs

    fake_engine.script = script
    fake_engine.step_delay_s = 0.001
    status, text = _post(make_app(), {"prompt": ["a", "b"], "stream": True})
    events = [line[len("data: ") :] for line in text.split("\n\n") if line.strip()]
    assert status == 200 and events[-1] == "[DONE]"
    assert FAILED in json.loads(events[-2])["error"]["message"]
    assert fake_engine.live == set()
