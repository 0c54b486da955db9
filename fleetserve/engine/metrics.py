"""Prometheus metrics of one engine, under vLLM's names, plus the periodic one-line stats log.

Gauges and the cumulative scheduler counters follow the `SchedulerStats` the engine core sends
after every step; request-level histograms (TTFT, ITL, E2E, queue time) and token counters are
recorded by the API server, which sees every request's timeline. Everything lives in a registry
owned by the caller (one per app), so several engines can coexist in one process (tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleetserve.engine.core.outputs import SchedulerStats

TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass
class _Totals:
    """Counter values already exported (the core's stats are cumulative; Prometheus wants incs)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class EngineMetrics:
    """The `vllm:*` metrics of one served model, registered in `registry`."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        # NOTE: prometheus_client appends `_total` to counter names itself.
        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Requests in the running batch."
        ).labels(model_name)
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled."
        ).labels(model_name)
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)."
        ).labels(model_name)
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(model_name)
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        ).labels(model_name)
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative preemptions of running requests."
        ).labels(model_name)
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Prompt tokens of requests that produced a first token."
        ).labels(model_name)
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.").labels(
            model_name
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS_S
        ).labels(model_name)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS_S
        ).labels(model_name)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency from arrival to the last token.",
            REQUEST_LATENCY_BUCKETS_S,
        ).labels(model_name)
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            REQUEST_LATENCY_BUCKETS_S,
        ).labels(model_name)
        self._totals = _Totals()

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Update gauges and cumulative counters from the core's per-step stats."""
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        totals = self._totals
        # NOTE: a prefix-cache reset may restart the core's counts; never decrement.
        self.prefix_cache_queries.inc(
            max(0, stats.prefix_cache_queries - totals.prefix_cache_queries)
        )
        self.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits - totals.prefix_cache_hits))
        self.num_preemptions.inc(max(0, stats.num_preemptions - totals.num_preemptions))
        totals.prefix_cache_queries = stats.prefix_cache_queries
        totals.prefix_cache_hits = stats.prefix_cache_hits
        totals.num_preemptions = stats.num_preemptions


@dataclass
class StatsLogger:
    """Accumulates token counts between periodic one-line logs of the engine's state."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    last_log_time: float = field(default_factory=time.monotonic)
    last_stats: SchedulerStats = field(default_factory=SchedulerStats)
    _last_queries: int = 0
    _last_hits: int = 0

    def record_tokens(self, num_prompt: int, num_generated: int) -> None:
        self.prompt_tokens += num_prompt
        self.generation_tokens += num_generated

    @property
    def is_idle(self) -> bool:
        """Nothing ran and nothing was produced since the last line (skip logging then)."""
        stats = self.last_stats
        return not (
            stats.num_running_reqs or stats.num_waiting_reqs
            or self.prompt_tokens or self.generation_tokens
        )  # fmt: skip

    def make_line(self, now: float | None = None) -> str:
        """The log line for the interval since the previous call; resets the interval."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.last_log_time, 1e-9)
        stats = self.last_stats
        queries = stats.prefix_cache_queries - self._last_queries
        hits = stats.prefix_cache_hits - self._last_hits
        hit_rate = 100.0 * hits / queries if queries > 0 else 0.0
        line = (
            f"running: {stats.num_running_reqs} reqs, waiting: {stats.num_waiting_reqs} reqs, "
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, "
            f"prefix cache hit rate: {hit_rate:.1f}%, "
            f"prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
            f"generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s"
        )
        self.prompt_tokens = self.generation_tokens = 0
        self._last_queries, self._last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self.last_log_time = now
        return line
