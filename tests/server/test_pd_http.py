"""Prefill-then-decode across two real `fleetserve serve` processes over HTTP, with vLLM's
`kv_transfer_params` protocol: the bundled SmolLM2 gives exactly the colocated engine's greedy
tokens for both connectors and both transfer modes, the decode engine computes only the last
prompt token, and the metrics show the transfers. (Tiny models are covered in-process by
tests/engine/kv_transfer; faults against real processes are in test_pd_http_faults.py.)"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from fleetserve import LLM, SamplingParams
from tests.server.server_process import MAX_MODEL_LEN, ServerHandle, start_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. It should rhyme and have four lines, and it should "
    "mention the moon, the wind and a boat that sails at night under the stars.",
    "List three colours: red, green,",
    # Two prompts sharing a long prefix (the second hits the decode engine's prefix cache).
    "You are a helpful assistant that answers questions about geography in one short "
    "sentence. Question: what is the largest ocean?",
    "You are a helpful assistant that answers questions about geography in one short "
    "sentence. Question: what is the longest river in Africa?",
]


def _kv(connector: str, role: str, mode: str, **extra: Any) -> str:
    return json.dumps({"connector": connector, "role": role, "transfer_mode": mode, **extra})


def _pd_pair(
    tmp_path: Path,
    connector: str,
    mode: str,
    *extra: str,
    model: str | None = None,
    max_model_len: int = MAX_MODEL_LEN,
) -> Iterator[tuple[ServerHandle, ServerHandle]]:
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    producer = start_server(tmp_path / "p", "--dtype", "float32", "--kv-transfer-config",
                            _kv(connector, "producer", mode), *extra, model=model,
                            max_model_len=max_model_len)  # fmt: skip
    consumer = start_server(tmp_path / "d", "--dtype", "float32", "--kv-transfer-config",
                            _kv(connector, "consumer", mode), *extra, model=model,
                            max_model_len=max_model_len)  # fmt: skip
    p = next(producer)
    try:
        d = next(consumer)
        try:
            yield p, d
        finally:
            consumer.close()
    finally:
        producer.close()


def completion(server: ServerHandle, prompt: str, **body: Any) -> dict[str, Any]:
    response = requests.post(
        f"{server.base_url}/v1/completions",
        headers=server.headers,
        json={
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
            **body,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


@pytest.fixture(scope="module")
def colocated() -> list[list[int]]:
    from fleetserve.engine.models.bundled import bundled_model_path

    llm = LLM(str(bundled_model_path()), dtype="float32", max_model_len=512)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=["tcp-pull", "tcp-push", "mooncake-pull", "mooncake-push"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerHandle, ServerHandle]]:
    connector, mode = request.param.split("-")
    yield from _pd_pair(tmp_path_factory.mktemp(request.param), connector, mode)


def test_prefill_then_decode_over_http_gives_the_colocated_tokens(
    pair: tuple[ServerHandle, ServerHandle], colocated: list[list[int]]
) -> None:
    producer, consumer = pair
    for prompt, expected in zip(PROMPTS, colocated, strict=True):
        prefill = completion(producer, prompt, kv_transfer_params={"do_remote_decode": True})
        assert len(prefill["choices"][0]["token_ids"]) == 1, "the prefill leg makes one token"
        params = prefill["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_block_ids"]
        decode = completion(consumer, prompt, kv_transfer_params=params)
        assert decode["choices"][0]["token_ids"] == expected, prompt
        # The decode engine computed only the last prompt token: the rest was loaded (or, for
        # the shared-prefix prompt, partly hit locally).
        usage = decode["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        assert decode.get("kv_transfer_params") is None
    loaded = consumer.metrics()["fleetserve:kv_tokens_loaded_total"]
    assert loaded > 0
    assert consumer.metrics()["fleetserve:kv_handshakes_total"] == 1  # one per producer
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the producer frees every block once its consumer is done
        metrics = producer.metrics()
        if (
            metrics["vllm:kv_cache_usage_perc"] == 0.0
            and metrics["fleetserve:kv_active_leases"] == 0
        ):
            break
        time.sleep(0.2)
    assert producer.metrics()["vllm:kv_cache_usage_perc"] == 0.0


def test_a_streamed_decode_leg(
    pair: tuple[ServerHandle, ServerHandle], colocated: list[list[int]]
) -> None:
    producer, consumer = pair
    prefill = completion(producer, PROMPTS[1], kv_transfer_params={"do_remote_decode": True})
    response = requests.post(
        f"{consumer.base_url}/v1/completions",
        headers=consumer.headers,
        json={
            "prompt": PROMPTS[1],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
            "stream": True,
            "kv_transfer_params": prefill["kv_transfer_params"],
        },
        stream=True,
        timeout=120,
    )
    tokens: list[int] = []
    for line in response.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            tokens += json.loads(line[6:])["choices"][0]["token_ids"]
    assert tokens == colocated[1]


def test_both_legs_dispatched_together_in_push_mode(
    tmp_path: Path, colocated: list[list[int]]
) -> None:
    # What a router that overlaps the legs does: it learns the producer's identity once
    # (GET /kv_transfer), names a transfer id, and sends the decode leg before the prefill is
    # answered; the producer writes the prompt's layers into the consumer's blocks as it goes.
    servers = _pd_pair(tmp_path, "tcp", "push")
    producer, consumer = next(servers)
    try:
        identity = requests.get(f"{producer.base_url}/kv_transfer", timeout=10).json()
        assert identity["role"] == "producer" and identity["transfer_mode"] == "push"
        decode_params = {
            "do_remote_prefill": True,
            "remote_engine_id": identity["engine_id"],
            "remote_host": identity["host"],
            "remote_port": identity["port"],
            "remote_request_id": "transfer-1",
        }
        results: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: results.update(
                decode=completion(consumer, PROMPTS[1], kv_transfer_params=decode_params)
            )
        )
        thread.start()
        time.sleep(0.5)  # the decode leg arrives first
        prefill_params = {"do_remote_decode": True, "transfer_id": "transfer-1"}
        completion(producer, PROMPTS[1], kv_transfer_params=prefill_params)
        thread.join(120)
        assert results["decode"]["choices"][0]["token_ids"] == colocated[1]
    finally:
        servers.close()


# Each tiny model meets each connector and each transfer mode (the in-process tests in
# tests/engine/kv_transfer/test_pd_engines.py run the full matrix).
TINY_PAIRS = [("llama", "tcp", "pull"), ("llama", "mooncake", "push"),
              ("qwen2", "tcp", "push"), ("qwen2", "mooncake", "pull")]  # fmt: skip


@pytest.mark.parametrize(("arch", "connector", "mode"), TINY_PAIRS)
def test_tiny_random_models_over_http_give_the_colocated_tokens(
    tmp_path: Path, arch: str, connector: str, mode: str
) -> None:
    from tests.engine.tiny_models import make_tiny_model

    model = str(make_tiny_model(tmp_path / "model", arch))
    rng = random.Random(7)
    prefix = [rng.randrange(3, 500) for _ in range(50)]
    prompts = [
        [rng.randrange(3, 500) for _ in range(5)],  # under one block
        [rng.randrange(3, 500) for _ in range(70)],  # several blocks and a partial one
        prefix + [rng.randrange(3, 500) for _ in range(12)],  # two sharing 3 blocks
        prefix + [rng.randrange(3, 500) for _ in range(9)],
    ]
    llm = LLM(model, dtype="float32", max_model_len=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    colocated = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    del llm
    servers = _pd_pair(tmp_path, connector, mode, model=model, max_model_len=256)
    producer, consumer = next(servers)
    try:
        for prompt, expected in zip(prompts, colocated, strict=True):
            first = completion(producer, prompt, kv_transfer_params={"do_remote_decode": True},
                               ignore_eos=True)  # fmt: skip
            second = completion(consumer, prompt, kv_transfer_params=first["kv_transfer_params"],
                                ignore_eos=True)  # fmt: skip
            assert second["choices"][0]["token_ids"] == expected.outputs[0].token_ids
            usage = second["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        assert consumer.metrics()["fleetserve:kv_tokens_loaded_total"] > 0
    finally:
        servers.close()


def test_a_colocated_engine_refuses_kv_transfer_params(tmp_path: Path) -> None:
    for server in start_server(tmp_path, "--dtype", "float32"):
        response = requests.post(
            f"{server.base_url}/v1/completions",
            headers=server.headers,
            json={
                "prompt": "hi",
                "max_tokens": 2,
                "kv_transfer_params": {"do_remote_decode": True},
            },
            timeout=60,
        )
        assert response.status_code == 400, response.text
        assert "KV connector" in response.json()["error"]["message"]
        assert requests.get(f"{server.base_url}/kv_transfer", timeout=10).status_code == 404
