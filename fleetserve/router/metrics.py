"""The router's Prometheus metrics (`fleetserve:router_*`, declared in
`fleetserve.common.metric_names`), registered in a registry the app owns (no globals), and the
parser that reads an engine's load out of its `/metrics` text."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.common import metric_names as names
from fleetserve.common.metric_names import MetricSpec
from fleetserve.router.policy import EngineLoad

__all__ = ["RouterMetrics", "parse_engine_load"]


def _register(registry: CollectorRegistry, spec: MetricSpec) -> Any:
    labels = list(spec.labels)
    if spec.kind == "gauge":
        return Gauge(spec.name, spec.documentation, labels, registry=registry)
    if spec.kind == "counter":
        return Counter(spec.name, spec.documentation, labels, registry=registry)
    return Histogram(spec.name, spec.documentation, labels, buckets=spec.buckets, registry=registry)


class RouterMetrics:
    """Every `names.ROUTER_METRICS` entry, registered in `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests: Counter = _register(registry, names.ROUTER_REQUESTS)
        self.decisions: Counter = _register(registry, names.ROUTER_DECISIONS)
        self.retries: Counter = _register(registry, names.ROUTER_RETRIES)
        self.ejections: Counter = _register(registry, names.ROUTER_EJECTIONS)
        self.upstream_latency: Histogram = _register(registry, names.ROUTER_UPSTREAM_LATENCY)
        self.upstream_errors: Counter = _register(registry, names.ROUTER_UPSTREAM_ERRORS)
        self.queue_depth: Gauge = _register(registry, names.ROUTER_QUEUE_DEPTH)
        self.in_flight: Gauge = _register(registry, names.ROUTER_IN_FLIGHT)
        self.engines: Gauge = _register(registry, names.ROUTER_ENGINES)


_LOAD_SAMPLES = {
    names.NUM_REQUESTS_WAITING.sample_name: "waiting",
    names.NUM_REQUESTS_RUNNING.sample_name: "running",
    names.KV_CACHE_USAGE.sample_name: "kv_usage",
}


def parse_engine_load(text: str) -> EngineLoad:
    """An engine's waiting/running/KV usage from its Prometheus text (summed over the
    `model_name` label; KV usage is the maximum).

    Raises:
        ValueError: the text is not Prometheus exposition, or lacks one of the three gauges
            (then it is no fleetserve or vLLM engine).
    """
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = _LOAD_SAMPLES.get(sample.name)
            if key is None:
                continue
            if key == "kv_usage":
                found[key] = max(found.get(key, 0.0), sample.value)
            else:
                found[key] = found.get(key, 0.0) + sample.value
    missing = sorted(name for name, key in _LOAD_SAMPLES.items() if key not in found)
    if missing:
        raise ValueError(f"the engine's /metrics lacks {', '.join(missing)}")
    return EngineLoad(
        waiting=found["waiting"], running=found["running"], kv_usage=found["kv_usage"]
    )
