"""Acceptance 5 of issue 16: heterogeneous disaggregation through a real `fleetserve router`.

A prefill `fleetserve serve` with --tensor-parallel-size 2 (the `mp` executor: a worker process
per rank, each moving its own KV heads) feeds a decode engine with TP=1, and the reverse (TP=1
prefill, TP=2 decode); the router's greedy tokens equal the colocated single engine's (TP=1)
exactly, streamed and not, and the decode engine loaded the prompts' KV instead of computing it.
Tiny random Llama with 4 KV heads (2 per rank), float32, the tcp connector in pull mode.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from fleetserve import LLM, SamplingParams
from tests.router.router_process import RouterHandle, complete_tokens, start_router
from tests.server.server_process import ServerHandle, start_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
MAX_MODEL_LEN = 256


def _prompts() -> list[list[int]]:
    rng = random.Random(16)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (7, 40, 70)]


PROMPTS = _prompts()


@dataclass
class Fleet:
    producer: ServerHandle
    consumer: ServerHandle
    router: RouterHandle


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.engine.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("model"), "llama", num_key_value_heads=4))


@pytest.fixture(scope="module")
def colocated(model: str) -> list[list[int]]:
    llm = LLM(model, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _engine_args(role: str, tp: int) -> tuple[str, ...]:
    kv = json.dumps({"connector": "tcp", "role": role, "transfer_mode": "pull"})
    return ("--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", str(tp),
            "--distributed-executor-backend", "mp" if tp > 1 else "uni",
            "--kv-transfer-config", kv)  # fmt: skip


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["prefill-tp2-decode-tp1",
                                                              "prefill-tp1-decode-tp2"])  # fmt: skip
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model: str
) -> Iterator[Fleet]:
    producer_tp, consumer_tp = request.param
    tmp = tmp_path_factory.mktemp(f"prefill-tp{producer_tp}-decode-tp{consumer_tp}")
    (tmp / "p").mkdir()
    (tmp / "d").mkdir()
    producer = start_server(tmp / "p", *_engine_args("producer", producer_tp), model=model,
                            max_model_len=MAX_MODEL_LEN)  # fmt: skip
    consumer = start_server(tmp / "d", *_engine_args("consumer", consumer_tp), model=model,
                            max_model_len=MAX_MODEL_LEN)  # fmt: skip
    p = next(producer)
    try:
        d = next(consumer)
        try:
            router = start_router(tmp / "router.log", "--discovery", "static", "--prefill",
                                  p.base_url, "--decode", d.base_url, "--disaggregation",
                                  "always")  # fmt: skip
            r = next(router)
            try:
                yield Fleet(p, d, r)
            finally:
                router.close()
        finally:
            consumer.close()
    finally:
        producer.close()


def _complete(router: RouterHandle, prompt: list[int], stream: bool) -> list[int]:
    return complete_tokens(router, prompt, stream, MAX_TOKENS)


def test_heterogeneous_tp_through_the_router_gives_the_colocated_tokens(
    fleet: Fleet, colocated: list[list[int]]
) -> None:
    decisions = "fleetserve:router_decisions_total"
    before = fleet.router.metric(decisions, kind="disaggregated", reason="always")
    loaded0 = fleet.consumer.metrics()["fleetserve:kv_tokens_loaded_total"]
    for stream in (False, True):
        for prompt, expected in zip(PROMPTS, colocated, strict=True):
            assert _complete(fleet.router, prompt, stream) == expected, (stream, len(prompt))
    n = 2 * len(PROMPTS)
    assert fleet.router.metric(decisions, kind="disaggregated", reason="always") == before + n
    assert fleet.router.metric("fleetserve:router_retries_total", stage="prefill") == 0
    # The decode engine loaded every full block of each prompt (the second pass hits its own
    # prefix cache for some of them, so at least the first pass's).
    loaded = fleet.consumer.metrics()["fleetserve:kv_tokens_loaded_total"] - loaded0
    assert loaded >= sum(len(p) // 16 * 16 for p in PROMPTS), loaded
