"""The declared metric names are exactly what the engine exports."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from fleetserve.common.metric_names import ENGINE_METRICS
from fleetserve.engine.metrics import EngineMetrics


def test_engine_exports_exactly_the_declared_metrics() -> None:
    registry = CollectorRegistry()
    EngineMetrics(registry, "m")
    text = generate_latest(registry).decode()
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    # NOTE: the text format lists each counter's and histogram's creation time as a gauge.
    exported = {name for name in families if not name.endswith("_created")}
    assert exported == {spec.sample_name for spec in ENGINE_METRICS}
    for spec in ENGINE_METRICS:
        sample = spec.sample_name + ("_count" if spec.kind == "histogram" else "")
        assert f'{sample}{{model_name="m"}}' in text, spec
