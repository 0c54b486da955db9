"""An engine that joins during a roll: the moment the operator drains the old decode engine
because the new one is Ready, the router may not have scraped the new one yet (an engine takes
requests only after one successful scrape). The new engine is scraped at once, not at the next
scrape tick, and a request arriving before that scrape answered waits for it (`join_wait_s`,
bounded) instead of failing with "no decode engine is available".

(Found on a loaded 2-core machine: test_roll_k8s.py's stream load got 125 fast 503s in the
0.9 s between the old decode pod's draining label and the router's first scrape of the new one.)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from fleetserve.api.router_config import RouterConfig
from fleetserve.router.app import STATE_KEY
from fleetserve.router.fleet import Endpoint, Fleet
from fleetserve.router.metrics import RouterMetrics
from tests.router.fake_upstream import FakeEngine
from tests.router.test_resilience import complete, run


def _roll(client: TestClient[Any, Any], new: FakeEngine) -> Fleet:
    """What discovery does when the old decode pod is labelled draining after the new one got
    Ready: one update of the decode source, the old engine gone, the new one joined. (A delay
    of `new`'s /metrics must stay under the scrape timeout, FAST's 0.5 s.)"""
    fleet: Fleet = client.server.app[STATE_KEY].fleet  # type: ignore[union-attr]
    fleet.update("static-decode", [Endpoint(new.url, "decode")])
    assert not fleet.usable(fleet.engines[new.url]), "not scraped yet"
    return fleet


def test_a_joining_engine_is_scraped_at_once_not_at_the_next_tick() -> None:
    async def main() -> None:
        old = await FakeEngine("d0", "decode").start()
        new = await FakeEngine("d1", "decode").start()
        # A long interval: only a scrape triggered by the join can make the new engine usable.
        config = RouterConfig(discovery="static", decode=(old.url,), mode="never",
                              scrape_interval_s=30.0)  # fmt: skip
        fleet = Fleet(config, RouterMetrics(CollectorRegistry()))
        fleet.update("static-decode", [Endpoint(old.url, "decode")])
        async with aiohttp.ClientSession() as session:
            scraper = asyncio.create_task(fleet.run_scraper(session))
            try:
                await _until(lambda: fleet.usable(fleet.engines[old.url]), timeout_s=5)
                fleet.update("static-decode", [Endpoint(old.url, "decode"),
                                               Endpoint(new.url, "decode")])  # fmt: skip
                started = time.monotonic()
                await _until(lambda: fleet.usable(fleet.engines[new.url]), timeout_s=5)
                assert time.monotonic() - started < 2.0
            finally:
                scraper.cancel()
                await asyncio.gather(scraper, return_exceptions=True)
                await old.stop()
                await new.stop()

    asyncio.run(main())


def test_a_request_that_finds_only_a_joining_decode_engine_waits_for_its_first_scrape() -> None:
    new = FakeEngine("d1", "decode", metrics_delay_s=0.25)

    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        await new.start()
        try:
            fleet = _roll(client, new)
            started = time.monotonic()
            streamed = await complete(client, stream=True)
            assert streamed.status == 200, await streamed.text()
            assert "d1-0" in await streamed.text()
            plain = await complete(client)
            assert plain.status == 200 and "from d1" in await plain.text()
            # It waited for the scrape (0.25 s), not for the join wait to run out.
            assert 0.2 < time.monotonic() - started < 3.0
            assert new.count("pd") == 2, "the new decode engine paired with the prefill engine"
            assert fleet.usable(fleet.engines[new.url])
        finally:
            await new.stop()

    run([FakeEngine("p", "prefill"), FakeEngine("d0", "decode")], scenario, join_wait_s=5.0)


def test_the_wait_for_a_joining_engine_is_bounded_and_its_503_says_so() -> None:
    new = FakeEngine("d1", "decode", metrics_ok=False)  # never answers a scrape

    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        await new.start()
        try:
            _roll(client, new)
            started = time.monotonic()
            response = await complete(client, stream=True)
            waited = time.monotonic() - started
            assert response.status == 503
            assert response.headers["Retry-After"] == "1"
            message = (await response.json())["error"]["message"]
            assert "no decode engine is available" in message
            assert "no joining decode engine became usable within 0.5 s" in message
            assert 0.45 < waited < 3.0
            assert new.requests == []
        finally:
            await new.stop()

    run([FakeEngine("p", "prefill"), FakeEngine("d0", "decode")], scenario, join_wait_s=0.5)


def test_with_no_engine_joining_or_no_join_wait_the_503_comes_at_once() -> None:
    new = FakeEngine("d1", "decode", metrics_ok=False)

    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        fleet: Fleet = client.server.app[STATE_KEY].fleet  # type: ignore[union-attr]
        fleet.update("static-decode", [])  # every decode engine gone, none joining
        started = time.monotonic()
        response = await complete(client)
        assert response.status == 503 and time.monotonic() - started < 1.0
        assert "none discovered" in (await response.json())["error"]["message"]
        await new.start()
        try:
            _roll(client, new)
            started = time.monotonic()
            response = await complete(client)  # join_wait_s=0: the old behaviour
            assert response.status == 503 and time.monotonic() - started < 1.0
            assert "joining" not in (await response.json())["error"]["message"]
        finally:
            await new.stop()

    run([FakeEngine("p", "prefill"), FakeEngine("d0", "decode")], scenario, join_wait_s=0.0)


async def _until(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_the_router_stays_ready_while_a_decode_engine_joins_but_not_past_the_join_wait() -> None:
    slow = FakeEngine("d1", "decode", metrics_delay_s=0.25)
    broken = FakeEngine("d2", "decode", metrics_ok=False)

    async def health(client: TestClient[Any, Any]) -> int:
        return (await client.get("/health")).status

    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        await slow.start()
        await broken.start()
        try:
            fleet = _roll(client, slow)
            # The readiness loop runs every 0.05 s: it sees the gap many times over.
            while not fleet.usable(fleet.engines[slow.url]):
                assert await health(client) == 200
                await asyncio.sleep(0.02)
            for _ in range(10):  # a few readiness ticks with the new engine serving
                assert await health(client) == 200
                await asyncio.sleep(0.02)
            # An engine that never answers a scrape: unready once the join wait ran out.
            _roll(client, broken)
            started = time.monotonic()
            while await health(client) == 200:
                assert time.monotonic() - started < 3.0, "still ready"
                await asyncio.sleep(0.02)
            assert time.monotonic() - started > 0.7
        finally:
            await slow.stop()
            await broken.stop()

    run([FakeEngine("p", "prefill"), FakeEngine("d0", "decode")], scenario, join_wait_s=0.8)
