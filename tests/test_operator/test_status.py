from __future__ import annotations

from typing import Any

from fleetserve.api.crd import crd_manifest
from fleetserve.api.models import InferenceDeploymentSpec, InferenceDeploymentStatus
from fleetserve.operator.reconcile import is_subset
from fleetserve.operator.status import (
    GroupState,
    RouterState,
    compute_status,
    failed_status,
    group_state,
    router_state,
)

SPEC = InferenceDeploymentSpec.model_validate(
    {
        "model": {"name": "m", "source": {"uri": "/m"}},
        "roles": {
            "prefill": {"replicas": 2},
            "decode": {"gpusPerPod": 8, "parallelism": {"tensor": 8, "pipeline": 2}},
        },
    }
)
HASHES = {("prefill", 0): "a", ("prefill", 1): "b", ("decode", 0): "c"}
ROLE_HASHES = {"prefill": "h", "decode": "h"}
ROUTER_READY = RouterState(ready_replicas=1, updated=True, ready=True)


def _status(
    groups: dict[str, dict[int, GroupState]],
    previous: dict | None = None,
    router: RouterState = ROUTER_READY,
    transfer_warnings: tuple[str, ...] = (),
) -> dict:
    return compute_status(
        SPEC,
        3,
        groups,
        HASHES,
        router,
        endpoint="http://e",
        role_hashes=ROLE_HASHES,
        compat_hash="h",
        previous=previous or {},
        now="T1",
        transfer_warnings=transfer_warnings,
    )


def _status_schema() -> dict[str, Any]:
    version = crd_manifest()["spec"]["versions"][0]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    return schema


def _pruned(value: Any, schema: dict[str, Any], path: str = "status") -> list[str]:
    """Paths the API server would prune from `value` under the structural `schema`."""
    if isinstance(value, dict):
        out = []
        for key, sub in value.items():
            if "properties" in schema:
                if key not in schema["properties"]:
                    out.append(f"{path}.{key}")
                    continue
                out += _pruned(sub, schema["properties"][key], f"{path}.{key}")
            elif "additionalProperties" in schema:
                out += _pruned(sub, schema["additionalProperties"], f"{path}.{key}")
            else:
                out.append(f"{path}.{key}")
        return out
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _pruned(v, schema["items"], f"{path}[{i}]")]
    return []


def _assert_written_through_the_model(status: dict[str, Any]) -> None:
    """The status is a dump of the model the CRD schema comes from: nothing would be pruned."""
    model = InferenceDeploymentStatus.model_validate(status)
    assert model.model_dump(by_alias=True, exclude_none=True) == status
    assert _pruned(status, _status_schema()) == []


def test_group_state_needs_every_pod_ready_and_updated() -> None:
    sts = {
        "metadata": {"generation": 2, "annotations": {"fleetserve.io/template-hash": "c"}},
        "status": {
            "observedGeneration": 2,
            "replicas": 2,
            "readyReplicas": 2,
            "updatedReplicas": 2,
            "currentRevision": "r1",
            "updateRevision": "r1",
        },
    }
    assert group_state(sts, 2) == GroupState(ready=True, template_hash="c")
    assert not group_state({**sts, "metadata": {**sts["metadata"], "generation": 3}}, 2).ready
    assert not group_state({**sts, "status": {**sts["status"], "updateRevision": "r2"}}, 2).ready
    assert not group_state({**sts, "status": {**sts["status"], "readyReplicas": 1}}, 2).ready


def test_router_state_needs_the_wanted_pods_ready_and_updated() -> None:
    deploy = {
        "metadata": {"generation": 4},
        "status": {
            "observedGeneration": 4,
            "replicas": 2,
            "updatedReplicas": 2,
            "readyReplicas": 2,
        },
    }
    assert router_state(deploy, 2) == RouterState(ready_replicas=2, updated=True, ready=True)
    assert router_state({**deploy, "metadata": {"generation": 5}}, 2).ready is False
    mid_roll = {**deploy, "status": {**deploy["status"], "replicas": 3}}
    assert router_state(mid_roll, 2).ready is False
    lost = {**deploy, "status": {**deploy["status"], "readyReplicas": 1}}
    assert router_state(lost, 2) == RouterState(ready_replicas=1, updated=True, ready=False)
    assert router_state(None, 1) == RouterState(ready_replicas=0, updated=False, ready=False)
    assert router_state(None, 0).ready
    assert router_state(
        {"metadata": {"generation": 1}, "status": {"observedGeneration": 1}}, 0
    ).ready


