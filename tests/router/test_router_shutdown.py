"""A stopping router (SIGTERM in a pod being replaced) cuts no request: it turns unready at
once but serves for its delay (the Service's endpoints drop it meanwhile), then closes its
listener and lets the streams in flight finish within its grace; only past the grace are they
cut. The router is served exactly as `fleetserve router` serves it (`fleetserve.router.serve`),
in front of a scripted engine whose stream takes several seconds."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest

from fleetserve.api.router_config import RouterConfig
from fleetserve.common.ports import free_port
from fleetserve.router.app import create_app
from fleetserve.router.serve import serve
from tests.router.fake_upstream import FakeEngine
from tests.router.test_resilience import FAST

STREAM = {"model": "m", "prompt": "hello", "stream": True}


async def _health(session: aiohttp.ClientSession, base: str) -> int:
    async with session.get(f"{base}/health") as response:
        return response.status


async def _started(engine_chunks: int, chunk_delay_s: float, **config: float) -> tuple[
    FakeEngine, asyncio.Event, asyncio.Task[None], str
]:  # fmt: skip
    engine = await FakeEngine(
        "d", "decode", chunks=engine_chunks, chunk_delay_s=chunk_delay_s
    ).start()
    app = create_app(
        RouterConfig(discovery="static", decode=(engine.url,), mode="never", **{**FAST, **config})
    )
    port, stop = free_port(), asyncio.Event()
    server = asyncio.create_task(serve(app, "127.0.0.1", port, stop))
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 20
        while True:
            try:
                if await _health(session, base) == 200:
                    break
            except aiohttp.ClientConnectionError:
                pass
            assert time.monotonic() < deadline, "the router never became ready"
            await asyncio.sleep(0.05)
    return engine, stop, server, base


def test_a_stopping_router_goes_unready_keeps_serving_then_lets_its_streams_finish() -> None:
    async def main() -> None:
        # A stream of 24 events 0.25 s apart (6 s) against a 1.5 s delay and a 30 s grace.
        engine, stop, server, base = await _started(24, 0.25, shutdown_delay_s=1.5,
                                                    shutdown_grace_s=30.0)  # fmt: skip
        try:
            async with aiohttp.ClientSession() as session:
                stream = await session.post(f"{base}/v1/completions", json=STREAM)
                assert stream.status == 200
                first = await stream.content.readline()
                assert first.startswith(b"data:")
                stop.set()
                await asyncio.sleep(0)
                # Unready at once, but a client that resolved the router a moment ago is served.
                assert await _health(session, base) == 503
                late = await session.post(
                    f"{base}/v1/completions", json={**STREAM, "stream": False}
                )
                assert late.status == 200, await late.text()
                # Then the listener closes while the stream still runs.
                while True:
                    try:
                        await _health(session, base)
                    except aiohttp.ClientConnectionError:
                        break
                    await asyncio.sleep(0.05)
                assert not server.done()
                assert not stream.content.at_eof(), "the stream ended before the listener closed"
                rest = await stream.content.read()
                assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
                assert rest.count(b"data: {") == 23, "events were lost"
            await asyncio.wait_for(server, timeout=10)
        finally:
            stop.set()
            await engine.stop()

    asyncio.run(main())


def test_past_its_grace_a_stopping_router_cuts_what_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        engine, stop, server, base = await _started(200, 0.25, shutdown_delay_s=0.0,
                                                    shutdown_grace_s=1.0)  # fmt: skip
        try:
            async with aiohttp.ClientSession() as session:
                stream = await session.post(f"{base}/v1/completions", json=STREAM)
                await stream.content.readline()
                stop.set()
                await asyncio.wait_for(server, timeout=15)
                try:
                    rest = await stream.content.read()
                except aiohttp.ClientPayloadError:
                    rest = b""
                assert not rest.rstrip().endswith(b"[DONE]")
        finally:
            await engine.stop()

    with caplog.at_level(logging.INFO, logger="fleetserve.router"):
        asyncio.run(main())
    assert "the grace of 1.0 s ran out" in caplog.text
