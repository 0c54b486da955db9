"""Placement rules (pure): creation tiers, held plans, packing affinity, unschedulable pods."""

from __future__ import annotations

from typing import Any

from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.operator.builders import Owner, build_group_statefulset
from fleetserve.operator.placement import (
    GroupPlacement,
    awaits_placement,
    creation_tiers,
    hold_creation,
    is_placed,
    pack_affinity,
    placement_condition,
    read_placement,
)
from fleetserve.operator.roll import RolePlan

MSG = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."


def _spec(prefill: dict[str, Any], decode: dict[str, Any]) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": {"uri": "/m"}},
            "roles": {"prefill": prefill, "decode": decode},
        }
    )


def _pod(
    name: str, role: str, group: int, *, node: str = "", unschedulable: str | None = None,
    phase: str = "Pending", deleting: bool = False,
) -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {
        "name": name,
        "labels": {"fleetserve.io/deployment": "d", "fleetserve.io/role": role,
                   "fleetserve.io/group": str(group)},
    }  # fmt: skip
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    conditions = []
    if unschedulable is not None:
        conditions.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": unschedulable}
        )  # fmt: skip
    elif node:
        conditions.append({"type": "PodScheduled", "status": "True"})
    return {
        "metadata": meta,
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase, "conditions": conditions},
    }


def test_tiers_put_larger_pods_first_and_cpu_last() -> None:
    partial_prefill = _spec(
        {"gpusPerPod": 2, "parallelism": {"tensor": 2}},
        {"gpusPerPod": 8, "parallelism": {"tensor": 16}},
    )
    assert creation_tiers(partial_prefill) == [["decode"], ["prefill"]]
    whole_both = _spec(
        {"gpusPerPod": 8, "parallelism": {"tensor": 8}},
        {"gpusPerPod": 8, "parallelism": {"tensor": 8, "pipeline": 2}},
    )
    assert creation_tiers(whole_both) == [["prefill", "decode"]]
    cpu_decode = _spec({"gpusPerPod": 1}, {"gpusPerPod": 0})
    assert creation_tiers(cpu_decode) == [["prefill"], ["decode"]]


def test_held_plan_creates_nothing_and_keeps_stale_groups() -> None:
    plan = RolePlan(
        create=(2, 3), drain=((0, "roll"), (1, "scale-down")), undrain=(4,), delete=(5,)
    )
    assert hold_creation(plan) == RolePlan(drain=((1, "scale-down"),), undrain=(4,), delete=(5,))


def test_read_placement_counts_bound_pods_and_keeps_the_schedulers_message() -> None:
    pods = [
        _pod("d-decode-0-1", "decode", 0, unschedulable=MSG),
        _pod("d-decode-0-0", "decode", 0, node="gpu-node-1", phase="Running"),
        _pod("d-prefill-0-0", "prefill", 0, node="gpu-node-0"),
        _pod("d-prefill-1-0", "prefill", 1),  # created, not yet looked at by the scheduler
        _pod("d-prefill-2-0", "prefill", 2, deleting=True, unschedulable=MSG),
        {"metadata": {"name": "router-x", "labels": {"fleetserve.io/role": "router"}}},
    ]
    placement = read_placement(pods)
    assert placement == {
        ("decode", 0): GroupPlacement(pods=2, bound=1, unschedulable=MSG),
        ("prefill", 0): GroupPlacement(pods=1, bound=1),
        ("prefill", 1): GroupPlacement(pods=1, bound=0),
    }
    assert not is_placed(placement[("decode", 0)], 2)
    assert is_placed(placement[("prefill", 0)], 1)
    assert not is_placed(placement[("prefill", 1)], 1)
    assert not is_placed(None, 1)
    # A StatefulSet that has not created every pod yet is not placed either.
    assert not is_placed(GroupPlacement(pods=1, bound=1), 2)


def test_only_pending_group_pods_await_placement() -> None:
    assert awaits_placement(_pod("a", "prefill", 0))
    assert awaits_placement(_pod("a", "prefill", 0, unschedulable=MSG))
    assert awaits_placement(_pod("a", "prefill", 0, node="n"))  # bound, starting
    assert not awaits_placement(_pod("a", "prefill", 0, node="n", phase="Running"))
    assert not awaits_placement(_pod("a", "prefill", 0, deleting=True))
    assert not awaits_placement({"metadata": {"name": "x", "labels": {}}, "status": {}})


def test_condition_names_unschedulable_groups_and_held_roles() -> None:
    clear = placement_condition({}, {"prefill": [("decode", 0)]})
    assert (clear.type, clear.status, clear.reason) == ("Unschedulable", "False", "AsExpected")
    stuck = placement_condition(
        {("decode", 1): MSG, ("decode", 0): "other"}, {"prefill": [("decode", 1), ("decode", 0)]}
    )
    assert (stuck.status, stuck.reason) == ("True", "Unschedulable")
    assert stuck.message == (
        f"decode group 0: other; decode group 1: {MSG}; "
        "new prefill groups wait for decode group 0, decode group 1"
    )


def test_gpu_pods_prefer_nodes_holding_their_role_and_cpu_pods_have_no_affinity() -> None:
    spec = _spec({"gpusPerPod": 2, "parallelism": {"tensor": 2}}, {"gpusPerPod": 0})
    owner = Owner("d", "ns", "u")
    prefill = build_group_statefulset(spec, owner, "prefill", spec.roles.prefill, 0)  # type: ignore[arg-type]
    pod_spec = prefill["spec"]["template"]["spec"]
    assert pod_spec["affinity"] == pack_affinity("d", "prefill")
    (term,) = pod_spec["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term == {
        "weight": 100,
        "podAffinityTerm": {
            "labelSelector": {
                "matchLabels": {"fleetserve.io/deployment": "d", "fleetserve.io/role": "prefill"}
            },
            "topologyKey": "kubernetes.io/hostname",
        },
    }
    # The selector matches the pods it is rendered into: a role packs with itself.
    labels = prefill["spec"]["template"]["metadata"]["labels"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    decode = build_group_statefulset(spec, owner, "decode", spec.roles.decode, 0)  # type: ignore[arg-type]
    assert "affinity" not in decode["spec"]["template"]["spec"]
