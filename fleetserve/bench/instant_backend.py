"""An OpenAI engine that answers at once: the backend of `fleetserve bench router`.

`python -m fleetserve.bench.instant_backend --port N` serves `/v1/completions` and
`/v1/chat/completions` (streamed or not, `--tokens` tokens per answer, `max_tokens` permitting),
`/v1/models`, `/health` and an idle `/metrics` in vLLM's names, with no model behind them, so that
what a client measures through a router is the router's own cost. A body carrying
`kv_transfer_params` is answered as a P/D engine would: `do_remote_decode` (the prefill leg) gets
one token and the parameters a decode engine would need; `do_remote_prefill` is served as usual.
Unknown paths answer 404 and are counted (`GET /stats`), so a router that expects another endpoint
shows up in the bench's output instead of silently measuring errors.

Imports only aiohttp and the standard library (it must start in a fraction of a second).
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from collections import Counter
from typing import Any

from aiohttp import web

__all__ = ["create_app", "main"]

_METRICS = (
    '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="%s"} 0\n'
    '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="%s"} 0\n'
    '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="%s"} 0.0\n'
)
_MAX_STATS_PATHS = 64
"""Distinct unknown paths remembered (a client probing many paths cannot grow the table)."""


def create_app(model: str, tokens: int, engine_id: str) -> web.Application:
    stats: Counter[str] = Counter()
    unknown: Counter[str] = Counter()

    def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def generate(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        stats["chat" if chat else "completions"] += 1
        kv = body.get("kv_transfer_params")
        wanted = body.get("max_tokens")
        n = min(tokens, wanted) if isinstance(wanted, int) and wanted >= 1 else tokens
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            n = 1
        created = int(time.time())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{stats.total()}"
        kind = "chat.completion" if chat else "text_completion"
        out_kv = None
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            stats["remote_decode"] += 1
            out_kv = {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": engine_id, "remote_host": request.host.split(":")[0],
                      "remote_port": 0, "remote_block_ids": [1], "remote_request_id": rid}  # fmt: skip
        elif isinstance(kv, dict) and kv.get("do_remote_prefill"):
            stats["remote_prefill"] += 1
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": " tok" * n}
            else:
                choice["text"] = " tok" * n
            answer: dict[str, Any] = {"id": rid, "object": kind, "created": created,
                                      "model": model, "choices": [choice], "usage": _usage(8, n)}  # fmt: skip
            if out_kv is not None:
                answer["kv_transfer_params"] = out_kv
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        for i in range(n):
            if chat:
                delta = {"content": " tok"} if i else {"role": "assistant", "content": " tok"}
                part: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
            else:
                part = {"index": 0, "text": " tok", "finish_reason": None}
            if i == n - 1:
                part["finish_reason"] = "length"
            event = {"id": rid, "object": chunk_kind, "created": created, "model": model,
                     "choices": [part]}  # fmt: skip
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        usage = {"id": rid, "object": chunk_kind, "created": created, "model": model,
                 "choices": [], "usage": _usage(8, n)}  # fmt: skip
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    async def tokenize(request: web.Request) -> web.Response:
        # vLLM's /tokenize answer shape; one token per word of the prompt (or of each message).
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not JSON")
        stats["tokenize"] += 1
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        text = body.get("prompt")
        if not isinstance(text, str):
            text = " ".join(
                str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict)
            )
        ids = [zlib.crc32(w.encode()) % 32000 for w in text.split()]
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    async def kv_transfer(_: web.Request) -> web.Response:
        # The identity a P/D router pairs engines by: both KV roles, one hash for every backend.
        return web.json_response(
            {"engine_id": engine_id, "role": "both", "host": "127.0.0.1", "port": 0,
             "compatibility_hash": "instant-backend"}
        )  # fmt: skip

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "bench"}]}
        )

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=_METRICS % (model, model, model), content_type="text/plain")

    async def get_stats(_: web.Request) -> web.Response:
        return web.json_response({"served": dict(stats), "unknown": dict(unknown)})

    async def not_found(request: web.Request) -> web.Response:
        key = f"{request.method} {request.path}"
        if key in unknown or len(unknown) < _MAX_STATS_PATHS:
            unknown[key] += 1
        return _error(404, f"no route {key}")

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/kv_transfer", kv_transfer)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", get_stats)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "param": None,
                   "code": status}}, status=status,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetserve.bench.instant_backend")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="instant")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer (max)")
    parser.add_argument("--engine-id", default="instant-0")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error("--tokens must be >= 1")
    app = create_app(args.model, args.tokens, args.engine_id)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
