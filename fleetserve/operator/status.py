"""Pure status computation from the live StatefulSets of each role and the router Deployment.

A group is ready when its StatefulSet has observed its generation, every pod is updated and ready;
a role's `readyReplicas` counts ready groups. `Ready=True` only when every group of every role is
ready and so is the router. The status is built as `InferenceDeploymentStatus` (the model the
CRD's status schema comes from) and dumped by alias without unset fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleetserve.api.labels import ANNOTATION_TEMPLATE_HASH
from fleetserve.api.models import (
    Condition,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    RoleStatus,
    RouterStatus,
)

__all__ = [
    "GroupState",
    "RouterState",
    "compute_status",
    "failed_status",
    "group_state",
    "merge_conditions",
    "router_state",
]


@dataclass(frozen=True, slots=True)
class GroupState:
    """What the operator knows about one live group StatefulSet."""

    ready: bool
    """All `group_size` pods ready and on the latest revision of the StatefulSet."""
    template_hash: str


@dataclass(frozen=True, slots=True)
class RouterState:
    """What the operator knows about the live router Deployment."""

    ready_replicas: int
    updated: bool
    """The Deployment observed its generation and every wanted pod runs its latest template."""
    ready: bool
    """Updated, and as many ready pods as wanted (trivially true for 0 replicas)."""


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


def router_state(deployment: dict[str, Any] | None, replicas: int) -> RouterState:
    """The router's state from its live Deployment (None: not created yet), wanting `replicas`."""
    if deployment is None:
        return RouterState(ready_replicas=0, updated=replicas == 0, ready=replicas == 0)
    meta = deployment.get("metadata", {})
    st = deployment.get("status") or {}
    updated = (
        st.get("observedGeneration", 0) >= meta.get("generation", 1)
        and st.get("updatedReplicas", 0) == replicas
        and st.get("replicas", 0) == replicas
    )
    ready_replicas = int(st.get("readyReplicas", 0))
    return RouterState(
        ready_replicas=ready_replicas, updated=updated, ready=updated and ready_replicas >= replicas
    )


def merge_conditions(
    previous: Sequence[dict[str, Any]], new: Sequence[Condition], now: str
) -> list[Condition]:
    """New conditions, keeping a previous `lastTransitionTime` when the status did not change."""
    old = {c.get("type"): c for c in previous}
    out = []
    for c in new:
        before = old.get(c.type)
        if before is not None and before.get("status") == c.status:
            stamp = before.get("lastTransitionTime") or now
        else:
            stamp = now
        out.append(c.model_copy(update={"last_transition_time": stamp}))
    return out


def _dump(status: InferenceDeploymentStatus) -> dict[str, Any]:
    return status.model_dump(by_alias=True, exclude_none=True)


