"""Adapter affinity: a request for a LoRA adapter goes to the engines that list it on
/v1/models, and its prompt hashes as the engine hashes it (the adapter's name in the key)."""

from __future__ import annotations

from fleetserve.common.block_hash import hash_token_blocks
from fleetserve.router.policy import EngineLoad, EngineSnapshot, RoutingPolicy, RoutingRequest
from fleetserve.router.prefix_cache import ApproxPrefixCache

BLOCK = 16
H = "compat-a"
PROMPT = list(range(100, 164))


def engine(url: str, role: str = "decode", *adapters: str, waiting: float = 0) -> EngineSnapshot:
    return EngineSnapshot(
        url,
        role,
        H,
        load=EngineLoad(waiting=waiting),
        adapters=frozenset(adapters),  # type: ignore[arg-type]
    )


def policy() -> RoutingPolicy:
    return RoutingPolicy(mode="always", min_uncached_tokens=0, block_size=BLOCK)


def request(adapter: str | None) -> RoutingRequest:
    hashes = hash_token_blocks(PROMPT, BLOCK, lora_name=adapter)
    return RoutingRequest(hashes, len(PROMPT), adapter=adapter)


def test_an_adapters_requests_go_only_to_engines_that_list_it_even_when_busier() -> None:
    # d0 is idle but has no such adapter; d1 lists it and has a queue.
    engines = [engine("http://d0:1"), engine("http://d1:1", "decode", "sql", waiting=20)]
    routing, cache = policy(), ApproxPrefixCache(100)
    for _ in range(6):
        assert routing.decide(engines, request("sql"), cache).decode_url == "http://d1:1"


def test_base_model_requests_use_every_engine() -> None:
    engines = [engine("http://d0:1"), engine("http://d1:1", "decode", "sql")]
    routing, cache = policy(), ApproxPrefixCache(100)
    seen = {routing.decide(engines, request(None), cache).decode_url for _ in range(6)}
    assert seen == {"http://d0:1", "http://d1:1"}


def test_an_adapter_no_engine_lists_still_reaches_an_engine_which_answers_the_400() -> None:
    engines = [engine("http://d0:1")]
    assert policy().decide(engines, request("nope"), ApproxPrefixCache(100)).decode_url == (
        "http://d0:1"
    )


def test_the_prefill_leg_needs_the_adapter_too() -> None:
    routing, cache = policy(), ApproxPrefixCache(100)
    without = [engine("http://d:1", "decode", "sql"), engine("http://p:1", "prefill")]
    decision = routing.decide(without, request("sql"), cache)
    assert (decision.kind, decision.reason) == ("decode_only", "no_prefill_with_adapter")
    with_it = [*without, engine("http://p2:1", "prefill", "sql")]
    decision = routing.decide(with_it, request("sql"), cache)
    assert (decision.prefill_url, decision.kind) == ("http://p2:1", "disaggregated")


def test_an_adapters_prompt_hashes_apart_from_the_base_models_and_gathers_on_its_engine() -> None:
    engines = [engine(f"http://d{i}:1", "decode", "sql") for i in range(3)]
    routing, cache = policy(), ApproxPrefixCache(100)
    first = routing.decide(engines, request("sql"), cache).decode_url
    cache.record(first, request("sql").block_hashes)
    assert cache.match(first, request(None).block_hashes) == 0, "the base model's blocks differ"
    for _ in range(4):
        assert routing.decide(engines, request("sql"), cache).decode_url == first


def test_the_router_learns_adapters_from_v1_models_and_follows_loads_at_run_time() -> None:
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from fleetserve.api.router_config import RouterConfig
    from fleetserve.router.app import create_app
    from tests.router.fake_upstream import FakeEngine

    engines = [FakeEngine("d0", "unified"), FakeEngine("d1", "unified", adapters=["sql"])]

    def served(engine: FakeEngine, model: str) -> int:
        return sum(1 for body in engine.requests if body.get("model") == model)

    async def main() -> None:
        for e in engines:
            await e.start()
        config = RouterConfig(
            discovery="static", engine=tuple(e.url for e in engines), scrape_interval_s=0.05
        )
        try:
            async with TestClient(TestServer(create_app(config))) as client:
                for _ in range(200):
                    if (await client.get("/health")).status == 200:
                        break
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.2)  # a scrape of /v1/models after readiness
                for _ in range(4):
                    body = {"model": "sql", "prompt": "hello", "max_tokens": 2}
                    assert (await client.post("/v1/completions", json=body)).status == 200
                # NOTE: counted by model: the readiness probe's generations go to both.
                assert (served(engines[0], "sql"), served(engines[1], "sql")) == (0, 4)
                engines[0].adapters.append("chat")  # loaded on d0 at run time
                await asyncio.sleep(0.3)
                for _ in range(3):
                    body = {"model": "chat", "prompt": "hello", "max_tokens": 2}
                    assert (await client.post("/v1/completions", json=body)).status == 200
                assert served(engines[0], "chat") == 3
        finally:
            for e in engines:
                await e.stop()

    asyncio.run(main())
