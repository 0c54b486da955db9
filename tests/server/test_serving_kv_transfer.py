"""`kv_transfer_params` through the HTTP layer, in-process: passed to the engine as sent,
checked for shape first (400 naming the field), one prompt and n=1 only, and a producer's
answer returned at the top level of the response (and in a stream's last chunk)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from fleetserve.engine.request_output import RequestOutput
from tests.server.fake_engine import FakeEngineClient, GenerateCall, run_client, token_outputs

MakeApp = Callable[..., web.Application]
ANSWER = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "127.0.0.1",
          "remote_port": 5600, "remote_request_id": "t", "remote_block_ids": [3, 4]}  # fmt: skip


def _post(app: web.Application, body: object, path: str = "/v1/completions") -> tuple[int, Any]:
    async def scenario(client: TestClient[Any, Any]) -> tuple[int, Any]:
        response = await client.post(path, json=body)
        return response.status, await response.text()

    return run_client(app, scenario)


@pytest.fixture
def producer(fake_engine: FakeEngineClient) -> FakeEngineClient:
    def script(call: GenerateCall) -> list[RequestOutput]:
        outputs = token_outputs(call, [[100]], fake_engine.tokenizer)
        outputs[-1] = replace(outputs[-1], kv_transfer_params=ANSWER)
        return outputs

    fake_engine.script = script
    return fake_engine


def test_the_params_reach_the_engine_and_the_answer_comes_back(
    make_app: MakeApp, producer: FakeEngineClient
) -> None:
    params = {"do_remote_decode": True}
    status, text = _post(make_app(), {"prompt": "x", "kv_transfer_params": params})
    assert status == 200, text
    assert json.loads(text)["kv_transfer_params"] == ANSWER
    assert producer.calls[-1].kv_transfer_params == params
    status, text = _post(make_app(), {"messages": [{"role": "user", "content": "x"}],
                                      "kv_transfer_params": params}, "/v1/chat/completions")  # fmt: skip
    assert status == 200 and json.loads(text)["kv_transfer_params"] == ANSWER


def test_a_stream_carries_the_answer_in_its_last_chunk(
    make_app: MakeApp, producer: FakeEngineClient
) -> None:
    body = {"prompt": "x", "stream": True, "kv_transfer_params": {"do_remote_decode": True}}
    status, text = _post(make_app(), body)
    chunks = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert status == 200 and chunks[-1]["kv_transfer_params"] == ANSWER
    assert all(c.get("kv_transfer_params") is None for c in chunks[:-1])


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"prompt": "x", "kv_transfer_params": {"do_remote_decode": "yes"}}, ["do_remote_decode"]),
        ({"prompt": "x", "kv_transfer_params": {"do_remote_decode": True, "x": 1}}, ["unknown"]),
        ({"prompt": ["a", "b"], "kv_transfer_params": {"do_remote_decode": True}}, ["one prompt"]),
        ({"prompt": "x", "n": 2, "kv_transfer_params": {"do_remote_decode": True}}, ["n=1"]),
    ],
)
def test_bad_params_are_a_400_naming_the_field(
    make_app: MakeApp, fake_engine: FakeEngineClient, body: dict[str, Any], words: list[str]
) -> None:
    status, text = _post(make_app(), body)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "kv_transfer_params", text
    assert all(word in error["message"] for word in words), error
    assert fake_engine.calls == []
