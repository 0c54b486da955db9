"""Carry out each role's group plan (`fleetserve.operator.roll`) against the cluster.

Per role: read its live group StatefulSets, render each one's template for its index (current or
stale), read where each draining group's drain stands (`fleetserve.operator.drain`), plan, then
act: mark or unmark drains (merge patches of the StatefulSet's annotations and of every pod's
label, which the applied objects do not carry, so an apply keeps them), apply new groups and
current ones whose other fields drifted, and delete groups whose drain ended. Stale groups are
never changed in place: a roll replaces them. Posts one event per action.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fleetserve.api.labels import (
    ANNOTATION_TEMPLATE_HASH,
    LABEL_DRAINING,
    LABEL_GROUP,
    LABEL_ROLE,
    group_selector,
)
from fleetserve.api.models import Condition, InferenceDeploymentSpec
from fleetserve.operator.builders import Owner, build_group, group_name
from fleetserve.operator.diff import is_subset
from fleetserve.operator.drain import (
    DrainingGroup,
    DrainState,
    drain_annotations,
    drain_progress,
    draining_condition,
    draining_label,
    draining_since,
    probe_leader,
)
from fleetserve.operator.kube import Kube
from fleetserve.operator.placement import (
    GroupPlacement,
    creation_tiers,
    hold_creation,
    is_placed,
    placement_condition,
)
from fleetserve.operator.render import ENGINE_PORT
from fleetserve.operator.roll import GroupView, RolePlan, plan_role
from fleetserve.operator.status import GroupState, group_state

__all__ = ["GroupsOutcome", "Probe", "converge_groups"]

Probe = Callable[[Sequence[dict[str, Any]], int], "int | None"]
"""In-flight count of a group from its pods (`probe_leader`); None when unknown."""

Event = tuple[str, str, str]


@dataclass
class GroupsOutcome:
    """What `converge_groups` did and what the status needs."""

    events: list[Event] = field(default_factory=list)
    groups: dict[str, dict[int, GroupState]] = field(default_factory=dict)
    """Role → index → state of the active (not draining) groups."""
    desired_hashes: dict[tuple[str, int], str] = field(default_factory=dict)
    owned: set[tuple[str, str]] = field(default_factory=set)
    """(kind, name) of every group object this pass kept, created or deleted; any other group
    object is an orphan."""
    draining: list[DrainingGroup] = field(default_factory=list)
    """Groups still draining after this pass (the deployment is reconciled again soon)."""
    condition: Condition | None = None
    placement: Condition | None = None
    """The `Unschedulable` condition (`fleetserve.operator.placement`), when placement was read."""


def _hash(obj: dict[str, Any]) -> str:
    return str((obj["metadata"].get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH, ""))


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Group:
    role: str
    index: int
    live: dict[str, Any]
    rendered: list[dict[str, Any]]
    state: GroupState
    since: datetime | None = None
    reason: str = ""
    progress: DrainState | None = None
    in_flight: int | None = None


class _Pass:
    """One pass over one deployment's groups (holds the kube handle and the event list)."""

    def __init__(
        self,
        kube: Kube,
        owner: Owner,
        now: datetime,
        probe: Probe,
        live: dict[tuple[str, str], dict[str, Any]],
    ) -> None:
        self.kube, self.owner, self.now, self.probe, self.live = kube, owner, now, probe, live
        self.out = GroupsOutcome()

    def pods(self, g: _Group) -> list[dict[str, Any]]:
        return self.kube.list(
            "Pod", self.owner.namespace, group_selector(self.owner.name, g.role, g.index)
        )

    def mark(self, g: _Group, since: str | None, reason: str | None) -> None:
        """Start (since set) or end (None) a group's drain: its annotations and pod labels."""
        name = group_name(self.owner.name, g.role, g.index)
        patch = {"metadata": {"annotations": drain_annotations(since, reason)}}
        self.kube.patch("StatefulSet", self.owner.namespace, name, patch)
        self.label_pods(g, draining=since is not None)

    def label_pods(
        self, g: _Group, *, draining: bool, pods: list[dict[str, Any]] | None = None
    ) -> None:
        for pod in self.pods(g) if pods is None else pods:
            labels = pod["metadata"].get("labels") or {}
            if (LABEL_DRAINING in labels) == draining or pod["metadata"].get("deletionTimestamp"):
                continue
            patch = {"metadata": {"labels": draining_label(draining)}}
            self.kube.patch("Pod", self.owner.namespace, pod["metadata"]["name"], patch)

    def read_drain(self, g: _Group, timeout_s: float) -> None:
        """Where a draining group stands; restamps an unreadable start, relabels new pods."""
        mark = draining_since(g.live)
        assert mark is not None
        since, g.reason = mark
        if since is None:
            since = self.now
            self.mark(g, _stamp(since), g.reason)
        g.since = since
        pods = self.pods(g)
        self.label_pods(g, draining=True, pods=pods)
        g.progress, g.in_flight = drain_progress(
            since, self.now, timeout_s, lambda: self.probe(pods, ENGINE_PORT)
        )


