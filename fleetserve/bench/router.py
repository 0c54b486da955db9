"""`fleetserve bench router`: what a router adds, against an engine that answers at once.

One instant backend process (`fleetserve.bench.instant_backend`: OpenAI answers with no model
behind them) and one load generator (this process, aiohttp); the same requests go, one target
after the other and never two at a time, straight to the backend, through `fleetserve router`
and through `vllm-router` (PyPI, Rust; `--vllm-router PATH`, in a side venv). Per target:

- latency: `--latency-requests` sequential non-streamed completions (one in flight), p50 and p99,
  and as many streamed ones (time to the last byte); the router's added latency is its p50/p99
  minus the direct one;
- throughput: a closed loop of `--concurrency` clients for `--duration` seconds: requests/s.

`--mode pd` puts a prefill and a decode backend behind the routers instead (fleetserve
`--prefill --decode --disaggregation always`, vllm-router `--vllm-pd-disaggregation`); the direct
column is then the client running both legs itself (prefill with `do_remote_decode`, decode with
the `kv_transfer_params` it answered), the least a P/D router must do.

`--config default` runs each router with its defaults (fleetserve: prefix- and load-aware;
vllm-router: `cache_aware`, which asks the backend to tokenize each prompt); `--config plain`
turns both routers' prefix awareness off (fleetserve `--no-prefix-aware --no-load-aware`,
vllm-router `round_robin`). A router that does not start (or never answers /health 200) is
reported as such in its column, with the last line it printed, and the other columns still run.
Both routers log at warning level. Every process started here is stopped (process groups).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from fleetserve.common.ports import free_port, free_ports

__all__ = ["Measurement", "Target", "add_arguments", "format_table", "run_from_args"]

_MODEL = "instant"
_PROMPT = "Route this request to an engine, please; it is short and should come back at once."


@dataclass(frozen=True, slots=True)
class Target:
    """One column: `argv` starts it (None: the backend itself), then it answers at `url`.

    `prefill_url` (direct P/D only): the client runs the prefill leg there itself and sends the
    `kv_transfer_params` it answers to `url`, the least any P/D router must do.
    """

    name: str
    url: str
    argv: list[str] | None = None
    prefill_url: str | None = None


@dataclass
class Measurement:
    name: str
    invocation: str = ""
    error: str = ""
    latency_ms: dict[str, float] = field(default_factory=dict)
    """'p50', 'p99', 'mean' of sequential non-streamed requests."""
    stream_ms: dict[str, float] = field(default_factory=dict)
    """The same for streamed requests, to the last byte."""
    requests_per_s: float = 0.0
    failed: int = 0
    backend_calls: dict[str, Any] = field(default_factory=dict)
    """Backend name → what it saw during this column (served kinds, unknown paths)."""


def _percentile(values: Sequence[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * pct / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _stats(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    return {
        "p50": _percentile(ms, 50),
        "p99": _percentile(ms, 99),
        "mean": sum(ms) / len(ms) if ms else math.nan,
    }


# -- processes ------------------------------------------------------------------------------


class _Process:
    """A child in its own process group, its output in a log file; stopped with its group."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip

    def last_line(self) -> str:
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1][-300:] if lines else "(no output)"

    def stop(self, grace_s: float = 5.0) -> None:
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
                return


