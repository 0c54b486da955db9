"""POST /v1/chat/completions in-process over a scripted engine: messages, role and content
deltas, n > 1, chat logprobs, usage, finish and stop reasons, and the context-sized default."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from fleetserve.engine.chat import apply_chat_template
from fleetserve.engine.request_output import RequestOutput
from tests.server.fake_engine import (
    IN_PROCESS_MAX_MODEL_LEN,
    MODEL_NAME,
    FakeEngineClient,
    GenerateCall,
    run_client,
    sse_events,
    token_outputs,
)

MakeApp = Callable[..., web.Application]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = [100, 101, 102]


def _post(make_app: MakeApp, body: dict[str, Any]) -> Any:
    async def scenario(client: TestClient[Any, Any]) -> Any:
        response = await client.post("/v1/chat/completions", json={"messages": CHAT, **body})
        if body.get("stream") and response.status == 200:
            return response.status, sse_events(await response.text())
        return response.status, await response.json()

    return run_client(make_app(), scenario)


def test_full_response_shape_and_default_max_tokens(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    status, data = _post(make_app, {"return_token_ids": True})
    assert status == 200, data
    prompt_ids = apply_chat_template(tokenizer, CHAT)
    text = "".join(str(tokenizer.decode([t])) for t in TOKENS)
    assert data["object"] == "chat.completion" and data["model"] == MODEL_NAME
    assert data["id"].startswith("chatcmpl-")
    assert data["choices"] == [
        {
            "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": "length", "stop_reason": None, "prompt_token_ids": prompt_ids,
            "token_ids": TOKENS,
        }
    ]  # fmt: skip
    assert data["usage"]["prompt_tokens"] == len(prompt_ids)
    assert data["usage"]["completion_tokens"] == 3
    (call,) = fake_engine.calls
    assert call.prompt_token_ids == prompt_ids and call.prompt is None
    # No limit in the body: the context left after the prompt.
    assert call.params.max_tokens == IN_PROCESS_MAX_MODEL_LEN - len(prompt_ids)


def test_max_completion_tokens_wins_over_max_tokens(
    make_app: MakeApp, fake_engine: FakeEngineClient
) -> None:
    _post(make_app, {"max_tokens": 9, "max_completion_tokens": 4})
    assert fake_engine.calls[0].params.max_tokens == 4


def test_stream_opens_with_roles_then_content_then_usage(make_app: MakeApp, tokenizer: Any) -> None:
    body = {"n": 2, "stream": True, "stream_options": {"include_usage": True}}
    status, events = _post(make_app, body)
    assert status == 200
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    roles = [e["choices"][0] for e in events[:2]]
    assert [(c["index"], c["delta"]) for c in roles] == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
    ]
    content = [e["choices"][0] for e in events[2:-1]]
    for index in (0, 1):
        mine = [c for c in content if c["index"] == index]
        assert [c["delta"] for c in mine] == [
            {"role": None, "content": str(tokenizer.decode([t]))} for t in TOKENS
        ]
        assert [c["finish_reason"] for c in mine] == [None, None, "length"]
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 6


def test_stream_role_chunks_carry_the_prompt_ids(make_app: MakeApp, tokenizer: Any) -> None:
    _, events = _post(make_app, {"stream": True, "return_token_ids": True})
    assert events[0]["choices"][0]["prompt_token_ids"] == apply_chat_template(tokenizer, CHAT)
    assert [e["choices"][0]["token_ids"] for e in events[1:]] == [[t] for t in TOKENS]


def test_logprobs_and_top_logprobs_shape(make_app: MakeApp, tokenizer: Any) -> None:
    _, data = _post(make_app, {"logprobs": True, "top_logprobs": 2})
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for token_id, item in zip(TOKENS, content, strict=True):
        token = str(tokenizer.decode([token_id]))
        assert item["token"] == token and item["logprob"] == -0.5
        assert item["bytes"] == list(token.encode())
        assert [(t["token"], t["logprob"]) for t in item["top_logprobs"]] == [
            (token, -0.5),
            (str(tokenizer.decode([token_id + 1])), -1.5),
        ]
        assert all(t["bytes"] == list(t["token"].encode()) for t in item["top_logprobs"])
    _, data = _post(make_app, {"logprobs": True})  # logprobs without alternatives
    assert [item["top_logprobs"] for item in data["choices"][0]["logprobs"]["content"]] == [[]] * 3
    _, events = _post(make_app, {"logprobs": True, "top_logprobs": 1, "stream": True})
    streamed = [e["choices"][0]["logprobs"] for e in events[1:]]
    assert [len(lp["content"]) for lp in streamed] == [1, 1, 1]
    assert all(len(lp["content"][0]["top_logprobs"]) == 1 for lp in streamed)


def test_stop_string_reason(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    def script(call: GenerateCall) -> list[RequestOutput]:
        return token_outputs(call, [TOKENS], tokenizer, finish_reason="stop", stop_reason="Par")

    fake_engine.script = script
    _, data = _post(make_app, {"stop": ["Par"]})
    assert fake_engine.calls[0].params.stop == ["Par"]
    choice = data["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "Par")


def test_bad_chat_fields_get_400_naming_them(make_app: MakeApp) -> None:
    status, data = _post(make_app, {"top_logprobs": 3})
    assert status == 400 and data["error"]["param"] == "top_logprobs"
    status, data = _post(make_app, {"messages": [{"role": "wizard", "content": "x"}]})
    assert status == 400 and data["error"]["param"] == "messages"
    assert "wizard" in data["error"]["message"]
    status, data = _post(make_app, {"messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert status == 400 and data["error"]["param"] == "messages"
