"""The router's HTTP app: `create_app(config) -> web.Application`.

Routes: POST /v1/completions and /v1/chat/completions (forwarded, `fleetserve.router.forward`),
GET /v1/models (an engine's list), /health (200 only once one real end-to-end generation went
through the fleet, and while a decode engine is usable or, for `join_wait_s` at most, joining:
requests wait for a joining engine then, `fleetserve.router.forward`), /metrics
(`fleetserve:router_*`).

Lifecycle (cleanup context): one client session, the discovery (static lists now, or a
Kubernetes pod watch), the scraper, and the readiness loop that sends a `max_tokens: 1`
generation through the fleet (disaggregated when prefill engines exist) at start and whenever
the router is unready. State lives in typed `web.AppKey`s (no module globals).

Streams are passed through chunk by chunk as they arrive; once the first byte reached the
client nothing is retried: a broken upstream stream ends with an OpenAI-shaped error event and
`data: [DONE]`. A client that goes away closes the upstream connection, which aborts the
request on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from fleetserve.api.router_config import RouterConfig
from fleetserve.openai.errors import RequestError, error_body, error_middleware, error_response
from fleetserve.router.admission import Admission
from fleetserve.router.discovery import run_discovery
from fleetserve.router.fleet import Fleet
from fleetserve.router.forward import Answer, Forwarder, Stream
from fleetserve.router.metrics import RouterMetrics
from fleetserve.router.policy import DECODE_ROLES, RoutingPolicy, RoutingRequest
from fleetserve.router.prompt import prompt_request

__all__ = ["READY_PROMPT", "STATE_KEY", "RouterState", "create_app"]

logger = logging.getLogger(__name__)

READY_PROMPT = "Hello"
"""The readiness generation's prompt (one token is generated)."""


@dataclass(slots=True)
class RouterState:
    """Everything one router app owns while it runs."""

    config: RouterConfig
    registry: CollectorRegistry
    metrics: RouterMetrics
    fleet: Fleet
    policy: RoutingPolicy
    warmup_policy: RoutingPolicy
    admission: Admission
    forwarder: Forwarder | None = None
    session: aiohttp.ClientSession | None = None
    ready: bool = False
    terminating: bool = False
    """Set when the router is stopping (`fleetserve.router.serve`): unready, still serving."""
    last_ready_error: str = "no generation went through the fleet yet"


STATE_KEY = web.AppKey("router_state", RouterState)


def create_app(config: RouterConfig) -> web.Application:
    """Build the router app; discovery, scraping and readiness start when the app starts."""
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)

    def policy(mode: str) -> RoutingPolicy:
        return RoutingPolicy(
            mode=mode,  # type: ignore[arg-type]
            min_uncached_tokens=config.min_uncached_tokens,
            block_size=config.block_size,
            prefix_aware=config.prefix_aware,
            load_aware=config.load_aware,
            saturation_waiting=config.saturation_waiting,
        )

    state = RouterState(
        config=config,
        registry=registry,
        metrics=metrics,
        fleet=Fleet(config, metrics),
        policy=policy(config.mode),
        warmup_policy=policy("never" if config.mode == "never" else "always"),
        admission=Admission(
            config.max_in_flight, config.max_queued, config.queue_timeout_s, metrics
        ),
    )
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024 * 1024)
    app[STATE_KEY] = state
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE_KEY]
    limit = state.config.max_in_flight + state.config.max_queued + 64
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, ttl_dns_cache=60)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    state.session = session
    state.forwarder = Forwarder(state.config, state.fleet, state.metrics, session)
    tasks = [
        asyncio.create_task(run_discovery(state.config, state.fleet), name="router-discovery"),
        asyncio.create_task(state.fleet.run_scraper(session), name="router-scraper"),
        asyncio.create_task(_readiness_loop(state), name="router-readiness"),
    ]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await session.close()


# -- readiness ------------------------------------------------------------------------------


def _serving(state: RouterState) -> bool:
    return any(
        e.role in DECODE_ROLES and state.fleet.usable(e) for e in state.fleet.engines.values()
    )


async def _readiness_loop(state: RouterState) -> None:
    """Keep `state.ready` true only after one generation went through the fleet end to end,
    and false while no decode engine is usable (then re-check with a new generation), unless
    one is joining and none has been usable for less than `join_wait_s`: requests wait for the
    joining one meanwhile, so a roll's hand-over from the old engine to the new one leaves the
    router ready."""
    loop = asyncio.get_running_loop()
    unserved_since: float | None = None
    while True:
        if state.ready and not _serving(state):
            now = loop.time()
            unserved_since = now if unserved_since is None else unserved_since
            joining = state.fleet.joining(DECODE_ROLES)
            if not joining or now - unserved_since >= state.config.join_wait_s:
                state.ready = False
                state.last_ready_error = "no decode engine is usable"
                logger.warning("router unready: no decode engine is usable")
        else:
            unserved_since = None
        if not state.ready and _serving(state):
            await _check_generation(state)
        await asyncio.sleep(state.config.scrape_interval_s)


