"""`fleetserve serve --pipeline-parallel-size 2` over HTTP with batches in flight: concurrent
requests get the tokens they get alone, and a worker killed while both stages hold a batch
fails /health within 5 s and ends every in-flight request with an error (never a hang)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.engine.distributed.test_tp_server import _complete
from tests.server.server_process import ServerHandle, start_server

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def pp_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    yield from start_server(
        tmp_path_factory.mktemp("pp-server"),
        "--pipeline-parallel-size", "2", "--device", "cpu", "--dtype", "float32",
        model=str(tiny_llama_dir), max_model_len=MAX_MODEL_LEN,
    )  # fmt: skip


@pytest.mark.timeout(600)
def test_pp2_serves_concurrently_and_a_dead_worker_ends_inflight(pp_server: ServerHandle) -> None:
    bodies: list[dict[str, Any]] = [
        {"model": pp_server.model_name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        for prompt in ("hello", "a longer prompt than the first", "third", "and a fourth one")
    ]
    alone = [_complete(pp_server, body).json()["choices"][0]["text"] for body in bodies]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        together = [r.json()["choices"][0]["text"] for r in pool.map(
            lambda body: _complete(pp_server, body), bodies)]  # fmt: skip
    assert together == alone

    long = {"max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True}
    long_bodies = [
        {**bodies[0], "prompt": word, **long} for word in ("one", "two", "three", "four")
    ]
    match = re.search(
        r"started 2 worker processes \[(\d+), (\d+)\]", pp_server.log_path.read_text()
    )
    assert match, "the engine core did not log its worker pids"
    with concurrent.futures.ThreadPoolExecutor(len(long_bodies)) as pool:
        pending = [pool.submit(_complete, pp_server, body) for body in long_bodies]
        time.sleep(0.3)  # the requests are decoding, in two batches (~1 s to go)
        killed_at = time.monotonic()
        os.kill(int(match.group(1)), signal.SIGKILL)  # the first stage
        while requests.get(f"{pp_server.base_url}/health", timeout=5).status_code == 200:
            assert time.monotonic() - killed_at < 5.0, "/health still passes 5 s after the kill"
            time.sleep(0.1)
        responses = [future.result(timeout=30) for future in pending]
    assert [r.status_code for r in responses] == [503] * len(responses), responses[0].text
    assert "worker rank 0" in pp_server.log_path.read_text()
