"""End to end on a deliberately small engine (issue 13): a real `fleetserve serve` process on the
bundled SmolLM2 with 12 KV blocks of 16 tokens (176 usable tokens), 4 batch slots and 4 waiting
sequences, so that a prompt can outgrow the KV cache and long requests preempt each other.

What it checks: a client's `X-Request-Id` is echoed, never an engine key (a duplicate neither
fails nor aborts the first request); a prompt the KV cache cannot hold is a 400 naming the limit
(streaming or not); preempted requests count as waiting for admission.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from tests.server.server_process import ServerHandle, start_server

pytestmark = pytest.mark.slow

NUM_KV_BLOCKS = 12
BLOCK_SIZE = 16
KV_TOKENS = (NUM_KV_BLOCKS - 1) * BLOCK_SIZE  # block 0 is the null block
MAX_WAITING = 4
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    yield from start_server(
        tmp_path_factory.mktemp("hardening"),
        "--num-kv-blocks", str(NUM_KV_BLOCKS), "--block-size", str(BLOCK_SIZE),
        "--max-num-seqs", "4", "--max-waiting-requests", str(MAX_WAITING),
    )  # fmt: skip


def _post(
    server: ServerHandle, body: dict[str, Any], headers: dict[str, str] | None = None, **kw: Any
) -> requests.Response:
    return requests.post(
        f"{server.base_url}/v1/completions", json=body,
        headers={**server.headers, **(headers or {})}, timeout=kw.pop("timeout", 60), **kw,
    )  # fmt: skip


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _idle(server: ServerHandle) -> bool:
    m = server.metrics()
    return (
        m["vllm:num_requests_running"] == 0
        and m["vllm:num_requests_waiting"] == 0
        and m["vllm:kv_cache_usage_perc"] == 0
    )


def test_a_prompt_the_kv_cache_cannot_hold_is_a_400_naming_the_limit(server: ServerHandle) -> None:
    # 300 tokens: shorter than max_model_len (512), longer than the cache (176 tokens).
    prompt = list(range(1000, 1300))
    for stream in (False, True):
        response = _post(server, {"prompt": prompt, "max_tokens": 4, "stream": stream})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "prompt" and error["type"] == "invalid_request_error"
        assert f"{KV_TOKENS} tokens" in error["message"], error["message"]
        assert "300" in error["message"] and "KV cache" in error["message"]
    # The limit is the cache's, not max_model_len's: a prompt that fits is served.
    fits = _post(server, {"prompt": prompt[: KV_TOKENS - 8], "max_tokens": 2, "ignore_eos": True})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 2


def test_a_duplicate_request_id_neither_fails_nor_aborts_the_first(server: ServerHandle) -> None:
    header = {"X-Request-Id": "retry-1"}
    body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    with _post(server, {**body, "stream": True}, header, stream=True, timeout=20) as first:
        events = (line for line in first.iter_lines() if line.startswith(b"data: "))
        next(events)  # the first request is running
        second = _post(server, {**body, "max_tokens": 3}, header, timeout=20)
        rest = list(events)  # a hang raises ReadTimeout here
    assert second.status_code == 200, second.text
    assert second.headers["X-Request-Id"] == "retry-1"
    assert first.headers["X-Request-Id"] == "retry-1"
    assert second.json()["usage"]["completion_tokens"] == 3
    assert rest[-1] == b"data: [DONE]"
    chunks = [json.loads(line[len(b"data: ") :]) for line in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    _wait_for(lambda: _idle(server))


def test_preempted_requests_count_as_waiting_for_admission(server: ServerHandle) -> None:
    """Four requests that each fit the cache alone but not together: FCFS preempts the newest
    three as they grow (each ends up WAITING again), and the waiting bound counts them."""
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 150, "ignore_eos": True, "stream": True}
    streams = [_post(server, body, stream=True, timeout=60) for _ in range(4)]
    try:
        assert all(s.status_code == 200 for s in streams)

        def three_preempted() -> bool:
            m = server.metrics()
            return m["vllm:num_preemptions_total"] >= 3 and m["vllm:num_requests_waiting"] >= 3

        _wait_for(three_preempted)
        # 3 preempted sequences wait; 2 more would exceed max_waiting_requests=4.
        refused = _post(server, {"prompt": "x", "max_tokens": 1, "n": 2}, timeout=10)
        assert refused.status_code == 429, refused.text
        assert "waiting" in refused.json()["error"]["message"]
    finally:
        for stream in streams:
            stream.close()
    _wait_for(lambda: _idle(server))
