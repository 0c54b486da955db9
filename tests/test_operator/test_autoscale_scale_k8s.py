"""A role's scale subresource (issue 18, acceptance 3): `kubectl scale` changes that role only.

The operator creates one `InferenceDeploymentRole` per role; `kubectl scale infdrole/NAME-prefill`
goes through its scale subresource, the operator carries it into the deployment's
`spec.roles.prefill.replicas`, and the reconcile creates the groups. The engine pods land on the
dev cluster's kwok GPU nodes (nothing runs: only the objects matter here).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.devcluster.helpers import poll
from tests.test_operator.test_autoscale_k8s import MetricsOperator, scaling_operator

pytestmark = [pytest.mark.k8s]

__all__ = ["scaling_operator"]  # the module fixture, shared with the loop's test

NAME = "scaled"


def _doc() -> dict[str, Any]:
    return {
        "apiVersion": "fleetserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": "m", "source": {"uri": "/m"}},
            "engine": {"cpu": "10m", "memory": "16Mi"},
            # NOTE: kwok pods run no engine, so a removed group's drain has nothing to wait
            # for (with the default timeout it would wait 600 s for an engine that never
            # answers its /metrics).
            "roles": {
                "prefill": {"replicas": 1, "drainTimeoutSeconds": 0},
                "decode": {"replicas": 1, "drainTimeoutSeconds": 0},
            },
        },
    }


def _groups(env: MetricsOperator, ns: str, role: str) -> int:
    items = env.get("statefulset", ns, selector=f"fleetserve.io/role={role}")["items"]
    return len(items)


def test_kubectl_scale_changes_that_role_and_nothing_else(
    scaling_operator: MetricsOperator,
) -> None:
    env = scaling_operator
    ns = env.new_namespace("scale-subresource")
    try:
        env.apply(ns, _doc())
        adapter = poll(
            "the prefill adapter",
            lambda: env.get("infdrole", ns, f"{NAME}-prefill"),
            timeout_s=60,
        )
        assert adapter["spec"] == {"deployment": NAME, "role": "prefill", "replicas": 1}
        assert env.get("infdrole", ns, f"{NAME}-decode")["spec"]["replicas"] == 1
        poll(
            "one group each", lambda: _groups(env, ns, "prefill") == _groups(env, ns, "decode") == 1
        )
        router_before = env.get("deployment", ns, f"{NAME}-router")["spec"]["replicas"]

        env.kubectl("scale", "-n", ns, f"infdrole/{NAME}-prefill", "--replicas", "3")
        poll("3 prefill groups", lambda: _groups(env, ns, "prefill") == 3, timeout_s=30)
        spec = env.get("infd", ns, NAME)["spec"]
        assert spec["roles"]["prefill"]["replicas"] == 3
        assert spec["roles"]["decode"]["replicas"] == 1
        assert _groups(env, ns, "decode") == 1
        assert env.get("deployment", ns, f"{NAME}-router")["spec"]["replicas"] == router_before
        path = f"/apis/fleetserve.io/v1alpha1/namespaces/{ns}/inferencedeploymentroles/{NAME}-prefill/scale"
        scale = json.loads(env.kubectl("get", "--raw", path).stdout)
        assert scale["spec"]["replicas"] == 3
        assert scale["status"]["selector"] == (
            f"fleetserve.io/deployment={NAME},fleetserve.io/role=prefill,apps.kubernetes.io/pod-index=0"
        )
        poll(
            "the adapter's status counts the ready groups",
            lambda: (
                (env.get("infdrole", ns, f"{NAME}-prefill").get("status") or {}).get("replicas")
                == 3
            ),
            timeout_s=60,
        )

        # Editing the deployment moves the adapter too (the deployment stays the description).
        env.kubectl("patch", "infd", NAME, "-n", ns, "--type=merge", "-p",
                    '{"spec":{"roles":{"prefill":{"replicas":2}}}}')  # fmt: skip
        poll(
            "the adapter follows the deployment",
            lambda: env.get("infdrole", ns, f"{NAME}-prefill")["spec"]["replicas"] == 2,
            timeout_s=30,
        )
        poll("2 prefill groups", lambda: _groups(env, ns, "prefill") == 2, timeout_s=30)

        # With autoscaling enabled the autoscaler owns the role: a scale is undone and said so.
        env.kubectl("patch", "infd", NAME, "-n", ns, "--type=merge", "-p",
                    '{"spec":{"autoscaling":{"enabled":true,"prefill":{"min":1,"max":3}}}}')  # fmt: skip
        poll(
            "the adapter marked autoscaled",
            lambda: (env.get("infdrole", ns, f"{NAME}-prefill").get("status") or {}).get(
                "autoscaled"
            ),
            timeout_s=30,
        )
        env.kubectl("scale", "-n", ns, f"infdrole/{NAME}-prefill", "--replicas", "3")

        def undone() -> bool:
            events = env.get("event", ns)["items"]
            return any(e.get("reason") == "ScaleIgnored" for e in events) and (
                env.get("infdrole", ns, f"{NAME}-prefill")["spec"]["replicas"] == 2
            )

        poll("the scale undone with a Warning", undone, timeout_s=30)
        assert env.get("infd", ns, NAME)["spec"]["roles"]["prefill"]["replicas"] == 2
        assert _groups(env, ns, "prefill") == 2
        assert env.rbac_denials() == []
    finally:
        env.kubectl("delete", "infd", "-n", ns, NAME, "--wait=false", check=False)
        env.delete_namespace(ns)
