"""The engine's Prometheus metrics, declared once: names, kinds, help texts and buckets.

The engine registers exactly these (`fleetserve.engine.metrics`); the router and the operator's
autoscaler read the same names from the engines' `/metrics`. The router's own metrics
(`fleetserve:router_*`) are declared here too. The names are vLLM's, so Gateway API
Inference Extension pickers, KEDA triggers and existing dashboards work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "AUTOSCALER_CURRENT",
    "AUTOSCALER_DECISIONS",
    "AUTOSCALER_DESIRED",
    "AUTOSCALER_LABELS",
    "AUTOSCALER_METRICS",
    "AUTOSCALER_NEEDED",
    "AUTOSCALER_READY",
    "AUTOSCALER_SCRAPE_ERRORS",
    "AUTOSCALER_TICK_SECONDS",
    "E2E_REQUEST_LATENCY",
    "ENGINE_LABEL",
    "ENGINE_METRICS",
    "EPLB_BALANCEDNESS",
    "EPLB_LAST_REARRANGE_SECONDS",
    "EPLB_METRICS",
    "EPLB_REBALANCES",
    "EPLB_REBALANCES_SKIPPED",
    "GENERATION_TOKENS",
    "INTER_TOKEN_LATENCY",
    "KV_ACTIVE_LEASES",
    "KV_BLOCKS_RECOMPUTED",
    "KV_CACHE_USAGE",
    "KV_HANDSHAKES",
    "KV_LEASE_EXPIRATIONS",
    "KV_TOKENS_LOADED",
    "KV_TRANSFERS",
    "KV_TRANSFER_BYTES",
    "KV_TRANSFER_DESCRIPTORS",
    "KV_TRANSFER_METRICS",
    "KV_TRANSFER_SECONDS",
    "MODEL_NAME_LABEL",
    "NUM_PREEMPTIONS",
    "NUM_REQUESTS_RUNNING",
    "NUM_REQUESTS_WAITING",
    "PREFIX_CACHE_HITS",
    "PREFIX_CACHE_QUERIES",
    "PROMPT_TOKENS",
    "PROMPT_TOKENS_WAITING",
    "REQUEST_QUEUE_TIME",
    "ROUTER_DECISIONS",
    "ROUTER_EJECTIONS",
    "ROUTER_ENGINES",
    "ROUTER_IN_FLIGHT",
    "ROUTER_METRICS",
    "ROUTER_QUEUE_DEPTH",
    "ROUTER_REQUESTS",
    "ROUTER_RETRIES",
    "ROUTER_UPSTREAM_ERRORS",
    "ROUTER_UPSTREAM_LATENCY",
    "SPEC_DECODE_METRICS",
    "SPEC_DECODE_NUM_ACCEPTED_TOKENS",
    "SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS",
    "SPEC_DECODE_NUM_DRAFTS",
    "SPEC_DECODE_NUM_DRAFT_TOKENS",
    "TIME_TO_FIRST_TOKEN",
    "MetricSpec",
]

MODEL_NAME_LABEL = "model_name"
"""The one label every engine metric carries (the served model name)."""
ENGINE_LABEL = "engine"
"""With data parallel (`--data-parallel-size` > 1), the second label of every engine metric: the
DP rank whose series it is ("0", "1", ...; vLLM's label), so a server exports one series per
rank; without, engine metrics carry no such label."""

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


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric as registered (`name`) and as it appears in the exposition (`sample_name`)."""

    name: str
    kind: Literal["gauge", "counter", "histogram"]
    documentation: str
    buckets: tuple[float, ...] = ()
    labels: tuple[str, ...] = ()
    """Labels besides `model_name`."""

    @property
    def sample_name(self) -> str:
        """The sample's name in `/metrics` text: prometheus_client appends `_total` to counters
        (histograms expose `_bucket`, `_sum` and `_count` under `name`)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name


NUM_REQUESTS_RUNNING = MetricSpec(
    "vllm:num_requests_running", "gauge", "Requests in the running batch."
)
NUM_REQUESTS_WAITING = MetricSpec(
    "vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled."
)
PROMPT_TOKENS_WAITING = MetricSpec(
    "fleetserve:prompt_tokens_waiting", "gauge",
    "Prompt tokens not yet computed: waiting requests' whole prompts plus the rest of"
    " partially prefilled ones (the prefill backlog the autoscaler divides by throughput).",
)  # fmt: skip
KV_CACHE_USAGE = MetricSpec(
    "vllm:kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (1 = full)."
)
PREFIX_CACHE_QUERIES = MetricSpec(
    "vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."
)
PREFIX_CACHE_HITS = MetricSpec(
    "vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache."
)
NUM_PREEMPTIONS = MetricSpec(
    "vllm:num_preemptions", "counter", "Cumulative preemptions of running requests."
)
PROMPT_TOKENS = MetricSpec(
    "vllm:prompt_tokens", "counter", "Prompt tokens of requests that produced a first token."
)
GENERATION_TOKENS = MetricSpec("vllm:generation_tokens", "counter", "Generated tokens.")
TIME_TO_FIRST_TOKEN = MetricSpec(
    "vllm:time_to_first_token_seconds", "histogram", "Time to first token.", TTFT_BUCKETS_S
)
INTER_TOKEN_LATENCY = MetricSpec(
    "vllm:inter_token_latency_seconds", "histogram", "Time between output tokens.", ITL_BUCKETS_S
)
E2E_REQUEST_LATENCY = MetricSpec(
    "vllm:e2e_request_latency_seconds",
    "histogram",
    "Request latency from arrival to the last token.",
    REQUEST_LATENCY_BUCKETS_S,
)
REQUEST_QUEUE_TIME = MetricSpec(
    "vllm:request_queue_time_seconds",
    "histogram",
    "Time a request waited before it was first scheduled.",
    REQUEST_LATENCY_BUCKETS_S,
)

KV_TRANSFER_SECONDS_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)  # fmt: skip
KV_TRANSFER_BYTES_BUCKETS = tuple(float(4**i * 1024) for i in range(12))  # 1 KiB .. 4 GiB
KV_TRANSFER_DESCRIPTOR_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0)

KV_TRANSFER_SECONDS = MetricSpec(
    "fleetserve:kv_transfer_seconds", "histogram",
    "Time of one KV transfer (all layers of a request), from start to landed.",
    KV_TRANSFER_SECONDS_BUCKETS,
)  # fmt: skip
KV_TRANSFER_BYTES = MetricSpec(
    "fleetserve:kv_transfer_bytes", "histogram", "Bytes moved by one KV transfer.",
    KV_TRANSFER_BYTES_BUCKETS,
)  # fmt: skip
KV_TRANSFER_DESCRIPTORS = MetricSpec(
    "fleetserve:kv_transfer_descriptors", "histogram",
    "Coalesced block runs in one KV transfer (what block-by-block copying would multiply).",
    KV_TRANSFER_DESCRIPTOR_BUCKETS,
)  # fmt: skip
KV_TRANSFERS = MetricSpec(
    "fleetserve:kv_transfers", "counter",
    "KV transfers by outcome (ok, failed) and failure stage.", labels=("outcome", "stage"),
)  # fmt: skip
KV_ACTIVE_LEASES = MetricSpec(
    "fleetserve:kv_active_leases", "gauge", "Prompts whose KV a producer holds for a consumer."
)
KV_LEASE_EXPIRATIONS = MetricSpec(
    "fleetserve:kv_lease_expirations", "counter",
    "Producer leases that expired with no consumer done (rising: the lease is too short).",
)  # fmt: skip
KV_HANDSHAKES = MetricSpec(
    "fleetserve:kv_handshakes", "counter", "Handshakes with new producer engines."
)
KV_BLOCKS_RECOMPUTED = MetricSpec(
    "fleetserve:kv_blocks_recomputed", "counter",
    "KV blocks recomputed locally after a failed load (load_failure_policy recompute).",
)  # fmt: skip
KV_TOKENS_LOADED = MetricSpec(
    "fleetserve:kv_tokens_loaded", "counter",
    "Prompt tokens a decode engine took from producers instead of computing them.",
)  # fmt: skip

KV_TRANSFER_METRICS: tuple[MetricSpec, ...] = (
    KV_TRANSFER_SECONDS,
    KV_TRANSFER_BYTES,
    KV_TRANSFER_DESCRIPTORS,
    KV_TRANSFERS,
    KV_ACTIVE_LEASES,
    KV_LEASE_EXPIRATIONS,
    KV_HANDSHAKES,
    KV_BLOCKS_RECOMPUTED,
    KV_TOKENS_LOADED,
)
"""What an engine with a KV connector exports besides `ENGINE_METRICS`."""

SPEC_DECODE_NUM_DRAFTS = MetricSpec(
    "vllm:spec_decode_num_drafts", "counter",
    "Speculative proposals verified (one per request and step with drafts).",
)  # fmt: skip
SPEC_DECODE_NUM_DRAFT_TOKENS = MetricSpec(
    "vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens verified by the target."
)
SPEC_DECODE_NUM_ACCEPTED_TOKENS = MetricSpec(
    "vllm:spec_decode_num_accepted_tokens", "counter", "Draft tokens the target accepted."
)
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = MetricSpec(
    "vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
    "Accepted draft tokens by their position in the proposal (0 = first).",
    labels=("position",),
)  # fmt: skip

SPEC_DECODE_METRICS: tuple[MetricSpec, ...] = (
    SPEC_DECODE_NUM_DRAFTS,
    SPEC_DECODE_NUM_DRAFT_TOKENS,
    SPEC_DECODE_NUM_ACCEPTED_TOKENS,
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
)
"""What an engine with speculative decoding exports besides `ENGINE_METRICS`."""

EPLB_BALANCEDNESS = MetricSpec(
    "fleetserve:eplb_balancedness", "gauge",
    "Mean / max per-EP-rank expert load over the last EPLB window, averaged over MoE layers"
    " (1 = even; the slowest rank bounds a MoE layer).",
)  # fmt: skip
EPLB_REBALANCES = MetricSpec(
    "fleetserve:eplb_rebalances", "counter", "EPLB placements committed (expert weights moved)."
)
EPLB_REBALANCES_SKIPPED = MetricSpec(
    "fleetserve:eplb_rebalances_skipped", "counter",
    "EPLB rebalances skipped: the plan gained less than the threshold, or no tokens.",
)  # fmt: skip
EPLB_LAST_REARRANGE_SECONDS = MetricSpec(
    "fleetserve:eplb_last_rearrange_seconds", "gauge",
    "Seconds the step loop stalled for the last expert rearrangement (async: the commit).",
)  # fmt: skip

EPLB_METRICS: tuple[MetricSpec, ...] = (
    EPLB_BALANCEDNESS,
    EPLB_REBALANCES,
    EPLB_REBALANCES_SKIPPED,
    EPLB_LAST_REARRANGE_SECONDS,
)
"""What an engine with EPLB exports besides `ENGINE_METRICS`."""

ENGINE_METRICS: tuple[MetricSpec, ...] = (
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PROMPT_TOKENS_WAITING,
    KV_CACHE_USAGE,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    NUM_PREEMPTIONS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    E2E_REQUEST_LATENCY,
    REQUEST_QUEUE_TIME,
)
"""Every metric the engine's API server exports, in registration order."""

# -- the router's own metrics (`fleetserve.router.metrics`; no model_name label) ---------------

ROUTER_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip

ROUTER_REQUESTS = MetricSpec(
    "fleetserve:router_requests", "counter",
    "Client requests the router answered, by route and HTTP status.", labels=("route", "status"),
)  # fmt: skip
ROUTER_DECISIONS = MetricSpec(
    "fleetserve:router_decisions", "counter",
    "Routing decisions by kind (disaggregated, decode_only, colocated) and reason.",
    labels=("kind", "reason"),
)  # fmt: skip
ROUTER_RETRIES = MetricSpec(
    "fleetserve:router_retries", "counter",
    "Upstream attempts repeated on another engine (or decode-only), by the stage that failed.",
    labels=("stage",),
)  # fmt: skip
ROUTER_EJECTIONS = MetricSpec(
    "fleetserve:router_ejections", "counter",
    "Circuit breakers opened, by what they guard (prefill, decode, unified, pair).",
    labels=("target",),
)  # fmt: skip
ROUTER_UPSTREAM_LATENCY = MetricSpec(
    "fleetserve:router_upstream_latency_seconds", "histogram",
    "Time from sending an upstream request to its answer's headers (prefill: the whole leg).",
    ROUTER_LATENCY_BUCKETS_S, labels=("role",),
)  # fmt: skip
ROUTER_UPSTREAM_ERRORS = MetricSpec(
    "fleetserve:router_upstream_errors", "counter",
    "Failed upstream attempts by role and kind (status_5xx, timeout, connection, stream).",
    labels=("role", "kind"),
)  # fmt: skip
ROUTER_QUEUE_DEPTH = MetricSpec(
    "fleetserve:router_queue_depth", "gauge", "Requests waiting for an in-flight slot."
)
ROUTER_IN_FLIGHT = MetricSpec(
    "fleetserve:router_in_flight", "gauge", "Requests the router is forwarding now."
)
ROUTER_ENGINES = MetricSpec(
    "fleetserve:router_engines", "gauge",
    "Engines the router knows, by role and whether they take requests now.",
    labels=("role", "available"),
)  # fmt: skip

ROUTER_METRICS: tuple[MetricSpec, ...] = (
    ROUTER_REQUESTS,
    ROUTER_DECISIONS,
    ROUTER_RETRIES,
    ROUTER_EJECTIONS,
    ROUTER_UPSTREAM_LATENCY,
    ROUTER_UPSTREAM_ERRORS,
    ROUTER_QUEUE_DEPTH,
    ROUTER_IN_FLIGHT,
    ROUTER_ENGINES,
)
"""Everything the router exports (its `labels` are all its labels: no `model_name`)."""

# -- the operator's autoscaler (`fleetserve.operator.autoscale.metrics`; its own labels) -------

AUTOSCALER_LABELS = ("namespace", "deployment", "role")

AUTOSCALER_DESIRED = MetricSpec(
    "fleetserve:autoscaler_desired_replicas", "gauge",
    "Groups the autoscaler wants per role.", labels=AUTOSCALER_LABELS,
)  # fmt: skip
AUTOSCALER_CURRENT = MetricSpec(
    "fleetserve:autoscaler_current_replicas", "gauge",
    "Groups desired before the latest decision (starting ones included).",
    labels=AUTOSCALER_LABELS,
)  # fmt: skip
AUTOSCALER_READY = MetricSpec(
    "fleetserve:autoscaler_ready_replicas", "gauge",
    "Groups whose engines answered the latest scrape.", labels=AUTOSCALER_LABELS,
)  # fmt: skip
AUTOSCALER_NEEDED = MetricSpec(
    "fleetserve:autoscaler_needed_replicas", "gauge",
    "Replicas the measured load needs, before tolerance, windows and bounds.",
    labels=AUTOSCALER_LABELS,
)  # fmt: skip
AUTOSCALER_DECISIONS = MetricSpec(
    "fleetserve:autoscaler_decisions", "counter",
    "Scale decisions that changed a role's desired groups, by direction (up, down).",
    labels=(*AUTOSCALER_LABELS, "direction"),
)  # fmt: skip
AUTOSCALER_SCRAPE_ERRORS = MetricSpec(
    "fleetserve:autoscaler_scrape_errors", "counter",
    "Engine or router /metrics scrapes that failed (the pod's load does not count).",
    labels=("namespace", "deployment"),
)  # fmt: skip
AUTOSCALER_TICK_SECONDS = MetricSpec(
    "fleetserve:autoscaler_tick_seconds", "histogram",
    "Time of one autoscaler tick of one deployment (scrapes, decision, status write).",
    (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), labels=("namespace", "deployment"),
)  # fmt: skip

AUTOSCALER_METRICS: tuple[MetricSpec, ...] = (
    AUTOSCALER_DESIRED,
    AUTOSCALER_CURRENT,
    AUTOSCALER_READY,
    AUTOSCALER_NEEDED,
    AUTOSCALER_DECISIONS,
    AUTOSCALER_SCRAPE_ERRORS,
    AUTOSCALER_TICK_SECONDS,
)
"""What the operator's metrics endpoint exports (`labels` are all their labels)."""
