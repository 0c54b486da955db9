"""End to end against a real `fleetserve serve` process (bundled SmolLM2, CPU), with `openai`.

One server per module: --max-num-seqs 4 --max-waiting-requests 6 --api-key. The engine-death
test runs last because it kills the server's engine core. These tests check what only the real
engine shows (outputs equal to `LLM`'s, stop strings across processes, real logprobs, aborts
freeing KV blocks, metrics, overload, death) and walk each endpoint's path end to end; the
response shapes and error bodies in detail are tested in-process over a scripted engine
(test_serving*.py, test_app.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

from fleetserve import LLM, SamplingParams
from tests.server.server_process import API_KEY, MAX_MODEL_LEN, ServerHandle, start_server

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    yield from start_server(
        tmp_path_factory.mktemp("server"), "--max-num-seqs", "4", "--max-waiting-requests", "6"
    )


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(server: ServerHandle) -> LLM:
    return LLM(server.model_path, dtype="float32", max_model_len=MAX_MODEL_LEN)


def _post(server: ServerHandle, path: str, body: object, **kwargs: object) -> requests.Response:
    data = body if isinstance(body, str) else json.dumps(body)
    headers = kwargs.pop("headers", server.headers)
    return requests.post(f"{server.base_url}{path}", data=data, headers=headers, timeout=120)  # type: ignore[arg-type]


# -- 1. the OpenAI client: chat and completions, streaming and not ------------------------


def test_models_lists_the_served_model(client: Any, server: ServerHandle) -> None:
    assert [m.id for m in client.models.list().data] == [server.model_name]


def test_greedy_completion_equals_llm_generate(client: Any, server: ServerHandle, llm: LLM) -> None:
    expected = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
    result = client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.model_extra["token_ids"] == expected.outputs[0].token_ids
    assert choice.model_extra["prompt_token_ids"] == expected.prompt_token_ids
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    # Pretokenized prompts skip tokenization; X-Request-Id names the request end to end.
    body = {"prompt": expected.prompt_token_ids, "max_tokens": 8, "temperature": 0}
    raw = _post(server, "/v1/completions", body, headers={**server.headers, "X-Request-Id": "r-1"})
    assert raw.json()["choices"][0]["text"] == expected.outputs[0].text
    assert raw.headers["X-Request-Id"] == "r-1" and raw.json()["id"] == "cmpl-r-1"


def test_greedy_chat_stream_equals_llm_chat(client: Any, server: ServerHandle, llm: LLM) -> None:
    expected = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=8))[0]
    stream = client.chat.completions.create(
        model=server.model_name, messages=CHAT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [expected.outputs[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert all(c.usage is None for c in chunks[:-1])  # only the final chunk without the option
    assert usage is not None
    assert usage.prompt_tokens == len(expected.prompt_token_ids)
    assert usage.completion_tokens == len(expected.outputs[0].token_ids)

    full = client.chat.completions.create(
        model=server.model_name, messages=CHAT, max_tokens=8, temperature=0
    )
    assert full.choices[0].message.content == expected.outputs[0].text
    assert full.usage.completion_tokens == usage.completion_tokens


def test_stop_string_never_leaks_in_a_stream(client: Any, server: ServerHandle, llm: LLM) -> None:
    full = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].text
    assert len(full) > 12, full
    cut = len(full) // 2
    stop = full[cut : cut + 5]  # spans token boundaries in the middle of the reply
    stream = client.chat.completions.create(
        model=server.model_name, messages=CHAT, max_tokens=10, temperature=0, stream=True,
        stop=[stop],
    )  # fmt: skip
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == full[: full.index(stop)]


def test_n_and_logprobs(client: Any, server: ServerHandle) -> None:
    result = client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=4, temperature=0.8, seed=7, n=2,
        logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in result.choices) == [0, 1]
    for choice in result.choices:
        lp = choice.logprobs
        assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 4
        assert "".join(lp.tokens) == choice.text
        assert all(len(top) == 2 for top in lp.top_logprobs)
    assert result.usage.completion_tokens == 8

    chat = client.chat.completions.create(
        model=server.model_name, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert len(item.top_logprobs) == 2
        # greedy: the sampled token is the most likely one
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs), abs=1e-4)


def test_streaming_n2_completions(client: Any, server: ServerHandle) -> None:
    stream = client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=3, n=2, seed=1, stream=True,
        logprobs=1, extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1]  # once per choice
    for index in (0, 1):
        mine = [c for c in chunks if c.index == index]
        assert sum(len(c.model_extra["token_ids"]) for c in mine) == 3
        assert mine[0].model_extra["prompt_token_ids"] is not None
        assert not any(c.model_extra["prompt_token_ids"] for c in mine[1:])
        tokens = [t for c in mine for t in c.logprobs.tokens]
        offsets = [o for c in mine for o in c.logprobs.text_offset]
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_batched_prompts_number_choices_prompt_major(
    client: Any, server: ServerHandle, llm: LLM
) -> None:
    prompts = [PROMPT, "Water boils at", "One, two, three,"]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = llm.generate(prompts, greedy)
    result = client.completions.create(
        model=server.model_name, prompt=prompts, max_tokens=5, temperature=0, n=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in result.choices] == list(range(6))
    for choice in result.choices:
        want = expected[choice.index // 2]
        assert choice.text == want.outputs[0].text  # greedy: both samples of a prompt agree
        assert choice.model_extra["prompt_token_ids"] == want.prompt_token_ids
    assert result.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert result.usage.completion_tokens == 6 * 5

    stream = client.completions.create(
        model=server.model_name, prompt=prompts, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [e.outputs[0].text for e in expected]
    assert chunks[-1].usage.completion_tokens == 3 * 5
    assert len({c.id for c in chunks}) == 1


def test_echo_with_logprobs_scores_the_prompt(client: Any, server: ServerHandle, llm: LLM) -> None:
    """What evaluation harnesses send for log-likelihoods: the prompt's own logprobs."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2, prompt_logprobs=2)
    expected = llm.generate([PROMPT], params)[0]
    assert expected.prompt_logprobs is not None
    prompt_ids = expected.prompt_token_ids
    for stream in (False, True):
        result = client.completions.create(
            model=server.model_name, prompt=prompt_ids, max_tokens=1, temperature=0, echo=True,
            logprobs=2, stream=stream,
        )  # fmt: skip
        choices = [c.choices[0] for c in result if c.choices] if stream else result.choices
        tokens = [t for c in choices for t in c.logprobs.tokens]
        values = [v for c in choices for v in c.logprobs.token_logprobs]
        tops = [t for c in choices for t in c.logprobs.top_logprobs]
        assert len(tokens) == len(prompt_ids) + 1
        assert "".join(c.text for c in choices) == "".join(tokens)
        assert values[0] is None and tops[0] is None
        for pos, token_id in enumerate(prompt_ids[1:], start=1):
            entry = expected.prompt_logprobs[pos]
            assert entry is not None
            assert values[pos] == pytest.approx(entry[token_id].logprob, abs=1e-4)
            assert len(tops[pos]) == 2
        assert values[-1] == pytest.approx(
            expected.outputs[0].logprobs[0][expected.outputs[0].token_ids[0]].logprob, abs=1e-4
        )
    bad = _post(server, "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "n": 2})
    assert bad.status_code == 400 and "n=1" in bad.json()["error"]["message"]


def test_a_refused_prompt_in_a_batch_refuses_the_batch(server: ServerHandle) -> None:
    body = {"prompt": ["fine", "hello " * 600], "max_tokens": 2}
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_tokenize_and_detokenize(server: ServerHandle, llm: LLM) -> None:
    tokens = _post(server, "/tokenize", {"prompt": PROMPT}).json()
    assert tokens["tokens"] == llm.tokenizer.encode(PROMPT)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = _post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": PROMPT}


# -- 2. bad input ----------------------------------------------------------------------------


def test_missing_api_key_gets_401(server: ServerHandle) -> None:
    response = _post(server, "/v1/completions", {"prompt": "x"}, headers={})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    wrong = requests.get(
        f"{server.base_url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=5
    )
    assert wrong.status_code == 401
    assert requests.get(f"{server.base_url}/health", timeout=5).status_code == 200


def test_bad_requests_interleaved_with_good_ones(server: ServerHandle) -> None:
    good = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    bad = [{"prompt": "x", "max_tokens": -1}, "{", {"prompt": "x", "top_p": 7}, {"n": 2}]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = []
        for i in range(8):
            body = good if i % 3 == 0 else bad[i % len(bad)]
            futures.append((body is good, pool.submit(_post, server, "/v1/completions", body)))
        results = [(is_good, f.result()) for is_good, f in futures]
    texts = {r.json()["choices"][0]["text"] for is_good, r in results if is_good}
    assert len(texts) == 1  # every good request got the same greedy answer
    assert all(r.status_code == 200 for is_good, r in results if is_good)
    assert all(r.status_code == 400 for is_good, r in results if not is_good)
    assert requests.get(f"{server.base_url}/health", timeout=5).status_code == 200


# -- 3. disconnect aborts; 5. metrics move -------------------------------------------------


def _wait_for(predicate: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


def test_disconnect_aborts_and_frees_kv(server: ServerHandle) -> None:
    idle = server.metrics()
    assert idle["vllm:num_requests_running"] == 0
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with requests.post(
        f"{server.base_url}/v1/completions", json=body, headers=server.headers, stream=True,
        timeout=120,
    ) as response:  # fmt: skip
        lines = response.iter_lines()
        received = 0
        while received < 3:
            if next(lines).startswith(b"data: "):
                received += 1
        busy = server.metrics()
        assert busy["vllm:num_requests_running"] == 1
        assert busy["vllm:kv_cache_usage_perc"] > idle["vllm:kv_cache_usage_perc"]
    # Leaving the block closes the connection mid-generation.
    _wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 0)
    after = server.metrics()
    assert after["vllm:kv_cache_usage_perc"] == idle["vllm:kv_cache_usage_perc"]
    assert after["vllm:generation_tokens_total"] < idle["vllm:generation_tokens_total"] + 400


def test_non_streaming_disconnect_aborts(server: ServerHandle) -> None:
    import socket
    from urllib.parse import urlparse

    idle_kv = server.metrics()["vllm:kv_cache_usage_perc"]
    body = json.dumps({"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}).encode()
    url = urlparse(server.base_url)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(head + body)
        _wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 1)
    # The socket is closed: the handler is cancelled and the request aborted in the engine.
    _wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 0)
    assert server.metrics()["vllm:kv_cache_usage_perc"] == idle_kv


METRIC_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
]


