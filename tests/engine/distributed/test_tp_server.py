"""Acceptance 2: `fleetserve serve --tensor-parallel-size 2` serves over HTTP with the 'mp'
executor; killing one worker process fails /health within 5 s and ends the in-flight requests
with errors (never a hang)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.server.server_process import ServerHandle, start_server

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def tp_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    yield from start_server(
        tmp_path_factory.mktemp("tp-server"),
        "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32",
        model=str(tiny_llama_dir), max_model_len=MAX_MODEL_LEN,
    )  # fmt: skip


def _worker_pids(server: ServerHandle) -> list[int]:
    match = re.search(r"started 2 worker processes \[(\d+), (\d+)\]", server.log_path.read_text())
    assert match, "the engine core did not log its worker pids"
    return [int(match.group(1)), int(match.group(2))]


def _complete(server: ServerHandle, body: dict[str, Any]) -> requests.Response:
    return requests.post(
        f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=60
    )


@pytest.mark.timeout(600)
def test_tp2_serves_and_a_dead_worker_fails_health_and_inflight(tp_server: ServerHandle) -> None:
    body: dict[str, Any] = {"model": tp_server.model_name, "prompt": "hello", "max_tokens": 8,
                            "temperature": 0}  # fmt: skip
    first = _complete(tp_server, body)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["completion_tokens"] == 8
    assert _complete(tp_server, body).json()["choices"] == first.json()["choices"]  # greedy

    long_body = {**body, "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True}
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        requests.post(
            f"{tp_server.base_url}/v1/completions", json={**long_body, "stream": True},
            headers=tp_server.headers, stream=True, timeout=60,
        ) as streaming,
    ):  # fmt: skip
        events = (line for line in streaming.iter_lines() if line.startswith(b"data: "))
        next(events)  # the stream is under way
        pending = pool.submit(_complete, tp_server, long_body)
        killed_at = time.monotonic()
        os.kill(_worker_pids(tp_server)[1], signal.SIGKILL)
        while requests.get(f"{tp_server.base_url}/health", timeout=5).status_code == 200:
            assert time.monotonic() - killed_at < 5.0, "/health still passes 5 s after the kill"
            time.sleep(0.1)
        response = pending.result(timeout=30)
        rest = list(events)
    assert response.status_code == 503, response.text
    assert "engine" in response.json()["error"]["message"]
    # The stream that had already sent 200 ends with an error event and [DONE].
    assert rest[-1] == b"data: [DONE]"
    assert json.loads(rest[-2][len(b"data: ") :])["error"]["code"] == "503"
    assert "worker rank 1" in tp_server.log_path.read_text()
