"""A scripted engine over real HTTP (an aiohttp app on a loopback port) for the router's
breaker, retry and streaming tests, where what matters is the engine's HTTP behaviour: 5xx,
400s, hangs, streams that break. Real engines are in test_router_e2e.py."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fleetserve.common import metric_names as names

COMPAT = "compat-1"


@dataclass
class FakeEngine:
    """`mode`: ok | error500 | error400 | error429 | hang | break (stream `chunks` then drop
    the connection) | kv_error (a P/D decode leg fails as an engine whose KV never arrived: 503,
    or in a stream an error event after the chat role chunk) | big (a 3 MB answer, a 500 kB first
    stream event). `waiting` etc. are what /metrics reports."""

    name: str
    role: str
    compat: str = COMPAT
    mode: str = "ok"
    chunks: int = 4
    chunk_delay_s: float = 0.0
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    metrics_ok: bool = True
    metrics_delay_s: float = 0.0
    """How long /metrics takes to answer (a scrape in flight while a test acts)."""
    adapters: list[str] = field(default_factory=list)
    """LoRA adapters /v1/models lists (with `parent` "m"); tests may change it while serving."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)
    aborted: int = 0
    completed: int = 0
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kv_transfer", self._kv_transfer)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def count(self, kind: str) -> int:
        """Requests seen of a kind: prefill (do_remote_decode), pd (do_remote_prefill), plain."""

        def kind_of(body: dict[str, Any]) -> str:
            kv = body.get("kv_transfer_params") or {}
            if kv.get("do_remote_decode"):
                return "prefill"
            return "pd" if kv.get("do_remote_prefill") else "plain"

        return sum(1 for b in self.requests if kind_of(b) == kind)

    async def _metrics(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.metrics_delay_s)
        if not self.metrics_ok or self.mode == "hang":
            if self.mode == "hang":
                await asyncio.sleep(3600)
            return web.Response(status=500)
        lines = [
            f'{names.NUM_REQUESTS_WAITING.name}{{model_name="m"}} {self.waiting}',
            f'{names.NUM_REQUESTS_RUNNING.name}{{model_name="m"}} {self.running}',
            f'{names.KV_CACHE_USAGE.name}{{model_name="m"}} {self.kv_usage}',
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def _kv_transfer(self, request: web.Request) -> web.Response:
        if self.role == "unified":
            return web.Response(status=404)
        role = "producer" if self.role == "prefill" else "consumer"
        return web.json_response({"role": role, "compatibility_hash": self.compat})

    async def _models(self, request: web.Request) -> web.Response:
        cards = [{"id": "m", "object": "model"}]
        cards += [{"id": a, "object": "model", "parent": "m"} for a in self.adapters]
        return web.json_response({"object": "list", "data": cards})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") or json.dumps(body.get("messages"))
        tokens = [ord(c) for c in text]
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.raw.append(await request.read())
        body = await request.json()
        self.requests.append(body)
        if self.mode == "error500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode == "error400":
            return web.json_response(
                {"error": {"message": "prompt too long", "type": "invalid_request_error",
                           "param": "prompt", "code": "400"}}, status=400,
            )  # fmt: skip
        if self.mode == "error429":
            return web.json_response({"error": {"message": "busy"}}, status=429)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            params = {"remote_engine_id": self.name, "remote_block_ids": [1, 2]}
            return web.json_response({"choices": [{"text": "p"}], "kv_transfer_params": params})
        if self.mode == "kv_error" and kv.get("do_remote_prefill"):
            error = {"message": "kv_transfer_failed: the producer died", "type": "x",
                     "param": None, "code": "kv_transfer_failed"}  # fmt: skip
            if not body.get("stream"):
                return web.json_response({"error": error}, status=503)
            failed = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await failed.prepare(request)
            role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            await failed.write(f"data: {json.dumps(role)}\n\n".encode())
            await failed.write(f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode())
            return failed
        if not body.get("stream"):
            self.completed += 1
            text = f"from {self.name}" + ("x" * 3_000_000 if self.mode == "big" else "")
            return web.json_response({"choices": [{"text": text}], "kv": kv})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(self.chunks):
                big = "x" * 500_000 if self.mode == "big" and i == 0 else ""
                event = {"choices": [{"text": f"{self.name}-{i}{big}"}]}
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
                await asyncio.sleep(self.chunk_delay_s)
            if self.mode == "break":
                assert request.transport is not None
                request.transport.close()  # the engine dies mid-stream
                return response
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionError, asyncio.CancelledError):
            self.aborted += 1
            raise
        self.completed += 1
        return response
