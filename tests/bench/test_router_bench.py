"""`fleetserve bench router`'s pieces: the instant backend speaks the OpenAI shapes a router
passes through (and answers a prefill leg as a P/D engine would), and the table reports a router
that did not start instead of numbers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import requests

from fleetserve.bench.router import Measurement, format_table
from fleetserve.common.ports import free_port
from tests.fleet.children import ROOT


@pytest.fixture(scope="module")
def backend() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleetserve.bench.instant_backend",
            "--port",
            str(port),
            "--tokens",
            "5",
        ],
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "backend did not start"
            try:
                if requests.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_completions_chat_and_streams(backend: str) -> None:
    plain = requests.post(f"{backend}/v1/completions", json={"prompt": "x", "max_tokens": 3}).json()
    assert (
        plain["choices"][0]["text"] == " tok tok tok" and plain["usage"]["completion_tokens"] == 3
    )
    chat = requests.post(
        f"{backend}/v1/chat/completions", json={"messages": [], "max_tokens": 99}
    ).json()
    assert chat["choices"][0]["message"]["content"] == " tok" * 5  # --tokens caps it
    streamed = requests.post(
        f"{backend}/v1/chat/completions", json={"messages": [], "stream": True}
    )
    events = [line[6:] for line in streamed.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert (
        "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == " tok" * 5
    )
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_a_prefill_leg_gets_one_token_and_the_transfer_params(backend: str) -> None:
    body = {"prompt": "x", "max_tokens": 8, "kv_transfer_params": {"do_remote_decode": True}}
    answer = requests.post(f"{backend}/v1/completions", json=body).json()
    assert answer["usage"]["completion_tokens"] == 1
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]


def test_unknown_paths_and_bad_bodies_are_refused_and_counted(backend: str) -> None:
    assert requests.post(f"{backend}/v1/completions/render", json={}).status_code == 404
    bad = requests.post(f"{backend}/v1/completions", data=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "the body is not JSON"
    stats = requests.get(f"{backend}/stats").json()
    assert stats["unknown"]["POST /v1/completions/render"] >= 1
    assert "vllm:num_requests_waiting" in requests.get(f"{backend}/metrics").text


def test_the_table_names_a_router_that_did_not_start() -> None:
    direct = Measurement("direct", latency_ms={"p50": 0.2, "p99": 0.3}, stream_ms={"p50": 0.4, "p99": 0.5},
                         requests_per_s=8000)  # fmt: skip
    failed = Measurement("fleetserve", error="exited with code 2: no such flag")
    peer = Measurement("vllm-router", latency_ms={"p50": 0.5, "p99": 1.3}, stream_ms={"p50": 0.7, "p99": 0.9},
                       requests_per_s=2000, backend_calls={"engine": {"unknown": {"POST /tokenize": 3}}})  # fmt: skip
    table = format_table([direct, failed, peer])
    lines = table.splitlines()
    assert lines[0].split() == ["direct", "fleetserve", "vllm-router"]
    assert next(ln for ln in lines if ln.startswith("added latency p50")).split()[-3:] == [
        "-",
        "-",
        "0.300",
    ]
    assert next(ln for ln in lines if ln.startswith("max requests/s")).split()[-3:] == [
        "8000",
        "failed",
        "2000",
    ]
    assert next(ln for ln in lines if ln.startswith("requests/s vs")).split()[-3:] == [
        "4.00",
        "-",
        "1.00",
    ]
    assert "fleetserve: did not run: exited with code 2: no such flag" in lines
    assert (
        "vllm-router: engine paths it called that an engine may not have: {'POST /tokenize': 3}"
        in lines
    )