def converge_groups(
    kube: Kube,
    spec: InferenceDeploymentSpec,
    owner: Owner,
    live: dict[tuple[str, str], dict[str, Any]],
    replicas: dict[str, int],
    now: datetime,
    probe: Probe = probe_leader,
    placement: dict[tuple[str, int], GroupPlacement] | None = None,
) -> GroupsOutcome:
    """Converge every role's groups one step (module docstring).

    Args:
        live: the deployment's children by (kind, name).
        replicas: role → the number of groups it should have now.
        placement: (role, index) → where the scheduler stands with that group's pods; with it,
            roles are created in `creation_tiers` order and a role's new groups wait while an
            earlier tier's group is created now or not yet placed (None: no ordering).
    """
    p = _Pass(kube, owner, now, probe, live)
    roles = dict(spec.roles.items())
    groups: dict[str, dict[int, _Group]] = {name: {} for name in roles}
    for (kind, _), obj in live.items():
        labels = obj["metadata"].get("labels") or {}
        role_name = labels.get(LABEL_ROLE, "")
        if kind != "StatefulSet" or role_name not in roles or LABEL_GROUP not in labels:
            continue
        index = int(labels[LABEL_GROUP])
        role = roles[role_name]
        g = _Group(
            role=role_name,
            index=index,
            live=obj,
            rendered=build_group(spec, owner, role_name, role, index),
            state=group_state(obj, role.group_size),
        )
        if draining_since(obj) is not None:
            p.read_drain(g, role.drain_timeout_seconds)
        groups[role_name][index] = g

    views = {
        name: [
            GroupView(
                index=g.index,
                current=_hash(g.rendered[1]) == _hash(g.live),
                ready=g.state.ready,
                draining=g.since is not None,
                done=g.progress in ("drained", "timed-out"),
            )
            for g in gs.values()
        ]
        for name, gs in groups.items()
    }
    # A roll waits while any role's new groups are not ready, so revisions change together.
    hold = any(v.current and not v.draining and not v.ready for vs in views.values() for v in vs)
    tiers = creation_tiers(spec) if placement is not None else [list(roles)]
    unplaced: list[tuple[str, int]] = []  # groups of earlier tiers the scheduler has not placed
    held: dict[str, list[tuple[str, int]]] = {}
    for tier in tiers:
        earlier = list(unplaced)
        for name in tier:
            role = roles[name]
            plan = plan_role(views[name], replicas[name], role.max_surge, hold_roll=hold)
            if earlier and plan.create:
                plan, held[name] = hold_creation(plan), earlier
            _act(p, spec, name, groups[name], plan)
            unplaced += [(name, i) for i in plan.create]
            unplaced += [
                (name, i)
                for i in sorted(p.out.groups.get(name, {}))
                if placement is not None
                and not is_placed(placement.get((name, i)), role.group_size)
            ]
    p.out.condition = draining_condition(p.out.draining)
    if placement is not None:
        active = {(r, i) for r, gs in p.out.groups.items() for i in gs}
        stuck = {k: placement[k].unschedulable for k in active if k in placement}
        p.out.placement = placement_condition({k: m for k, m in stuck.items() if m}, held)
    return p.out


def _act(
    p: _Pass,
    spec: InferenceDeploymentSpec,
    role_name: str,
    groups: dict[int, _Group],
    plan: RolePlan,
) -> None:
    """Carry out one role's plan."""
    ns, out = p.owner.namespace, p.out
    role = dict(spec.roles.items())[role_name]
    for index in plan.delete:
        g = groups.pop(index)
        name = group_name(p.owner.name, role_name, index)
        for kind in ("StatefulSet", "Service"):
            p.kube.delete(kind, ns, name)
            out.owned.add((kind, name))
        assert g.progress is not None and g.since is not None
        age = (p.now - g.since).total_seconds()
        if g.progress == "drained":
            out.events.append(("Normal", "Drained", f"deleted {name} ({g.reason}): nothing in"
                               f" flight after {age:.0f}s"))  # fmt: skip
        else:
            count = "an unknown number of" if g.in_flight is None else str(g.in_flight)
            out.events.append(("Warning", "DrainTimedOut", f"deleted {name} ({g.reason}) after"
                               f" {age:.0f}s with {count} requests or KV leases in flight"))  # fmt: skip
    for index in plan.undrain:
        g = groups[index]
        p.mark(g, None, None)
        g.since = None
        out.events.append(("Normal", "DrainCancelled",
                           f"{group_name(p.owner.name, role_name, index)} serves again"))  # fmt: skip
    for index, reason in plan.drain:
        g = groups[index]
        p.mark(g, _stamp(p.now), reason)
        g.since, g.reason = p.now, reason
        out.events.append(("Normal", "Draining",
                           f"draining {group_name(p.owner.name, role_name, index)} ({reason})"))  # fmt: skip
    for index in plan.create:
        for obj in build_group(spec, p.owner, role_name, role, index):
            p.kube.apply(obj)
            out.owned.add((obj["kind"], obj["metadata"]["name"]))
        out.events.append(("Normal", "Created",
                           f"created group {group_name(p.owner.name, role_name, index)}"))  # fmt: skip
    for index, g in groups.items():
        for obj in g.rendered:
            out.owned.add((obj["kind"], obj["metadata"]["name"]))
        if g.since is not None:
            out.draining.append(
                DrainingGroup(role_name, index, g.since, g.reason, role.drain_timeout_seconds)
            )
            continue
        out.groups.setdefault(role_name, {})[index] = g.state
        out.desired_hashes[(role_name, index)] = _hash(g.rendered[1])
        current = _hash(g.rendered[1]) == _hash(g.live)
        for obj in g.rendered:
            # A stale group's StatefulSet is replaced by the roll, never changed in place; its
            # Service (no template) and a current group's fields outside the template converge.
            if obj["kind"] == "StatefulSet" and not current:
                continue
            fields = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
            found = p.live.get((obj["kind"], obj["metadata"]["name"]))
            if found is None or not is_subset(fields, found):
                p.kube.apply(obj)
