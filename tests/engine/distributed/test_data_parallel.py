"""Dense data parallel (issue 16): `fleetserve serve --data-parallel-size 2` runs two independent
engine cores behind one server. Greedy answers equal a DP=1 engine's, concurrent requests spread
over both ranks, an abort reaches the rank that runs the request, `/metrics` has one series per
rank (`engine` label), and a dead rank fails /health and ends in-flight requests with errors.

One real server process for the module (its death test last: it kills a core).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
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

from fleetserve import LLM, SamplingParams
from tests.engine.tiny_models import make_tiny_model
from tests.server.server_process import ServerHandle, start_server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 4096
"""Long enough that a request runs for seconds on the tiny model."""
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [40, 41], [100, 7, 3, 8, 9]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny"), "llama", max_position_embeddings=MAX_MODEL_LEN
    )


@pytest.fixture(scope="module")
def dp_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    yield from start_server(
        tmp_path_factory.mktemp("dp-server"),
        "--data-parallel-size", "2", "--device", "cpu", "--dtype", "float32",
        model=str(tiny_model), max_model_len=MAX_MODEL_LEN,
    )  # fmt: skip


def _complete(server: ServerHandle, body: dict[str, Any]) -> requests.Response:
    body = {"model": server.model_name, "temperature": 0, **body}
    return requests.post(
        f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=60
    )


def _series(server: ServerHandle, name: str) -> dict[str, float]:
    """engine label → value of the metric `name` (one sample per rank)."""
    text = requests.get(f"{server.base_url}/metrics", timeout=10).text
    found = {}
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}\{{(.*)\}} (\S+)", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            found[labels.get("engine", "-")] = float(match.group(2))
    return found


def _core_pids(server: ServerHandle) -> list[int]:
    """The engine core processes' ids, by rank."""
    match = re.search(r"processes \[(\d+), (\d+)\] by rank", server.log_path.read_text())
    assert match, "the server did not log its engine cores' pids"
    return [int(match.group(1)), int(match.group(2))]


@dataclasses.dataclass
class _Stream:
    """A long streaming request, under way: its response and its remaining `data:` events.

    NOTE: the two live and die together. Dropping the events iterator half-read closes the
    connection (urllib3 releases it when its read generator is closed), which the server takes
    for a client that left; a test that kept only the response once had its request aborted
    under it.
    """

    response: requests.Response
    events: Iterator[bytes]

    def close(self) -> None:
        """Leave: the server aborts the request."""
        self.response.close()


def _stream(server: ServerHandle, prompt: list[int]) -> _Stream:
    """Start a long streaming request and read its first event."""
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": MAX_MODEL_LEN - 16,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    response = requests.post(
        f"{server.base_url}/v1/completions", json=body, headers=server.headers, stream=True,
        timeout=60,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    events = (line for line in response.iter_lines() if line.startswith(b"data: "))
    next(events)
    return _Stream(response, events)


def _wait_for(condition: Any, what: str, timeout_s: float = 10.0, seen: Any = None) -> None:
    """Poll `condition` until it holds; the failure names `what` and, if given, `seen()`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            last = f"; last seen: {seen()}" if seen is not None else ""
            raise AssertionError(f"{what} within {timeout_s} s{last}")
        time.sleep(0.05)


@pytest.mark.timeout(600)
def test_dp2_greedy_answers_equal_dp1_and_spread_over_both_ranks(
    dp_server: ServerHandle, tiny_model: Path
) -> None:
    reference = LLM(str(tiny_model), device="cpu", dtype="float32",
                    max_model_len=MAX_MODEL_LEN)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0] for o in reference.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params)]  # fmt: skip
    before = _series(dp_server, "vllm:generation_tokens_total")
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(
            pool.map(
                lambda p: _complete(dp_server, {"prompt": p, "max_tokens": MAX_TOKENS}), PROMPTS
            )
        )
    assert [r.json()["choices"][0]["text"] for r in responses] == [o.text for o in expected]
    after = _series(dp_server, "vllm:generation_tokens_total")
    gained = {rank: after[rank] - before.get(rank, 0.0) for rank in after}
    assert set(gained) == {"0", "1"}
    assert sum(gained.values()) == sum(len(o.token_ids) for o in expected)
    assert all(tokens > 0 for tokens in gained.values()), gained  # both ranks served


@pytest.mark.timeout(600)
def test_an_abort_reaches_its_rank_and_the_least_loaded_rank_takes_the_next(
    dp_server: ServerHandle,
) -> None:
    running = functools.partial(_series, dp_server, "vllm:num_requests_running")
    opened: list[_Stream] = []
    try:
        # 1 → rank c (the round-robin cursor), 2 → the other (less loaded), 3 → c (a tie, the
        # cursor's turn): c runs two, the other one.
        first = _stream(dp_server, [5, 6, 7])
        second = _stream(dp_server, [8, 9, 10])
        third = _stream(dp_server, [11, 12])
        opened += [first, second, third]
        _wait_for(lambda: sorted(running().values()) == [1.0, 2.0], "1 and 3 did not share a rank",
                  seen=lambda: (running(), _series(dp_server, "vllm:num_requests_waiting")))  # fmt: skip
        snapshot = running()
        busy = max(snapshot, key=snapshot.__getitem__)
        first.close()  # the client leaves: the server aborts the request on its rank
        third.close()
        _wait_for(
            lambda: running()[busy] == 0.0, "the aborts did not stop both requests on their rank"
        )
        assert sorted(running().values()) == [0.0, 1.0]
        # The other rank's request streams on.
        for _ in range(50):
            assert b'finish_reason":null' in next(second.events)
        # The cursor points at the busy rank now; the idle one is less loaded, and wins.
        opened.append(_stream(dp_server, [13, 14]))
        _wait_for(lambda: running() == {"0": 1.0, "1": 1.0}, "4 did not go to the idle rank")
    finally:
        for stream in opened:
            stream.close()
    _wait_for(lambda: set(running().values()) == {0.0}, "both ranks did not go idle")


@pytest.mark.timeout(600)
def test_a_dead_rank_fails_health_and_inflight_requests(dp_server: ServerHandle) -> None:
    streams = [_stream(dp_server, [5, 6, 7]), _stream(dp_server, [8, 9, 10])]
    try:
        _wait_for(
            lambda: _series(dp_server, "vllm:num_requests_running") == {"0": 1.0, "1": 1.0},
            "the two requests did not run one on each rank",
        )
        killed_at = time.monotonic()
        os.kill(_core_pids(dp_server)[1], signal.SIGKILL)
        while requests.get(f"{dp_server.base_url}/health", timeout=5).status_code == 200:
            assert time.monotonic() - killed_at < 5.0, "/health still passes 5 s after the kill"
            time.sleep(0.1)
        for stream in streams:
            rest = list(stream.events)
            # Both ranks' requests end with an error event and [DONE] (one failure unit).
            assert rest[-1] == b"data: [DONE]"
            assert json.loads(rest[-2][len(b"data: ") :])["error"]["code"] == "503"
    finally:
        for stream in streams:
            stream.close()
    later = _complete(dp_server, {"prompt": [5], "max_tokens": 2})
    assert later.status_code == 503, later.text
    assert "data-parallel rank 1" in later.json()["error"]["message"]
