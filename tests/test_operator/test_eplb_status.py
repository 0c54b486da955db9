"""EPLB's balancedness on its way to the InferenceDeployment's status: what the operator reads
from an engine's /metrics (a real engine's exposition and a simulated one's), how it folds the
role's engines, and the patch it writes (the dev-cluster test, test_eplb_status_k8s.py, runs the
whole path against the API server)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fleetserve.api.models import InferenceDeploymentSpec, RoleStatus
from fleetserve.engine.core.outputs import SchedulerStats
from fleetserve.engine.eplb.stats import EplbStats
from fleetserve.engine.metrics import EngineMetrics
from fleetserve.operator.autoscale.sim_engine import SimEngine
from fleetserve.operator.autoscale.sim_eplb import load_time_balancedness
from fleetserve.operator.eplb_status import (
    eplb_roles,
    parse_balancedness,
    role_balancedness,
    status_patch,
)


def test_reads_what_the_engine_exports() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m", eplb=True)
    assert parse_balancedness(generate_latest(registry).decode()) is None  # no window yet
    metrics.record_scheduler_stats(SchedulerStats(eplb=EplbStats(balancedness=0.625)))
    assert parse_balancedness(generate_latest(registry).decode()) == 0.625


def test_reads_what_a_simulated_engine_exports() -> None:
    engine = SimEngine("decode")
    assert parse_balancedness(engine.exposition(0.0).decode()) is None
    engine.eplb_balancedness = load_time_balancedness(8, 8)
    assert parse_balancedness(engine.exposition(0.0).decode()) == engine.eplb_balancedness


def test_the_simulated_load_time_placement_is_skewed() -> None:
    # A Zipf load on p % E: the first ranks hold the hottest experts.
    assert 0.3 < load_time_balancedness(8, 8) < load_time_balancedness(2, 0) < 0.7
    with pytest.raises(ValueError, match="must split over 3 EP ranks"):
        load_time_balancedness(3, 0)


def test_roles_fold_their_engines_and_the_patch_names_only_them() -> None:
    values = role_balancedness({"prefill": [0.5, 0.7], "decode": []})
    assert values == {"prefill": 0.6}  # decode: no engine reported, its status is kept
    patch = status_patch(values)
    assert patch == {"roles": {"prefill": {"eplbBalancedness": 0.6}}}
    RoleStatus.model_validate(patch["roles"]["prefill"])  # the CRD's status schema has it


def test_only_eplb_roles_are_watched() -> None:
    role = {"gpusPerPod": 2, "parallelism": {"tensor": 2, "expert": True}}
    spec = InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": {"uri": "/m"}, "moe": True},
            "roles": {"prefill": role, "decode": {**role, "eplb": {"enabled": True}}},
        }
    )
    assert eplb_roles(spec) == ["decode"]


def test_the_watch_serves_only_deployments_running_eplb() -> None:
    from fleetserve.operator.eplb_status import EplbStatusWatch

    watch = EplbStatusWatch(kube=None, lock_for=lambda key: None)  # type: ignore[arg-type]
    meta = {"namespace": "ns", "name": "d"}
    eplb_on = {"roles": {"decode": {"eplb": {"enabled": True}}}}
    watch.track({"metadata": meta, "spec": {"roles": {"decode": {}}}})
    assert watch.targets == {}
    watch.track({"metadata": meta, "spec": eplb_on})
    assert watch.targets == {"ns/d": ("ns", "d")}
    watch.track({"metadata": {**meta, "deletionTimestamp": "now"}, "spec": eplb_on})
    assert watch.targets == {}
    watch.track({"metadata": meta, "spec": eplb_on})
    watch.forget("ns", "d")
    assert watch.targets == {}
