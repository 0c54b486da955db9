"""The server's limits in-process (issue 13): client ids are echoed but never engine keys,
logprobs are capped at 20, `n` at 128 and the prompts of a batch at a server limit, admission
counts sequences (prompts × n, all or nothing), unsupported features (`tools`,
`tool_choice: auto`) and a priority the scheduler would ignore are refused with a 400 naming the
field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from fleetserve.engine.config import EngineConfig
from fleetserve.server.app import ServerConfig, create_app
from tests.server.fake_engine import MODEL_NAME, FakeEngineClient, run_client

MakeApp = Callable[..., web.Application]
CHAT = [{"role": "user", "content": "hi"}]


def _post(app: web.Application, path: str, body: object) -> tuple[int, Any, Any]:
    async def scenario(client: TestClient[Any, Any]) -> tuple[int, Any, Any]:
        response = await client.post(path, json=body)
        return response.status, json.loads(await response.text()), response.headers

    return run_client(app, scenario)


def _assert_400(status: int, data: Any, param: str, *words: str) -> None:
    assert status == 400, data
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for word in words:
        assert word in error["message"], (word, error["message"])


# -- request ids ---------------------------------------------------------------------------


def test_a_client_request_id_is_echoed_but_engine_ids_stay_unique(
    make_app: MakeApp, fake_engine: FakeEngineClient
) -> None:
    fake_engine.step_delay_s = 0.01  # both requests are in flight at once

    async def scenario(client: TestClient[Any, Any]) -> list[Any]:
        async def one() -> Any:
            response = await client.post(
                "/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "same"}
            )
            return response.status, response.headers["X-Request-Id"], await response.json()

        return list(await asyncio.gather(one(), one()))

    results = run_client(make_app(), scenario)
    assert [(status, echoed) for status, echoed, _ in results] == [(200, "same")] * 2
    engine_ids = [c.request_id for c in fake_engine.calls]
    assert len(engine_ids) == 2 and len(set(engine_ids)) == 2, engine_ids
    assert fake_engine.aborted == []  # neither request was aborted by the other


# -- logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1, "echo": True}, "logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1},
         "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
         "top_logprobs"),
    ],
)  # fmt: skip
def test_logprobs_outside_0_to_20_are_refused(
    make_app: MakeApp, fake_engine: FakeEngineClient, path: str, body: Any, param: str
) -> None:
    status, data, _ = _post(make_app(), path, body)
    _assert_400(status, data, param, "20")
    assert fake_engine.calls == []


def test_twenty_logprobs_are_served(make_app: MakeApp, fake_engine: FakeEngineClient) -> None:
    status, _, _ = _post(make_app(), "/v1/completions", {"prompt": "x", "logprobs": 20})
    assert status == 200
    body = {"messages": CHAT, "logprobs": True, "top_logprobs": 20}
    status, _, _ = _post(make_app(), "/v1/chat/completions", body)
    assert status == 200
    assert [c.params.logprobs for c in fake_engine.calls] == [20, 20]


# -- n, prompts, admission by sequences --------------------------------------------------------


@pytest.mark.parametrize("n", [129, 100_000])
def test_n_is_capped_at_128(make_app: MakeApp, fake_engine: FakeEngineClient, n: int) -> None:
    for path, body in [
        ("/v1/completions", {"prompt": "x", "n": n}),
        ("/v1/chat/completions", {"messages": CHAT, "n": n}),
    ]:
        status, data, _ = _post(make_app(), path, body)
        _assert_400(status, data, "n", "128")
        # The validator's own message, once: no pydantic prefix, no second "got".
        assert data["error"]["message"] == f"n: n must be an integer in [1, 128], got {n}"
    assert fake_engine.calls == []


def test_the_prompts_of_a_batch_are_capped_by_the_server(
    engine_config: EngineConfig, fake_engine: FakeEngineClient
) -> None:
    fake_engine.max_waiting_requests = 100
    config = ServerConfig(
        engine=engine_config,
        served_model_name=MODEL_NAME,
        stats_log_interval_s=0,
        max_waiting_requests=100,
        max_prompts_per_request=3,
    )
    app = create_app(config, engine_client=fake_engine)
    status, data, _ = _post(app, "/v1/completions", {"prompt": ["a", "b", "c", "d"]})
    _assert_400(status, data, "prompt", "4 prompts", "3")
    assert fake_engine.calls == []
    app = create_app(config, engine_client=fake_engine)
    status, _, _ = _post(app, "/v1/completions", {"prompt": [[5], [6], [7]]})
    assert status == 200 and len(fake_engine.calls) == 3


def test_the_default_prompt_limit_is_128(make_app: MakeApp) -> None:
    status, data, _ = _post(make_app(), "/v1/completions", {"prompt": [[5]] * 129})
    _assert_400(status, data, "prompt", "128")


def test_admission_counts_sequences_all_or_nothing(
    make_app: MakeApp, fake_engine: FakeEngineClient
) -> None:
    fake_engine.max_waiting_requests = 4
    fake_engine.waiting = 2
    for body in (
        {"prompt": "x", "n": 3},
        {"prompt": ["a", "b", "c"]},
        {"prompt": ["a", "b"], "n": 2},
    ):
        status, data, headers = _post(make_app(), "/v1/completions", body)
        assert status == 429, (body, data)
        assert headers["Retry-After"] == "1" and data["error"]["type"] == "rate_limit_error"
    assert fake_engine.calls == []  # nothing of a refused batch reached the engine
    status, _, _ = _post(make_app(), "/v1/completions", {"prompt": ["a", "b"]})
    assert status == 200 and len(fake_engine.calls) == 2


def test_a_request_larger_than_the_waiting_bound_is_a_400(
    make_app: MakeApp, fake_engine: FakeEngineClient
) -> None:
    """Retrying could never help it, so it is bad input, not overload."""
    fake_engine.max_waiting_requests = 4
    status, data, _ = _post(make_app(), "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2})
    _assert_400(status, data, "n", "6 sequences", "4")
    assert fake_engine.calls == []


# -- unsupported features, priority -------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        # structured output landed (tests/server/test_structured_*.py); these parts did not
        ("/v1/chat/completions", {"tools": [TOOL]}, "tool_choice"),
        ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": "required", "stream": True},
         "stream"),
        ("/v1/chat/completions", {"functions": [TOOL["function"]]}, "functions"),
    ],
)  # fmt: skip
def test_unbuilt_tool_calling_fields_are_refused(
    make_app: MakeApp, fake_engine: FakeEngineClient, path: str, extra: Any, param: str
) -> None:
    body = {"messages": CHAT} if "chat" in path else {"prompt": "x"}
    status, data, _ = _post(make_app(), path, {**body, **extra})
    _assert_400(status, data, param, param, "not supported")
    assert fake_engine.calls == []


def test_neutral_values_of_those_fields_are_accepted(
    make_app: MakeApp, fake_engine: FakeEngineClient
) -> None:
    body = {"messages": CHAT, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}}  # fmt: skip
    status, _, _ = _post(make_app(), "/v1/chat/completions", body)
    assert status == 200


def test_priority_is_refused_under_fcfs(make_app: MakeApp, fake_engine: FakeEngineClient) -> None:
    assert fake_engine.config.scheduler.policy == "fcfs"
    status, data, _ = _post(make_app(), "/v1/completions", {"prompt": "x", "priority": 3})
    _assert_400(status, data, "priority", "--scheduling-policy priority")
    assert _post(make_app(), "/v1/completions", {"prompt": "x", "priority": 0})[0] == 200


def test_priority_reaches_the_engine_under_the_priority_policy(tokenizer: Any) -> None:
    from fleetserve.engine.models.bundled import bundled_model_path

    config = EngineConfig.create(
        str(bundled_model_path()), device="cpu", max_model_len=128, scheduling_policy="priority"
    )
    engine = FakeEngineClient(config, tokenizer)
    server = ServerConfig(engine=config, served_model_name=MODEL_NAME, stats_log_interval_s=0)
    for path, body in [
        ("/v1/completions", {"prompt": "x", "priority": -7}),
        ("/v1/chat/completions", {"messages": CHAT, "priority": 5}),
    ]:
        status, _, _ = _post(create_app(server, engine_client=engine), path, body)
        assert status == 200
    assert [c.priority for c in engine.calls] == [-7, 5]
