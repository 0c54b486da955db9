"""Discovery: which Kubernetes pods are engines (real `kubernetes` client models), static URL
lists, the fleet's membership updates, and the /metrics load parser."""

from __future__ import annotations

import pytest
from kubernetes.client import V1ObjectMeta, V1Pod, V1PodCondition, V1PodStatus
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from fleetserve.api.labels import LABEL_COMPAT, LABEL_ROLE
from fleetserve.api.router_config import RouterConfig
from fleetserve.common import metric_names as names
from fleetserve.router.discovery import pod_endpoint, static_endpoints
from fleetserve.router.fleet import Endpoint, Fleet
from fleetserve.router.metrics import RouterMetrics, parse_engine_load


def _pod(role: str = "decode", ip: str | None = "10.0.0.7", ready: str = "True",
         compat: str | None = "h1", deleting: bool = False) -> V1Pod:  # fmt: skip
    labels = {LABEL_ROLE: role, **({LABEL_COMPAT: compat} if compat else {})}
    meta = V1ObjectMeta(name="pod-0", labels=labels,
                        deletion_timestamp="2026-01-01T00:00:00Z" if deleting else None)  # fmt: skip
    status = V1PodStatus(pod_ip=ip, conditions=[V1PodCondition(type="Ready", status=ready)])
    return V1Pod(metadata=meta, status=status)


def test_a_ready_pod_is_an_engine_with_its_labels() -> None:
    assert pod_endpoint(_pod(), "decode", 8000, None) == Endpoint(
        "http://10.0.0.7:8000", "decode", "h1"
    )
    assert pod_endpoint(_pod(ip="fd00::5"), "decode", 8000, "h1") == Endpoint(
        "http://[fd00::5]:8000", "decode", "h1"
    )
    assert pod_endpoint(_pod("unified", compat=None), "unified", 9, None) == Endpoint(
        "http://10.0.0.7:9", "unified", None
    )


@pytest.mark.parametrize(
    "pod",
    [
        _pod(ready="False"),
        _pod(ip=None),
        _pod(deleting=True),
        _pod(role="prefill"),  # selected as decode but labelled prefill: skipped
        _pod(compat="h2"),  # another compatibility hash than the router's
        _pod(compat=None),  # a P/D pod without a hash is never paired
    ],
)
def test_pods_that_cannot_serve_are_not_engines(pod: V1Pod) -> None:
    assert pod_endpoint(pod, "decode", 8000, "h1") is None


def test_static_endpoints_and_fleet_membership() -> None:
    config = RouterConfig(discovery="static", prefill=("http://p:1/",), decode=("http://d:1",),
                          engine=("http://u:1",))  # fmt: skip
    sources = static_endpoints(config)
    assert sources["static-prefill"] == [Endpoint("http://p:1", "prefill")]
    fleet = Fleet(config, RouterMetrics(CollectorRegistry()))
    for source, endpoints in sources.items():
        fleet.update(source, endpoints)
    assert set(fleet.engines) == {"http://p:1", "http://d:1", "http://u:1"}
    # Nothing is usable before a scrape; static P/D engines still need their hash.
    assert not any(s.available for s in fleet.snapshots())
    fleet.engines["http://u:1"].scraped = True
    fleet.engines["http://d:1"].scraped = True
    assert [s.url for s in fleet.snapshots() if s.available] == ["http://u:1"]
    fleet.engines["http://d:1"].compatibility_hash = "h"
    assert fleet.engines["http://d:1"].learn_identity
    fleet.prefixes.record("http://d:1", [b"x"])  # type: ignore[list-item]
    fleet.update("static-decode", [])  # the engine left: forgotten with its prefixes
    assert "http://d:1" not in fleet.engines and fleet.prefixes.size("http://d:1") == 0
    # A pod whose hash changed (a rolled group) comes back as a new engine.
    fleet.update("k8s-decode", [Endpoint("http://10.0.0.1:8000", "decode", "a")])
    fleet.engines["http://10.0.0.1:8000"].scraped = True
    fleet.update("k8s-decode", [Endpoint("http://10.0.0.1:8000", "decode", "b")])
    assert fleet.engines["http://10.0.0.1:8000"].compatibility_hash == "b"
    assert not fleet.engines["http://10.0.0.1:8000"].scraped


def test_the_load_parser_reads_the_engines_metric_names() -> None:
    registry = CollectorRegistry()
    for spec, value in ((names.NUM_REQUESTS_WAITING, 3), (names.NUM_REQUESTS_RUNNING, 5),
                        (names.KV_CACHE_USAGE, 0.25)):  # fmt: skip
        Gauge(spec.name, spec.documentation, ["model_name"], registry=registry).labels("m").set(
            value
        )
    load = parse_engine_load(generate_latest(registry).decode())
    assert (load.waiting, load.running, load.kv_usage) == (3, 5, 0.25)
    with pytest.raises(ValueError, match="lacks vllm:kv_cache_usage_perc"):
        parse_engine_load("vllm:num_requests_waiting 1\nvllm:num_requests_running 2\n")
