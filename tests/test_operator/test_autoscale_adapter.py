"""The pure parts of the scale adapter and the loop: the adapter CRD and object, live leaders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fleetserve.api.role_adapter import ROLE_CRD_FILENAME, role_crd_manifest, role_crd_yaml
from fleetserve.operator.autoscale.loop import alive_leaders
from fleetserve.operator.autoscale.scale_adapter import build_role_adapter
from fleetserve.operator.builders import Owner

ROOT = Path(__file__).resolve().parents[2]


def test_the_checked_in_adapter_crd_is_the_generated_one() -> None:
    checked_in = (ROOT / "crds" / ROLE_CRD_FILENAME).read_text()
    assert checked_in == role_crd_yaml(), (
        f"crds/ is stale: run `fleetserve crds --role-adapter -o crds/{ROLE_CRD_FILENAME}`"
    )
    assert ROLE_CRD_FILENAME in (ROOT / "crds" / "kustomization.yaml").read_text()


def test_the_adapter_has_a_scale_subresource_on_spec_replicas() -> None:
    version = role_crd_manifest()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["replicas"]["minimum"] == 0


def test_an_adapter_is_owned_by_its_deployment() -> None:
    obj = build_role_adapter(Owner("d", "ns", "uid-1"), "prefill", 3)
    assert obj["metadata"]["name"] == "d-prefill"
    assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert obj["spec"] == {"deployment": "d", "role": "prefill", "replicas": 3}


def _pod(
    role: str, group: int, index: int = 0, *, ready: bool = True, **meta: Any
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"d-{role}-{group}-{index}",
            "uid": f"{role}-{group}-{index}",
            "labels": {
                "fleetserve.io/role": role,
                "fleetserve.io/group": str(group),
                "apps.kubernetes.io/pod-index": str(index),
            },
            **meta,
        },
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_only_ready_leaders_of_kept_groups_count() -> None:
    pods = [
        _pod("prefill", 0),
        _pod("prefill", 0, 1),  # a follower rank: its group is represented by pod 0
        _pod("prefill", 1, ready=False),  # still starting
        _pod("prefill", 2),  # beyond the 2 groups the role keeps: on its way out
        _pod("decode", 0, deletionTimestamp="2026-01-01T00:00:00Z"),  # terminating
        _pod("decode", 1),
        _pod("router", 0),
    ]
    leaders = alive_leaders(pods, {"prefill": 2, "decode": 2})
    assert set(leaders["prefill"]) == {"prefill-0-0"}
    assert set(leaders["decode"]) == {"decode-1-0"}
