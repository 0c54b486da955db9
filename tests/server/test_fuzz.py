"""Property-based HTTP fuzzing of a real `fleetserve serve` process (issue 13).

schemathesis draws request bodies from the server's own `/openapi.json` (generated from the
pydantic protocol models): bodies that fit the schema (positive) and bodies that break it
(negative), for every POST route, a fixed and derandomized number of cases so the run is
bounded and reproducible. Every answer must be below 500; every 4xx must be OpenAI-shaped;
2xx JSON bodies must match the published response schema. Afterwards the server must answer a
good request exactly as it did before, be healthy and idle (nothing left running or holding KV
blocks). The figures (cases, duration, worst latency) are printed; run with `-s` to see them.

The engine is a tiny random-weight Llama (fast on a CPU) with a byte-level tokenizer.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.engine.tiny_models import make_tiny_model
from tests.server.server_process import ServerHandle, start_server

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 400
"""Cases drawn in all (positive and negative, over the four POST routes)."""
ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
EDGE_CASES: list[dict[str, Any]] = [
    # Found by fuzzing and probing the boundaries (each was a 500 before its fix).
    {"prompt": "x", "seed": 2**70},
    {"prompt": "x", "seed": 2**64 + 5},
    {"prompt": "x", "top_k": 2**70},
    {"prompt": "x", "min_tokens": 10**30, "max_tokens": None},
    {"prompt": "x", "stop_token_ids": [2**70]},
    {"prompt": "x", "cache_salt": "\ud800"},
    {"prompt": "x", "stop": ["\udfff"]},
    {"prompt": "x", "n": 2, "seed": 2**64 - 1},
    # Boundaries that must be served.
    {"prompt": "x", "seed": 2**64 - 1, "max_tokens": 2},
    {"prompt": "x", "seed": -(2**63), "max_tokens": 2},
    {"prompt": "x", "top_k": 2**63 - 1, "max_tokens": 2},
    {"prompt": "x", "temperature": 1e-300, "max_tokens": 2},
    {"prompt": "x", "repetition_penalty": 1e300, "max_tokens": 2},
    {"prompt": "x", "logprobs": 20, "echo": True, "max_tokens": 2},
]
GOOD = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    yield from start_server(
        tmp_path_factory.mktemp("fuzz"), "--max-num-seqs", "8", "--max-waiting-requests", "32",
        model=str(model), max_model_len=128,
    )  # fmt: skip


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    worst: tuple[float, str] = (0.0, "")
    defects: list[str] = field(default_factory=list)

    def defect(self, what: str, case: Any, response: requests.Response) -> None:
        body = json.dumps(case.body)[:400] if case.body is not None else "<no body>"
        self.defects.append(
            f"{what}: {case.method} {case.path} {body} -> {response.status_code} "
            f"{response.text[:300]}"
        )


def _is_openai_error(response: requests.Response) -> bool:
    try:
        data = response.json()
    except ValueError:
        return False
    error = data.get("error") if isinstance(data, dict) else None
    return (
        isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and isinstance(error["message"], str)
        and bool(error["message"])
        and isinstance(error["type"], str)
        and (error["param"] is None or isinstance(error["param"], str))
    )


def _good_answer(server: ServerHandle) -> Any:
    response = requests.post(
        f"{server.base_url}/v1/completions", json=GOOD, headers=server.headers, timeout=30
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["token_ids"]


def test_fuzzing_from_the_openapi_schema_finds_no_server_error(server: ServerHandle) -> None:
    from schemathesis.specs.openapi.checks import response_schema_conformance

    before = _good_answer(server)
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    strategies = [
        schema[route]["POST"].as_strategy(mode, headers=server.headers)
        for route in ROUTES
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    ]
    tally = Tally()
    session = requests.Session()

    @settings(
        max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
        phases=[Phase.generate], suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(case=st.one_of(strategies))
    def fuzz(case: Any) -> None:
        start = time.monotonic()
        response = case.call(base_url=server.base_url, session=session, timeout=60)
        latency = time.monotonic() - start
        tally.latencies.append(latency)
        tally.statuses[response.status_code] += 1
        if latency > tally.worst[0]:
            # NOTE: a negative case's body may be bytes (not JSON-serialisable): repr it.
            tally.worst = (latency, f"{case.path} {json.dumps(case.body, default=repr)[:200]}")
        if response.status_code >= 500:
            tally.defect("server error", case, response)
        elif response.status_code >= 400 and not _is_openai_error(response):
            tally.defect("4xx not OpenAI-shaped", case, response)
        elif response.status_code < 300 and "json" in response.headers.get("Content-Type", ""):
            try:
                case.validate_response(response, checks=[response_schema_conformance])
            except Exception as exc:  # schemathesis reports conformance failures by raising
                tally.defect(f"response off its schema ({type(exc).__name__})", case, response)

    started = time.monotonic()
    fuzz()
    for body in EDGE_CASES:
        response = session.post(
            f"{server.base_url}/v1/completions", data=json.dumps(body), headers=server.headers,
            timeout=60,
        )  # fmt: skip
        if response.status_code >= 500 or (
            response.status_code >= 400 and not _is_openai_error(response)
        ):
            tally.defects.append(f"edge case {body} -> {response.status_code} {response.text}")
    duration = time.monotonic() - started
    latencies = sorted(tally.latencies)
    print(
        f"\nfuzz: {len(latencies)} cases in {duration:.1f} s, statuses {dict(tally.statuses)}, "
        f"median {1000 * latencies[len(latencies) // 2]:.0f} ms, worst "
        f"{1000 * tally.worst[0]:.0f} ms ({tally.worst[1]})"
    )
    assert not tally.defects, "\n".join(tally.defects[:20])
    assert len(latencies) == MAX_EXAMPLES
    assert tally.statuses[200] > 0 and tally.statuses[400] > 0  # both kinds were exercised
    # Afterwards: the same answer, healthy, nothing left in the engine.
    assert _good_answer(server) == before
    assert requests.get(f"{server.base_url}/health", timeout=5).status_code == 200
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert m["vllm:kv_cache_usage_perc"] == 0
