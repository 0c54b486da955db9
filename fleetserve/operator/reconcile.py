"""Level-based reconcile of one InferenceDeployment: desired children vs live, then status.

Idempotent: objects whose desired fields already hold on the live object are not written, so an
unchanged resource costs only reads. Replica groups are created, rolled and removed by
`fleetserve.operator.rollout`: a template change surges a new group before the old one drains,
and a group is removed only after a KV-safe drain (`fleetserve.operator.drain`); while one
drains the pass asks to be run again soon (`ReconcileResult.requeue_after_s`).

A spec the operator cannot realise ends the pass in phase Failed (`fleetserve.operator.errors`):
the status says why, one Warning event is posted when it first says so, and since the status is
then unchanged the next passes write nothing until the spec changes. Transient API failures
propagate to the caller, which retries (`fleetserve.operator.handlers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from kubernetes.client.exceptions import ApiException

from fleetserve.api.compat import compatibility_hash, role_compatibility_hashes
from fleetserve.api.labels import LABEL_DEPLOYMENT, LABEL_GROUP, LABEL_ROLE
from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.operator.autoscale.replicas import with_effective_replicas
from fleetserve.operator.builders import (
    Owner,
    build_children,
    build_router_children,
    router_name,
)
from fleetserve.operator.diff import is_subset
from fleetserve.operator.drain import DRAIN_POLL_S
from fleetserve.operator.errors import SpecProblem, spec_problem
from fleetserve.operator.gang import (
    ADMISSION_POLL_S,
    admission_condition,
    admission_waits,
    uses_kueue,
    waiting_pod_groups,
)
from fleetserve.operator.kube import Kube
from fleetserve.operator.placement import read_placement
from fleetserve.operator.rollout import converge_groups
from fleetserve.operator.status import (
    compute_status,
    failed_status,
    merge_conditions,
    router_state,
)
from fleetserve.operator.transfer_checks import ClusterFacts, cluster_facts, transfer_warnings

__all__ = [
    "CHILD_KINDS",
    "MIN_RUN_BEFORE_GROUP_RESTART_S",
    "ReconcileResult",
    "is_subset",
    "live_pod",
    "reconcile",
    "recreate_group",
    "restart_group_after_container_restart",
]

CHILD_KINDS = ("Service", "StatefulSet", "Deployment", "ServiceAccount", "Role", "RoleBinding")

_T = TypeVar("_T")

MIN_RUN_BEFORE_GROUP_RESTART_S = 30.0
"""A container that dies sooner after its pod was created is crash-looping at start-up: its
group is left to the kubelet's back-off instead of being recreated in a hot loop."""


@dataclass
class ReconcileResult:
    """What one pass did: events to post (type, reason, message) and the new status."""

    events: list[tuple[str, str, str]] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    status_written: bool = False
    requeue_after_s: float | None = None
    """Reconcile again this soon (a group drains: its engines' counts are no events)."""


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def reconcile(kube: Kube, body: dict[str, Any], *, now: str | None = None) -> ReconcileResult:
    """Converge the children of `body` (an InferenceDeployment object) and write its status.

    Raises:
        ApiException, urllib3 errors: API failures other than a rejected child (the caller
            retries them with a delay).
    """
    meta = body["metadata"]
    owner = Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    stamp = now or _now()
    spec: InferenceDeploymentSpec | None = None
    try:
        spec = InferenceDeploymentSpec.model_validate(body["spec"])
        # The autoscaler's (or the spec's) groups per role: everything below reads these.
        spec = with_effective_replicas(spec, body.get("status"))
        build_children(spec, owner)  # a spec the builders refuse fails before any write
    except ValueError as exc:  # pydantic's ValidationError is a ValueError too
        hashes = role_compatibility_hashes(spec) if spec is not None else None
        return _fail(kube, body, _problem(exc), stamp, role_hashes=hashes)
    try:
        return _converge(kube, body, spec, owner, stamp)
    except ApiException as exc:
        problem = spec_problem(exc)
        if problem is None:
            raise
        return _fail(kube, body, problem, stamp, role_hashes=role_compatibility_hashes(spec))


