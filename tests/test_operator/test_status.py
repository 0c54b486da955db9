from __future__ import annotations

from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.operator.reconcile import is_subset
from fleetserve.operator.status import GroupState, compute_status, group_state

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


def _status(groups: dict[str, dict[int, GroupState]], previous: dict | None = None) -> dict:
    return compute_status(
        SPEC,
        3,
        groups,
        HASHES,
        endpoint="http://e",
        compat_hash="h",
        previous=previous or {},
        now="T1",
    )


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


def test_ready_only_when_every_group_of_every_role_is_ready() -> None:
    partial = {
        "prefill": {0: GroupState(True, "a"), 1: GroupState(True, "b")},
        "decode": {0: GroupState(False, "c")},
    }
    st = _status(partial)
    assert st["phase"] == "Progressing"
    assert [(c["type"], c["status"]) for c in st["conditions"]] == [
        ("Ready", "False"),
        ("Progressing", "True"),
        ("Degraded", "False"),
    ]
    assert st["roles"]["decode"] == {
        "replicas": 1,
        "readyReplicas": 0,
        "updatedReplicas": 1,
        "groupSize": 2,
    }
    assert st["conditions"][0]["message"] == "decode 0/1 groups ready"
    full = {**partial, "decode": {0: GroupState(True, "c")}}
    ready = _status(full, st)
    assert ready["phase"] == "Ready" and ready["observedGeneration"] == 3
    assert ready["conditions"][0] == {
        "type": "Ready",
        "status": "True",
        "reason": "AllGroupsReady",
        "message": "all groups ready",
        "lastTransitionTime": "T1",
    }
    lost = _status(partial, ready)
    assert lost["phase"] == "Degraded"
    assert lost["conditions"][2]["reason"] == "GroupLost"


def test_is_subset_ignores_server_defaults() -> None:
    assert is_subset({"a": [{"b": 1}]}, {"a": [{"b": 1, "c": 2}], "d": 3})
    assert not is_subset({"a": [{"b": 1}]}, {"a": [{"b": 1}, {"b": 2}]})
    assert not is_subset({"a": "1"}, {"a": 1})
