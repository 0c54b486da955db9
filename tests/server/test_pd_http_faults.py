"""Faults between two real `fleetserve serve` processes, under both load-failure policies: the
prefill engine killed after answering, restarted on the same address, the decode leg arriving
after the lease ran out, the prefill engine frozen (as behind a cut connection) and killed in the
middle of a push. Under `recompute` every request completes with the colocated tokens; under
`fail` it ends at once with a 503 whose code (`kv_transfer_failed`) a router recognises; nothing
hangs, and KV usage returns to idle (read from /metrics)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from fleetserve import LLM, SamplingParams
from tests.engine.tiny_models import make_prompts, make_tiny_model
from tests.server.server_process import ServerHandle, start_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
MAX_MODEL_LEN = 256
PROMPTS = make_prompts(512, [24, 60, 130], seed=21)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("llama"), "llama"))


@pytest.fixture(scope="module")
def colocated(model: str) -> list[list[int]]:
    llm = LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outputs]


def _serve(tmp_path: Path, name: str, model: str, role: str, **kv: Any) -> Iterator[ServerHandle]:
    folder = tmp_path / name
    folder.mkdir()
    config = {"connector": "tcp", "role": role, **kv}
    return start_server(folder, "--dtype", "float32", "--kv-transfer-config", json.dumps(config),
                        model=model, max_model_len=MAX_MODEL_LEN)  # fmt: skip


def _post(server: ServerHandle, prompt: list[int], **body: Any) -> requests.Response:
    return requests.post(
        f"{server.base_url}/v1/completions",
        headers=server.headers,
        json={
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            **body,
        },
        timeout=120,
    )


def _prefill(producer: ServerHandle) -> list[dict[str, Any]]:
    params = []
    for prompt in PROMPTS:
        response = _post(producer, prompt, kv_transfer_params={"do_remote_decode": True})
        assert response.status_code == 200, response.text
        params.append(response.json()["kv_transfer_params"])
    return params


def _decode_all(
    consumer: ServerHandle, params: list[dict[str, Any]], policy: str, colocated: list[list[int]]
) -> list[str]:
    """Decode every prompt; returns the error messages (none under recompute)."""
    errors = []
    for prompt, p, expected in zip(PROMPTS, params, colocated, strict=True):
        started = time.monotonic()
        response = _post(consumer, prompt, kv_transfer_params=p)
        assert time.monotonic() - started < 30, "a failed transfer must not hang the request"
        if policy == "recompute":
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["token_ids"] == expected
        else:
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "kv_transfer_failed", error
            errors.append(error["message"])
    return errors


def _idle_eventually(server: ServerHandle, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.metrics()["vllm:kv_cache_usage_perc"] == 0.0:
            return
        time.sleep(0.2)
    raise AssertionError(f"KV usage still {server.metrics()['vllm:kv_cache_usage_perc']}")


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_the_prefill_engine_killed_after_answering(
    tmp_path: Path, model: str, colocated: list[list[int]], policy: str
) -> None:
    producer = _serve(tmp_path, "p", model, "producer")
    p = next(producer)
    params = _prefill(p)
    p.process.send_signal(signal.SIGKILL)
    p.process.wait(30)
    for d in _serve(tmp_path, "d", model, "consumer", load_failure_policy=policy,
                    handshake_timeout_s=2.0):  # fmt: skip
        errors = _decode_all(d, params, policy, colocated)
        assert all("handshake" in e for e in errors), errors
        _idle_eventually(d)
    producer.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_restarted_prefill_engine_never_serves_stale_blocks(
    tmp_path: Path, model: str, colocated: list[list[int]], policy: str
) -> None:
    first = _serve(tmp_path, "p1", model, "producer", side_channel_port=0)
    p = next(first)
    port = requests.get(f"{p.base_url}/kv_transfer", timeout=10).json()["port"]
    params = _prefill(p)
    first.close()
    for _restarted in _serve(tmp_path, "p2", model, "producer", side_channel_port=port):
        for d in _serve(tmp_path, "d", model, "consumer", load_failure_policy=policy):
            errors = _decode_all(d, params, policy, colocated)
            assert all("it restarted" in e for e in errors), errors


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_decode_leg_that_comes_after_the_lease(
    tmp_path: Path, model: str, colocated: list[list[int]], policy: str
) -> None:
    for p in _serve(tmp_path, "p", model, "producer", lease_seconds=1.0):
        params = _prefill(p)
        # NOTE: a lease is granted a step after its prompt finished, so the last one may lag
        # the response by that step.
        deadline = time.monotonic() + 5
        while p.metrics()["fleetserve:kv_active_leases"] < len(PROMPTS):
            assert time.monotonic() < deadline, p.metrics()["fleetserve:kv_active_leases"]
            time.sleep(0.05)
        time.sleep(2.0)  # nobody heartbeats: the consumer stalled (or queued) past the lease
        _idle_eventually(p)
        metrics = p.metrics()
        assert metrics["fleetserve:kv_lease_expirations_total"] == len(PROMPTS)
        assert metrics["fleetserve:kv_active_leases"] == 0
        for d in _serve(tmp_path, "d", model, "consumer", load_failure_policy=policy):
            errors = _decode_all(d, params, policy, colocated)
            assert all("lease" in e and "expired" in e for e in errors), errors
            if policy == "recompute":
                assert d.metrics()["fleetserve:kv_blocks_recomputed_total"] > 0


def test_a_hash_mismatch_is_a_400_naming_both_hashes(tmp_path: Path, model: str) -> None:
    for p in _serve(tmp_path, "p", model, "producer"):
        params = _prefill(p)
        for d in start_server(tmp_path, "--dtype", "float32", "--block-size", "8",
                              "--kv-transfer-config",
                              json.dumps({"connector": "tcp", "role": "consumer"}),
                              model=model, max_model_len=MAX_MODEL_LEN):  # fmt: skip
            theirs = params[0]["compatibility_hash"]
            mine = requests.get(f"{d.base_url}/kv_transfer", timeout=10).json()[
                "compatibility_hash"
            ]
            response = _post(d, PROMPTS[0], kv_transfer_params=params[0])
            assert response.status_code == 400, response.text
            message = response.json()["error"]["message"]
            assert theirs in message and mine in message


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_an_unresponsive_prefill_engine(
    tmp_path: Path, model: str, colocated: list[list[int]], policy: str
) -> None:
    # The prefill engine's core (its control channel and transport live there) stops answering,
    # as a cut connection or a frozen node would: every request ends within the timeouts.
    for p in _serve(tmp_path, "p", model, "producer"):
        params = _prefill(p)
        core = p.engine_core_pid()
        import os

        os.kill(core, signal.SIGSTOP)
        try:
            for d in _serve(tmp_path, "d", model, "consumer", load_failure_policy=policy,
                            handshake_timeout_s=1.0, transfer_timeout_s=3.0):  # fmt: skip
                _decode_all(d, params, policy, colocated)
                _idle_eventually(d)
        finally:
            os.kill(core, signal.SIGCONT)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_the_prefill_engine_killed_in_the_middle_of_a_push(tmp_path: Path, policy: str) -> None:
    # SmolLM2 with a long prompt computed in small chunks: both legs are dispatched together,
    # so the producer pushes each chunk's layers while it computes the next; it is killed once
    # it has run for a while, with the prompt half computed and half pushed.
    import random
    import threading

    rng = random.Random(3)
    prompt = [rng.randrange(100, 40_000) for _ in range(1200)]
    kv = {"connector": "tcp", "transfer_mode": "push", "load_failure_policy": policy,
          "transfer_timeout_s": 4.0}  # fmt: skip
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    producer = start_server(tmp_path / "p", "--dtype", "float32", "--max-num-batched-tokens",
                            "64", "--long-prefill-token-threshold", "64", "--kv-transfer-config",
                            json.dumps({**kv, "role": "producer"}), max_model_len=2048)  # fmt: skip
    consumer = start_server(tmp_path / "d", "--dtype", "float32", "--kv-transfer-config",
                            json.dumps({**kv, "role": "consumer"}), max_model_len=2048)  # fmt: skip
    p, d = next(producer), next(consumer)
    try:
        identity = requests.get(f"{p.base_url}/kv_transfer", timeout=10).json()
        decode_params = {"do_remote_prefill": True, "remote_engine_id": identity["engine_id"],
                         "remote_host": identity["host"], "remote_port": identity["port"],
                         "remote_request_id": "mid-push"}  # fmt: skip
        result: dict[str, requests.Response] = {}
        decode = threading.Thread(
            target=lambda: result.update(leg=_post(d, prompt, kv_transfer_params=decode_params))
        )
        decode.start()
        time.sleep(0.5)  # the decode leg's push request reaches the producer first
        prefill_error: list[BaseException] = []

        def prefill_leg() -> None:
            try:
                _post(p, prompt, kv_transfer_params={"do_remote_decode": True,
                                                     "transfer_id": "mid-push"})  # fmt: skip
            except requests.ConnectionError as exc:  # its server dies under it
                prefill_error.append(exc)

        prefill = threading.Thread(target=prefill_leg, daemon=True)
        prefill.start()
        deadline = time.monotonic() + 30
        while p.metrics()["vllm:num_requests_running"] < 1:
            assert time.monotonic() < deadline, "the prefill leg never ran"
            time.sleep(0.02)
        time.sleep(0.6)  # several chunks computed and pushed, many to go
        assert p.metrics()["vllm:num_requests_running"] == 1, "the prefill finished too soon"
        p.process.send_signal(signal.SIGKILL)
        p.process.wait(30)
        started = time.monotonic()
        decode.join(60)
        assert not decode.is_alive(), "the decode leg hangs"
        prefill.join(30)
        assert prefill_error, "the killed producer's own request must end with its connection"
        assert time.monotonic() - started < 30
        response = result["leg"]
        if policy == "fail":
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "kv_transfer_failed"
        else:
            assert response.status_code == 200, response.text
            # The same prompt computed from scratch on the decode engine (a cache salt keeps it
            # off the blocks the recompute left in the prefix cache).
            fresh = _post(d, prompt, cache_salt="fresh")
            assert fresh.status_code == 200, fresh.text
            tokens = response.json()["choices"][0]["token_ids"]
            assert tokens == fresh.json()["choices"][0]["token_ids"]
            assert d.metrics()["fleetserve:kv_blocks_recomputed_total"] > 0
        _idle_eventually(d)
        text = requests.get(f"{d.base_url}/metrics", timeout=10).text
        failed = [
            line
            for line in text.splitlines()
            if line.startswith("fleetserve:kv_transfers_total{") and 'outcome="failed"' in line
        ]
        assert failed and sum(float(line.rsplit(" ", 1)[1]) for line in failed) >= 1, failed
    finally:
        consumer.close()
        producer.close()
