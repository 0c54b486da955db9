"""Breakers, retries, fallback, streaming and admission through the real router app over
scripted engines (real HTTP on loopback ports; the behaviour under test is the engines' HTTP
answers, which real engines give only under faults: those are in test_router_e2e.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient, TestServer

from fleetserve.api.router_config import RouterConfig
from fleetserve.router.app import STATE_KEY, create_app
from tests.router.fake_upstream import FakeEngine

Scenario = Callable[[TestClient[Any, Any], dict[str, FakeEngine]], Awaitable[None]]
FAST = {
    "scrape_interval_s": 0.05,
    "breaker_failures": 2,
    "breaker_cooldown_s": 0.4,
    "connect_timeout_s": 0.5,
    "first_byte_timeout_s": 1.0,
    "read_timeout_s": 1.0,
    "prefill_timeout_s": 1.0,
}


def run(
    engines: list[FakeEngine], scenario: Scenario, *, ready: bool = True, **config: Any
) -> None:
    """Start the engines and a router over them, wait until it is ready, run `scenario`."""

    async def main() -> None:
        for engine in engines:
            await engine.start()
        by_role: dict[str, list[str]] = {"prefill": [], "decode": [], "engine": []}
        for engine in engines:
            by_role["engine" if engine.role == "unified" else engine.role].append(engine.url)
        args = {k: tuple(v) for k, v in by_role.items()}
        router = create_app(RouterConfig(discovery="static", **args, **{**FAST, **config}))
        try:
            async with TestClient(TestServer(router, handler_cancellation=True)) as client:
                if ready:
                    await wait_for(lambda: _status(client, "/health"), 200)
                for engine in engines:
                    engine.requests.clear()  # drop the readiness generation
                    engine.raw.clear()
                    engine.completed = engine.aborted = 0
                await scenario(client, {e.name: e for e in engines})
        finally:
            for engine in engines:
                await engine.stop()

    asyncio.run(main())


async def _status(client: TestClient[Any, Any], path: str) -> int:
    return (await client.get(path)).status


async def wait_for(probe: Callable[[], Awaitable[Any]], want: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    got = None
    while time.monotonic() < deadline:
        got = await probe()
        if got == want:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"waited {timeout_s} s for {want!r}, last {got!r}")


async def complete(client: TestClient[Any, Any], **body: Any) -> aiohttp.ClientResponse:
    return await client.post("/v1/completions", json={"model": "m", "prompt": "hello", **body})


def metric(client: TestClient[Any, Any], name: str, **labels: str) -> float:
    state = client.server.app[STATE_KEY]  # type: ignore[union-attr]
    value = state.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def breaker_state(client: TestClient[Any, Any], url: str) -> str:
    return client.server.app[STATE_KEY].fleet.engines[url].breaker.state  # type: ignore[union-attr]


def test_a_burst_of_client_4xx_opens_no_breaker_and_is_passed_on_as_is() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        e["p"].mode = "error400"
        for _ in range(20):
            response = await complete(client)
            assert response.status == 400
            assert (await response.json())["error"]["message"] == "prompt too long"
        assert e["d"].requests == [], "a failed prefill sends no decode leg"
        assert breaker_state(client, e["p"].url) == "closed"
        assert metric(client, "fleetserve:router_ejections_total", target="prefill") == 0
        assert metric(client, "fleetserve:router_retries_total", stage="prefill") == 0
        e["p"].mode = "ok"
        response = await complete(client)
        assert response.status == 200 and e["d"].count("pd") == 1

    run([FakeEngine("p", "prefill"), FakeEngine("d", "decode")], scenario)


def test_prefill_5xx_falls_back_to_decode_only_opens_the_breaker_and_is_probed_back() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        e["p"].mode = "error500"
        for _ in range(6):
            response = await complete(client)
            assert response.status == 200, await response.text()
            assert (await response.json())["kv"] == {}, "decode-only: no kv_transfer_params"
        assert e["p"].count("prefill") == 2, "the breaker opened after 2 failures"
        assert breaker_state(client, e["p"].url) == "open"
        assert metric(client, "fleetserve:router_ejections_total", target="prefill") == 1
        assert metric(client, "fleetserve:router_retries_total", stage="prefill") == 2
        fallback = metric(
            client, "fleetserve:router_decisions_total", kind="decode_only",
            reason="prefill_unavailable",
        )  # fmt: skip
        assert fallback == 6
        e["p"].mode = "ok"
        await asyncio.sleep(0.45)  # the cooldown: half-open, one trial goes through
        response = await complete(client)
        assert (await response.json())["kv"]["remote_engine_id"] == "p"
        assert breaker_state(client, e["p"].url) == "closed"

    run([FakeEngine("p", "prefill"), FakeEngine("d", "decode")], scenario)


def test_a_failed_prefill_is_retried_on_another_prefill_engine() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        e["p1"].mode = "error500"
        for _ in range(6):
            response = await complete(client)
            assert (await response.json())["kv"]["remote_engine_id"] == "p2"
        assert e["d"].count("plain") == 0

    engines = [FakeEngine("p1", "prefill"), FakeEngine("p2", "prefill"), FakeEngine("d", "decode")]
    run(engines, scenario)


def test_a_decode_failure_before_the_first_byte_is_retried_elsewhere() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        e["d1"].mode = "error500"
        for stream in (False, True, False, True):
            response = await complete(client, stream=stream)
            text = await response.text()
            assert response.status == 200 and "d2" in text and "d1" not in text
        assert metric(client, "fleetserve:router_retries_total", stage="decode") >= 1
        assert metric(client, "fleetserve:router_ejections_total", target="decode") == 1

    run([FakeEngine("d1", "decode"), FakeEngine("d2", "decode")], scenario, mode="never")


def test_a_hung_decode_engine_times_out_is_ejected_and_others_serve() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        e["d1"].mode = "hang"
        started = time.monotonic()
        results = await asyncio.gather(*(complete(client) for _ in range(4)))
        assert [r.status for r in results] == [200] * 4
        assert time.monotonic() - started < 4.0
        await wait_for(lambda: asyncio.sleep(0, breaker_state(client, e["d1"].url)), "open")
        e["d1"].mode = "ok"
        await wait_for(lambda: asyncio.sleep(0, breaker_state(client, e["d1"].url)), "half_open")
        seen = {(await (await complete(client)).json())["choices"][0]["text"] for _ in range(6)}
        assert seen == {"from d1", "from d2"}, "the ejected engine came back"

    run([FakeEngine("d1", "decode"), FakeEngine("d2", "decode")], scenario, mode="never")


def test_no_replay_once_the_first_byte_reached_the_client() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        e["d1"].mode = e["d2"].mode = "break"
        response = await complete(client, stream=True)
        text = await response.text()
        events = [x.removeprefix("data: ") for x in text.split("\n\n") if x.strip()]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "not retried" in error["message"]
        texts = [json.loads(x)["choices"][0]["text"] for x in events[:-2]]
        name = texts[0].split("-")[0]
        assert texts == [f"{name}-{i}" for i in range(4)], "each chunk exactly once, one engine"
        assert len(e["d1"].requests) + len(e["d2"].requests) == 1

    engines = [FakeEngine("d1", "decode"), FakeEngine("d2", "decode")]
    run(engines, scenario, mode="never")


def test_a_client_that_leaves_aborts_the_upstream_stream() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        e["d"].chunks, e["d"].chunk_delay_s = 200, 0.02
        response = await complete(client, stream=True)
        await response.content.readuntil(b"\n\n")
        response.close()
        await wait_for(lambda: asyncio.sleep(0, e["d"].aborted), 1)
        assert e["d"].completed == 0
        state = client.server.app[STATE_KEY]  # type: ignore[union-attr]
        await wait_for(lambda: asyncio.sleep(0, state.fleet.engines[e["d"].url].in_flight), 0)
        assert breaker_state(client, e["d"].url) == "closed", "a client leaving is no failure"

    run([FakeEngine("d", "decode")], scenario, mode="never")


def test_429_with_retry_after_when_every_engine_is_saturated() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        e["d"].waiting = 100
        await asyncio.sleep(0.2)  # scraped
        response = await complete(client)
        assert response.status == 429 and response.headers["Retry-After"] == "1"
        assert "saturated" in (await response.json())["error"]["message"]
        e["d"].waiting = 0
        await asyncio.sleep(0.2)
        assert (await complete(client)).status == 200

    run([FakeEngine("d", "decode")], scenario, mode="never")


def test_429_when_the_in_flight_limit_and_the_queue_are_full() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        e["d"].chunks, e["d"].chunk_delay_s = 50, 0.02
        first = await complete(client, stream=True)  # holds the only slot while it streams
        queued = asyncio.create_task(complete(client))
        await asyncio.sleep(0.1)
        assert metric(client, "fleetserve:router_queue_depth") == 1
        refused = await complete(client)
        assert refused.status == 429 and refused.headers["Retry-After"] == "1"
        await first.text()
        assert (await queued).status == 200

    run([FakeEngine("d", "decode")], scenario, mode="never", max_in_flight=1, max_queued=1)


def test_unready_until_a_generation_goes_through_then_ready() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        await asyncio.sleep(0.3)
        response = await client.get("/health")
        assert response.status == 503
        assert "readiness generation got 503" in (await response.json())["error"]["message"]
        e["d"].mode = "ok"
        await wait_for(lambda: _status(client, "/health"), 200)
        assert e["p"].count("prefill") >= 1, "the readiness generation went prefill -> decode"
        assert e["d"].count("pd") >= 1

    engines = [FakeEngine("p", "prefill"), FakeEngine("d", "decode", mode="error500")]
    run(engines, scenario, ready=False)


def test_mismatched_compatibility_hashes_are_not_paired_over_http() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        labels = {"kind": "decode_only", "reason": "no_compatible_prefill"}
        before = metric(client, "fleetserve:router_decisions_total", **labels)
        for _ in range(3):
            assert (await (await complete(client)).json())["kv"] == {}
        assert e["p"].requests == []
        assert metric(client, "fleetserve:router_decisions_total", **labels) == before + 3

    run([FakeEngine("p", "prefill", compat="other"), FakeEngine("d", "decode")], scenario)


def test_bad_requests_get_openai_errors_and_models_come_from_an_engine() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        response = await client.post("/v1/completions", data=b"{nope")
        assert response.status == 400 and "not valid JSON" in (await response.text())
        response = await complete(client, kv_transfer_params={"do_remote_decode": True})
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "kv_transfer_params"
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "m"
        chat = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert chat.status == 200 and e["d"].count("pd") == 1
        text = await (await client.get("/metrics")).text()
        assert 'fleetserve:router_decisions_total{kind="disaggregated",reason="always"}' in text

    run([FakeEngine("p", "prefill"), FakeEngine("d", "decode")], scenario)


def test_colocated_engines_and_prefix_affinity_through_the_app() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        # The fake tokenizes one token per character: 200 characters are 12 full blocks.
        prompts = [f"{k}" * 200 for k in "abcd"]
        first = {}
        for round_ in range(3):
            for prompt in prompts:
                answer = await (await complete(client, prompt=prompt + f" {round_}")).json()
                served = answer["choices"][0]["text"]
                first.setdefault(prompt, served)
                assert served == first[prompt], "a repeated prefix stays on its engine"
        assert len(set(first.values())) == 2, "distinct prefixes spread over both engines"
        assert e["u1"].count("plain") + e["u2"].count("plain") == 12
        assert metric(client, DECISIONS_TOTAL, kind="colocated", reason="unified") >= 12

    run([FakeEngine("u1", "unified"), FakeEngine("u2", "unified")], scenario)


DECISIONS_TOTAL = "fleetserve:router_decisions_total"


def test_a_kv_transfer_failure_before_the_first_token_is_retried_decode_only() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        e["d"].mode = "kv_error"
        for stream in (False, True, False, True):
            response = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "stream": stream})  # fmt: skip
            text = await response.text()
            assert response.status == 200 and "error" not in text, text
            assert "from d" in text or "d-0" in text
        # Two failed P/D legs open the pair's breaker: the rest go decode-only at once.
        assert e["d"].count("pd") == 2 and e["d"].count("plain") == 4
        assert breaker_state(client, e["d"].url) == "closed", "the decode engine is not to blame"
        assert metric(client, "fleetserve:router_ejections_total", target="pair") == 1

    run([FakeEngine("p", "prefill"), FakeEngine("d", "decode")], scenario)


def test_the_body_passes_through_unchanged_except_kv_transfer_params() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        raw = b'{"prompt":  "hi",\n "max_tokens": 3, "x_unknown": {"k": [1, 2.50]}}'
        headers = {"Content-Type": "application/json"}
        response = await client.post("/v1/completions", data=raw, headers=headers)
        assert response.status == 200
        assert e["d"].raw == [raw], "decode-only: the client's bytes exactly"

    run([FakeEngine("d", "decode")], scenario, mode="never")

    async def pd(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        body = {"prompt": "hi", "max_tokens": 3, "x_unknown": {"k": [1, 2.5]}, "stream": True,
                "stream_options": {"include_usage": True}, "min_tokens": 2}  # fmt: skip
        assert (await client.post("/v1/completions", json=body)).status == 200
        prefill, decode = e["p"].requests[0], e["d"].requests[0]
        kept = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        leg = {
            "max_tokens": 1,
            "stream": False,
            "n": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        assert prefill == {**kept, **leg}
        kv = {"remote_engine_id": "p", "remote_block_ids": [1, 2], "do_remote_prefill": True}
        assert decode == {**body, "kv_transfer_params": kv}

    run([FakeEngine("p", "prefill"), FakeEngine("d", "decode")], pd)


def test_a_large_answer_arrives_whole() -> None:
    async def scenario(client: TestClient[Any, Any], e: dict[str, FakeEngine]) -> None:
        e["d"].mode = "big"
        answer = await (await complete(client)).json()
        assert answer["choices"][0]["text"] == "from d" + "x" * 3_000_000
        text = await (await complete(client, stream=True)).text()
        events = [x.removeprefix("data: ") for x in text.split("\n\n") if x.strip()]
        texts = [json.loads(x)["choices"][0]["text"] for x in events[:-1]]
        assert texts == ["d-0" + "x" * 500_000, "d-1", "d-2", "d-3"] and events[-1] == "[DONE]"

    run([FakeEngine("d", "decode")], scenario, mode="never")
