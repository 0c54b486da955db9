"""`fleetserve bench pd-handover`: what handing a prompt from a prefill to a decode engine costs.

For the same prompts, TTFT of one colocated engine against TTFT of a warm prefill/decode pair
driven with vLLM's `kv_transfer_params` protocol, split into the KV transfer the transport timed
(`fleetserve:kv_transfer_seconds` on both engines) and everything else: the second HTTP leg,
tokenising twice, the consumer's scheduling and its one-token step. Two ways of driving the pair:

- pull: the prefill leg (`max_tokens` 1) first, then the decode leg; the decode engine reads the
  blocks (what vLLM's proxy and its 197 ms p50 / 29 ms transfer figure measure);
- push, overlapped: both legs dispatched together, as a router that learned the producer's
  identity once does (GET /kv_transfer); the producer writes each layer into the blocks the
  decode engine pre-allocated as it computes them.

Every prompt is new to every engine (a random prefix), so no prefix-cache hit flatters either
side. Engines run one configuration at a time: the colocated engine, then each pair.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetserve.common.ports import free_port

__all__ = ["add_arguments", "run_from_args"]

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")
_TRANSFER_SUM = "fleetserve:kv_transfer_seconds_sum"


@dataclass(frozen=True, slots=True)
class Server:
    host: str
    port: int

    def post(self, path: str, body: dict[str, Any]) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"POST {path} → {response.status}: {response.read()[:300]!r}")
        return response

    def get_json(self, path: str) -> Any:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())

    def metric_sum(self, name: str) -> float:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + " ") or line.startswith(name + "{")
        )


@contextmanager
def _serve(args: argparse.Namespace, log_dir: Path, name: str, *extra: str) -> Iterator[Server]:
    """One `fleetserve serve` process, until /health answers; stopped on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "fleetserve", "serve", args.model, "--port", str(port),
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), *extra]  # fmt: skip
    log = (log_dir / f"{name}.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = Server("127.0.0.1", port)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {log.name}")
            try:
                conn = http.client.HTTPConnection(server.host, port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy after 300 s; see {log.name}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": 2,
        "ignore_eos": True,
        "temperature": 0.0,
        "return_token_ids": True,
        **extra,
    }


def _token_times(server: Server, body: dict[str, Any], start: float) -> list[float]:
    """Seconds from `start` until each streamed chunk with tokens of `body` arrives."""
    response = server.post("/v1/completions", {**body, "stream": True})
    times = []
    for raw in response:
        line = raw.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0].get("token_ids"):
                times.append(time.perf_counter() - start)
    if not times:
        raise RuntimeError("the stream ended without a token")
    return times


def _first_token_s(server: Server, body: dict[str, Any], start: float) -> float:
    return _token_times(server, body, start)[0]


def _colocated(server: Server, prompt: str) -> tuple[float, float]:
    """(TTFT, the gap to the second token: one decode step of this prompt)."""
    times = _token_times(server, _body(prompt), time.perf_counter())
    if len(times) < 2:
        raise RuntimeError("the colocated engine stopped after one token (EOS): use other prompts")
    return times[0], times[1] - times[0]


def _pull(prefill: Server, decode: Server, prompt: str) -> float:
    start = time.perf_counter()
    leg = json.loads(
        prefill.post(
            "/v1/completions", _body(prompt, kv_transfer_params={"do_remote_decode": True})
        ).read()
    )
    return _first_token_s(
        decode, _body(prompt, kv_transfer_params=leg["kv_transfer_params"]), start
    )


def _push_overlapped(
    prefill: Server, decode: Server, prompt: str, identity: dict[str, Any]
) -> float:
    transfer_id = f"bench-{random.getrandbits(64):016x}"
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": identity["engine_id"],
        "remote_host": identity["host"],
        "remote_port": identity["port"],
        "remote_request_id": transfer_id,
    }
    start = time.perf_counter()
    errors: list[BaseException] = []

    def prefill_leg() -> None:
        try:
            prefill.post(
                "/v1/completions",
                _body(
                    prompt,
                    kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id},
                ),
            ).read()
        except BaseException as exc:  # reported below, in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=prefill_leg)
    thread.start()
    try:
        return _first_token_s(decode, _body(prompt, kv_transfer_params=params), start)
    finally:
        thread.join(300)
        if errors:
            raise errors[0]


def _prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(n)]