def test_ready_only_when_every_group_of_every_role_is_ready() -> None:
    partial = {
        "prefill": {0: GroupState(True, "a"), 1: GroupState(True, "b")},
        "decode": {0: GroupState(False, "c")},
    }
    st = _status(partial)
    _assert_written_through_the_model(st)
    assert st["phase"] == "Progressing"
    assert [(c["type"], c["status"]) for c in st["conditions"]] == [
        ("Ready", "False"),
        ("Progressing", "True"),
        ("Degraded", "False"),
        ("TransferReady", "True"),
    ]
    assert st["roles"]["decode"] == {
        "replicas": 1,
        "readyReplicas": 0,
        "updatedReplicas": 1,
        "groupSize": 2,
        "compatibilityHash": "h",
    }
    assert st["conditions"][0]["message"] == "decode 0/1 groups ready"
    full = {**partial, "decode": {0: GroupState(True, "c")}}
    ready = _status(full, st)
    _assert_written_through_the_model(ready)
    assert ready["phase"] == "Ready" and ready["observedGeneration"] == 3
    assert ready["router"] == {"replicas": 1, "readyReplicas": 1}
    assert ready["compatibilityHash"] == "h" and ready["endpoint"] == "http://e"
    assert ready["conditions"][0] == {
        "type": "Ready",
        "status": "True",
        "reason": "AllGroupsReady",
        "message": "all groups and the router ready",
        "lastTransitionTime": "T1",
    }
    lost = _status(partial, ready)
    assert lost["phase"] == "Degraded"
    assert lost["conditions"][2]["reason"] == "GroupLost"


def test_ready_counts_the_router() -> None:
    groups = {
        "prefill": {0: GroupState(True, "a"), 1: GroupState(True, "b")},
        "decode": {0: GroupState(True, "c")},
    }
    starting = _status(groups, router=RouterState(ready_replicas=0, updated=False, ready=False))
    _assert_written_through_the_model(starting)
    assert starting["phase"] == "Progressing"
    assert starting["conditions"][0]["status"] == "False"
    assert starting["conditions"][0]["message"] == "router 0/1 pods ready"
    assert starting["router"] == {"replicas": 1, "readyReplicas": 0}
    ready = _status(groups, starting)
    assert ready["phase"] == "Ready"
    # The router's pod dies after Ready: the deployment is degraded, not merely progressing.
    lost = _status(groups, ready, RouterState(ready_replicas=0, updated=True, ready=False))
    assert lost["phase"] == "Degraded"
    assert lost["conditions"][2]["message"] == "router 0/1 pods ready"


def test_failed_status_says_why_and_keeps_the_role_hashes() -> None:
    previous = _status(
        {"prefill": {0: GroupState(True, "a"), 1: GroupState(True, "b")}, "decode": {}}
    )
    failed = failed_status(
        4,
        "InvalidSpec",
        "set model.dtype explicitly",
        previous=previous,
        now="T2",
        role_hashes={"prefill": "p", "decode": "q"},
    )
    _assert_written_through_the_model(failed)
    assert failed["phase"] == "Failed" and failed["observedGeneration"] == 4
    assert failed["conditions"][0] == {
        "type": "Ready",
        "status": "False",
        "reason": "InvalidSpec",
        "message": "set model.dtype explicitly",
        "lastTransitionTime": previous["conditions"][0]["lastTransitionTime"],
    }
    assert failed["conditions"][1]["status"] == "False"
    assert failed["conditions"][1]["lastTransitionTime"] == "T2"
    assert failed["roles"]["prefill"] == {**previous["roles"]["prefill"], "compatibilityHash": "p"}
    assert failed["roles"]["decode"]["compatibilityHash"] == "q"
    # Unknown hashes (the spec did not even validate): roles are left out, so kept as they were.
    bare = failed_status(5, "InvalidSpec", "spec.model: Field required", previous={}, now="T3")
    _assert_written_through_the_model(bare)
    assert "roles" not in bare or bare["roles"] == {}
    assert is_subset(bare, {**bare, "endpoint": "http://e"})


def test_is_subset_ignores_server_defaults() -> None:
    assert is_subset({"a": [{"b": 1}]}, {"a": [{"b": 1, "c": 2}], "d": 3})
    assert not is_subset({"a": [{"b": 1}]}, {"a": [{"b": 1}, {"b": 2}]})
    assert not is_subset({"a": "1"}, {"a": 1})


def test_transfer_warnings_make_transfer_ready_false_without_blocking_ready() -> None:
    groups = {
        "prefill": {0: GroupState(True, "a"), 1: GroupState(True, "b")},
        "decode": {0: GroupState(True, "c")},
    }
    st = _status(groups, transfer_warnings=("one", "two"))
    _assert_written_through_the_model(st)
    assert st["phase"] == "Ready"
    transfer = next(c for c in st["conditions"] if c["type"] == "TransferReady")
    assert transfer["status"] == "False" and transfer["message"] == "one; two"
    assert transfer["reason"] == "TransferRequirementsUnmet"
