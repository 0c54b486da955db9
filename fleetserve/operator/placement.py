"""Placement of replica groups on GPU nodes (pure): creation order, packing, unschedulable pods.

On a cluster with exactly enough GPUs, pods that need part of a node must not fragment the nodes
a group of whole-node pods needs. Two rules keep them apart:

- Creation order (first-fit decreasing): roles are created in tiers of GPUs per pod, largest
  first. A role's new groups wait (`hold_creation`) while a group of an earlier tier is created
  in the same pass or still has pods the scheduler has not bound, so large pods claim their
  nodes before smaller ones arrive. Ordering by creation, not by pod priority: pods created in
  one pass reach the scheduler's queue in the StatefulSet controller's order, whatever their
  priority, and a PriorityClass would be a cluster-scoped object that also preempts.
- Packing (`pack_affinity`): every GPU pod prefers nodes that already hold pods of its role of
  its deployment, so partial-node pods fill one node before they start another (the scheduler's
  default scoring spreads them by least-allocated CPU and memory).

Pods the scheduler cannot place carry `PodScheduled=False` with reason `Unschedulable` and its
message ("0/4 nodes are available: 4 Insufficient nvidia.com/gpu"); `read_placement` reads them
and `placement_condition` names the groups in the deployment's `Unschedulable` condition.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetserve.api.labels import LABEL_DEPLOYMENT, LABEL_GROUP, LABEL_ROLE
from fleetserve.api.models import Condition, InferenceDeploymentSpec
from fleetserve.operator.roll import RolePlan

__all__ = [
    "HOSTNAME_KEY",
    "PACK_WEIGHT",
    "GroupPlacement",
    "awaits_placement",
    "creation_tiers",
    "hold_creation",
    "is_placed",
    "pack_affinity",
    "placement_condition",
    "read_placement",
]

HOSTNAME_KEY = "kubernetes.io/hostname"
PACK_WEIGHT = 100
"""The highest weight a preferred term may have: packing outweighs the default spreading."""

GroupKey = tuple[str, int]
"""(role, group index)."""


@dataclass(frozen=True, slots=True)
class GroupPlacement:
    """Where the scheduler stands with one group's live (not terminating) pods."""

    pods: int = 0
    bound: int = 0
    """Pods the scheduler placed on a node (`spec.nodeName` set)."""
    unschedulable: str = ""
    """The scheduler's message for the first (by name) pod it found no node for; "" if none."""


def _unschedulable_message(pod: dict[str, Any]) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        scheduled = (c.get("type"), c.get("status"), c.get("reason"))
        if scheduled == ("PodScheduled", "False", "Unschedulable"):
            return str(c.get("message") or "no node fits the pod")
    return None


def read_placement(pods: Sequence[dict[str, Any]]) -> dict[GroupKey, GroupPlacement]:
    """Per (role, group index), the placement of the groups' pods (others are ignored)."""
    out: dict[GroupKey, GroupPlacement] = {}
    for pod in sorted(pods, key=lambda p: str(p["metadata"].get("name", ""))):
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        if meta.get("deletionTimestamp") or LABEL_ROLE not in labels or LABEL_GROUP not in labels:
            continue
        key = (labels[LABEL_ROLE], int(labels[LABEL_GROUP]))
        seen = out.get(key, GroupPlacement())
        bound = bool((pod.get("spec") or {}).get("nodeName"))
        message = "" if bound else _unschedulable_message(pod) or ""
        out[key] = GroupPlacement(
            pods=seen.pods + 1,
            bound=seen.bound + bound,
            unschedulable=seen.unschedulable or message,
        )
    return out


def is_placed(placement: GroupPlacement | None, group_size: int) -> bool:
    """Every one of the group's `group_size` pods exists and is bound to a node."""
    return placement is not None and placement.bound >= group_size


def awaits_placement(pod: dict[str, Any]) -> bool:
    """A group pod whose scheduling the deployment's status and creation order wait on: one
    not yet running (phase Pending: unbound, unschedulable, or bound and starting). Later
    changes show in its StatefulSet's status, which the operator watches already."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if LABEL_DEPLOYMENT not in labels or meta.get("deletionTimestamp"):
        return False
    return (pod.get("status") or {}).get("phase", "Pending") == "Pending"


def creation_tiers(spec: InferenceDeploymentSpec) -> list[list[str]]:
    """The roles in creation order: tiers of equal GPUs per pod, most GPUs first (a CPU role,
    0 GPUs, last); within a tier, the roles' fixed order."""
    by_gpus: dict[int, list[str]] = {}
    for name, role in spec.roles.items():
        by_gpus.setdefault(role.gpus_per_pod, []).append(name)
    return [by_gpus[g] for g in sorted(by_gpus, reverse=True)]


def hold_creation(plan: RolePlan) -> RolePlan:
    """`plan` with its new groups held back: nothing is created, and no stale group is drained
    for a roll (the plan counted on the new groups to replace it). Scale-down drains, undrains
    and deletions of finished drains go ahead."""
    return dataclasses.replace(
        plan, create=(), drain=tuple(d for d in plan.drain if d[1] != "roll")
    )


def pack_affinity(deployment: str, role: str) -> dict[str, Any]:
    """The pod `affinity` of a GPU role's pods: prefer nodes that hold pods of the same role
    of the same deployment (`topologyKey` the node), so partial-node pods pack."""
    term = {
        "labelSelector": {"matchLabels": {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role}},
        "topologyKey": HOSTNAME_KEY,
    }
    return {
        "podAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": PACK_WEIGHT, "podAffinityTerm": term}
            ]
        }
    }


def _group(key: GroupKey) -> str:
    return f"{key[0]} group {key[1]}"


def placement_condition(
    unschedulable: Mapping[GroupKey, str], held: Mapping[str, Sequence[GroupKey]]
) -> Condition:
    """The `Unschedulable` condition: True naming each group with a pod the scheduler cannot
    place and the scheduler's message, then each role whose new groups wait for earlier groups
    to be placed; False when every group's pods are placed or on their way."""
    if not unschedulable:
        return Condition(
            type="Unschedulable",
            status="False",
            reason="AsExpected",
            message="no group waits for nodes",
        )
    parts = [f"{_group(k)}: {unschedulable[k]}" for k in sorted(unschedulable)]
    parts += [
        f"new {role} groups wait for {', '.join(_group(k) for k in sorted(held[role]))}"
        for role in sorted(held)
    ]
    return Condition(
        type="Unschedulable", status="True", reason="Unschedulable", message="; ".join(parts)
    )
