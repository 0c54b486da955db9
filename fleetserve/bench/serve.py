"""`fleetserve bench serve`: an async streaming load generator for any OpenAI-compatible server.

Requests arrive as a Poisson process (`--request-rate`, gamma-shaped with `--burstiness`) or all at
once, optionally capped at `--max-concurrency` in flight. Prompts are synthetic: random token ids
of the given input length, or a shared prefix per group plus a random suffix (`--dataset
shared-prefix`), decoded to text when a tokenizer is available. Every request streams, and the
client records its timeline. Metric definitions follow `vllm bench serve` (anchors-engine.md §6):

- TTFT: time from sending the request to the first streamed token.
- TPOT (per request): (E2EL - TTFT) / (output tokens - 1), for requests with more than 1 token.
- ITL: every gap between successive streamed chunks, pooled over requests (a multi-token chunk is
  one gap).
- E2EL: time from sending to the end of the response.
- Goodput: completed requests meeting every `--goodput` SLO (ttft, tpot, e2el in ms), per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from fleetserve.bench.serve_launch import add_launch_arguments

_SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    """One request's client-side timeline (seconds)."""

    prompt_len: int
    success: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0

    @property
    def tpot_s(self) -> float:
        """0 for requests with at most one output token (they count as meeting a TPOT SLO)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    stats_ms: dict[str, dict[str, float]]
    """Metric ('ttft', 'tpot', 'itl', 'e2el') → {'mean', 'median', 'std', 'p90', ...} in ms."""


# -- workload -------------------------------------------------------------------------------


def make_requests(
    args: argparse.Namespace, vocab_size: int, decode: Any | None
) -> list[BenchRequest]:
    """Synthetic prompts; `decode(ids) -> str` turns them into text when given."""
    rng = random.Random(args.seed)
    ratio = args.random_range_ratio

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab_size) for _ in range(n)]  # skip special tokens

    prefixes: list[list[int]] = []
    if args.dataset == "shared-prefix":
        if not 0 < args.shared_prefix_len < args.input_len:
            raise ValueError("--shared-prefix-len must be in (0, --input-len)")
        prefixes = [tokens(args.shared_prefix_len) for _ in range(args.num_prefix_groups)]
    elif args.dataset != "random":
        raise ValueError(f"--dataset must be 'random' or 'shared-prefix', got {args.dataset!r}")
    requests = []
    for i in range(args.num_prompts):
        n_in = length(args.input_len)
        if prefixes:
            prefix = prefixes[i % len(prefixes)]
            ids = prefix + tokens(max(1, n_in - len(prefix)))
        else:
            ids = tokens(n_in)
        prompt: str | list[int] = decode(ids) if decode is not None else ids
        requests.append(BenchRequest(prompt, len(ids), length(args.output_len)))
    return requests


def arrival_delays(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between request starts: gamma(shape=burstiness, mean=1/rate); 0 when rate is inf."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num)]


# -- client ---------------------------------------------------------------------------------


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    chat: bool,
    model: str,
    request: BenchRequest,
    args: argparse.Namespace,
) -> RequestResult:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
    }
    if chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    result = RequestResult(prompt_len=request.prompt_len)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))
                    return result
                if event.get("usage"):
                    result.output_tokens = int(event["usage"].get("completion_tokens", 0))
                choices = event.get("choices") or []  # usage-only chunks have none
                text = _chunk_text(choices[0], chat) if choices else ""
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                chunks += 1
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2el_s = time.perf_counter() - start
    if result.output_tokens == 0:
        result.output_tokens = chunks  # the server sent no usage: count streamed chunks
    result.success = chunks > 0
    if not result.success:
        result.error = "no tokens were streamed"
    return result


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return str((choice.get("delta") or {}).get("content") or "")
    return str(choice.get("text") or "")


async def run_benchmark(
    args: argparse.Namespace, requests: list[BenchRequest], model: str
) -> tuple[list[RequestResult], float]:
    chat = args.endpoint.endswith("chat/completions")
    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency
    semaphore = asyncio.Semaphore(limit) if limit else None
    delays = arrival_delays(len(requests), args.request_rate, args.burstiness, args.seed)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)

    async with aiohttp.ClientSession(
        headers=headers, timeout=timeout, connector=connector
    ) as session:

        async def one(request: BenchRequest) -> RequestResult:
            if semaphore is None:
                return await send_request(session, url, chat, model, request, args)
            async with semaphore:
                return await send_request(session, url, chat, model, request, args)

        start = time.perf_counter()
        tasks = []
        for request, delay in zip(requests, delays, strict=True):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def resolve_model(args: argparse.Namespace) -> str:
    """The first model the server lists, unless --model is given."""
    if args.model:
        return str(args.model)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with (
        aiohttp.ClientSession(headers=headers) as session,
        session.get(args.base_url.rstrip("/") + "/v1/models") as response,
    ):
        response.raise_for_status()
        data = await response.json()
    return str(data["data"][0]["id"])


# -- metrics --------------------------------------------------------------------------------


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] → {'ttft': 0.5, 'tpot': 0.05} (seconds).

    Raises:
        ValueError: an unknown metric name or a non-positive/invalid number.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in _SLO_NAMES:
            raise ValueError(f"--goodput metric must be one of {_SLO_NAMES}, got {name!r}")
        try:
            ms = float(value)
        except ValueError as exc:
            raise ValueError(f"--goodput {name} must be a number of ms, got {value!r}") from exc
        if ms <= 0:
            raise ValueError(f"--goodput {name} must be > 0 ms, got {ms}")
        slos[name] = ms / 1000.0
    return slos


def _percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    pos = (len(ordered) - 1) * pct / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _stats_ms(values: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values]
    stats = {
        "mean": statistics.fmean(ms) if ms else 0.0,
        "median": statistics.median(ms) if ms else 0.0,
        "std": statistics.pstdev(ms) if ms else 0.0,
    }
    for pct in percentiles:
        stats[f"p{pct:g}"] = _percentile(ms, pct)
    return stats


def summarize(
    results: list[RequestResult],
    duration_s: float,
    percentiles: Sequence[float],
    slos: dict[str, float] | None = None,
) -> Summary:
    ok = [r for r in results if r.success]
    total_out = sum(r.output_tokens for r in ok)
    total_in = sum(r.prompt_len for r in ok)
    goodput = None
    if slos:
        good = [
            r for r in ok
            if r.ttft_s <= slos.get("ttft", math.inf)
            and r.tpot_s <= slos.get("tpot", math.inf)
            and r.e2el_s <= slos.get("e2el", math.inf)
        ]  # fmt: skip
        goodput = len(good) / duration_s
    return Summary(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        goodput=goodput,
        stats_ms={
            "ttft": _stats_ms([r.ttft_s for r in ok], percentiles),
            "tpot": _stats_ms([r.tpot_s for r in ok if r.output_tokens > 1], percentiles),
            "itl": _stats_ms([gap for r in ok for gap in r.itl_s], percentiles),
            "e2el": _stats_ms([r.e2el_s for r in ok], percentiles),
        },
    )


def format_table(summary: Summary) -> str:
    def row(label: str, value: float | int, fmt: str = ".2f") -> str:
        return f"{label:<40}{value:>12{fmt}}"

    lines = [
        "{s:{c}^52}".format(s=" Serving Benchmark Result ", c="="),
        row("Successful requests:", summary.completed, "d"),
        row("Failed requests:", summary.failed, "d"),
        row("Benchmark duration (s):", summary.duration_s),
        row("Total input tokens:", summary.total_input_tokens, "d"),
        row("Total generated tokens:", summary.total_output_tokens, "d"),
        row("Request throughput (req/s):", summary.request_throughput),
    ]
    if summary.goodput is not None:
        lines.append(row("Request goodput (req/s):", summary.goodput))
    lines += [
        row("Output token throughput (tok/s):", summary.output_throughput),
        row("Total token throughput (tok/s):", summary.total_token_throughput),
    ]
    titles = {"ttft": ("Time to First Token", "TTFT"), "tpot": (
        "Time per Output Token (excl. 1st token)", "TPOT"), "itl": ("Inter-token Latency", "ITL"),
        "e2el": ("End-to-end Latency", "E2EL")}  # fmt: skip
    for key, (title, short) in titles.items():
        lines.append("{s:{c}^52}".format(s=f" {title} ", c="-"))
        for stat, value in summary.stats_ms[key].items():
            label = stat.capitalize() if stat in ("mean", "median", "std") else stat.upper()
            lines.append(row(f"{label} {short} (ms):", value))
    lines.append("=" * 52)
    return "\n".join(lines)


def write_plot(results: list[RequestResult], path: str) -> str:
    """Histograms of TTFT, TPOT, ITL and E2EL as a PNG; returns what happened, for printing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; --plot skipped (pip install matplotlib)"
    ok = [r for r in results if r.success]
    series = {
        "TTFT (ms)": [r.ttft_s * 1000 for r in ok],
        "TPOT (ms)": [r.tpot_s * 1000 for r in ok if r.output_tokens > 1],
        "ITL (ms)": [g * 1000 for r in ok for g in r.itl_s],
        "E2EL (ms)": [r.e2el_s * 1000 for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, values) in zip(axes.flat, series.items(), strict=True):
        ax.hist(values, bins=30)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"plot written to {path}"


# -- CLI ------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions",
                        choices=["/v1/completions", "/v1/chat/completions"])  # fmt: skip
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--tokenizer", default=None,
                        help="HF folder to decode prompts to text (default: bundled model; "
                             "'none' sends token ids, completions only)")  # fmt: skip
    parser.add_argument("--dataset", default="random", choices=["random", "shared-prefix"])
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len*(1-r), len*(1+r)]")  # fmt: skip
    parser.add_argument("--shared-prefix-len", type=int, default=64)
    parser.add_argument("--num-prefix-groups", type=int, default=1)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests/s of the Poisson process (inf: all at once)")  # fmt: skip
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of inter-arrival gaps (1 = Poisson)")  # fmt: skip
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")  # fmt: skip
    parser.add_argument("--percentiles", default="90,99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--request-timeout", type=float, default=3600.0)
    parser.add_argument("--output-json", default=None, help="write summary + per-request data")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write latency histograms")
    add_launch_arguments(parser)


