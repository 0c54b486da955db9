"""Gang admission through Kueue (pure): the spec field, the pod-group metadata on every pod of
every group, and the AwaitingAdmission condition from gated pods and Kueue's Workloads."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.operator.builders import Owner, build_children
from fleetserve.operator.gang import (
    ADMISSION_GATE,
    admission_condition,
    admission_waits,
    waiting_pod_groups,
)

OWNER = Owner(name="d", namespace="ns", uid="u")
QUOTA_MESSAGE = (
    "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor"
    " default-flavor, 16 more needed"
)


def _spec(scheduling: dict[str, Any] | None) -> InferenceDeploymentSpec:
    body: dict[str, Any] = {
        "model": {"name": "m", "source": {"uri": "/m"}},
        "roles": {
            "prefill": {"replicas": 2, "gpusPerPod": 2, "parallelism": {"tensor": 2}},
            # 16 ranks over 8-GPU pods: groups of two whole-node pods.
            "decode": {"replicas": 2, "gpusPerPod": 8, "parallelism": {"tensor": 16}},
        },
    }
    if scheduling is not None:
        body["scheduling"] = scheduling
    return InferenceDeploymentSpec.model_validate(body)


def _templates(spec: InferenceDeploymentSpec) -> dict[str, dict[str, Any]]:
    return {
        c["metadata"]["name"]: c["spec"]["template"]
        for c in build_children(spec, OWNER)
        if c["kind"] == "StatefulSet"
    }


def test_every_pod_of_every_group_is_one_kueue_pod_group_of_its_size() -> None:
    spec = _spec({"gangAdmission": "kueue", "queueName": "team-a"})
    templates = _templates(spec)
    assert sorted(templates) == ["d-decode-0", "d-decode-1", "d-prefill-0", "d-prefill-1"]
    sizes = {"decode": "2", "prefill": "1"}
    for name, template in templates.items():
        labels, annotations = template["metadata"]["labels"], template["metadata"]["annotations"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
        # The StatefulSet's name: one Workload per group, unique among live groups.
        assert labels["kueue.x-k8s.io/pod-group-name"] == name
        assert annotations == {
            "kueue.x-k8s.io/pod-group-total-count": sizes[labels["fleetserve.io/role"]],
            "kueue.x-k8s.io/pod-group-serving": "true",
        }
    router = next(c for c in build_children(spec, OWNER) if c["kind"] == "Deployment")
    assert "kueue.x-k8s.io/queue-name" not in router["spec"]["template"]["metadata"]["labels"]


def test_without_gang_admission_the_pods_are_rendered_as_before() -> None:
    plain, explicit = _spec(None), _spec({"gangAdmission": "none"})
    assert _templates(plain) == _templates(explicit)
    for template in _templates(plain).values():
        assert "annotations" not in template["metadata"]
        assert not any(k.startswith("kueue.x-k8s.io/") for k in template["metadata"]["labels"])

    # Turning it on changes the template, so the groups roll into gated, queued pods.
    def digests(spec: InferenceDeploymentSpec) -> dict[str, str]:
        return {
            c["metadata"]["name"]: c["metadata"]["annotations"]["fleetserve.io/template-hash"]
            for c in build_children(spec, OWNER)
            if c["kind"] == "StatefulSet"
        }

    on, off = digests(_spec({"gangAdmission": "kueue", "queueName": "q"})), digests(plain)
    assert on.keys() == off.keys()
    assert all(on[name] != off[name] for name in on)


@pytest.mark.parametrize(
    ("scheduling", "fragment"),
    [
        ({"gangAdmission": "kueue"}, "scheduling.queueName"),
        ({"queueName": "q"}, "scheduling.queueName"),
        ({"gangAdmission": "none", "queueName": "q"}, "only then"),
        ({"gangAdmission": "volcano", "queueName": "q"}, "'none' or 'kueue'"),
        (
            {"gangAdmission": "kueue", "queueName": "Team_A"},
            "scheduling.queueName\n  String should match",
        ),
        ({"gangAdmission": "kueue", "queueName": "a" * 64}, "at most 63 characters"),
        ({"gangAdmission": "kueue", "queueName": "q", "priority": 1}, "priority"),
    ],
)
def test_bad_scheduling_is_refused_naming_the_field(
    scheduling: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValidationError, match=fragment) as info:
        _spec(scheduling)
    assert "scheduling" in str(info.value)


def _pod(
    name: str, role: str, group: int, *, gated: bool, deleting: bool = False
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {
            "fleetserve.io/role": role,
            "fleetserve.io/group": str(group),
            "kueue.x-k8s.io/pod-group-name": f"d-{role}-{group}",
        },
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    spec: dict[str, Any] = {"schedulingGates": [{"name": ADMISSION_GATE}]} if gated else {}
    return {"metadata": meta, "spec": spec}


def _workload(name: str, message: str) -> dict[str, Any]:
    conditions = [
        {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": message}
    ]
    return {"metadata": {"name": name}, "status": {"conditions": conditions}}


PODS = [
    _pod("d-decode-0-0", "decode", 0, gated=False),
    _pod("d-decode-0-1", "decode", 0, gated=False),
    _pod("d-decode-1-0", "decode", 1, gated=True),
    _pod("d-decode-1-1", "decode", 1, gated=True),
    _pod("d-prefill-0-0", "prefill", 0, gated=True),
    _pod("d-prefill-1-0", "prefill", 1, gated=True, deleting=True),
]


def test_gated_groups_wait_with_kueues_reason() -> None:
    assert waiting_pod_groups(PODS) == ["d-decode-1", "d-prefill-0"]
    workloads = {"d-decode-1": _workload("d-decode-1", QUOTA_MESSAGE), "d-prefill-0": None}
    waits = admission_waits(PODS, workloads)
    assert waits == {
        ("decode", 1): QUOTA_MESSAGE,
        ("prefill", 0): "Kueue has no Workload for the group yet (it waits for all its pods)",
    }
    cond = admission_condition("team-a", waits)
    assert (cond.type, cond.status, cond.reason) == (
        "AwaitingAdmission",
        "True",
        "QuotaReservationPending",
    )
    assert cond.message == (
        "waiting for Kueue admission in LocalQueue team-a: decode group 1: "
        f"{QUOTA_MESSAGE}; prefill group 0: Kueue has no Workload for the group yet"
        " (it waits for all its pods)"
    )


def test_unreadable_workloads_still_name_the_gated_groups() -> None:
    assert admission_waits(PODS, None) == {
        ("decode", 1): "gated by Kueue, not admitted yet",
        ("prefill", 0): "gated by Kueue, not admitted yet",
    }


def test_no_gated_pod_means_admitted() -> None:
    ungated = [p for p in PODS if not p["spec"]]
    assert waiting_pod_groups(ungated) == []
    cond = admission_condition("q", admission_waits(ungated, {}))
    assert (cond.status, cond.reason) == ("False", "Admitted")
    assert "LocalQueue q" in cond.message