async def _check_generation(state: RouterState) -> None:
    assert state.forwarder is not None
    model = next((e.model for e in state.fleet.engines.values() if e.model), None)
    body: dict[str, object] = {"prompt": READY_PROMPT, "max_tokens": 1, "temperature": 0.0}
    if model is not None:
        body["model"] = model
    try:
        answer = await state.forwarder.forward(
            body, "completions", RoutingRequest(), state.warmup_policy, None
        )
    except Exception as exc:  # the readiness check must survive anything and say why
        state.last_ready_error = f"{type(exc).__name__}: {exc}"
        return
    assert isinstance(answer, Answer)
    if answer.status == 200:
        state.ready = True
        logger.info("router ready: a generation went through the fleet")
    else:
        state.last_ready_error = (
            f"the readiness generation got {answer.status}: {answer.body[:300]!r}"
        )
        logger.info("router not ready yet: %s", state.last_ready_error)


# -- handlers -------------------------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "completions")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "chat")


async def _proxy(request: web.Request, route: str) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    try:
        response = await _proxy_inner(request, route, state)
    except RequestError as exc:
        response = exc.to_response()
    state.metrics.requests.labels(route, str(response.status)).inc()
    return response


async def _proxy_inner(request: web.Request, route: str, state: RouterState) -> web.StreamResponse:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if "kv_transfer_params" in body:
        raise RequestError(
            400,
            "kv_transfer_params is set by the router, not by clients",
            param="kv_transfer_params",
        )
    forwarder = state.forwarder
    assert forwarder is not None and state.session is not None
    async with state.admission.slot():
        authorization = request.headers.get("Authorization")
        tokenize_url = _tokenize_url(state) if state.policy.needs_tokens else None
        base = await prompt_request(
            state.session,
            body,
            route,
            tokenize_url=tokenize_url,
            headers=state.fleet.engine_headers(authorization),
            block_size=state.config.block_size,
            needs_tokens=state.policy.needs_tokens,
            timeout_s=state.config.connect_timeout_s,
            adapter=state.fleet.adapter_of(body.get("model")),
        )
        outcome = await forwarder.forward(body, route, base, state.policy, authorization, raw)
        if isinstance(outcome, Answer):
            headers = {"Content-Type": outcome.content_type}
            if outcome.retry_after_s is not None:
                headers["Retry-After"] = str(outcome.retry_after_s)
            return web.Response(status=outcome.status, body=outcome.body, headers=headers)
        return await _pipe(request, outcome)


def _tokenize_url(state: RouterState) -> str | None:
    """The least busy usable decode or unified engine (all serve the same tokenizer)."""
    engines = [
        e for e in state.fleet.engines.values()
        if e.role in DECODE_ROLES and state.fleet.usable(e)
    ]  # fmt: skip
    return min(engines, key=lambda e: e.in_flight).url if engines else None


async def _pipe(request: web.Request, stream: Stream) -> web.StreamResponse:
    """Write the upstream body to the client chunk by chunk (no buffering, no replay)."""
    upstream = stream.upstream
    response = web.StreamResponse(status=upstream.status)
    response.headers["Content-Type"] = upstream.headers.get("Content-Type", "text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    outcome: bool | None = None
    try:
        await response.prepare(request)
        tail = b"\n\n"
        if stream.head:
            await response.write(stream.head)
            tail = stream.head[-2:]
        chunks = upstream.content.iter_any().__aiter__()
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                outcome = True
                break
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcome = False
                logger.warning("upstream stream broke after its first byte: %s", exc)
                message = f"the engine's stream broke ({type(exc).__name__}); it is not retried"
                event = b"" if tail.endswith(b"\n\n") else b"\n\n"
                event += b"data: " + error_body(503, message).encode() + b"\n\ndata: [DONE]\n\n"
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await response.write(event)
                break
            await response.write(chunk)
            tail = (tail + chunk)[-2:]
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write_eof()
    except (ConnectionError, RuntimeError) as exc:  # the client went away
        logger.info("client left a stream: %s", exc)
    finally:
        if outcome is True:
            upstream.release()
        else:
            upstream.close()  # aborts the request on the engine
        stream.finish(outcome)
    return response


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    assert state.session is not None
    url = _tokenize_url(state)
    if url is None:
        return error_response(503, "no engine is available", retry_after_s=1)
    headers = state.fleet.engine_headers(request.headers.get("Authorization"))
    timeout = aiohttp.ClientTimeout(total=state.config.connect_timeout_s * 3)
    try:
        async with state.session.get(f"{url}/v1/models", headers=headers, timeout=timeout) as r:
            data = await r.read()
            return web.Response(status=r.status, body=data, content_type="application/json")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return error_response(503, f"the engine {url} did not list its models: {exc}")


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.terminating:
        return error_response(503, "the router is shutting down", retry_after_s=1)
    if state.ready:
        return web.Response(status=200)
    return error_response(
        503, f"the router is not ready: {state.last_ready_error}", retry_after_s=1
    )


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE_KEY].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
