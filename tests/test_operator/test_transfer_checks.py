"""The pure checks of what KV transfer needs from the cluster."""

from __future__ import annotations

import re
from typing import Any

import pytest

from fleetserve.api.models import QUANTITY_PATTERN, InferenceDeploymentSpec
from fleetserve.operator.transfer_checks import (
    ClusterFacts,
    cluster_facts,
    cpu_cores,
    transfer_warnings,
)


def _spec(kv: dict[str, Any], cpu: str = "4", unified: bool = False) -> InferenceDeploymentSpec:
    roles = {"unified": {}} if unified else {"prefill": {}, "decode": {}}
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": {"uri": "/m"}},
            "engine": {"cpu": cpu},
            "kvTransfer": kv,
            "roles": roles,
        }
    )


def _node(allocatable: dict[str, str], unschedulable: bool = False) -> dict[str, Any]:
    return {"spec": {"unschedulable": unschedulable}, "status": {"allocatable": allocatable}}


def test_facts_from_live_objects() -> None:
    facts = cluster_facts(
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
        [
            _node({"cpu": "8", "rdma/hca": "4"}, unschedulable=True),
            _node({"cpu": "8", "nvidia.com/gpu": "8", "rdma/ib": "0"}),
        ],
    )
    assert facts.pod_security_enforce == "restricted"
    # A cordoned node's devices and an exhausted resource are not on offer.
    assert facts.node_resources == frozenset({"cpu", "nvidia.com/gpu"})
    unlabelled = cluster_facts({"metadata": {}}, None)
    assert unlabelled == ClusterFacts(pod_security_enforce="privileged", node_resources=None)


def test_a_cluster_that_meets_everything_gets_no_warning() -> None:
    facts = ClusterFacts("privileged", frozenset({"rdma/hca"}))
    assert transfer_warnings(_spec({"connector": "mooncake", "protocol": "rdma"}), facts) == []
    assert transfer_warnings(_spec({"connector": "tcp"}), ClusterFacts()) == []


def test_unknown_facts_claim_nothing() -> None:
    spec = _spec({"connector": "mooncake", "protocol": "rdma"})
    assert transfer_warnings(spec, ClusterFacts()) == []


@pytest.mark.parametrize("level", ["baseline", "restricted"])
def test_pod_security_that_rejects_ipc_lock(level: str) -> None:
    [warning] = transfer_warnings(_spec({"connector": "tcp"}), ClusterFacts(level))
    assert f"Pod Security '{level}'" in warning and "IPC_LOCK" in warning


def test_rdma_without_a_device_plugin() -> None:
    spec = _spec({"connector": "mooncake", "protocol": "rdma", "rdmaResource": "x/hca"})
    [warning] = transfer_warnings(spec, ClusterFacts("privileged", frozenset({"rdma/hca"})))
    assert "'x/hca'" in warning and "Pending" in warning


def test_more_transfer_threads_than_cpus() -> None:
    [warning] = transfer_warnings(
        _spec({"connector": "tcp", "numThreads": 8}, cpu="2500m"), ClusterFacts()
    )
    assert "numThreads 8 exceeds engine.cpu 2500m" in warning
    assert (
        transfer_warnings(_spec({"connector": "tcp", "numThreads": 1}, cpu="500m"), ClusterFacts())
        == []
    )


def test_a_unified_fleet_moves_no_kv() -> None:
    spec = _spec({"connector": "none"}, unified=True)
    assert transfer_warnings(spec, ClusterFacts("restricted")) == []


@pytest.mark.parametrize(
    ("quantity", "cores"),
    [("4", 4), ("500m", 0.5), ("1.5", 1.5), (".5", 0.5), ("1k", 1000), ("1e3", 1000),
     ("0.5e1", 5), ("2500u", 0.0025)],
)  # fmt: skip
def test_cpu_quantities_in_every_form_the_crd_admits(quantity: str, cores: float) -> None:
    """The CRD admits every Kubernetes quantity form, so the reconcile reads each of them
    (a form it could not read passed `kubectl apply` and then failed the reconcile)."""
    assert re.fullmatch(QUANTITY_PATTERN, quantity) is not None
    assert cpu_cores(quantity) == pytest.approx(cores)
    spec = _spec({"connector": "tcp", "numThreads": 8}, cpu=quantity)
    assert bool(transfer_warnings(spec, ClusterFacts())) == (cores < 8)


def test_cpu_quantity_that_is_none_is_named() -> None:
    with pytest.raises(ValueError, match=r"engine\.cpu must be a CPU quantity"):
        cpu_cores("four")