def test_metrics_exist_and_move(server: ServerHandle) -> None:
    before = server.metrics()
    assert set(METRIC_NAMES) <= set(before)
    # Long enough for two full KV blocks, so the second request hits the prefix cache.
    prompt = "Metrics must move under load. " * 6 + PROMPT
    body = {"prompt": prompt, "max_tokens": 3, "ignore_eos": True}
    assert _post(server, "/v1/completions", body).status_code == 200
    assert _post(server, "/v1/completions", body).status_code == 200  # a prefix-cache hit
    after = server.metrics()
    for name in METRIC_NAMES[3:]:
        if name != "vllm:num_preemptions_total":
            assert after[name] > before[name], name
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 6
    assert 'model_name="' in requests.get(f"{server.base_url}/metrics", timeout=5).text


# -- 4. overload -----------------------------------------------------------------------------


def test_overload_gets_429_with_retry_after(server: ServerHandle) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: _post(server, "/v1/completions", body), range(16)))
    statuses = sorted(r.status_code for r in results)
    assert set(statuses) == {200, 429}, statuses
    # 4 batch slots + 6 waiting sequences: at most 10 admitted, at least 6.
    assert 6 <= statuses.count(200) <= 10
    for r in results:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
        else:
            choice = r.json()["choices"][0]
            assert (
                choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 8
            )
    assert requests.get(f"{server.base_url}/health", timeout=5).status_code == 200


