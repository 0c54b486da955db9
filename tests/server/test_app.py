"""The app in-process over a scripted engine: its lifecycle, /v1/models, /health, /metrics,
/tokenize and /detokenize, the API key (401) and OpenAI-shaped errors for aiohttp's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from fleetserve.engine.chat import apply_chat_template
from fleetserve.engine.config import EngineConfig
from tests.server.fake_engine import (
    IN_PROCESS_MAX_MODEL_LEN,
    MODEL_NAME,
    FakeEngineClient,
    run_client,
)

MakeApp = Callable[..., web.Application]
API_KEY = "secret"


def test_the_app_starts_and_stops_the_engine_client(
    make_app: MakeApp, fake_engine: FakeEngineClient
) -> None:
    async def scenario(client: TestClient[Any, Any]) -> bool:
        return fake_engine.started and not fake_engine.shut_down

    assert run_client(make_app(), scenario)
    assert fake_engine.shut_down


def test_models_health_and_metrics(
    make_app: MakeApp, fake_engine: FakeEngineClient, engine_config: EngineConfig
) -> None:
    async def scenario(client: TestClient[Any, Any]) -> Any:
        models = await (await client.get("/v1/models")).json()
        healthy = (await client.get("/health")).status
        fake_engine.healthy = False
        sick = await client.get("/health")
        metrics = await client.get("/metrics")
        return models, healthy, sick.status, await sick.json(), metrics.status, metrics.headers

    models, healthy, sick, sick_body, metrics, headers = run_client(make_app(), scenario)
    assert models["object"] == "list"
    (card,) = models["data"]
    assert (card["id"], card["object"], card["owned_by"]) == (MODEL_NAME, "model", "fleetserve")
    assert (card["root"], card["max_model_len"]) == (
        engine_config.model.model,
        IN_PROCESS_MAX_MODEL_LEN,
    )
    assert healthy == 200 and sick == 503
    assert sick_body["error"]["type"] == "service_unavailable"
    assert metrics == 200 and headers["Content-Type"].startswith("text/plain")


def test_api_key_guards_the_v1_routes(make_app: MakeApp) -> None:
    async def scenario(client: TestClient[Any, Any]) -> Any:
        missing = await client.post("/v1/completions", json={"prompt": "x"})
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        right = await client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        health = await client.get("/health")
        return missing.status, await missing.json(), wrong.status, right.status, health.status

    missing, body, wrong, right, health = run_client(make_app(api_key=API_KEY), scenario)
    assert missing == 401 and wrong == 401
    assert body["error"]["type"] == "authentication_error"
    assert body["error"]["code"] == "invalid_api_key"
    assert right == 200 and health == 200


def test_tokenize_and_detokenize(make_app: MakeApp, tokenizer: Any) -> None:
    chat = [{"role": "user", "content": "Hi"}]

    async def scenario(client: TestClient[Any, Any]) -> Any:
        async def post(path: str, body: object) -> Any:
            response = await client.post(path, json=body)
            return response.status, await response.json()

        return [
            await post("/tokenize", {"prompt": "Hello world"}),
            await post("/tokenize", {"messages": chat}),
            await post("/tokenize", {"prompt": "a", "messages": chat}),
            await post("/tokenize", {}),
            await post("/tokenize", {"messages": [{"role": "wizard"}]}),
            await post("/detokenize", {"tokens": tokenizer.encode("Hello world")}),
            await post("/detokenize", {"tokens": [-1]}),
            await post("/detokenize", {"tokens": [1], "model": "other"}),
        ]

    results = run_client(make_app(), scenario)
    ids = tokenizer.encode("Hello world")
    assert results[0] == (
        200,
        {"count": len(ids), "max_model_len": IN_PROCESS_MAX_MODEL_LEN, "tokens": ids},
    )
    chat_ids = apply_chat_template(tokenizer, chat)
    assert results[1][1]["tokens"] == chat_ids
    for status, body in results[2:4]:
        assert status == 400 and body["error"]["param"] == "prompt"
    assert results[4][0] == 400 and results[4][1]["error"]["param"] == "messages"
    assert results[5] == (200, {"prompt": "Hello world"})
    assert results[6][0] == 400 and results[6][1]["error"]["param"] == "tokens"
    assert results[7][0] == 400 and results[7][1]["error"]["param"] == "model"


def test_aiohttp_errors_are_openai_shaped(make_app: MakeApp) -> None:
    async def scenario(client: TestClient[Any, Any]) -> Any:
        missing = await client.get("/v1/nothing")
        wrong_method = await client.get("/v1/completions")
        return missing.status, await missing.json(), wrong_method.status, await wrong_method.json()

    missing, missing_body, wrong, wrong_body = run_client(make_app(), scenario)
    assert missing == 404 and missing_body["error"]["type"] == "not_found_error"
    assert wrong == 405 and wrong_body["error"]["type"] == "invalid_request_error"
