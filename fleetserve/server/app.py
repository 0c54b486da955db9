"""The OpenAI-compatible HTTP server of one engine: `create_app(config) -> web.Application`.

Lifecycle: the app's cleanup context starts the engine client (by default an `AsyncLLM`, which
spawns the EngineCore process where the model loads; tests pass their own `EngineClient`),
starts the periodic stats log, and on shutdown stops both. State lives in typed `web.AppKey`s
on the app (no module globals), so tests can run several apps in one process.

Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize,
/v1/load_lora_adapter, /v1/unload_lora_adapter (`serving_lora`); GET /v1/models (the base
model and its LoRA adapters),
/health (200 only while the engine can serve: its core process and its output task live),
/metrics (Prometheus text), /openapi.json (the schema of every route, generated from the
pydantic protocol models: `fleetserve.openai.openapi`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from fleetserve.engine.async_llm import AsyncLLM
from fleetserve.engine.chat import apply_chat_template
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.dp_async_llm import DPAsyncLLM
from fleetserve.engine.engine_client import DEFAULT_MAX_PENDING_OUTPUTS, EngineClient
from fleetserve.engine.metrics import EngineMetrics
from fleetserve.openai.errors import (
    RequestError,
    error_middleware,
    error_response,
    make_auth_middleware,
    parse_body,
)
from fleetserve.openai.openapi import openapi_schema
from fleetserve.openai.protocol import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    messages_as_dicts,
)
from fleetserve.plugins.loader import process_plugins
from fleetserve.server.serving import OpenAIServing
from fleetserve.server.serving_chat import create_chat_completion
from fleetserve.server.serving_completion import create_completion
from fleetserve.server.serving_lora import LORA_MODELS_KEY, LoRAModels, add_lora_routes

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `create_app` needs besides the engine's own configuration."""

    engine: EngineConfig
    served_model_name: str
    """The `model` name clients send and /v1/models lists."""
    api_key: str | None = None
    """When set, /v1 routes require `Authorization: Bearer <api_key>`."""
    max_waiting_requests: int = 1024
    """Sequences allowed to wait for a batch slot (preempted ones included); beyond it requests
    get 429 + Retry-After (a request with more sequences than this gets 400)."""
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    """Prompts one completions request may batch; more is a 400."""
    max_pending_outputs: int = DEFAULT_MAX_PENDING_OUTPUTS
    """Outputs a request's client may leave unread before the request is aborted."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer (`EngineArgs.skip_tokenizer_init`): token ids in and out only."""
    stats_log_interval_s: float = 10.0
    """Period of the one-line stats log (0 disables it)."""
    startup_timeout_s: float = 600.0
    """How long the engine core may take to load the model."""
    allow_runtime_lora_updating: bool = False
    """Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (`serving_lora`)."""

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        for name in ("max_prompts_per_request", "max_pending_outputs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.stats_log_interval_s < 0:
            raise ValueError(f"stats_log_interval_s must be >= 0, got {self.stats_log_interval_s}")


CONFIG_KEY = web.AppKey("config", ServerConfig)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
ENGINE_KEY = web.AppKey("engine", EngineClient)
SERVING_KEY = web.AppKey("serving", OpenAIServing)


def create_app(config: ServerConfig, engine_client: EngineClient | None = None) -> web.Application:
    """Build the app; the engine starts when the app starts (cleanup_ctx).

    Args:
        engine_client: the engine to serve; None builds an `AsyncLLM` for `config.engine`
            (its metrics in this app's registry). The app starts and shuts down either one.
    """
    middlewares: list[Middleware] = [error_middleware]
    if config.api_key:
        middlewares.append(make_auth_middleware(config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app[CONFIG_KEY] = config
    app[REGISTRY_KEY] = CollectorRegistry()
    app.cleanup_ctx.append(functools.partial(_engine_ctx, engine_client=engine_client))
    app.cleanup_ctx.append(_stats_log_ctx)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/kv_transfer", _kv_transfer)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/v1/plugins", _plugins)
    # NOTE: general plugins run in this process too; server plugins add routes (allowlisted).
    plugins = process_plugins()
    plugins.run_general()
    plugins.apply_server(app)
    app[LORA_MODELS_KEY] = LoRAModels(
        config.served_model_name,
        config.engine.model.model,
        config.engine.model.max_model_len,
        config.engine.lora,
        allow_runtime_updates=config.allow_runtime_lora_updating,
    )
    add_lora_routes(app)
    return app


async def _engine_ctx(
    app: web.Application, *, engine_client: EngineClient | None
) -> AsyncIterator[None]:
    config = app[CONFIG_KEY]
    engine = engine_client
    if engine is None and config.engine.parallel.data_parallel_size > 1:
        engine = DPAsyncLLM(
            config.engine,
            registry=app[REGISTRY_KEY],
            model_name=config.served_model_name,
            max_waiting_requests=config.max_waiting_requests,
            max_pending_outputs=config.max_pending_outputs,
            skip_tokenizer_init=config.skip_tokenizer_init,
        )
    if engine is None:
        metrics = EngineMetrics(
            app[REGISTRY_KEY],
            config.served_model_name,
            kv_transfer=config.engine.kv_transfer is not None,
            spec_decode=config.engine.speculative is not None,
            eplb=config.engine.eplb.enabled,
        )
        engine = AsyncLLM(
            config.engine,
            metrics=metrics,
            registry=app[REGISTRY_KEY],
            max_waiting_requests=config.max_waiting_requests,
            max_pending_outputs=config.max_pending_outputs,
            skip_tokenizer_init=config.skip_tokenizer_init,
        )
    try:
        await engine.start(config.startup_timeout_s)
    except BaseException:
        await engine.shutdown()
        raise
    app[ENGINE_KEY] = engine
    app[SERVING_KEY] = OpenAIServing(
        engine,
        config.served_model_name,
        config.max_prompts_per_request,
        models=app[LORA_MODELS_KEY],
    )
    yield
    await engine.shutdown()


async def _stats_log_ctx(app: web.Application) -> AsyncIterator[None]:
    interval_s = app[CONFIG_KEY].stats_log_interval_s
    if interval_s <= 0:
        yield
        return
    engine = app[ENGINE_KEY]

    async def log_periodically() -> None:
        while True:
            await asyncio.sleep(interval_s)
            stats_logger = engine.stats_logger
            if stats_logger.is_idle:
                stats_logger.last_log_time = time.monotonic()
            else:
                logger.info("%s", stats_logger.make_line())

    task = asyncio.create_task(log_periodically(), name="stats-log")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _completions(request: web.Request) -> web.StreamResponse:
    return await create_completion(request.app[SERVING_KEY], request)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await create_chat_completion(request.app[SERVING_KEY], request)


async def _models(request: web.Request) -> web.Response:
    return _json(ModelList(data=request.app[LORA_MODELS_KEY].cards()).model_dump_json())


async def _plugins(request: web.Request) -> web.Response:
    """The plugins this API server process found: loaded, failed or denied (the engine
    processes load the same general plugins from the same environment)."""
    del request
    records = [r.as_dict() for r in process_plugins().records()]
    return web.json_response({"object": "list", "data": records})


async def _kv_transfer(request: web.Request) -> web.Response:
    """How other engines and routers reach this engine's KV connector (a router that sends
    both legs of a P/D request at once needs the producer's identity before it answers)."""
    connector = request.app[ENGINE_KEY].kv_connector
    if connector is None:
        return error_response(404, "this engine has no KV connector (--kv-transfer-config)")
    return web.json_response(connector)


async def _health(request: web.Request) -> web.Response:
    if request.app[ENGINE_KEY].is_healthy:
        return web.Response(status=200)
    return error_response(503, "the engine cannot serve (its core process or output task is gone)")


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _tokenize(request: web.Request) -> web.Response:
    body = await parse_body(request, TokenizeRequest)
    serving = request.app[SERVING_KEY]
    serving.check_model(body.model)
    tokenizer = serving.require_tokenizer("/tokenize requests", "prompt")
    if (body.prompt is None) == (body.messages is None):
        raise RequestError(400, "exactly one of prompt or messages is required", param="prompt")
    if body.messages is not None:
        try:
            ids = apply_chat_template(
                tokenizer,
                messages_as_dicts(body.messages),
                add_generation_prompt=body.add_generation_prompt,
            )
        except ValueError as exc:
            raise RequestError(400, str(exc), param="messages") from exc
    else:
        ids = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    response = TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids)
    return _json(response.model_dump_json())


async def _detokenize(request: web.Request) -> web.Response:
    body = await parse_body(request, DetokenizeRequest)
    serving = request.app[SERVING_KEY]
    serving.check_model(body.model)
    vocab = serving.engine.config.model.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise RequestError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
    tokenizer = serving.require_tokenizer("/detokenize requests", "tokens")
    text = str(tokenizer.decode(body.tokens))
    return _json(DetokenizeResponse(prompt=text).model_dump_json())


async def _openapi(request: web.Request) -> web.Response:
    config = request.app[CONFIG_KEY]
    model = config.engine.model
    schema = openapi_schema(config.served_model_name, model.max_model_len, model.vocab_size)
    return web.json_response(schema)


def _json(text: str) -> web.Response:
    return web.Response(text=text, content_type="application/json")