def _get(url: str, timeout_s: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def _post_once(url: str) -> None:
    body = json.dumps({"model": _MODEL, "prompt": _PROMPT, "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with contextlib.suppress(urllib.error.URLError, OSError):
        urllib.request.urlopen(request, timeout=5).close()


def _wait_ready(proc: _Process | None, url: str, timeout_s: float) -> str:
    """'' once `url`/health answers 200, else why not. A router that becomes ready only after a
    real generation went through gets one completion a second while it is not."""
    deadline = time.monotonic() + timeout_s
    last_post = 0.0
    while time.monotonic() < deadline:
        if proc is not None and proc.proc.poll() is not None:
            return f"exited with code {proc.proc.returncode}: {proc.last_line()}"
        if _get(f"{url}/health") == 200:
            return ""
        if time.monotonic() - last_post > 1.0 and _get(f"{url}/v1/models") == 200:
            _post_once(url)
            last_post = time.monotonic()
        time.sleep(0.1)
    tail = proc.last_line() if proc is not None else ""
    return f"/health did not answer 200 within {timeout_s:g} s; last output: {tail}"


def _backend_stats(backend_url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{backend_url}/stats", timeout=5) as response:
            data: dict[str, Any] = json.load(response)
            return data
    except (urllib.error.URLError, OSError, json.JSONDecodeError):
        return {}


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section in ("served", "unknown"):
        a, b = after.get(section) or {}, before.get(section) or {}
        diff = {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0)}
        if diff:
            out[section] = diff
    return out


# -- load -----------------------------------------------------------------------------------


async def _one(session: aiohttp.ClientSession, target: Target, stream: bool) -> float | None:
    """Seconds for one completion (to the last byte), or None when it failed."""
    body: dict[str, Any] = {"model": _MODEL, "prompt": _PROMPT, "max_tokens": 16,
                            "temperature": 0.0}  # fmt: skip
    if stream:
        body["stream"] = True
    start = time.perf_counter()
    try:
        if target.prefill_url is not None:
            leg = {**body, "stream": False, "max_tokens": 1,
                   "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
            async with session.post(f"{target.prefill_url}/v1/completions", json=leg) as first:
                if first.status != 200:
                    return None
                body["kv_transfer_params"] = (await first.json())["kv_transfer_params"]
        async with session.post(f"{target.url}/v1/completions", json=body) as response:
            data = await response.read()
            if response.status != 200:
                return None
    except (aiohttp.ClientError, TimeoutError, KeyError, json.JSONDecodeError):
        return None
    elapsed = time.perf_counter() - start
    if stream and not data.rstrip().endswith(b"data: [DONE]"):
        return None
    return elapsed


async def _sequential(target: Target, n: int, stream: bool) -> tuple[list[float], int]:
    connector = aiohttp.TCPConnector(limit=2)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        times, failed = [], 0
        for _ in range(n):
            t = await _one(session, target, stream)
            if t is None:
                failed += 1
            else:
                times.append(t)
        return times, failed


async def _closed_loop(target: Target, clients: int, duration_s: float) -> tuple[int, int, float]:
    """(completed, failed, seconds) of `clients` loops sending back to back for `duration_s`."""
    connector = aiohttp.TCPConnector(limit=2 * clients)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        done = failed = 0
        start = time.perf_counter()
        stop_at = start + duration_s

        async def loop() -> None:
            nonlocal done, failed
            while time.perf_counter() < stop_at:
                if await _one(session, target, stream=False) is None:
                    failed += 1
                else:
                    done += 1

        await asyncio.gather(*(loop() for _ in range(clients)))
        return done, failed, time.perf_counter() - start


def measure(target: Target, args: argparse.Namespace) -> Measurement:
    m = Measurement(target.name)

    async def run() -> None:
        await _closed_loop(target, 8, args.warmup)
        times, failed = await _sequential(target, args.latency_requests, stream=False)
        m.latency_ms, m.failed = _stats(times), failed
        times, failed = await _sequential(target, args.latency_requests, stream=True)
        m.stream_ms, m.failed = _stats(times), m.failed + failed
        done, failed, seconds = await _closed_loop(target, args.concurrency, args.duration)
        m.requests_per_s, m.failed = done / seconds, m.failed + failed

    asyncio.run(run())
    return m


# -- output ---------------------------------------------------------------------------------


def format_table(results: list[Measurement], reference: str = "vllm-router") -> str:
    """The columns side by side; ratios of each router to `reference` where both ran."""
    direct = next((r for r in results if r.name == "direct" and not r.error), None)
    ref = next((r for r in results if r.name == reference and not r.error), None)
    names = [r.name for r in results]
    width = max(14, *(len(n) + 2 for n in names))
    lines = [f"{'':<34}" + "".join(f"{n:>{width}}" for n in names)]

    def row(label: str, values: list[str]) -> None:
        lines.append(f"{label:<34}" + "".join(f"{v:>{width}}" for v in values))

    def num(value: float, fmt: str = ".3f") -> str:
        return "-" if value is None or math.isnan(value) else format(value, fmt)

    for key, title in (("latency_ms", "latency"), ("stream_ms", "streamed latency")):
        for pct in ("p50", "p99"):
            row(f"{title} {pct} (ms)",
                ["failed" if r.error else num(getattr(r, key).get(pct, math.nan)) for r in results])  # fmt: skip
    for pct in ("p50", "p99"):
        values = []
        for r in results:
            if r.error or direct is None or r is direct:
                values.append("-")
            else:
                values.append(num(r.latency_ms[pct] - direct.latency_ms[pct]))
        row(f"added latency {pct} (ms)", values)
    row("max requests/s", ["failed" if r.error else num(r.requests_per_s, ".0f") for r in results])
    if ref is not None:
        row(f"requests/s vs {reference}",
            ["-" if r.error else num(r.requests_per_s / ref.requests_per_s, ".2f") for r in results])  # fmt: skip
    row("failed requests", ["-" if r.error else str(r.failed) for r in results])
    for r in results:
        if r.error:
            lines.append(f"{r.name}: did not run: {r.error}")
        for backend, calls in r.backend_calls.items():
            if calls.get("unknown"):
                lines.append(f"{r.name}: {backend} paths it called that an engine may not have:"
                             f" {calls['unknown']}")  # fmt: skip
    return "\n".join(lines)


# -- CLI ------------------------------------------------------------------------------------


def _default_vllm_router() -> str | None:
    side = Path("/work/peers/vllm-router-venv/bin/vllm-router")
    return str(side) if side.exists() else shutil.which("vllm-router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-router", default=None, metavar="PATH",
                        help="the vllm-router executable (default: /work/peers/vllm-router-venv/bin/"
                             "vllm-router or PATH's; 'none' leaves its column out)")  # fmt: skip
    parser.add_argument("--mode", choices=["colocated", "pd"], default="colocated",
                        help="one engine behind the router, or a prefill and a decode engine"
                             " (the router runs both legs; direct: the client does)")  # fmt: skip
    parser.add_argument("--config", choices=["default", "plain"], default="default",
                        help="routers with their defaults, or both without prefix awareness")  # fmt: skip
    parser.add_argument("--latency-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of the closed loop")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up per target")
    parser.add_argument("--ready-timeout", type=float, default=60.0)
    parser.add_argument("--output-json", default=None)


def _targets(args: argparse.Namespace, backends: dict[str, str]) -> list[Target]:
    pd = args.mode == "pd"
    if pd:
        targets = [Target("direct", backends["decode"], prefill_url=backends["prefill"])]
        fleet_engines = ["--prefill", backends["prefill"], "--decode", backends["decode"],
                         "--disaggregation", "always"]  # fmt: skip
        peer_engines = ["--vllm-pd-disaggregation", "--prefill", backends["prefill"],
                        "--decode", backends["decode"]]  # fmt: skip
    else:
        targets = [Target("direct", backends["engine"])]
        fleet_engines = ["--engine", backends["engine"], "--disaggregation", "never"]
        peer_engines = ["--worker-urls", backends["engine"]]
    port = free_port()
    fleet = [sys.executable, "-m", "fleetserve", "--log-level", "WARNING", "router",
             "--discovery", "static", *fleet_engines, "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    if args.config == "plain":
        fleet += ["--no-prefix-aware", "--no-load-aware"]
    targets.append(Target("fleetserve", f"http://127.0.0.1:{port}", fleet))
    vllm_router = _default_vllm_router() if args.vllm_router is None else args.vllm_router
    if vllm_router != "none":
        if vllm_router is None or not Path(vllm_router).exists():
            raise ValueError(
                "vllm-router not found: install it in a side venv (python -m venv"
                " /work/peers/vllm-router-venv && /work/peers/vllm-router-venv/bin/pip install"
                " vllm-router), pass --vllm-router PATH, or --vllm-router none"
            )
        port = free_port()
        policy = "cache_aware" if args.config == "default" else "round_robin"
        peer = [vllm_router, "--host", "127.0.0.1", "--port", str(port), *peer_engines,
                "--policy", policy, "--log-level", "warning"]  # fmt: skip
        targets.append(Target("vllm-router", f"http://127.0.0.1:{port}", peer))
    return targets


def run_from_args(args: argparse.Namespace) -> int:
    if args.latency_requests < 1 or args.concurrency < 1 or args.duration <= 0:
        raise ValueError("--latency-requests and --concurrency must be >= 1, --duration > 0")
    names = ["prefill", "decode"] if args.mode == "pd" else ["engine"]
    ports = free_ports(len(names))
    urls = {name: f"http://127.0.0.1:{port}" for name, port in zip(names, ports, strict=True)}
    targets = _targets(args, urls)
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        logs = Path(tmp)
        backends: dict[str, _Process] = {}
        results: list[Measurement] = []
        try:
            for name, url in urls.items():
                port = url.rsplit(":", 1)[1]
                backends[name] = _Process(name, [sys.executable, "-m", "fleetserve.bench.instant_backend",
                                                 "--port", port, "--model", _MODEL, "--engine-id", name], logs)  # fmt: skip
            for name, url in urls.items():
                why = _wait_ready(backends[name], url, 30)
                if why:
                    raise RuntimeError(f"the instant backend ({name}) did not start: {why}")
            print(f"bench router on {os.cpu_count()} CPUs: {args.mode}, instant backends {urls},"
                  f" config {args.config}, {args.latency_requests} sequential requests (and as"
                  f" many streamed), then {args.concurrency} clients for {args.duration:g} s;"
                  " one target at a time")  # fmt: skip
            for target in targets:
                invocation = " ".join(target.argv) if target.argv else "(the backends themselves)"
                print(f"-- {target.name}: {invocation}", flush=True)
                proc = _Process(target.name, target.argv, logs) if target.argv else None
                try:
                    why = _wait_ready(proc, target.url, args.ready_timeout)
                    before = {n: _backend_stats(u) for n, u in urls.items()}
                    if why:
                        m = Measurement(target.name, invocation, error=why)
                    else:
                        m = measure(target, args)
                        m.invocation = invocation
                    m.backend_calls = {
                        n: _delta(_backend_stats(u), before[n]) for n, u in urls.items()
                    }
                finally:
                    if proc is not None:
                        proc.stop()
                results.append(m)
                summary = m.error or (
                    f"p50 {m.latency_ms['p50']:.3f} ms, {m.requests_per_s:.0f} requests/s"
                )
                print(f"   {summary}", flush=True)
        finally:
            for backend in backends.values():
                backend.stop()
    print(format_table(results))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if any(r.name != "direct" and not r.error for r in results) else 1
