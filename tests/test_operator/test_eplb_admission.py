"""The EPLB admission rules (issue 17): EPLB needs expert parallel, and its redundant experts
must split over the role's EP group (data × tensor); pydantic and the CRD's CEL agree (the
dev-cluster test in test_eplb_status_k8s.py sends the same spec to a real API server)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from fleetserve.api.crd import crd_manifest
from fleetserve.api.models import InferenceDeploymentSpec


def _spec(role: dict[str, Any]) -> dict[str, Any]:
    """The role as decode of a P/D pair; as the unified role when it has data ranks (data
    parallel runs only there, issue 16)."""
    model = {"name": "m", "source": {"uri": "/m"}, "moe": True}
    if role.get("parallelism", {}).get("data", 1) > 1:
        return {"model": model, "kvTransfer": {"connector": "none"}, "roles": {"unified": role}}
    return {"model": model, "roles": {"prefill": {}, "decode": role}}


@pytest.mark.parametrize(
    ("decode", "error"),
    [
        ({"gpusPerPod": 4, "parallelism": {"tensor": 2, "data": 2, "expert": True},
          "eplb": {"enabled": True, "redundantExperts": 8}}, None),
        ({"gpusPerPod": 2, "parallelism": {"tensor": 2, "expert": True},
          "eplb": {"enabled": True, "redundantExperts": 3}},
         r"roles.decode: eplb.redundantExperts must be a multiple of the EP group"
         r" \(parallelism.tensor × parallelism.data = 2\), got 3"),
        ({"gpusPerPod": 4, "parallelism": {"tensor": 2, "data": 2, "expert": True},
          "eplb": {"enabled": True, "redundantExperts": 6}}, r"EP group .* = 4\), got 6"),
        ({"gpusPerPod": 2, "parallelism": {"tensor": 2},
          "eplb": {"enabled": True}}, r"roles.decode: eplb needs parallelism.expert: true"),
        # EPLB off: its numbers are not checked (they are not rendered either).
        ({"gpusPerPod": 2, "parallelism": {"tensor": 2, "expert": True},
          "eplb": {"redundantExperts": 3}}, None),
    ],
)  # fmt: skip
def test_redundant_experts_must_divide_the_ep_group(
    decode: dict[str, Any], error: str | None
) -> None:
    if error is None:
        InferenceDeploymentSpec.model_validate(_spec(decode))
        return
    with pytest.raises(ValidationError, match=error):
        InferenceDeploymentSpec.model_validate(_spec(decode))


def test_the_crd_carries_the_same_rules() -> None:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    role = schema["properties"]["spec"]["properties"]["roles"]["properties"]["decode"]
    rules = {r["message"]: r["rule"] for r in role["x-kubernetes-validations"]}
    assert rules["eplb needs parallelism.expert: true"] == (
        "!self.eplb.enabled || self.parallelism.expert"
    )
    divides = rules[
        "eplb.redundantExperts must be a multiple of the EP group"
        " (parallelism.tensor × parallelism.data)"
    ]
    assert divides == (
        "!self.eplb.enabled || self.eplb.redundantExperts"
        " % (self.parallelism.tensor * self.parallelism.data) == 0"
    )
    eplb = role["properties"]["eplb"]["properties"]
    assert eplb["useAsync"] == {
        "type": "boolean",
        "default": False,
        "description": "move expert weights in the background and switch between steps",
    }
