"""Through a real `fleetserve router` process in front of real `fleetserve serve` prefill and
decode processes (tiny random model): greedy outputs equal the colocated engine's exactly with
`--disaggregation always` and `selective`, streamed and not, over tcp (pull) and mooncake
(push); the router's and the engines' metrics show which requests were disaggregated."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from fleetserve import LLM, SamplingParams
from tests.router.router_process import RouterHandle, complete_tokens, start_router
from tests.server.server_process import ServerHandle, start_server
from tests.server.test_pd_http import _kv

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
MAX_MODEL_LEN = 256
MIN_UNCACHED = 32
DECISIONS = "fleetserve:router_decisions_total"


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    prefix = [rng.randrange(3, 500) for _ in range(64)]
    return [
        [rng.randrange(3, 500) for _ in range(5)],  # under one block: selective keeps it local
        [rng.randrange(3, 500) for _ in range(70)],  # several blocks and a partial one
        prefix + [rng.randrange(3, 500) for _ in range(12)],  # two sharing 4 blocks
        prefix + [rng.randrange(3, 500) for _ in range(9)],
    ]


PROMPTS = _prompts()


@dataclass
class Fleet:
    producer: ServerHandle
    consumer: ServerHandle
    always: RouterHandle
    selective: RouterHandle
    expected: list[list[int]]
    model: str


@pytest.fixture(scope="module", params=["tcp-pull", "mooncake-push"])
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    from tests.engine.tiny_models import make_tiny_model

    connector, mode = request.param.split("-")
    tmp = tmp_path_factory.mktemp(request.param)
    model = str(make_tiny_model(tmp / "model", "llama"))
    llm = LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    expected = [o.outputs[0].token_ids for o in outputs]
    del llm
    (tmp / "p").mkdir()
    (tmp / "d").mkdir()
    common = ("--dtype", "float32")
    producer = start_server(tmp / "p", *common, "--kv-transfer-config",
                            _kv(connector, "producer", mode), model=model,
                            max_model_len=MAX_MODEL_LEN)  # fmt: skip
    consumer = start_server(tmp / "d", *common, "--kv-transfer-config",
                            _kv(connector, "consumer", mode), model=model,
                            max_model_len=MAX_MODEL_LEN)  # fmt: skip
    p = next(producer)
    try:
        d = next(consumer)
        try:
            engines = ("--discovery", "static", "--prefill", p.base_url, "--decode", d.base_url)
            always = start_router(tmp / "always.log", *engines, "--disaggregation", "always")
            selective = start_router(tmp / "selective.log", *engines, "--disaggregation",
                                     "selective", "--min-uncached-tokens", str(MIN_UNCACHED))  # fmt: skip
            a = next(always)
            try:
                s = next(selective)
                try:
                    yield Fleet(p, d, a, s, expected, Path(model).name)
                finally:
                    selective.close()
            finally:
                always.close()
        finally:
            consumer.close()
    finally:
        producer.close()


def _complete(router: RouterHandle, prompt: Any, stream: bool) -> list[int]:
    return complete_tokens(router, prompt, stream, MAX_TOKENS)


def _engine_counters(f: Fleet) -> tuple[float, float]:
    """(prompt tokens the prefill engine computed, prompt tokens the decode engine loaded)."""
    return (
        f.producer.metrics()["vllm:prompt_tokens_total"],
        f.consumer.metrics()["fleetserve:kv_tokens_loaded_total"],
    )


def test_always_disaggregates_every_request_with_the_colocated_tokens(fleet: Fleet) -> None:
    before = fleet.always.metric(DECISIONS, kind="disaggregated", reason="always")
    prefilled0, loaded0 = _engine_counters(fleet)
    for stream in (False, True):
        for prompt, expected in zip(PROMPTS, fleet.expected, strict=True):
            assert _complete(fleet.always, prompt, stream) == expected, (stream, len(prompt))
    n = 2 * len(PROMPTS)
    assert fleet.always.metric(DECISIONS, kind="disaggregated", reason="always") == before + n
    assert fleet.always.metric("fleetserve:router_retries_total", stage="prefill") == 0
    prefilled, loaded = _engine_counters(fleet)
    # The prefill engine computed every prompt (prefix-cache hits count as prompt tokens too),
    # and the decode engine loaded all but the last token of each from it.
    assert prefilled - prefilled0 == 2 * sum(len(p) for p in PROMPTS)
    assert loaded - loaded0 > 0


def test_selective_prefills_remotely_only_what_the_decode_engine_lacks(fleet: Fleet) -> None:
    r = fleet.selective

    def decisions() -> dict[str, float]:
        return {
            reason: r.metric(DECISIONS, kind=kind, reason=reason)
            for kind, reason in [
                ("disaggregated", "selective"),
                ("decode_only", "short_prompt"),
                ("decode_only", "prefix_cached"),
            ]
        }

    before = decisions()
    prefilled0, _ = _engine_counters(fleet)
    # Text prompts too: the router tokenizes them on an engine and hashes its token ids.
    text = "the router hashes the blocks of this prompt exactly as the engines do " * 3
    expected_text = _complete(fleet.always, text, False)
    hits: list[float] = []
    for stream in (False, True):
        hits.append(fleet.consumer.metrics()["vllm:prefix_cache_hits_total"])
        for prompt, expected in zip(PROMPTS, fleet.expected, strict=True):
            assert _complete(r, prompt, stream) == expected, (stream, len(prompt))
        assert _complete(r, text, stream) == expected_text
    after = decisions()
    # The router's belief is the engine's truth: the second pass, routed decode-only as
    # cached, hit the decode engine's prefix cache for at least the 4 full blocks of each of
    # the three long token prompts.
    second_pass_hits = fleet.consumer.metrics()["vllm:prefix_cache_hits_total"] - hits[1]
    assert second_pass_hits >= 3 * 64, second_pass_hits
    delta = {k: after[k] - before[k] for k in after}
    # First pass: the 5-token prompt is short, the 70-token one and the first shared-prefix
    # one are remote; the second shared-prefix one has 9 + partial-block tokens uncached
    # (64 of 73 cached): local. The text prompt goes remote. Second pass: all cached locally.
    assert delta == {"selective": 3.0, "short_prompt": 2.0, "prefix_cached": 5.0}, delta
    prefilled, _ = _engine_counters(fleet)
    remote = len(PROMPTS[1]) + len(PROMPTS[2])
    assert prefilled - prefilled0 >= remote + 1  # plus the text prompt's tokens (and `always`)


def test_chat_through_the_router_equals_the_decode_engine_alone(fleet: Fleet) -> None:
    body = {"model": fleet.model, "messages": [{"role": "user", "content": "a chat message"}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    direct = requests.post(f"{fleet.consumer.base_url}/v1/chat/completions", json=body,
                           headers=fleet.consumer.headers, timeout=120)  # fmt: skip
    assert direct.status_code == 200, direct.text
    before = fleet.always.metric(DECISIONS, kind="disaggregated", reason="always")
    routed = requests.post(f"{fleet.always.base_url}/v1/chat/completions", json=body, timeout=120)
    assert routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]
    assert fleet.always.metric(DECISIONS, kind="disaggregated", reason="always") == before + 1
    models = requests.get(f"{fleet.always.base_url}/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == fleet.model


def test_a_client_error_from_the_prefill_engine_is_passed_on_and_opens_no_breaker(
    fleet: Fleet,
) -> None:
    too_long = [5] * (MAX_MODEL_LEN + 10)
    for _ in range(8):
        response = requests.post(f"{fleet.always.base_url}/v1/completions",
                                 json={"prompt": too_long, "max_tokens": 2}, timeout=60)  # fmt: skip
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert fleet.always.metric("fleetserve:router_ejections_total", target="prefill") == 0
    assert _complete(fleet.always, PROMPTS[1], False) == fleet.expected[1]


def test_a_colocated_engine_behind_the_router(fleet: Fleet, tmp_path: Path) -> None:
    # The decode engine also serves whole requests (no kv_transfer_params): behind `--engine`
    # it is a colocated engine, and every decision is `colocated`.
    routers = start_router(tmp_path / "colocated.log", "--discovery", "static", "--engine",
                           fleet.consumer.base_url, "--disaggregation", "always")  # fmt: skip
    router = next(routers)
    try:
        before = router.metric(DECISIONS, kind="colocated", reason="unified")
        for stream in (False, True):
            for prompt, expected in zip(PROMPTS, fleet.expected, strict=True):
                assert _complete(router, prompt, stream) == expected
        assert router.metric(DECISIONS, kind="colocated", reason="unified") == before + 8
        assert router.metric(DECISIONS, kind="disaggregated", reason="always") == 0
    finally:
        routers.close()