def _problem(exc: ValueError) -> SpecProblem:
    problem = spec_problem(exc)
    assert problem is not None, f"a ValueError is always a spec problem: {exc!r}"
    return problem


def _write_status(
    kube: Kube,
    body: dict[str, Any],
    status: dict[str, Any],
    result: ReconcileResult,
    *,
    drop_other_roles: bool,
) -> bool:
    """Patch `status` unless the live status already holds it; True when written.

    With `drop_other_roles`, roles in the live status that `status` does not list are removed
    (a merge patch keeps map keys it does not name, so they are set to null).
    """
    meta = body["metadata"]
    previous = body.get("status") or {}
    result.status = status
    if is_subset(status, previous):
        return False
    patch = dict(status)
    roles = status.get("roles") or {}
    gone = {name: None for name in previous.get("roles") or {} if name not in roles}
    if drop_other_roles and gone:
        patch["roles"] = {**gone, **roles}
    kube.patch_status("InferenceDeployment", meta["namespace"], meta["name"], patch)
    result.status_written = True
    return True


def _fail(
    kube: Kube,
    body: dict[str, Any],
    problem: SpecProblem,
    now: str,
    *,
    role_hashes: dict[str, str] | None,
) -> ReconcileResult:
    result = ReconcileResult()
    status = failed_status(
        int(body["metadata"].get("generation", 1)),
        problem.reason,
        problem.message,
        previous=body.get("status") or {},
        now=now,
        role_hashes=role_hashes,
    )
    if _write_status(kube, body, status, result, drop_other_roles=False):
        result.events.append(("Warning", problem.reason, problem.message))
    return result


