"""`fleetserve bench serve`: metric math, and the client against a mock SSE server with known delays."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from fleetserve.bench.serve import (
    RequestResult,
    add_arguments,
    arrival_delays,
    make_requests,
    parse_goodput,
    run_from_args,
    summarize,
)

FIRST_TOKEN_DELAY_S = 0.3
TOKEN_GAP_S = 0.1
NUM_TOKENS = 4


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_summary_definitions_match_vllm_bench() -> None:
    results = [
        RequestResult(prompt_len=10, success=True, ttft_s=0.1, e2el_s=0.4, itl_s=[0.1, 0.2],
                      output_tokens=4),
        RequestResult(prompt_len=20, success=True, ttft_s=0.3, e2el_s=0.3, output_tokens=1),
        RequestResult(prompt_len=30, error="HTTP 429"),
    ]  # fmt: skip
    summary = summarize(results, 2.0, [50, 90], parse_goodput(["ttft:200", "tpot:150"]))
    assert (summary.completed, summary.failed) == (2, 1)
    assert summary.total_input_tokens == 30 and summary.total_output_tokens == 5
    assert summary.request_throughput == 1.0
    assert summary.total_token_throughput == 17.5
    # Request 0: TPOT = (0.4 - 0.1) / 3 = 100 ms; request 1 has one token (TPOT not defined).
    assert summary.stats_ms["tpot"]["mean"] == pytest.approx(100.0)
    assert summary.stats_ms["itl"]["median"] == pytest.approx(150.0)
    assert summary.stats_ms["itl"]["p90"] == pytest.approx(190.0)
    assert summary.stats_ms["ttft"]["mean"] == pytest.approx(200.0)
    # Only request 0 meets TTFT <= 200 ms (request 1 took 300 ms).
    assert summary.goodput == 0.5


def test_goodput_and_workload_validation() -> None:
    assert parse_goodput(["e2el:1500"]) == {"e2el": 1.5}
    with pytest.raises(ValueError, match="--goodput metric"):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match="--goodput ttft"):
        parse_goodput(["ttft:-1"])
    assert arrival_delays(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    delays = arrival_delays(2000, 10.0, 1.0, 0)
    assert sum(delays) / len(delays) == pytest.approx(0.1, rel=0.1)


def test_shared_prefix_prompts_share_their_prefix() -> None:
    args = _args("--dataset", "shared-prefix", "--num-prompts", "4", "--input-len", "20",
                 "--shared-prefix-len", "8", "--num-prefix-groups", "2")  # fmt: skip
    requests = make_requests(args, 1000, None)
    ids = [r.prompt for r in requests]
    assert all(isinstance(p, list) and len(p) == 20 for p in ids)
    assert ids[0][:8] == ids[2][:8] != ids[1][:8] == ids[3][:8]
    assert ids[0][8:] != ids[2][8:]


async def _mock_completions(request: web.Request) -> web.StreamResponse:
    """Streams NUM_TOKENS one-token chunks with known delays, then a usage-only chunk."""
    body = await request.json()
    assert body["stream"] is True
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.sleep(FIRST_TOKEN_DELAY_S)
    for i in range(NUM_TOKENS):
        if i:
            await asyncio.sleep(TOKEN_GAP_S)
        chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": NUM_TOKENS}}
    await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return response


async def _mock_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "mock", "object": "model"}]})


@pytest.fixture
def mock_server() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", _mock_completions)
    app.router.add_get("/v1/models", _mock_models)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_client_timings_against_mock_sse_server(
    mock_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    args = _args("--base-url", mock_server, "--tokenizer", "none", "--num-prompts", "3",
                 "--input-len", "5", "--output-len", "4", "--max-concurrency", "3",
                 "--goodput", "ttft:1000", "tpot:1000", "--output-json", str(out),
                 "--plot", str(tmp_path / "plot.png"))  # fmt: skip
    assert run_from_args(args) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TTFT (ms)" in printed
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert summary["completed"] == 3 and summary["total_output_tokens"] == 3 * NUM_TOKENS
    stats = summary["stats_ms"]
    # Generous tolerances: the box is shared, but delays only ever grow.
    assert 1000 * FIRST_TOKEN_DELAY_S <= stats["ttft"]["mean"] < 1000 * FIRST_TOKEN_DELAY_S + 250
    assert 1000 * TOKEN_GAP_S * 0.9 <= stats["itl"]["median"] < 1000 * TOKEN_GAP_S + 150
    assert stats["tpot"]["mean"] == pytest.approx(stats["itl"]["mean"], rel=0.2)
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert all(len(r["itl_s"]) == NUM_TOKENS - 1 for r in data["requests"])
    assert data["config"]["request_rate"] == "inf"