def compute_status(
    spec: InferenceDeploymentSpec,
    generation: int,
    groups: dict[str, dict[int, GroupState]],
    desired_hashes: dict[tuple[str, int], str],
    router: RouterState,
    *,
    endpoint: str,
    role_hashes: dict[str, str],
    compat_hash: str,
    previous: dict[str, Any],
    now: str,
    transfer_warnings: Sequence[str] = (),
) -> dict[str, Any]:
    """The status object (camelCase) for the CR's status subresource.

    Args:
        groups: role → group index → live state of the groups that serve (not draining).
        desired_hashes: (role, group index) → the template hash that group should carry.
        router: the live router Deployment's state.
        role_hashes: role → the KV compatibility hash its pods carry.
        previous: the current `.status` (for condition transition times and Degraded).
        transfer_warnings: what KV transfer needs and cannot get
            (`fleetserve.operator.transfer_checks`); with a connector, the `TransferReady`
            condition is False listing them, True when there are none.
    """
    roles: dict[str, RoleStatus] = {}
    all_ready = True
    waiting: list[str] = []
    for name, role in spec.roles.items():
        live = groups.get(name, {})
        ready = sum(1 for g in live.values() if g.ready)  # draining groups are not passed
        updated = sum(
            1 for i, g in live.items() if g.template_hash == desired_hashes.get((name, i))
        )
        roles[name] = RoleStatus(
            replicas=role.replicas,
            ready_replicas=ready,
            updated_replicas=updated,
            group_size=role.group_size,
            compatibility_hash=role_hashes.get(name),
        )
        if ready != role.replicas or len(live) != role.replicas or updated != role.replicas:
            all_ready = False
            waiting.append(f"{name} {ready}/{role.replicas} groups ready")
    if not router.ready:
        all_ready = False
        waiting.append(f"router {router.ready_replicas}/{spec.router.replicas} pods ready")
    was_ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in previous.get("conditions", [])
    )
    lost_group = any(
        r.ready_replicas < r.replicas == r.updated_replicas for r in roles.values()
    ) or (router.updated and not router.ready)
    degraded = not all_ready and was_ready and lost_group
    message = "; ".join(waiting) or "all groups and the router ready"
    conditions = [
        Condition(
            type="Ready",
            status="True" if all_ready else "False",
            reason="AllGroupsReady" if all_ready else "GroupsNotReady",
            message=message,
        ),
        Condition(
            type="Progressing",
            status="False" if all_ready else "True",
            reason="Stable" if all_ready else "Reconciling",
            message=message,
        ),
        Condition(
            type="Degraded",
            status="True" if degraded else "False",
            reason="GroupLost" if degraded else "AsExpected",
            message=message if degraded else "",
        ),
    ]
    if spec.kv_transfer.connector != "none":
        conditions.append(_transfer_condition(transfer_warnings))
    status = InferenceDeploymentStatus(
        observed_generation=generation,
        phase="Ready" if all_ready else "Degraded" if degraded else "Progressing",
        conditions=merge_conditions(previous.get("conditions", []), conditions, now),
        roles=roles,
        router=RouterStatus(replicas=spec.router.replicas, ready_replicas=router.ready_replicas),
        endpoint=endpoint,
        compatibility_hash=compat_hash,
    )
    return _dump(status)


def _transfer_condition(warnings: Sequence[str]) -> Condition:
    if warnings:
        return Condition(
            type="TransferReady",
            status="False",
            reason="TransferRequirementsUnmet",
            message="; ".join(warnings),
        )
    return Condition(
        type="TransferReady",
        status="True",
        reason="AsExpected",
        message="the cluster meets what KV transfer needs",
    )


def failed_status(
    generation: int,
    reason: str,
    message: str,
    *,
    previous: dict[str, Any],
    now: str,
    role_hashes: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Status of a spec the operator cannot realise: phase Failed, Ready=False saying why.

    Children already running are left as they are. Fields not set here (roles, router,
    endpoint) keep their last values, except each role's compatibility hash when known
    (`role_hashes`), which shows a mismatch.
    """
    conditions = [
        Condition(type="Ready", status="False", reason=reason, message=message),
        Condition(type="Progressing", status="False", reason=reason, message=message),
        Condition(type="Degraded", status="False", reason="AsExpected", message=""),
    ]
    prev_roles = previous.get("roles") or {}
    roles = {
        name: RoleStatus.model_validate(
            {**_known(prev_roles.get(name) or {}, RoleStatus), "compatibilityHash": h}
        )
        for name, h in (role_hashes or {}).items()
    }
    status = InferenceDeploymentStatus(
        observed_generation=generation,
        phase="Failed",
        conditions=merge_conditions(previous.get("conditions", []), conditions, now),
        roles=roles,
    )
    return _dump(status)


def _known(data: dict[str, Any], model: type[RoleStatus]) -> dict[str, Any]:
    """`data` restricted to `model`'s wire names (a stale field must not fail the write)."""
    names = {f.alias or n for n, f in model.model_fields.items()}
    return {k: v for k, v in data.items() if k in names}