def _converge(
    kube: Kube,
    body: dict[str, Any],
    spec: InferenceDeploymentSpec,
    owner: Owner,
    now: str,
) -> ReconcileResult:
    result = ReconcileResult()
    selector = f"{LABEL_DEPLOYMENT}={owner.name}"
    live: dict[tuple[str, str], dict[str, Any]] = {}
    for kind in CHILD_KINDS:
        for obj in kube.list(kind, owner.namespace, selector):
            obj.setdefault("kind", kind)
            live[_key(obj)] = obj

    # The number of groups each role should have now (the autoscaler's, once it decides).
    replicas = {name: role.replicas for name, role in spec.roles.items()}
    previous = body.get("status") or {}
    # Where the scheduler stands with the group pods: larger pods are created first, and the
    # status names groups it cannot place (fleetserve.operator.placement).
    pods = kube.list("Pod", owner.namespace, f"{selector},{LABEL_GROUP}")
    placement = read_placement(pods)
    groups = converge_groups(
        kube, spec, owner, live, replicas, _parse_time(now), placement=placement
    )
    result.events += groups.events
    if groups.draining:
        result.requeue_after_s = DRAIN_POLL_S

    for obj in build_router_children(spec, owner):
        current = live.get(_key(obj))
        # NOTE: list items carry no apiVersion/kind, so only metadata/spec/data are compared.
        fields = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
        if current is not None and is_subset(fields, current):
            continue
        if current is None:
            name = obj["metadata"]["name"]
            result.events.append(("Normal", "Created", f"created {obj['kind']} {name}"))
        kube.apply(obj)

    # Group objects no group keeps: a Service left by a deleted group, or a removed role's.
    for key, obj in live.items():
        if key not in groups.owned and LABEL_GROUP in (obj["metadata"].get("labels") or {}):
            kube.delete(key[0], owner.namespace, key[1])
            result.events.append(("Normal", "ScaledDown", f"deleted {key[0]} {key[1]}"))

    warnings = transfer_warnings(spec, _cluster_facts(kube, spec, owner.namespace))
    status = compute_status(
        spec,
        int(body["metadata"].get("generation", 1)),
        groups.groups,
        groups.desired_hashes,
        router_state(live.get(("Deployment", router_name(owner.name))), spec.router.replicas),
        endpoint=f"http://{owner.name}.{owner.namespace}.svc:80",
        role_hashes=role_compatibility_hashes(spec),
        compat_hash=compatibility_hash(spec),
        previous=previous,
        now=now,
        transfer_warnings=warnings,
    )
    if groups.condition is not None:
        (draining,) = merge_conditions(previous.get("conditions", []), [groups.condition], now)
        status["conditions"].append(draining.model_dump(by_alias=True, exclude_none=True))
    if groups.placement is not None:
        (placed,) = merge_conditions(previous.get("conditions", []), [groups.placement], now)
        status["conditions"].append(placed.model_dump(by_alias=True, exclude_none=True))
    if uses_kueue(spec):
        queue = str(spec.scheduling.queue_name)
        waits = admission_waits(pods, _workloads(kube, owner.namespace, waiting_pod_groups(pods)))
        (admitted,) = merge_conditions(
            previous.get("conditions", []), [admission_condition(queue, waits)], now
        )
        status["conditions"].append(admitted.model_dump(by_alias=True, exclude_none=True))
        if waits:  # Kueue's admission and its reasons change no pod: look again soon
            result.requeue_after_s = min(
                result.requeue_after_s or ADMISSION_POLL_S, ADMISSION_POLL_S
            )
    written = _write_status(kube, body, status, result, drop_other_roles=True)
    if written and status["phase"] != previous.get("phase"):
        result.events.append(("Normal", "Phase", f"phase {status['phase']}"))
    if (
        written
        and warnings
        and _condition(status, "TransferReady") != _condition(previous, "TransferReady")
    ):
        result.events.append(("Warning", "TransferRequirementsUnmet", "; ".join(warnings)))
    waiting_now, waiting_before = (
        _condition(status, "AwaitingAdmission"),
        _condition(previous, "AwaitingAdmission"),
    )
    if written and waiting_now is not None and waiting_now != waiting_before:
        if waiting_now[0] == "True":
            result.events.append(("Warning", "AwaitingAdmission", waiting_now[1]))
        elif waiting_before is not None and waiting_before[0] == "True":
            result.events.append(("Normal", "Admitted", waiting_now[1]))
    placed_now, placed_before = (
        _condition(status, "Unschedulable"),
        _condition(previous, "Unschedulable"),
    )
    if written and placed_now is not None and placed_now != placed_before:
        if placed_now[0] == "True":
            result.events.append(("Warning", "Unschedulable", placed_now[1]))
        elif placed_before is not None and placed_before[0] == "True":
            result.events.append(("Normal", "Placed", "every group's pods are placed"))
    return result


def _condition(status: dict[str, Any], kind: str) -> tuple[str, str] | None:
    """(status, message) of one condition, None when absent."""
    for c in status.get("conditions") or []:
        if c.get("type") == kind:
            return c.get("status", ""), c.get("message", "")
    return None


def _cluster_facts(kube: Kube, spec: InferenceDeploymentSpec, namespace: str) -> ClusterFacts:
    """Read what `transfer_warnings` checks: the namespace, and the nodes only for rdma (a list
    of every node is not worth its cost otherwise). A read the operator may not make (an older
    install's RBAC) leaves that fact unknown rather than failing the pass."""
    if spec.kv_transfer.connector == "none":
        return ClusterFacts()
    ns = _readable(lambda: kube.get_cluster("Namespace", namespace))
    nodes = (
        _readable(lambda: kube.list_cluster("Node"))
        if spec.kv_transfer.protocol == "rdma"
        else None
    )
    return cluster_facts(ns, nodes)


def _workloads(
    kube: Kube, namespace: str, names: list[str]
) -> dict[str, dict[str, Any] | None] | None:
    """Kueue's Workloads of the waiting pod groups by name (None: not made yet); None when
    the operator may not read them. Read one by one: only groups that wait are asked for, and
    a GET of a missing kind (Kueue not installed) reads as None rather than failing."""
    workloads: dict[str, dict[str, Any] | None] = {}
    for name in names:
        try:
            workloads[name] = kube.get("Workload", namespace, name)
        except ApiException as exc:
            if exc.status in (401, 403):
                return None
            raise
    return workloads


