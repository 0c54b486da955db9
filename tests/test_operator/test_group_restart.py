"""A container restart in a multi-pod group recreates the group once: the decision over the pods
as the API server lists them (an in-memory stand-in for the list and delete calls; the k8s test
`test_a_container_restart_recreates_the_whole_group` runs it against the dev cluster, and
`test_a_delete_by_uid_spares_another_incarnation` the uid precondition)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, cast

from fleetserve.api.labels import LABEL_DEPLOYMENT, LABEL_GROUP, LABEL_ROLE
from fleetserve.operator.kube import Kube
from fleetserve.operator.reconcile import recreate_group, restart_group_after_container_restart

CREATED = "2026-12-06T10:00:00Z"
LABELS = {LABEL_DEPLOYMENT: "big", LABEL_ROLE: "decode", LABEL_GROUP: "0"}


def _pod(
    name: str, uid: str, *, ran_s: int | None = None, deleting: bool = False
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": uid, "labels": dict(LABELS),
                            "creationTimestamp": CREATED}  # fmt: skip
    if deleting:
        meta["deletionTimestamp"] = "2026-12-06T10:05:00Z"
    status: dict[str, Any] = {"restartCount": 0}
    if ran_s is not None:
        finished = f"2026-12-06T10:{ran_s // 60:02d}:{ran_s % 60:02d}Z"
        status = {"restartCount": 1, "lastState": {"terminated": {"finishedAt": finished}}}
    return {"metadata": meta, "status": {"containerStatuses": [status]}}


@dataclass
class _Pods:
    """The group's pods as the API server holds them. `delete` honours a uid precondition as the
    API server does, and records the names it deleted. `replaced_after_list` names pods that
    are recreated (a new uid under the same name, as a StatefulSet does after another
    handler's delete) between the next list and the deletes that follow it."""

    pods: list[dict[str, Any]]
    deleted: list[str] = field(default_factory=list)
    replaced_after_list: list[str] = field(default_factory=list)

    def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        wanted = dict(pair.split("=", 1) for pair in selector.split(","))
        assert (kind, namespace, wanted) == ("Pod", "ns", LABELS)
        listed = [copy.deepcopy(p) for p in self.pods]
        for name in self.replaced_after_list:
            self.pods = [p for p in self.pods if p["metadata"]["name"] != name]
            self.pods.append(_pod(name, f"new-{name}"))
        return listed

    def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        assert kind == "Pod" and uid is not None, "group pods are deleted by uid"
        found = [p for p in self.pods if p["metadata"]["name"] == name]
        if not found or found[0]["metadata"]["uid"] != uid:
            return False  # missing, or 409 Conflict: another incarnation of the name
        self.pods.remove(found[0])
        self.deleted.append(name)
        return True

    def uids(self) -> dict[str, str]:
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in self.pods}


def _restart(pods: _Pods, pod: dict[str, Any]) -> list[str]:
    return restart_group_after_container_restart(cast(Kube, pods), pod)


def test_a_late_restart_of_a_member_deletes_every_live_pod_of_its_group() -> None:
    crashed = _pod("big-decode-0-1", "old-1", ran_s=120)
    pods = _Pods([_pod("big-decode-0-0", "old-0"), crashed])
    assert _restart(pods, crashed) == ["big-decode-0-0", "big-decode-0-1"]
    assert pods.deleted == ["big-decode-0-0", "big-decode-0-1"]


def test_an_early_crash_is_left_to_the_back_off() -> None:
    crashed = _pod("big-decode-0-1", "old-1", ran_s=5)
    pods = _Pods([_pod("big-decode-0-0", "old-0"), crashed])
    assert _restart(pods, crashed) == [] and pods.deleted == []


def test_a_late_event_of_a_replaced_pod_leaves_the_replacements_alone() -> None:
    """The event that reported the restart arrives again after the group was recreated (kopf
    handles each pod uid in its own worker, so a busy operator can see it late): the pods
    listed now are the replacements, with fresh restart counts, and they stay."""
    stale = _pod("big-decode-0-1", "old-1", ran_s=120)
    pods = _Pods([_pod("big-decode-0-0", "new-0"), _pod("big-decode-0-1", "new-1")])
    assert _restart(pods, stale) == [] and pods.deleted == []


def test_a_pod_already_being_deleted_or_alone_recreates_nothing() -> None:
    crashed = _pod("big-decode-0-1", "old-1", ran_s=120)
    deleting = _Pods([_pod("big-decode-0-0", "old-0", deleting=True), crashed])
    assert _restart(deleting, crashed) == []  # one live member: its restart restarts it all
    dying = _pod("big-decode-0-1", "old-1", ran_s=120, deleting=True)
    assert _restart(_Pods([_pod("big-decode-0-0", "old-0"), dying]), dying) == []


def test_a_member_recreated_after_the_list_keeps_its_replacement() -> None:
    """Another handler deleted member 0 and its StatefulSet recreated it between this list and
    these deletes: the replacement (same name, new uid) is not deleted."""
    crashed = _pod("big-decode-0-1", "old-1", ran_s=120)
    pods = _Pods([_pod("big-decode-0-0", "old-0"), crashed],
                 replaced_after_list=["big-decode-0-0"])  # fmt: skip
    assert _restart(pods, crashed) == ["big-decode-0-1"]
    assert pods.uids() == {"big-decode-0-0": "new-big-decode-0-0"}


def test_a_gone_pod_deletes_its_older_siblings_but_no_replacement() -> None:
    gone = _pod("big-decode-0-1", "old-1")
    pods = _Pods([_pod("big-decode-0-0", "old-0")])
    assert recreate_group(cast(Kube, pods), gone) == ["big-decode-0-0"]
    raced = _Pods([_pod("big-decode-0-0", "old-0")], replaced_after_list=["big-decode-0-0"])
    assert recreate_group(cast(Kube, raced), gone) == []
    assert raced.uids() == {"big-decode-0-0": "new-big-decode-0-0"}