# -- 6. bench serve against this server ---------------------------------------------------


def test_bench_serve_prints_the_metrics_table(
    server: ServerHandle, tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    import argparse

    from fleetserve.bench.serve import add_arguments, run_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    args = parser.parse_args(
        ["--base-url", server.base_url, "--api-key", API_KEY, "--tokenizer", server.model_path,
         "--endpoint", "/v1/chat/completions", "--num-prompts", "4", "--input-len", "16",
         "--output-len", "4", "--request-rate", "20", "--goodput", "ttft:60000",
         "--output-json", str(out)]
    )  # fmt: skip
    assert run_from_args(args) == 0
    printed = capsys.readouterr().out
    for label in ("Successful requests:", "Request goodput", "Mean TTFT (ms):", "P99 ITL (ms):",
                  "Median TPOT (ms):", "Mean E2EL (ms):", "Output token throughput"):  # fmt: skip
        assert label in printed, label
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 4 and summary["total_output_tokens"] == 16


# -- engine death (last: it kills this module's engine core) ----------------------------------


def test_engine_core_death_fails_health_and_inflight(server: ServerHandle) -> None:
    import os
    import signal

    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        requests.post(
            f"{server.base_url}/v1/completions", json={**body, "stream": True},
            headers=server.headers, stream=True, timeout=120,
        ) as streaming,
    ):  # fmt: skip
        events = (line for line in streaming.iter_lines() if line.startswith(b"data: "))
        next(events)  # the stream is under way
        pending = pool.submit(_post, server, "/v1/completions", body)
        _wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 2)
        os.kill(server.engine_core_pid(), signal.SIGKILL)
        response = pending.result(timeout=30)
        rest = list(events)
    assert response.status_code == 503
    assert "engine core" in response.json()["error"]["message"]
    # A stream that already sent 200 ends with an error event and [DONE], never hangs.
    assert rest[-1] == b"data: [DONE]"
    assert json.loads(rest[-2][len(b"data: ") :])["error"]["code"] == "503"
    assert requests.get(f"{server.base_url}/health", timeout=5).status_code == 503
    again = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert again.status_code == 503
