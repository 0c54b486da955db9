"""What one engine group reports, as the autoscaler reads it: counters from `/metrics` text, and
the rates between two scrapes of the same pod.

An engine's `/metrics` is parsed with prometheus_client's text parser into `EngineCounters`
(cumulative counters and gauges at one instant). `engine_load(previous, current)` turns two of
them into `EngineLoad` (rates over the interval). `join_alive` keeps only the loads of pods that
are alive now, so a dead pod's last value never counts (the stale-series ratchet llm-d hit).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from fleetserve.common import metric_names as names

__all__ = [
    "EngineCounters",
    "EngineLoad",
    "engine_load",
    "join_alive",
    "parse_engine_metrics",
    "parse_router_queue",
]


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """One scrape of one engine's `/metrics`: sums over its series (one per served model)."""

    time_s: float
    prompt_tokens: float = 0.0
    """Cumulative prompt tokens of requests that produced a first token."""
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    ttft_count: float = 0.0
    ttft_sum: float = 0.0
    itl_count: float = 0.0
    itl_sum: float = 0.0
    prompt_tokens_waiting: float = 0.0
    requests_waiting: float = 0.0
    requests_running: float = 0.0
    kv_usage: float = 0.0


_SAMPLES: Mapping[str, str] = {
    names.PROMPT_TOKENS.sample_name: "prompt_tokens",
    names.PREFIX_CACHE_QUERIES.sample_name: "prefix_queries",
    names.PREFIX_CACHE_HITS.sample_name: "prefix_hits",
    f"{names.TIME_TO_FIRST_TOKEN.name}_count": "ttft_count",
    f"{names.TIME_TO_FIRST_TOKEN.name}_sum": "ttft_sum",
    f"{names.INTER_TOKEN_LATENCY.name}_count": "itl_count",
    f"{names.INTER_TOKEN_LATENCY.name}_sum": "itl_sum",
    names.PROMPT_TOKENS_WAITING.sample_name: "prompt_tokens_waiting",
    names.NUM_REQUESTS_WAITING.sample_name: "requests_waiting",
    names.NUM_REQUESTS_RUNNING.sample_name: "requests_running",
    names.KV_CACHE_USAGE.sample_name: "kv_usage",
}


def parse_engine_metrics(text: str, time_s: float) -> EngineCounters:
    """The autoscaler's counters from an engine's Prometheus text (series summed per name; KV
    usage, a fraction, averaged over its series: a data-parallel pod exports one per rank, each
    rank with an equal cache).

    Raises:
        ValueError: text that is not the Prometheus exposition format.
    """
    totals = dict.fromkeys(_SAMPLES.values(), 0.0)
    kv_series = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = _SAMPLES.get(sample.name)
            if field is not None:
                totals[field] += float(sample.value)
                kv_series += field == "kv_usage"
    if kv_series > 1:
        totals["kv_usage"] /= kv_series
    return EngineCounters(time_s=time_s, **totals)


def parse_router_queue(text: str) -> float:
    """Requests waiting in the router for an in-flight slot (`fleetserve:router_queue_depth`).

    Raises:
        ValueError: text that is not the Prometheus exposition format.
    """
    depth = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == names.ROUTER_QUEUE_DEPTH.sample_name:
                depth += float(sample.value)
    return depth


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine group's load over the last scrape interval (the policy's per-pod input)."""

    prompt_tokens_per_s: float = 0.0
    """Prompt tokens the engine finished prefilling per second."""
    prompt_tokens_arriving_per_s: float = 0.0
    """Finished plus the growth of the backlog: prompt tokens arriving, per second."""
    prompt_tokens_waiting: float = 0.0
    prompt_tokens_waiting_before: float = 0.0
    """The backlog at the start of the interval."""
    interval_s: float = 0.0
    """Seconds between the two scrapes (0: a first scrape, gauges only)."""
    mean_uncached_prompt_tokens: float | None = None
    """Mean prompt tokens per first token, less the prefix-cache hits (None: no request)."""
    requests_waiting: float = 0.0
    requests_running: float = 0.0
    kv_usage: float = 0.0
    mean_itl_s: float | None = None
    """Mean inter-token latency over the interval (None: no token)."""


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def engine_load(previous: EngineCounters | None, current: EngineCounters) -> EngineLoad:
    """Rates between two scrapes of the same engine; gauges only without a previous one.

    A counter that went down (the engine restarted) counts from zero.
    """
    gauges = EngineLoad(
        prompt_tokens_waiting=current.prompt_tokens_waiting,
        requests_waiting=current.requests_waiting,
        requests_running=current.requests_running,
        kv_usage=current.kv_usage,
    )
    dt = current.time_s - previous.time_s if previous is not None else 0.0
    if previous is None or dt <= 0:
        return gauges

    def delta(field: str) -> float:
        now, before = getattr(current, field), getattr(previous, field)
        return float(now - before if now >= before else now)

    finished = delta("prompt_tokens") / dt
    growth = (current.prompt_tokens_waiting - previous.prompt_tokens_waiting) / dt
    prompt_tokens = delta("prompt_tokens")
    first_tokens = delta("ttft_count")
    hit_fraction = _ratio(delta("prefix_hits"), delta("prefix_queries")) or 0.0
    mean_prompt = _ratio(prompt_tokens, first_tokens)
    return replace(
        gauges,
        prompt_tokens_per_s=finished,
        prompt_tokens_arriving_per_s=max(0.0, finished + growth),
        prompt_tokens_waiting_before=previous.prompt_tokens_waiting,
        interval_s=dt,
        mean_uncached_prompt_tokens=(
            None if mean_prompt is None else mean_prompt * (1.0 - min(1.0, hit_fraction))
        ),
        mean_itl_s=_ratio(delta("itl_sum"), delta("itl_count")),
    )


def join_alive(loads: Mapping[str, EngineLoad], alive: Collection[str]) -> dict[str, EngineLoad]:
    """The loads of the pods in `alive` only (a pod that is gone or not ready never counts)."""
    return {pod: load for pod, load in loads.items() if pod in alive}
