"""`fleetserve up`: the commands it runs (checked against the real `fleetserve serve` parser and
the engine's KV config), its start-up errors, and the local fleet end to end.

`test_up_answers_chat_completions_through_the_router` needs `fleetserve router` (issue 15): until
the router lands it fails, with `fleetserve up` saying that the router exited during start-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from fleetserve.cli import build_parser, main
from fleetserve.common.ports import free_ports, parse_port_range
from fleetserve.engine.config import KVTransferConfig
from fleetserve.fleet.up import _ports, curl_line, plan_fleet
from tests.fleet.children import ROOT, alive, wait_gone
from tests.fleet.prometheus import router_decisions, scrape, total, went_prefill_then_decode


def _args(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["up", *argv])


def test_the_plan_is_a_producer_a_consumer_and_a_static_router() -> None:
    args = _args("--connector", "mooncake", "--transfer-mode", "push", "--disaggregation",
                 "selective", "--min-uncached-tokens", "64", "--no-load-aware",
                 "--engine-args", "--num-kv-blocks 128 --device cpu")  # fmt: skip
    plan = plan_fleet(args, "/models/SmolLM2", (8000, 8101, 8102))
    prefill, decode = plan.engines
    assert plan.model_name == "SmolLM2"
    assert plan.base_url == "http://127.0.0.1:8000"
    assert [c.name for stage in plan.stages for c in stage] == ["prefill", "decode", "router"]
    fleetserve = [sys.executable, "-m", "fleetserve"]
    assert plan.router.argv == [
        *fleetserve, "router", "--discovery", "static",
        "--prefill", "http://127.0.0.1:8101", "--decode", "http://127.0.0.1:8102",
        "--host", "127.0.0.1", "--port", "8000", "--disaggregation", "selective",
        "--min-uncached-tokens", "64", "--no-load-aware",
    ]  # fmt: skip
    assert plan.router.health_url == "http://127.0.0.1:8000/health"
    for child, role, port in ((prefill, "producer", 8101), (decode, "consumer", 8102)):
        assert child.argv[:4] == [*fleetserve, "serve"]
        assert child.health_url == f"http://127.0.0.1:{port}/health"
        # Every flag is one the real `fleetserve serve` takes, with the values planned.
        served = build_parser().parse_args(list(child.argv[3:]))
        assert (served.model, served.port, served.host) == ("/models/SmolLM2", port, "127.0.0.1")
        assert served.served_model_name == "SmolLM2"
        assert (served.num_kv_blocks, served.device) == (128, "cpu")
        kv = KVTransferConfig.from_dict(served.kv_transfer_config)
        assert (kv.connector, kv.role, kv.transfer_mode, kv.host) == (
            "mooncake",
            role,
            "push",
            "127.0.0.1",
        )


def test_the_router_flags_default_to_the_routers_own() -> None:
    plan = plan_fleet(_args(), "/m", (9000, 9101, 9102))
    assert plan.router.argv[-2:] == ["--disaggregation", "always"]
    assert "--min-uncached-tokens" not in plan.router.argv


def test_curl_line_is_a_valid_request_body() -> None:
    line = curl_line("http://127.0.0.1:8000", "SmolLM2-135M-Instruct")
    body = json.loads(line.split(" -d ", 1)[1].strip("'"))
    assert body["model"] == "SmolLM2-135M-Instruct" and body["messages"][0]["role"] == "user"
    assert line.startswith("curl -s http://127.0.0.1:8000/v1/chat/completions ")


def test_a_busy_port_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["up", "--port", "0", "--decode-port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"the decode port (--decode-port) 127.0.0.1:{port} cannot be bound" in err
        assert main(["up", "--port", str(port)]) == 2
        assert "the router port (--port) 127.0.0.1:" in capsys.readouterr().err


def _three_free_ports_in_a_row() -> int:
    """The first of three free ports in a row in this worker's share of the suite's range (the
    conftest sets FLEETSERVE_PORT_RANGE to it), which no other worker chooses from."""
    share = os.environ["FLEETSERVE_PORT_RANGE"]
    first, last = parse_port_range(share)
    for low in range(first, last - 1, 3):
        with contextlib.ExitStack() as held:
            try:
                for port in range(low, low + 3):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return low
    raise AssertionError(f"no three free ports in a row in {share}")


def test_the_ports_left_to_choose_are_chosen_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """With --port 0, the router's and both engines' ports are chosen at once, so they differ:
    from a range of exactly three ports, they are those three, every time."""
    low = _three_free_ports_in_a_row()
    monkeypatch.setenv("FLEETSERVE_PORT_RANGE", f"{low}-{low + 2}")
    for _ in range(10):
        ports = _ports(build_parser().parse_args(["up", "--port", "0"]))
        assert sorted(ports) == [low, low + 1, low + 2]
    given = _ports(build_parser().parse_args(["up", "--port", "0", "--decode-port", str(low)]))
    assert given[2] == low and sorted(given[:2]) == [low + 1, low + 2]


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--once"]) == 2
    assert "--once needs --ask" in capsys.readouterr().err
    assert main(["up", "--model", "/nonexistent", "--port", "0"]) == 2
    assert "--model must be a Hugging Face model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["up", "--connector", "nccl"])
    assert "invalid choice: 'nccl'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["up", "--port", "70000"])
    assert "a port must be in 0..65535" in capsys.readouterr().err


# -- end to end (needs `fleetserve router`, issue 15) ---------------------------------------


def _chat(base: str, question: str, **body: object) -> requests.Response:
    return requests.post(
        f"{base}/v1/chat/completions",
        json={"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": question}],
              "max_tokens": 16, "temperature": 0.0, **body},
        timeout=120,
    )  # fmt: skip


def _streamed_text(response: requests.Response) -> str:
    text = []
    for raw in response.iter_lines():
        line = raw.decode()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[5:])["choices"]:
            text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


@pytest.mark.slow
@pytest.mark.router
def test_up_answers_chat_completions_through_the_router(tmp_path: Path) -> None:
    """`fleetserve up` → a chat completion through the router on 127.0.0.1: real text, the
    colocated answer, prefill → decode visible in the metrics; Ctrl-C stops every process."""
    port, prefill_port, decode_port = free_ports(3)
    log_path = tmp_path / "up.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetserve", "up", "--port", str(port), "--prefill-port",
         str(prefill_port), "--decode-port", str(decode_port), "--dtype", "float32",
         "--max-model-len", "512", "--startup-timeout", "300"],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while "[up] ready" not in log_path.read_text():
            assert proc.poll() is None, f"fleetserve up exited:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not up:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.5)
        base = f"http://127.0.0.1:{port}"
        decode = f"http://127.0.0.1:{decode_port}"
        loaded_before = total(scrape(decode), "fleetserve:kv_tokens_loaded")
        question = "What is the capital of France?"
        answer = _chat(base, question)
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["message"]["content"]
        assert text.strip(), "the router answered no text"
        # The prefill engine asked directly computes the whole prompt itself: same greedy text.
        direct = _chat(f"http://127.0.0.1:{prefill_port}", question)
        assert direct.status_code == 200, direct.text
        assert text == direct.json()["choices"][0]["message"]["content"]
        with _chat(base, question, stream=True) as streamed:
            assert streamed.status_code == 200
            assert _streamed_text(streamed) == text
        # prefill → decode: the decode engine loaded the prompt's KV, and the router says so.
        assert total(scrape(decode), "fleetserve:kv_tokens_loaded") > loaded_before
        assert went_prefill_then_decode(router_decisions(scrape(base))) >= 2
        models = requests.get(f"{base}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
        pids = [int(line.split("(pid ")[1].split(")")[0])
                for line in log_path.read_text().splitlines() if line.startswith("[up] started ")]  # fmt: skip
        assert len(pids) == 3
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == 0, log_path.read_text()[-4000:]
    assert wait_gone(pids, timeout_s=5) == [], [p for p in pids if alive(p)]


def test_fleetserve_up_does_not_load_torch() -> None:
    """The supervising process stays small: `fleetserve up` (here stopped by a busy port after
    parsing its flags and checking its ports) imports neither torch nor the engine."""
    code = (
        "import socket, sys\n"
        "from fleetserve.cli import main\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "code = main(['up', '--port', str(s.getsockname()[1])])\n"
        "print(code, 'torch' in sys.modules, any(m.startswith('fleetserve.engine') for m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)  # fmt: skip
    assert out.stdout.split() == ["2", "False", "False"], out.stdout + out.stderr