def _load_decoder(args: argparse.Namespace) -> tuple[int, Any | None]:
    """(vocab size, decode function or None) from --tokenizer."""
    if args.tokenizer == "none":
        return 32000, None
    path = args.tokenizer
    if path is None:
        from fleetserve.engine.models.bundled import bundled_model_path

        path = str(bundled_model_path())
    from fleetserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    return len(tokenizer), lambda ids: tokenizer.decode(ids)


def run_from_args(args: argparse.Namespace) -> int:
    if args.launch:
        import tempfile

        from fleetserve.bench.serve_launch import format_rows, run_launched

        logs = Path(tempfile.mkdtemp(prefix="fleetserve-bench-serve-"))
        print(f"server logs: {logs}")
        print(format_rows(run_launched(args, logs)))
        return 0
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    slos = parse_goodput(args.goodput)
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    vocab, decode = _load_decoder(args)
    if decode is None and args.endpoint.endswith("chat/completions"):
        raise ValueError("--endpoint /v1/chat/completions needs a --tokenizer for text prompts")
    requests = make_requests(args, vocab, decode)
    model = asyncio.run(resolve_model(args))
    print(f"benchmarking {model} at {args.base_url}{args.endpoint}: {len(requests)} requests, "
          f"rate {args.request_rate}, max concurrency {args.max_concurrency}")  # fmt: skip
    results, duration_s = asyncio.run(run_benchmark(args, requests, model))
    summary = summarize(results, duration_s, percentiles, slos)
    print(format_table(summary))
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        print(f"{summary.failed} requests failed; first errors: {errors[:3]}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({
            "model": model, "base_url": args.base_url, "endpoint": args.endpoint,
            "config": _json_config(args),
            "summary": asdict(summary),
            "requests": [asdict(r) | {"tpot_s": r.tpot_s} for r in results],
        }, indent=2, default=str))  # fmt: skip
    if args.plot:
        print(write_plot(results, args.plot))
    return 0 if summary.completed else 1


def _json_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for key, value in vars(args).items():
        if isinstance(value, float) and math.isinf(value):
            config[key] = "inf"  # JSON has no infinity
        elif isinstance(value, str | int | float | bool | list | type(None)):
            config[key] = value
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetserve.bench.serve", description=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