def _timed_pair(
    prefill: Server, decode: Server, prompts: list[str], one: Callable[[str], float]
) -> list[tuple[float, float]]:
    """(TTFT, transfer seconds) per prompt, one at a time (transfer from both engines' metrics)."""
    out = []
    for prompt in prompts:
        before = prefill.metric_sum(_TRANSFER_SUM) + decode.metric_sum(_TRANSFER_SUM)
        ttft = one(prompt)
        after = prefill.metric_sum(_TRANSFER_SUM) + decode.metric_sum(_TRANSFER_SUM)
        out.append((ttft, after - before))
    return out


def _kv(connector: str, role: str, mode: str) -> str:
    return json.dumps({"connector": connector, "role": role, "transfer_mode": mode})


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:8.1f}"


def _pair(
    args: argparse.Namespace, log_dir: Path, connector: str, mode: str
) -> contextlib.AbstractContextManager[tuple[Server, Server]]:
    @contextmanager
    def both() -> Iterator[tuple[Server, Server]]:
        name = f"{connector}-{mode}"
        flag = "--kv-transfer-config"
        with (
            _serve(args, log_dir, f"{name}-p", flag, _kv(connector, "producer", mode)) as p,
            _serve(args, log_dir, f"{name}-d", flag, _kv(connector, "consumer", mode)) as d,
        ):
            yield p, d

    return both()


def _print(
    rows: list[tuple[str, str, int, list[tuple[float, float]], list[tuple[float, float]]]],
) -> None:
    print(
        f"{'connector':>9} {'legs':>15} {'words':>5} {'colocated':>9} {'P/D':>8} {'P/D-colo':>8}"
        f" {'transfer':>8} {'else':>8} {'step':>8} {'else-step':>9}"
    )
    for connector, mode, words, colo, timed in rows:
        pull = mode == "pull"
        # Push overlaps the transfer with the prefill's compute: its exposed part is in "else".
        transfer = [x if pull else 0.0 for _, x in timed]
        extra = [t - c for (t, _), (c, _) in zip(timed, colo, strict=True)]
        rest = [e - x for e, x in zip(extra, transfer, strict=True)]
        step = [g for _, g in colo]
        beyond = [r - g for r, g in zip(rest, step, strict=True)]
        label = "pull" if pull else "push-overlapped"
        print(
            f"{connector:>9} {label:>15} {words:>5} {_ms([c for c, _ in colo]):>9}"
            f" {_ms([t for t, _ in timed])} {_ms(extra)}"
            f" {_ms(transfer) if pull else 'overlap':>8} {_ms(rest)} {_ms(step)} {_ms(beyond):>9}"
        )
    print(
        "p50 per prompt, in ms. transfer: what the transport timed (fleetserve:kv_transfer_seconds)."
        "\nelse = P/D - colocated - transfer. step: one decode step of the prompt on the colocated"
        "\nengine (the decode engine computes the last prompt token again, as in vLLM's protocol)."
    )


def run_from_args(args: argparse.Namespace) -> int:
    if args.model is None:
        from fleetserve.engine.models.bundled import bundled_model_path

        args.model = str(bundled_model_path())
    lengths = [int(x) for x in args.prompt_words.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="fleetserve-pd-handover-"))
    sets = {w: _prompts(args.num_prompts + 1, w, args.seed + w) for w in lengths}
    colocated: dict[int, list[tuple[float, float]]] = {}
    with _serve(args, log_dir, "colocated") as server:
        for words, prompts in sets.items():
            _colocated(server, "warm up " + prompts[0])
            colocated[words] = [_colocated(server, p) for p in prompts[1:]]
    rows = []
    for connector in args.connectors.split(","):
        for mode in ("pull", "push"):
            with _pair(args, log_dir, connector, mode) as (p, d):
                identity = p.get_json("/kv_transfer")

                def one(prompt: str, p: Server = p, d: Server = d, mode: str = mode) -> float:
                    if mode == "pull":
                        return _pull(p, d, prompt)
                    return _push_overlapped(p, d, prompt, identity)  # noqa: B023 (used at once)

                for words, prompts in sets.items():
                    one("warm up " + prompts[0])  # the handshake, once per pair
                    timed = _timed_pair(p, d, prompts[1:], one)
                    rows.append((connector, mode, words, colocated[words], timed))
    print(f"model {args.model}, {args.num_prompts} prompts per row; logs in {log_dir}")
    _print(rows)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (default: the bundled one)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--prompt-words", default="16,256", help="prompt lengths, in words")
    parser.add_argument("--connectors", default="tcp,mooncake")
    parser.add_argument("--seed", type=int, default=0)
