"""POST /v1/completions in-process over a scripted engine: the response shapes, streamed and
not (n > 1 numbering, batched prompts, echo, logprobs, usage, finish and stop reasons)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from fleetserve.engine.request_output import RequestOutput
from tests.server.fake_engine import (
    MODEL_NAME,
    FakeEngineClient,
    GenerateCall,
    run_client,
    sse_events,
    token_outputs,
    top_entry,
)

MakeApp = Callable[..., web.Application]
TOKENS = [100, 101, 102]


def _post(make_app: MakeApp, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    """POST the body; returns (status, JSON body or SSE events, headers)."""

    async def scenario(client: TestClient[Any, Any]) -> Any:
        response = await client.post("/v1/completions", json=body, headers=headers)
        text = await response.text()
        if body.get("stream") and response.status == 200:
            return response.status, sse_events(text), response.headers
        return response.status, await response.json(), response.headers

    return run_client(make_app(), scenario)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return "".join(str(tokenizer.decode([t])) for t in ids)


def test_full_response_shape_and_usage(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    body = {"prompt": "Hello there", "max_tokens": 3, "return_token_ids": True}
    status, data, _ = _post(make_app, body)
    assert status == 200, data
    prompt_ids = tokenizer.encode("Hello there")
    assert data["object"] == "text_completion" and data["model"] == MODEL_NAME
    assert data["id"].startswith("cmpl-") and isinstance(data["created"], int)
    assert data["choices"] == [
        {
            "index": 0, "text": _decode(tokenizer, TOKENS), "logprobs": None,
            "finish_reason": "length", "stop_reason": None, "prompt_token_ids": prompt_ids,
            "token_ids": TOKENS,
        }
    ]  # fmt: skip
    assert data["usage"] == {
        "prompt_tokens": len(prompt_ids), "completion_tokens": 3,
        "total_tokens": len(prompt_ids) + 3, "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip
    (call,) = fake_engine.calls
    assert (call.request_id, call.prompt, call.prompt_token_ids) == (
        data["id"],
        "Hello there",
        prompt_ids,
    )
    assert call.params.max_tokens == 3 and fake_engine.admissions == [1]


def test_token_ids_are_omitted_unless_asked_and_the_request_id_is_the_clients(
    make_app: MakeApp,
) -> None:
    status, data, headers = _post(
        make_app, {"prompt": [5, 6, 7], "max_tokens": 3}, {"X-Request-Id": "r-1"}
    )
    assert status == 200
    assert data["id"] == "cmpl-r-1" and headers["X-Request-Id"] == "r-1"
    choice = data["choices"][0]
    assert choice["prompt_token_ids"] is None and choice["token_ids"] is None


def test_stream_chunks_then_usage_then_done(make_app: MakeApp, tokenizer: Any) -> None:
    body = {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}}
    status, events, headers = _post(make_app, body)
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert len({e["id"] for e in events}) == 1
    assert all(e["object"] == "text_completion" for e in events)
    content = events[:-1]
    assert [e["choices"][0]["text"] for e in content] == [
        str(tokenizer.decode([t])) for t in TOKENS
    ]
    assert [e["choices"][0]["finish_reason"] for e in content] == [None, None, "length"]
    assert all(e["usage"] is None for e in content)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


def test_stream_without_include_usage_has_no_usage_chunk(make_app: MakeApp) -> None:
    _, events, _ = _post(make_app, {"prompt": "Hi", "stream": True})
    assert len(events) == 3 and all(e["usage"] is None and e["choices"] for e in events)


def test_continuous_usage_counts_up_in_every_chunk(make_app: MakeApp, tokenizer: Any) -> None:
    body = {
        "prompt": "Hi", "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    _, events, _ = _post(make_app, body)
    num_prompt = len(tokenizer.encode("Hi"))
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 3, 3]
    assert all(e["usage"]["prompt_tokens"] == num_prompt for e in events)
    assert all(
        e["usage"]["total_tokens"] == num_prompt + e["usage"]["completion_tokens"] for e in events
    )
    assert events[-1]["choices"] == []


def test_n_choices_are_numbered_and_each_finishes_once(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    def script(call: GenerateCall) -> list[RequestOutput]:
        # Choice 0 finishes first and keeps appearing (empty) while choice 1 runs.
        return token_outputs(call, [[100], [200, 201, 202]], tokenizer)

    fake_engine.script = script
    status, data, _ = _post(make_app, {"prompt": "Hi", "n": 2, "seed": 3})
    assert status == 200
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert [c["text"] for c in data["choices"]] == [
        _decode(tokenizer, [100]),
        _decode(tokenizer, [200, 201, 202]),
    ]
    assert data["usage"]["completion_tokens"] == 4
    assert fake_engine.calls[0].params.n == 2  # one engine request; it fans out itself

    _, events, _ = _post(make_app, {"prompt": "Hi", "n": 2, "stream": True})
    choices = [c for e in events for c in e["choices"]]
    assert sorted(c["index"] for c in choices if c["finish_reason"]) == [0, 1]
    assert [c["index"] for c in choices] == [0, 1, 1, 1]  # no empty chunks for a finished one


def test_batched_prompts_number_choices_prompt_major(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    prompts = ["one", "two words", "three more words"]

    def script(call: GenerateCall) -> list[RequestOutput]:
        prompt_index = prompts.index(call.prompt or "")
        tokens = [[300 + 10 * prompt_index + j, 400] for j in range(call.params.n)]
        return token_outputs(call, tokens, tokenizer, num_cached_tokens=prompt_index)

    fake_engine.script = script
    body = {"prompt": prompts, "n": 2, "return_token_ids": True}
    status, data, _ = _post(make_app, body, {"X-Request-Id": "b"})
    assert status == 200
    assert [c["index"] for c in data["choices"]] == list(range(6))
    for choice in data["choices"]:
        prompt_index, j = divmod(choice["index"], 2)
        assert choice["token_ids"] == [300 + 10 * prompt_index + j, 400]
        assert choice["prompt_token_ids"] == tokenizer.encode(prompts[prompt_index])
    num_prompt = sum(len(tokenizer.encode(p)) for p in prompts)
    assert data["usage"]["prompt_tokens"] == num_prompt
    assert data["usage"]["completion_tokens"] == 12
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 0 + 1 + 2}
    # One fresh engine id per prompt (X-Request-Id only names the response); the batch was
    # admitted as a whole (6 sequences) before any prompt was added.
    ids = [c.request_id for c in fake_engine.calls]
    base = ids[0].removesuffix("-0")
    assert base.startswith("cmpl-") and base != "cmpl-b" and data["id"] == "cmpl-b"
    assert ids == [f"{base}-{i}" for i in range(3)]
    assert [c.admit for c in fake_engine.calls] == [False] * 3
    assert fake_engine.admissions == [6]

    body = {"prompt": prompts, "stream": True, "stream_options": {"include_usage": True}}
    _, events, _ = _post(make_app, body)
    texts = ["", "", ""]
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [_decode(tokenizer, [300 + 10 * p, 400]) for p in range(3)]
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert len({e["id"] for e in events}) == 1


def test_echo_prepends_the_prompt_once(make_app: MakeApp, tokenizer: Any) -> None:
    output_text = _decode(tokenizer, TOKENS)
    _, data, _ = _post(make_app, {"prompt": "Echo me", "echo": True})
    assert data["choices"][0]["text"] == "Echo me" + output_text
    ids = tokenizer.encode("Echo me")
    _, events, _ = _post(make_app, {"prompt": ids, "echo": True, "stream": True})
    texts = [e["choices"][0]["text"] for e in events]
    assert texts[0] == str(tokenizer.decode(ids)) + str(tokenizer.decode([TOKENS[0]]))
    assert "".join(texts) == str(tokenizer.decode(ids)) + output_text


def test_logprobs_shape_and_text_offsets(make_app: MakeApp, tokenizer: Any) -> None:
    tokens = [str(tokenizer.decode([t])) for t in TOKENS]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(3)]
    _, data, _ = _post(make_app, {"prompt": "Hi", "logprobs": 2})
    logprobs = data["choices"][0]["logprobs"]
    assert logprobs["tokens"] == tokens
    assert logprobs["token_logprobs"] == [-0.5] * 3
    assert logprobs["text_offset"] == offsets
    assert logprobs["top_logprobs"] == [
        {str(tokenizer.decode([t])): -0.5, str(tokenizer.decode([t + 1])): -1.5} for t in TOKENS
    ]
    # A stream's offsets run on across its chunks.
    _, events, _ = _post(make_app, {"prompt": "Hi", "logprobs": 1, "stream": True})
    chunks = [e["choices"][0]["logprobs"] for e in events]
    assert [o for c in chunks for o in c["text_offset"]] == offsets
    assert all(len(top) == 1 for c in chunks for top in c["top_logprobs"])


def test_echo_with_logprobs_puts_the_prompts_first(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    prompt_ids = tokenizer.encode("Score this prompt")
    prompt_logprobs = [None, *(top_entry(t, tokenizer, logprob=-2.0) for t in prompt_ids[1:])]

    def script(call: GenerateCall) -> list[RequestOutput]:
        assert call.params.prompt_logprobs == 2
        return token_outputs(call, [[100]], tokenizer, prompt_logprobs=prompt_logprobs)

    fake_engine.script = script
    for stream in (False, True):
        body = {"prompt": prompt_ids, "echo": True, "logprobs": 2, "max_tokens": 1}
        _, data, _ = _post(make_app, {**body, "stream": stream})
        choices = [e["choices"][0] for e in data] if stream else data["choices"]
        tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
        values = [v for c in choices for v in c["logprobs"]["token_logprobs"]]
        tops = [t for c in choices for t in c["logprobs"]["top_logprobs"]]
        assert len(tokens) == len(prompt_ids) + 1
        assert "".join(c["text"] for c in choices) == "".join(tokens)
        assert values[0] is None and tops[0] is None
        assert values[1:-1] == [-2.0] * (len(prompt_ids) - 1) and values[-1] == -0.5
        assert all(len(top) == 2 for top in tops[1:])


@pytest.mark.parametrize(("reason", "stop"), [("stop", "\n"), ("stop", 2), ("length", None)])
def test_finish_and_stop_reasons_reach_the_client(
    make_app: MakeApp,
    fake_engine: FakeEngineClient,
    tokenizer: Any,
    reason: str,
    stop: int | str | None,
) -> None:
    def script(call: GenerateCall) -> list[RequestOutput]:
        return token_outputs(call, [TOKENS], tokenizer, finish_reason=reason, stop_reason=stop)

    fake_engine.script = script
    _, data, _ = _post(make_app, {"prompt": "Hi"})
    assert (data["choices"][0]["finish_reason"], data["choices"][0]["stop_reason"]) == (
        reason,
        stop,
    )
    _, events, _ = _post(make_app, {"prompt": "Hi", "stream": True})
    assert [(e["choices"][0]["finish_reason"], e["choices"][0]["stop_reason"]) for e in events] == [
        (None, None),
        (None, None),
        (reason, stop),
    ]
