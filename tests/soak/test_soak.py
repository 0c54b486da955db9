"""Soak: one real `fleetserve serve` process under mixed load for a bounded time (issue 13).

`WORKERS` concurrent clients, for `soak_seconds()` (the `SOAK_SECONDS` environment variable,
default `DEFAULT_SOAK_SECONDS`: a few minutes, as issue 13 asks), each loop over a seeded random
mix: good completions and chats (some greedy ones checked against the answer the idle server
gave), streams (each must end with `data: [DONE]`), bad bodies (each must be an OpenAI-shaped
400), streams the client closes mid-way and requests it gives up on (cancellations). The engine
is a tiny random-weight Llama with a small KV cache (preemption happens) and a small waiting bound
(429s happen, and are answers too).

Afterwards: no request lost (every one got a status, a complete stream or was cancelled by its
client on purpose; none timed out), the engine back to idle (nothing running or waiting, KV
usage 0), no unhandled error in the server's log, and the resident memory of the API server and
of the engine core grown by less than `RSS_GROWTH_BOUND_MIB` since the warm-up. The figures
(requests, answers and errors by kind, latencies up to the worst, RSS growth) are printed to the
terminal even without `-s`, so `make test`'s log keeps them. A shorter run, to check the test
itself: `SOAK_SECONDS=20 pytest tests/soak`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests

from tests.engine.tiny_models import make_tiny_model
from tests.server.server_process import API_KEY, ServerHandle, start_server

pytestmark = pytest.mark.slow

DEFAULT_SOAK_SECONDS = 150.0
WARMUP_SECONDS = 10.0
"""RSS is first measured after this long under load (allocator pools, caches warmed up); at
most half the run, for short runs."""
WORKERS = 48
RSS_GROWTH_BOUND_MIB = 64
REQUEST_TIMEOUT_S = 60.0
"""A request without an answer by then counts as lost."""
GREEDY = {"prompt": "soak", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
BAD_BODIES: list[Any] = [
    {"prompt": "x", "max_tokens": -1},
    {"prompt": "x", "n": 1000},
    {"prompt": "x", "logprobs": -1},
    {"prompt": [10**9]},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    {"prompt": "x", "priority": 5},
    {"prompt": "x", "temperature": "hot"},
    {"messages": []},
    "{not json",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    yield from start_server(
        tmp_path_factory.mktemp("soak"),
        "--max-num-seqs", "16", "--max-waiting-requests", "48",
        "--num-kv-blocks", "48", "--block-size", "16",
        model=str(model), max_model_len=256,
    )  # fmt: skip


def soak_seconds() -> float:
    """How long the load runs: `SOAK_SECONDS` from the environment, else the default."""
    raw = os.environ.get("SOAK_SECONDS")
    if raw is None:
        return DEFAULT_SOAK_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        pytest.fail(f"SOAK_SECONDS must be a positive number of seconds, got {raw!r}")
    return seconds


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class Soak:
    def __init__(self, server: ServerHandle, reference: str) -> None:
        self.url = server.base_url
        self.reference = reference
        self.outcomes: Counter[str] = Counter()
        self.problems: list[str] = []
        self.latencies: list[float] = []

    def problem(self, kind: str, detail: str) -> None:
        self.outcomes[f"{kind}:PROBLEM"] += 1
        self.problems.append(f"{kind}: {detail[:300]}")

    async def worker(self, session: aiohttp.ClientSession, rng: random.Random, end: float) -> None:
        kinds = ["complete", "greedy", "chat", "stream", "bad", "close_stream", "give_up"]
        weights = [3, 2, 2, 3, 3, 1, 1]
        while time.monotonic() < end:
            kind = rng.choices(kinds, weights)[0]
            start = time.monotonic()
            try:
                await asyncio.wait_for(getattr(self, kind)(session, rng), REQUEST_TIMEOUT_S)
            except TimeoutError:
                self.problem(kind, "lost: no answer within the timeout")
            except aiohttp.ClientError as exc:
                self.problem(kind, f"lost: {type(exc).__name__}: {exc}")
            self.latencies.append(time.monotonic() - start)

    async def _post(self, session: aiohttp.ClientSession, path: str, body: Any) -> Any:
        data = body if isinstance(body, str) else json.dumps(body)
        return session.post(f"{self.url}{path}", data=data,
                            headers={"Content-Type": "application/json"})  # fmt: skip

    def _record(self, kind: str, status: int, text: str, expect: tuple[int, ...]) -> None:
        if status not in expect:
            self.problem(kind, f"status {status}: {text}")
        elif status >= 400 and "error" not in json.loads(text):
            self.problem(kind, f"{status} without an OpenAI error: {text}")
        else:
            self.outcomes[f"{kind}:{status}"] += 1

    async def complete(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        body = {"prompt": rng.choice(["a", "hello world", "x" * 40]), "ignore_eos": True,
                "max_tokens": rng.randint(1, 64), "n": rng.choice([1, 1, 2, 4])}  # fmt: skip
        async with await self._post(session, "/v1/completions", body) as response:
            text = await response.text()
            self._record("complete", response.status, text, (200, 429))
            if response.status == 200:
                usage = json.loads(text)["usage"]["completion_tokens"]
                if usage != body["max_tokens"] * body["n"]:
                    self.problem("complete", f"{usage} tokens for {body}")

    async def greedy(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        async with await self._post(session, "/v1/completions", GREEDY) as response:
            text = await response.text()
            self._record("greedy", response.status, text, (200, 429))
            if response.status == 200 and json.loads(text)["choices"][0]["text"] != self.reference:
                self.problem("greedy", f"a different greedy answer under load: {text}")

    async def chat(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        body = {"messages": [{"role": "user", "content": "hi " * rng.randint(1, 20)}],
                "max_tokens": rng.randint(1, 32)}  # fmt: skip
        async with await self._post(session, "/v1/chat/completions", body) as response:
            self._record("chat", response.status, await response.text(), (200, 429))

    async def stream(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        body = {"prompt": "stream", "max_tokens": rng.randint(1, 64), "ignore_eos": True,
                "stream": True, "n": rng.choice([1, 2])}  # fmt: skip
        async with await self._post(session, "/v1/completions", body) as response:
            text = await response.text()
            if response.status != 200:
                self._record("stream", response.status, text, (429,))
                return
            events = [e[len("data: ") :] for e in text.split("\n\n") if e.strip()]
            if not events or events[-1] != "[DONE]":
                self.problem("stream", f"did not end with [DONE]: {text[-200:]}")
                return
            chunks = [json.loads(e) for e in events[:-1]]
            if any("error" in c for c in chunks):
                self.problem("stream", f"error event: {text[-300:]}")
                return
            finishes = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
            if len(finishes) != body["n"]:
                self.problem("stream", f"{len(finishes)} finished choices of {body['n']}")
                return
            self.outcomes["stream:200"] += 1

    async def bad(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        body = rng.choice(BAD_BODIES)
        path = "/v1/chat/completions" if "messages" in str(body) else "/v1/completions"
        async with await self._post(session, path, body) as response:
            self._record("bad", response.status, await response.text(), (400,))

    async def close_stream(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        body = {"prompt": "cancel me", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with await self._post(session, "/v1/completions", body) as response:
            if response.status != 200:
                self._record("close_stream", response.status, await response.text(), (429,))
                return
            for _ in range(rng.randint(1, 5)):
                await response.content.readline()
            response.close()  # the client goes away mid-stream
        self.outcomes["close_stream:cancelled"] += 1

    async def give_up(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        body = {"prompt": "never mind", "max_tokens": 200, "ignore_eos": True}

        async def attempt() -> tuple[int, str]:
            async with await self._post(session, "/v1/completions", body) as response:
                return response.status, await response.text()

        try:
            status, text = await asyncio.wait_for(attempt(), rng.uniform(0.01, 0.2))
        except TimeoutError:
            self.outcomes["give_up:cancelled"] += 1  # the client hung up before the answer
            return
        self._record("give_up", status, text, (200, 429))


def _idle(server: ServerHandle) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"the engine did not go idle: {m}"
        time.sleep(0.2)


def _report(
    soak: Soak, elapsed: float, metrics: dict[str, float], rss: dict[str, tuple[float, float]]
) -> str:
    latencies = sorted(soak.latencies)
    total = len(latencies)
    answers = {k: n for k, n in soak.outcomes.items() if k.endswith((":200", ":cancelled"))}
    errors = {k: n for k, n in soak.outcomes.items() if k not in answers}
    growth = {name: end - warm for name, (warm, end) in rss.items()}
    return (
        f"\nsoak: {total} requests in {elapsed:.0f} s by {WORKERS} clients "
        f"({total / elapsed:.0f}/s)\n"
        f"soak: answers by kind {dict(sorted(answers.items()))}\n"
        f"soak: errors by kind {dict(sorted(errors.items()))} (bad:400 and 429s are expected "
        f"answers; PROBLEM is a failure)\n"
        f"soak: latency median {1000 * latencies[total // 2]:.0f} ms, p99 "
        f"{1000 * latencies[int(0.99 * total)]:.0f} ms, worst {1000 * latencies[-1]:.0f} ms; "
        f"preemptions {metrics['vllm:num_preemptions_total']:.0f}\n"
        f"soak: RSS MiB api {rss['api'][0]:.0f} -> {rss['api'][1]:.0f} "
        f"({growth['api']:+.0f}), core {rss['core'][0]:.0f} -> {rss['core'][1]:.0f} "
        f"({growth['core']:+.0f}); bound {RSS_GROWTH_BOUND_MIB} MiB"
    )


def test_mixed_load_loses_nothing_and_leaks_nothing(
    server: ServerHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    duration = soak_seconds()
    warmup = min(WARMUP_SECONDS, duration / 2)
    reference = requests.post(
        f"{server.base_url}/v1/completions", json=GREEDY, headers=server.headers, timeout=30
    ).json()["choices"][0]["text"]
    core_pid = server.engine_core_pid()
    soak = Soak(server, reference)
    rss: dict[str, tuple[float, float]] = {}

    async def main() -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        connector = aiohttp.TCPConnector(limit=WORKERS)
        async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
            end = time.monotonic() + duration
            rngs = [random.Random(seed) for seed in range(WORKERS)]
            workers = [asyncio.create_task(soak.worker(session, r, end)) for r in rngs]
            await asyncio.sleep(warmup)
            warm = (_rss_mib(server.process.pid), _rss_mib(core_pid))
            await asyncio.gather(*workers)
            rss["api"] = (warm[0], _rss_mib(server.process.pid))
            rss["core"] = (warm[1], _rss_mib(core_pid))

    started = time.monotonic()
    asyncio.run(main())
    elapsed = time.monotonic() - started
    metrics = _idle(server)
    with capsys.disabled():
        print(_report(soak, elapsed, metrics, rss))
    assert not soak.problems, "\n".join(soak.problems[:20])
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    for kind in ("complete", "greedy", "chat", "stream", "bad"):
        assert soak.outcomes[f"{kind}:{400 if kind == 'bad' else 200}"] > 0, kind
    assert soak.outcomes["close_stream:cancelled"] > 0 and soak.outcomes["give_up:cancelled"] > 0
    for name, (warm, end) in rss.items():
        assert end - warm < RSS_GROWTH_BOUND_MIB, f"{name} RSS grew {end - warm:.0f} MiB"
    log = server.log_path.read_text()
    assert "Traceback" not in log and "unhandled error" not in log, log[-3000:]
    assert requests.get(f"{server.base_url}/health", timeout=5).status_code == 200
