"""The operator's own Prometheus metrics (the `fleetserve:autoscaler_*` family) and its endpoint."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from fleetserve.common import metric_names as names
from fleetserve.operator.autoscale.policy import Decision

__all__ = ["AutoscalerMetrics", "serve_metrics"]


@dataclass
class AutoscalerMetrics:
    """Registered once per operator process, in `registry` (never the global one)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        def make(spec: names.MetricSpec) -> Any:
            kind = {"gauge": Gauge, "counter": Counter}.get(spec.kind)
            if kind is not None:
                return kind(spec.name, spec.documentation, spec.labels, registry=self.registry)
            return Histogram(
                spec.name,
                spec.documentation,
                spec.labels,
                buckets=spec.buckets,
                registry=self.registry,
            )

        self.desired: Gauge = make(names.AUTOSCALER_DESIRED)
        self.current: Gauge = make(names.AUTOSCALER_CURRENT)
        self.ready: Gauge = make(names.AUTOSCALER_READY)
        self.needed: Gauge = make(names.AUTOSCALER_NEEDED)
        self.decisions: Counter = make(names.AUTOSCALER_DECISIONS)
        self.scrape_errors: Counter = make(names.AUTOSCALER_SCRAPE_ERRORS)
        self.tick_seconds: Histogram = make(names.AUTOSCALER_TICK_SECONDS)

    def record(self, namespace: str, deployment: str, decision: Decision, seconds: float) -> None:
        for role, r in decision.roles.items():
            labels = (namespace, deployment, role)
            self.desired.labels(*labels).set(r.desired)
            self.current.labels(*labels).set(r.current)
            self.ready.labels(*labels).set(r.ready)
            self.needed.labels(*labels).set(r.needed)
            if r.desired != r.current:
                direction = "up" if r.desired > r.current else "down"
                self.decisions.labels(*labels, direction).inc()
        self.tick_seconds.labels(namespace, deployment).observe(seconds)

    def forget(self, namespace: str, deployment: str, roles: list[str]) -> None:
        """Drop a deployment's series (it is gone or no longer autoscaled)."""
        for role in roles:
            for gauge in (self.desired, self.current, self.ready, self.needed):
                with contextlib.suppress(KeyError):
                    gauge.remove(namespace, deployment, role)


def serve_metrics(metrics: AutoscalerMetrics, address: str) -> Any:
    """Serve `metrics` at `http://HOST:PORT/metrics`; returns the server (call `.shutdown()`).

    Raises:
        ValueError: `address` is not HOST:PORT.
        OSError: the port cannot be bound.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--metrics must be HOST:PORT, got {address!r}")
    server, _thread = start_http_server(
        int(port), addr=host or "0.0.0.0", registry=metrics.registry
    )
    return server
