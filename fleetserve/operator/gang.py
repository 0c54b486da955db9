"""Gang admission of replica groups through Kueue (pure): pod-group metadata and status.

With `spec.scheduling.gangAdmission: kueue`, every replica group is one Kueue *pod group*
(Kueue's plain-pod integration): each pod of the group carries the group's name, its size and
the LocalQueue. Kueue's webhook gates each such pod (`kueue.x-k8s.io/admission`) as it is
created, so the scheduler does not see it; once all `group_size` pods exist, Kueue admits the
group's one Workload against its ClusterQueue's quota and lifts every gate together, or leaves
them all gated. A group therefore gets all of its GPUs or holds none.

Every group takes part, single-pod groups too: a GPU pod outside the queue would take GPUs the
ClusterQueue's quota does not count, and a group admitted by quota could then find them gone.
The groups are serving groups (`pod-group-serving`): Kueue never considers them finished, and
a pod the StatefulSet recreates joins its admitted group instead of queueing anew.

`admission_waits` reads which groups still wait (gated pods, and when the operator may read
Kueue's Workloads, Kueue's reason); `admission_condition` names them in the deployment's
`AwaitingAdmission` condition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fleetserve.api.labels import (
    ANNOTATION_KUEUE_POD_GROUP_SERVING,
    ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT,
    LABEL_GROUP,
    LABEL_KUEUE_POD_GROUP_NAME,
    LABEL_KUEUE_QUEUE_NAME,
    LABEL_ROLE,
)
from fleetserve.api.models import Condition, InferenceDeploymentSpec, Role

__all__ = [
    "ADMISSION_GATE",
    "ADMISSION_POLL_S",
    "admission_condition",
    "admission_waits",
    "gang_pod_metadata",
    "uses_kueue",
    "waiting_pod_groups",
]

ADMISSION_GATE = "kueue.x-k8s.io/admission"
"""The scheduling gate Kueue's webhook puts on a queued pod and lifts when it admits it."""

ADMISSION_POLL_S = 5.0
"""How soon a deployment with a group waiting for admission is reconciled again: Kueue's
decisions and reasons live in its Workloads, which the operator does not watch."""

GroupKey = tuple[str, int]
"""(role, group index)."""


def uses_kueue(spec: InferenceDeploymentSpec) -> bool:
    return spec.scheduling.gang_admission == "kueue"


def gang_pod_metadata(
    spec: InferenceDeploymentSpec, role: Role, group: str
) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) the pods of replica group `group` (its StatefulSet's name) carry
    under gang admission; both empty without it.

    The pod-group name is the StatefulSet's: unique among the namespace's live groups, and a
    recreated pod of the group joins the same Workload.
    """
    if not uses_kueue(spec):
        return {}, {}
    assert spec.scheduling.queue_name is not None, "validated: kueue needs a queue name"
    labels = {
        LABEL_KUEUE_QUEUE_NAME: spec.scheduling.queue_name,
        LABEL_KUEUE_POD_GROUP_NAME: group,
    }
    annotations = {
        ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT: str(role.group_size),
        ANNOTATION_KUEUE_POD_GROUP_SERVING: "true",
    }
    return labels, annotations


def _gated(pod: Mapping[str, Any]) -> bool:
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == ADMISSION_GATE for g in gates)


def _workload_reason(workload: Mapping[str, Any]) -> str:
    """Kueue's word on a Workload not admitted: its QuotaReserved (else Admitted) condition's
    message when False, else ""."""
    conditions = (workload.get("status") or {}).get("conditions") or []
    for kind in ("QuotaReserved", "Admitted"):
        for c in conditions:
            if c.get("type") == kind and c.get("status") == "False" and c.get("message"):
                return str(c["message"])
    return ""


def _waiting_pods(pods: Sequence[Mapping[str, Any]]) -> dict[GroupKey, str]:
    """(role, index) → pod-group name, for each group with a live pod Kueue still gates."""
    out: dict[GroupKey, str] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if meta.get("deletionTimestamp") or LABEL_ROLE not in labels or LABEL_GROUP not in labels:
            continue
        if _gated(pod):
            key = (labels[LABEL_ROLE], int(labels[LABEL_GROUP]))
            out[key] = labels.get(LABEL_KUEUE_POD_GROUP_NAME, "")
    return out


def waiting_pod_groups(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """Names of the pod groups (= their Workloads) with a live pod Kueue still gates."""
    return sorted({name for name in _waiting_pods(pods).values() if name})


def admission_waits(
    pods: Sequence[Mapping[str, Any]],
    workloads: Mapping[str, Mapping[str, Any] | None] | None,
) -> dict[GroupKey, str]:
    """Per group with a (live) pod still gated by Kueue: why it waits.

    `workloads` maps the names `waiting_pod_groups` gave to Kueue's Workload of that name
    (None: none yet; Kueue makes it once every pod of the group exists), or is None when
    Workloads cannot be read. The reason is Kueue's when it has one, e.g. "couldn't assign
    flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor default-flavor,
    16 more needed".
    """
    out: dict[GroupKey, str] = {}
    for key, group in _waiting_pods(pods).items():
        reason = "gated by Kueue, not admitted yet"
        if workloads is not None:
            workload = workloads.get(group)
            if workload is None:
                reason = "Kueue has no Workload for the group yet (it waits for all its pods)"
            else:
                reason = _workload_reason(workload) or reason
        out[key] = reason
    return out


def admission_condition(queue: str, waits: Mapping[GroupKey, str]) -> Condition:
    """The `AwaitingAdmission` condition: True naming each group Kueue has not admitted (its
    pods gated, holding no node or GPU) with Kueue's reason; False when none waits."""
    if not waits:
        return Condition(
            type="AwaitingAdmission",
            status="False",
            reason="Admitted",
            message=f"Kueue admitted every group (LocalQueue {queue})",
        )
    parts = [f"{role} group {index}: {waits[(role, index)]}" for role, index in sorted(waits)]
    return Condition(
        type="AwaitingAdmission",
        status="True",
        reason="QuotaReservationPending",
        message=f"waiting for Kueue admission in LocalQueue {queue}: " + "; ".join(parts),
    )
