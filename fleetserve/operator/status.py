"""Pure status computation from the live StatefulSets of each role.

A group is ready when its StatefulSet has observed its generation, every pod is updated and ready;
a role's `readyReplicas` counts ready groups. `Ready=True` only when every group of every role is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetserve.api.models import InferenceDeploymentSpec

__all__ = ["GroupState", "compute_status", "group_state", "merge_conditions"]

from fleetserve.operator.builders import ANNOTATION_TEMPLATE_HASH


@dataclass(frozen=True, slots=True)
class GroupState:
    """What the operator knows about one live group StatefulSet."""

    ready: bool
    """All `group_size` pods ready and on the latest revision of the StatefulSet."""
    template_hash: str


def group_state(sts: dict[str, Any], group_size: int) -> GroupState:
    meta = sts.get("metadata", {})
    st = sts.get("status") or {}
    settled = st.get("observedGeneration", 0) >= meta.get("generation", 1) and st.get(
        "currentRevision"
    ) == st.get("updateRevision", st.get("currentRevision"))
    ready = (
        settled
        and st.get("readyReplicas", 0) == group_size
        and st.get("updatedReplicas", 0) == group_size
        and st.get("replicas", 0) == group_size
    )
    annotations = meta.get("annotations") or {}
    return GroupState(ready=ready, template_hash=annotations.get(ANNOTATION_TEMPLATE_HASH, ""))


def merge_conditions(
    previous: list[dict[str, Any]], new: list[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """New conditions, keeping a previous `lastTransitionTime` when the status did not change."""
    old = {c.get("type"): c for c in previous}
    out = []
    for c in new:
        before = old.get(c["type"])
        if before is not None and before.get("status") == c["status"]:
            stamp = before.get("lastTransitionTime") or now
        else:
            stamp = now
        out.append({**c, "lastTransitionTime": stamp})
    return out


def compute_status(
    spec: InferenceDeploymentSpec,
    generation: int,
    groups: dict[str, dict[int, GroupState]],
    desired_hashes: dict[tuple[str, int], str],
    *,
    endpoint: str,
    compat_hash: str,
    previous: dict[str, Any],
    now: str,
) -> dict[str, Any]:
    """The status object (camelCase) for the CR's status subresource.

    Args:
        groups: role → group index → live state (only groups that exist).
        desired_hashes: (role, group index) → the template hash that group should carry.
        previous: the current `.status` (for condition transition times and Degraded).
    """
    roles: dict[str, Any] = {}
    all_ready = True
    waiting: list[str] = []
    for name, role in spec.roles.items():
        live = groups.get(name, {})
        ready = sum(1 for i, g in live.items() if g.ready and i < role.replicas)
        updated = sum(
            1 for i, g in live.items() if g.template_hash == desired_hashes.get((name, i))
        )
        roles[name] = {
            "replicas": role.replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "groupSize": role.group_size,
        }
        if ready != role.replicas or len(live) != role.replicas or updated != role.replicas:
            all_ready = False
            waiting.append(f"{name} {ready}/{role.replicas} groups ready")
    was_ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in previous.get("conditions", [])
    )
    lost_group = any(
        roles[n]["readyReplicas"] < roles[n]["replicas"] == roles[n]["updatedReplicas"]
        for n in roles
    )
    degraded = not all_ready and was_ready and lost_group
    message = "; ".join(waiting) or "all groups ready"
    conditions = [
        {
            "type": "Ready",
            "status": "True" if all_ready else "False",
            "reason": "AllGroupsReady" if all_ready else "GroupsNotReady",
            "message": message,
        },
        {
            "type": "Progressing",
            "status": "False" if all_ready else "True",
            "reason": "Stable" if all_ready else "Reconciling",
            "message": message,
        },
        {
            "type": "Degraded",
            "status": "True" if degraded else "False",
            "reason": "GroupLost" if degraded else "AsExpected",
            "message": message if degraded else "",
        },
    ]
    phase = "Ready" if all_ready else "Degraded" if degraded else "Progressing"
    return {
        "observedGeneration": generation,
        "phase": phase,
        "conditions": merge_conditions(previous.get("conditions", []), conditions, now),
        "roles": roles,
        "endpoint": endpoint,
        "compatibilityHash": compat_hash,
    }
