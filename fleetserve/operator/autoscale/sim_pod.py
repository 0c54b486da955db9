"""A simulated engine pod: `SimEngine` behind `/health` and `/metrics`, its load from a trace.

Run as the engine command of an InferenceDeployment (the rendered `serve MODEL ...` arguments
are accepted; only `--host`, `--port`, `--kv-transfer-config` (its role), EPLB's flags and the EP
size (its `fleetserve:eplb_balancedness`, `sim_eplb`) and the `--sim-*` flags, given through
`engine.args`, are read):

    python -m fleetserve.operator.autoscale.sim_pod serve MODEL --host H --port P \
        --kv-transfer-config '{"role": "producer", ...}' --sim-trace FILE --sim-peers DIR

The trace file is JSON, re-read every second so a test can change the load while pods run:
`{"t0": <epoch s>, "trace": "step:low=1,high=12,at=30", "prompt_tokens": 8192,
"output_tokens": 256, "prefill_tokens_per_s": 16000}`. Each pod registers itself under
`DIR/<role>/` (a file it touches every 0.5 s and removes on exit) and takes
rate(now − t0) ÷ (pods of its role alive) of the load, as arrivals to its own queueing model
(prefill) or sequences to decode (decode). It starts in well under a second (no torch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from fleetserve.operator.autoscale.sim_engine import EngineModel, SimEngine, SimRequest
from fleetserve.operator.autoscale.sim_eplb import load_time_balancedness
from fleetserve.operator.autoscale.trace import Trace

__all__ = ["TraceFile", "main", "peers_alive"]

_STEP_S = 0.1
_PEER_TOUCH_S = 0.5
_PEER_FRESH_S = 2.0


@dataclass(frozen=True, slots=True)
class TraceFile:
    t0: float
    trace: Trace
    prompt_tokens: int = 8192
    output_tokens: int = 256
    prefill_tokens_per_s: float = 16000.0

    @classmethod
    def read(cls, path: Path) -> TraceFile:
        """Raises: OSError, ValueError (bad JSON, trace or field)."""
        doc = json.loads(path.read_text())
        return cls(
            t0=float(doc["t0"]),
            trace=Trace.parse(str(doc["trace"])),
            prompt_tokens=int(doc.get("prompt_tokens", 8192)),
            output_tokens=int(doc.get("output_tokens", 256)),
            prefill_tokens_per_s=float(doc.get("prefill_tokens_per_s", 16000.0)),
        )


def peers_alive(directory: Path, now: float) -> int:
    """Pods whose registration file was touched within the freshness window (at least 1)."""
    try:
        fresh = [p for p in directory.iterdir() if now - p.stat().st_mtime <= _PEER_FRESH_S]
    except FileNotFoundError:
        return 1
    return max(1, len(fresh))


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's product of uniforms: fine for the small means of one step)."""
    limit, n, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        n += 1
        product *= rng.random()
    return n


class _Pod:
    def __init__(self, role: str, trace_path: Path, peers: Path, seed: int) -> None:
        self.role = role
        self.trace_path = trace_path
        self.peers = peers / role
        self.me = self.peers / (os.environ.get("HOSTNAME") or str(os.getpid()))
        self.rng = random.Random(seed)
        self.trace = TraceFile.read(trace_path)
        self.engine = SimEngine(
            role, EngineModel(prefill_tokens_per_s=self.trace.prefill_tokens_per_s)
        )
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def run(self) -> None:
        self.peers.mkdir(parents=True, exist_ok=True)
        last_read = last_touch = 0.0
        while not self.stop.wait(_STEP_S):
            now = time.time()
            if now - last_touch >= _PEER_TOUCH_S:
                self.me.touch()
                last_touch = now
            if now - last_read >= 1.0:
                # A file being rewritten: keep the last good one.
                with contextlib.suppress(OSError, ValueError, KeyError):
                    self.trace = TraceFile.read(self.trace_path)
                last_read = now
            share = self.trace.trace.rate(now - self.trace.t0) / peers_alive(self.peers, now)
            with self.lock:
                for _ in range(_poisson(self.rng, share * _STEP_S)):
                    r = SimRequest(now, self.trace.prompt_tokens, self.trace.output_tokens)
                    self.engine.submit(r)
                self.engine.advance(now, _STEP_S)
        self.me.unlink(missing_ok=True)

    def metrics(self) -> bytes:
        with self.lock:
            return self.engine.exposition(time.time())


def _handler(pod: _Pod) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                body, kind = b"ok", "text/plain"
            elif self.path == "/metrics":
                body, kind = pod.metrics(), "text/plain; version=0.0.4"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the scrapes every second would drown the pod's log

    return Handler


def _role(kv_config: str | None) -> str:
    if not kv_config:
        raise ValueError("--kv-transfer-config is required: its role says prefill or decode")
    role = json.loads(kv_config).get("role")
    if role not in ("producer", "consumer"):
        raise ValueError(f"--kv-transfer-config role must be producer or consumer, got {role!r}")
    return "prefill" if role == "producer" else "decode"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a simulated engine pod")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--kv-transfer-config", default=None)
    parser.add_argument("--sim-trace", type=Path, required=True)
    parser.add_argument("--sim-peers", type=Path, required=True)
    parser.add_argument("--sim-seed", type=int, default=0)
    parser.add_argument("--enable-eplb", action="store_true")
    parser.add_argument("--num-redundant-experts", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    args, _ = parser.parse_known_args(argv)
    pod = _Pod(_role(args.kv_transfer_config), args.sim_trace, args.sim_peers, args.sim_seed)
    if args.enable_eplb:
        pod.engine.eplb_balancedness = load_time_balancedness(
            args.tensor_parallel_size * args.data_parallel_size, args.num_redundant_experts
        )
    server = ThreadingHTTPServer((args.host, args.port), _handler(pod))
    worker = threading.Thread(target=pod.run, name="sim", daemon=True)
    worker.start()

    def stop(*_: Any) -> None:
        pod.stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve_forever()
    worker.join(timeout=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
