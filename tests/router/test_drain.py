"""The router's side of a drain and a roll: a pod labelled draining gets no new request (and its
watch event drops it at once), and prefill and decode are paired only within one compatibility
hash while two revisions serve side by side."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import V1ObjectMeta, V1Pod, V1PodCondition, V1PodStatus
from prometheus_client import CollectorRegistry

from fleetserve.api.labels import LABEL_COMPAT, LABEL_DRAINING, LABEL_ROLE
from fleetserve.api.router_config import RouterConfig
from fleetserve.common.block_hash import hash_token_blocks
from fleetserve.router.discovery import pod_endpoint, run_discovery
from fleetserve.router.fleet import Fleet
from fleetserve.router.metrics import RouterMetrics
from fleetserve.router.policy import EngineLoad, EngineSnapshot, RoutingPolicy, RoutingRequest
from fleetserve.router.prefix_cache import ApproxPrefixCache
from tests.router.test_kubernetes_discovery import FakeApiServer


def _v1pod(labels: dict[str, str]) -> V1Pod:
    return V1Pod(
        metadata=V1ObjectMeta(name="p-0", labels={LABEL_ROLE: "decode", LABEL_COMPAT: "h", **labels}),
        status=V1PodStatus(pod_ip="10.0.0.9", conditions=[V1PodCondition(type="Ready", status="True")]),
    )  # fmt: skip


def test_a_draining_pod_is_no_engine_even_while_ready() -> None:
    assert pod_endpoint(_v1pod({}), "decode", 8000, None) is not None
    assert pod_endpoint(_v1pod({LABEL_DRAINING: "true"}), "decode", 8000, None) is None
    # Any value: the operator sets "true", but the key alone means draining.
    assert pod_endpoint(_v1pod({LABEL_DRAINING: ""}), "decode", 8000, None) is None


def _pod(name: str, ip: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": "5",
                     "labels": {LABEL_ROLE: "decode", LABEL_COMPAT: "h", **(labels or {})}},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip


def test_the_draining_label_drops_the_pod_from_the_fleet_at_once_and_unlabelling_restores_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        api = FakeApiServer()
        api.pods = {"d-0": _pod("d-0", "10.2.0.1"), "d-1": _pod("d-1", "10.2.0.2")}
        runner = await api.serve(tmp_path, monkeypatch)
        config = RouterConfig(namespace="ns", prefill_selector="r=p", decode_selector="r=d",
                              engine_port=8000)  # fmt: skip
        fleet = Fleet(config, RouterMetrics(CollectorRegistry()))
        task = asyncio.create_task(run_discovery(config, fleet))

        async def engines(want: set[str]) -> float:
            start = time.monotonic()
            while set(fleet.engines) != want:
                assert time.monotonic() - start < 10, (sorted(fleet.engines), want)
                await asyncio.sleep(0.005)
            return time.monotonic() - start

        try:
            both = {"http://10.2.0.1:8000", "http://10.2.0.2:8000"}
            await engines(both)
            # NOTE: discovery lists each selector (prefill, decode) once at start, in either
            # order; both engines can appear from the decode list before the prefill list is
            # made, which would then read as a relist caused by the event.
            start = time.monotonic()
            while api.lists < 2:
                assert time.monotonic() - start < 10, api.lists
                await asyncio.sleep(0.005)
            lists = api.lists
            drained = _pod("d-0", "10.2.0.1", {LABEL_DRAINING: "true"})
            await api.queue("r=d").put({"type": "MODIFIED", "object": drained})
            # From the watch event itself, not a relist: well under a second.
            assert await engines({"http://10.2.0.2:8000"}) < 1.0
            assert api.lists == lists
            # A cancelled drain (the label removed) brings the pod back.
            await api.queue("r=d").put({"type": "MODIFIED", "object": _pod("d-0", "10.2.0.1")})
            await engines(both)
        finally:
            task.cancel()
            for queue in api.events.values():
                await queue.put(None)
            await asyncio.gather(task, return_exceptions=True)
            await runner.cleanup()

    asyncio.run(main())


def test_two_revisions_side_by_side_are_paired_only_within_their_hash() -> None:
    """A roll that changed the compatibility hash: old (A) and new (B) prefill and decode
    engines all serve. Every disaggregated decision pairs a prefill and a decode of one hash,
    over many prompts and loads that would otherwise favour a cross-hash pair."""
    policy = RoutingPolicy(mode="always", min_uncached_tokens=0, block_size=4)
    cache = ApproxPrefixCache(1024)
    engines = [
        EngineSnapshot("http://pA:1", "prefill", "A", EngineLoad(running=6.0)),
        EngineSnapshot("http://pB:1", "prefill", "B", EngineLoad()),
        EngineSnapshot("http://dA:1", "decode", "A", EngineLoad()),
        EngineSnapshot("http://dB:1", "decode", "B", EngineLoad(running=6.0)),
    ]
    hashes = {e.url: e.compatibility_hash for e in engines}
    kinds = set()
    for i in range(200):
        tokens = [i % 7 + 1] * (4 + i % 13)
        request = RoutingRequest(hash_token_blocks(tokens, 4), len(tokens))
        d = policy.decide(engines, request, cache)
        kinds.add((d.decode_url, d.prefill_url))
        assert d.prefill_url is not None, d
        assert hashes[d.prefill_url] == hashes[d.decode_url], d
    # Both revisions were used (the least loaded decode is dA, whose only partner is pA).
    assert ("http://dA:1", "http://pA:1") in kinds
    # The old revision drains its prefill (gone from the fleet): its decode serves alone, and
    # the new prefill is never paired with it.
    without_pa = [e for e in engines if e.url != "http://pA:1"]
    for i in range(50):
        tokens = [i + 1] * 9
        d = policy.decide(without_pa, RoutingRequest(hash_token_blocks(tokens, 4), 9), cache)
        if d.decode_url == "http://dA:1":
            assert d.prefill_url is None and d.reason == "no_compatible_prefill", d
        else:
            assert d.prefill_url == "http://pB:1", d
