"""Prometheus metrics of one engine, under vLLM's names, plus the periodic one-line stats log.

Gauges and the cumulative scheduler counters follow the `SchedulerStats` the engine core sends
after every step; request-level histograms (TTFT, ITL, E2E, queue time) and token counters are
recorded by the API server, which sees every request's timeline. Everything lives in a registry
owned by the caller (one per app), so several engines can coexist in one process (tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleetserve.common import metric_names as names
from fleetserve.common.metric_names import MetricSpec
from fleetserve.engine.core.outputs import SchedulerStats
from fleetserve.engine.eplb.stats import EplbStats
from fleetserve.engine.kv_transfer.stats import KVTransferStats
from fleetserve.engine.spec_decode.stats import SpecDecodingStats


@dataclass
class _Totals:
    """Counter values already exported (the core's stats are cumulative; Prometheus wants incs)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


def register(registry: CollectorRegistry, spec: MetricSpec, *, per_engine: bool = False) -> Any:
    """The metric `spec` declares, in `registry`, labelled `model_name` (+ `engine` when
    `per_engine`, + `spec.labels`)."""
    engine = [names.ENGINE_LABEL] if per_engine else []
    labels = [names.MODEL_NAME_LABEL, *engine, *spec.labels]
    if spec.kind == "gauge":
        return Gauge(spec.name, spec.documentation, labels, registry=registry)
    if spec.kind == "counter":
        # NOTE: prometheus_client appends `_total` to counter names itself.
        return Counter(spec.name, spec.documentation, labels, registry=registry)
    return Histogram(spec.name, spec.documentation, labels, buckets=spec.buckets,
                     registry=registry)  # fmt: skip


class MetricFamilies:
    """Each engine metric registered once in `registry`, labelled per engine (`engine`, the
    data-parallel rank) when `per_engine`: the engines of one data-parallel server share it, so
    every family holds one series per rank."""

    def __init__(self, registry: CollectorRegistry, *, per_engine: bool = False) -> None:
        self.registry = registry
        self.per_engine = per_engine
        self._families: dict[str, Any] = {}

    def family(self, spec: MetricSpec) -> Any:
        """The family of `spec` (registered on first use)."""
        if spec.name not in self._families:
            self._families[spec.name] = register(self.registry, spec, per_engine=self.per_engine)
        return self._families[spec.name]


class EngineMetrics:
    """The `vllm:*` metrics of one served model, registered in `registry` (and the
    `fleetserve:kv_*` ones when the engine transfers KV, `kv_transfer=True`; the
    `vllm:spec_decode_*` ones with speculative decoding, `spec_decode=True`).

    One data-parallel rank's metrics: `families` (per engine) shared by the ranks of one server,
    `engine` this rank's label value.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        *,
        kv_transfer: bool = False,
        spec_decode: bool = False,
        eplb: bool = False,
        families: MetricFamilies | None = None,
        engine: str | None = None,
    ) -> None:
        if families is None:
            families = MetricFamilies(registry)
        if families.per_engine != (engine is not None):
            raise ValueError("engine must be given exactly when the families are per engine")
        self.model_name = model_name
        self.labels: tuple[str, ...] = (model_name,) if engine is None else (model_name, engine)
        """The label values every series of this engine starts with."""
        labels = self.labels

        def make(spec: MetricSpec) -> Any:
            return families.family(spec).labels(*labels)

        self.num_requests_running: Gauge = make(names.NUM_REQUESTS_RUNNING)
        self.num_requests_waiting: Gauge = make(names.NUM_REQUESTS_WAITING)
        self.prompt_tokens_waiting: Gauge = make(names.PROMPT_TOKENS_WAITING)
        self.kv_cache_usage_perc: Gauge = make(names.KV_CACHE_USAGE)
        self.prefix_cache_queries: Counter = make(names.PREFIX_CACHE_QUERIES)
        self.prefix_cache_hits: Counter = make(names.PREFIX_CACHE_HITS)
        self.num_preemptions: Counter = make(names.NUM_PREEMPTIONS)
        self.prompt_tokens: Counter = make(names.PROMPT_TOKENS)
        self.generation_tokens: Counter = make(names.GENERATION_TOKENS)
        self.time_to_first_token: Histogram = make(names.TIME_TO_FIRST_TOKEN)
        self.inter_token_latency: Histogram = make(names.INTER_TOKEN_LATENCY)
        self.e2e_request_latency: Histogram = make(names.E2E_REQUEST_LATENCY)
        self.request_queue_time: Histogram = make(names.REQUEST_QUEUE_TIME)
        self._totals = _Totals()
        self.kv_transfer = KVTransferMetrics(families, labels) if kv_transfer else None
        self.spec_decode = SpecDecodeMetrics(families, labels) if spec_decode else None
        self.eplb = EplbMetrics(families, labels) if eplb else None

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Update gauges and cumulative counters from the core's per-step stats."""
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.prompt_tokens_waiting.set(stats.num_waiting_prompt_tokens)
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
        if self.kv_transfer is not None and stats.kv_transfer is not None:
            self.kv_transfer.record(stats.kv_transfer)
        if self.spec_decode is not None and stats.spec_decoding is not None:
            self.spec_decode.record(stats.spec_decoding)
        if self.eplb is not None and stats.eplb is not None:
            self.eplb.record(stats.eplb)


class SpecDecodeMetrics:
    """The `vllm:spec_decode_*` counters, from the scheduler's cumulative acceptance counts."""

    def __init__(self, families: MetricFamilies, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.num_drafts = families.family(names.SPEC_DECODE_NUM_DRAFTS).labels(*labels)
        self.num_draft_tokens = families.family(names.SPEC_DECODE_NUM_DRAFT_TOKENS).labels(*labels)
        self.num_accepted_tokens = families.family(names.SPEC_DECODE_NUM_ACCEPTED_TOKENS).labels(
            *labels
        )
        self.per_pos = families.family(names.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS)
        self._seen = SpecDecodingStats()

    def record(self, stats: SpecDecodingStats) -> None:
        seen = self._seen
        self.num_drafts.inc(max(0, stats.num_drafts - seen.num_drafts))
        self.num_draft_tokens.inc(max(0, stats.num_draft_tokens - seen.num_draft_tokens))
        self.num_accepted_tokens.inc(max(0, stats.num_accepted_tokens - seen.num_accepted_tokens))
        for position, total in enumerate(stats.num_accepted_tokens_per_pos):
            before = (
                seen.num_accepted_tokens_per_pos[position]
                if position < len(seen.num_accepted_tokens_per_pos)
                else 0
            )
            self.per_pos.labels(*self.labels, str(position)).inc(max(0, total - before))
        self._seen = stats.copy()


class EplbMetrics:
    """The `fleetserve:eplb_*` metrics, from the EP group's cumulative EPLB counts."""

    def __init__(self, families: MetricFamilies, labels: tuple[str, ...]) -> None:
        self.labels = labels
        # NOTE: no child until a window has been measured: a 0 would read as "all on one rank".
        self.balancedness = families.family(names.EPLB_BALANCEDNESS)
        self.rebalances = families.family(names.EPLB_REBALANCES).labels(*labels)
        self.skipped = families.family(names.EPLB_REBALANCES_SKIPPED).labels(*labels)
        self.last_rearrange_s = families.family(names.EPLB_LAST_REARRANGE_SECONDS).labels(*labels)
        self._seen = EplbStats()

    def record(self, stats: EplbStats) -> None:
        if stats.balancedness is not None:
            self.balancedness.labels(*self.labels).set(stats.balancedness)
        self.rebalances.inc(max(0, stats.rebalances - self._seen.rebalances))
        self.skipped.inc(max(0, stats.skipped - self._seen.skipped))
        self.last_rearrange_s.set(stats.last_rearrange_s)
        self._seen = stats


class KVTransferMetrics:
    """The `fleetserve:kv_*` metrics, from the connector's cumulative counters and its
    per-transfer observations (each observed exactly once: the core hands them over once)."""

    def __init__(self, families: MetricFamilies, labels: tuple[str, ...]) -> None:
        self.labels = labels

        def make(spec: MetricSpec) -> Any:
            return families.family(spec).labels(*labels)

        self.seconds = make(names.KV_TRANSFER_SECONDS)
        self.bytes = make(names.KV_TRANSFER_BYTES)
        self.descriptors = make(names.KV_TRANSFER_DESCRIPTORS)
        self.transfers = families.family(names.KV_TRANSFERS)
        self.active_leases = make(names.KV_ACTIVE_LEASES)
        self.lease_expirations = make(names.KV_LEASE_EXPIRATIONS)
        self.handshakes = make(names.KV_HANDSHAKES)
        self.blocks_recomputed = make(names.KV_BLOCKS_RECOMPUTED)
        self.tokens_loaded = make(names.KV_TOKENS_LOADED)
        self._seen: dict[str, int] = {}

    def _inc(self, counter: Any, key: str, total: int) -> None:
        counter.inc(max(0, total - self._seen.get(key, 0)))
        self._seen[key] = max(total, self._seen.get(key, 0))

    def record(self, stats: KVTransferStats) -> None:
        for observation in stats.observations:
            self.seconds.observe(observation.seconds)
            self.bytes.observe(observation.bytes)
            self.descriptors.observe(observation.descriptors)
        ok = self.transfers.labels(*self.labels, "ok", "")
        self._inc(ok, "ok", stats.transfers_ok)
        for stage, count in stats.failures_by_stage.items():
            self._inc(self.transfers.labels(*self.labels, "failed", stage), stage, count)
        self.active_leases.set(stats.active_leases)
        self._inc(self.lease_expirations, "expirations", stats.lease_expirations)
        self._inc(self.handshakes, "handshakes", stats.handshakes)
        self._inc(self.blocks_recomputed, "recomputed", stats.blocks_recomputed)
        self._inc(self.tokens_loaded, "tokens_loaded", stats.tokens_loaded)


@dataclass
class StatsLogger:
    """Accumulates token counts between periodic one-line logs of the engine's state."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    last_log_time: float = field(default_factory=time.monotonic)
    last_stats: SchedulerStats = field(default_factory=SchedulerStats)
    _last_queries: int = 0
    _last_hits: int = 0
    _last_draft_tokens: int = 0
    _last_accepted_tokens: int = 0

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
        spec = stats.spec_decoding
        if spec is not None:
            drafted = spec.num_draft_tokens - self._last_draft_tokens
            accepted = spec.num_accepted_tokens - self._last_accepted_tokens
            rate = 100.0 * accepted / drafted if drafted > 0 else 0.0
            line += f", draft acceptance rate: {rate:.1f}% of {drafted} draft tokens"
            self._last_draft_tokens = spec.num_draft_tokens
            self._last_accepted_tokens = spec.num_accepted_tokens
        self.prompt_tokens = self.generation_tokens = 0
        self._last_queries, self._last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self.last_log_time = now
        return line