def _readable(read: Callable[[], _T]) -> _T | None:
    try:
        return read()
    except ApiException as exc:
        if exc.status in (401, 403):
            return None
        raise


def _group_selector(labels: dict[str, str]) -> str:
    return ",".join(
        f"{k}={labels[k]}" for k in (LABEL_DEPLOYMENT, LABEL_ROLE, LABEL_GROUP) if k in labels
    )


def live_pod(kube: Kube, pod: dict[str, Any]) -> dict[str, Any] | None:
    """`pod` as it is now (same uid), or None once it is gone; read by listing its group."""
    meta = pod["metadata"]
    selector = _group_selector(meta.get("labels") or {})
    for current in kube.list("Pod", meta["namespace"], selector):
        if current["metadata"].get("uid") == meta.get("uid"):
            return current
    return None


def _parse_time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def restart_group_after_container_restart(kube: Kube, pod: dict[str, Any]) -> list[str]:
    """When a container of a multi-pod group's pod has restarted, delete every pod of the group.

    The ranks of one group share a torch.distributed world: a rank that restarts alone can
    never rejoin it, so the whole group starts over (LeaderWorkerSet's
    RecreateGroupOnPodRestart). The StatefulSet recreates the pods with fresh restart counts.

    Returns:
        Names of the pods deleted: none for a single-pod group (its container restart already
        restarts the whole group), for a pod already being deleted, for a pod that is no longer
        one of its group's live pods, or for a container that died within
        `MIN_RUN_BEFORE_GROUP_RESTART_S` of its pod's creation (crash-looping at start-up, left
        to the kubelet's back-off). Each member is deleted by uid, so one recreated under its
        name since the list (by another handler's deletes) is left alone.
    """
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    if LABEL_GROUP not in labels or LABEL_DEPLOYMENT not in labels or meta.get("deletionTimestamp"):
        return []
    created = meta.get("creationTimestamp")
    restarted_late = False
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        finished = (((status.get("lastState") or {}).get("terminated")) or {}).get("finishedAt")
        if not status.get("restartCount") or not finished or not created:
            continue
        ran_s = (_parse_time(finished) - _parse_time(created)).total_seconds()
        restarted_late = restarted_late or ran_s >= MIN_RUN_BEFORE_GROUP_RESTART_S
    if not restarted_late:
        return []
    members = [
        p
        for p in kube.list("Pod", meta["namespace"], _group_selector(labels))
        if not p["metadata"].get("deletionTimestamp")
    ]
    # NOTE: `pod` may be an event's body that arrives late, when its group was already
    # recreated: the restart was handled, and the members listed now are the replacements.
    # Only a restart of a pod that is still a member (same uid) recreates the group.
    if len(members) < 2 or all(m["metadata"].get("uid") != meta.get("uid") for m in members):
        return []
    return [
        m["metadata"]["name"]
        for m in members
        if kube.delete("Pod", meta["namespace"], m["metadata"]["name"], uid=m["metadata"]["uid"])
    ]


def recreate_group(kube: Kube, pod: dict[str, Any]) -> list[str]:
    """After pod `pod` of a multi-pod group is gone, delete its older siblings (whole-group restart).

    Returns:
        Names of the pods deleted. Pods created after `pod` (replacements) are kept, so the
        cascade of DELETED events this causes terminates; each sibling is deleted by uid, so a
        replacement created under its name after the list is kept too.
    """
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    if LABEL_GROUP not in labels or LABEL_DEPLOYMENT not in labels:
        return []
    born = meta.get("creationTimestamp", "")
    deleted = []
    for sibling in kube.list("Pod", meta["namespace"], _group_selector(labels)):
        smeta = sibling["metadata"]
        if smeta["name"] == meta["name"] or smeta.get("deletionTimestamp"):
            continue
        if smeta.get("creationTimestamp", "") <= born and kube.delete(
            "Pod", meta["namespace"], smeta["name"], uid=smeta["uid"]
        ):
            deleted.append(smeta["name"])
    return deleted
