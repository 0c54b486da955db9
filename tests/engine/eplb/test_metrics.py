"""EPLB's counts on the engine's /metrics: the names `metric_names` declares, fed by the
`SchedulerStats` the core sends (through the same msgpack message as every step)."""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.common import metric_names as names
from fleetserve.engine.core.messages import CoreMessage, CoreOutputs
from fleetserve.engine.core.outputs import SchedulerStats
from fleetserve.engine.eplb.stats import EplbStats
from fleetserve.engine.metrics import EngineMetrics


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }


def test_eplb_counts_reach_the_metrics_after_the_core_message() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m", eplb=True)
    samples = _samples(registry)
    # Before the first window there is no balancedness to show (a 0 would be a lie).
    assert names.EPLB_BALANCEDNESS.sample_name not in samples
    assert {spec.sample_name for spec in names.EPLB_METRICS} - set(samples) == {
        names.EPLB_BALANCEDNESS.sample_name
    }
    for stats in (
        EplbStats(balancedness=0.5, rebalances=1, skipped=0, last_rearrange_s=0.25, steps=10),
        EplbStats(balancedness=0.9, rebalances=2, skipped=1, last_rearrange_s=0.01, steps=20),
    ):
        message = CoreOutputs(outputs=[], stats=SchedulerStats(eplb=stats))
        wire = msgspec.msgpack.encode(message)
        decoded = msgspec.msgpack.decode(wire, type=CoreMessage)
        assert isinstance(decoded, CoreOutputs) and decoded.stats.eplb == stats
        metrics.record_scheduler_stats(decoded.stats)
    samples = _samples(registry)
    assert samples[names.EPLB_BALANCEDNESS.sample_name] == 0.9
    assert samples[names.EPLB_REBALANCES.sample_name] == 2
    assert samples[names.EPLB_REBALANCES_SKIPPED.sample_name] == 1
    assert samples[names.EPLB_LAST_REARRANGE_SECONDS.sample_name] == 0.01


def test_engines_without_eplb_export_none_of_it() -> None:
    registry = CollectorRegistry()
    EngineMetrics(registry, "m").record_scheduler_stats(SchedulerStats(eplb=EplbStats(0.5)))
    assert not [name for name in _samples(registry) if name.startswith("fleetserve:eplb")]
