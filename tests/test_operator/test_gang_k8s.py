"""Gang admission through Kueue on the dev cluster (issue 16, acc. 6): a group gets all its pods
placed or holds none of its GPUs.

Kueue v0.17.0 runs on the session cluster (the `kueue` fixture); the operator runs as its
ServiceAccount with manifests/operator/rbac-kueue.yaml. The test's own ClusterQueue has quota
for exactly one group of two whole-node pods (16 GPUs), while the session's nodes have room for
both: what holds the second group back is Kueue, and it holds all of it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetserve.devcluster.testing import DevCluster
from tests.devcluster.helpers import poll
from tests.test_operator.helpers import SA_USER, OperatorEnv

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[2]
GATE = "kueue.x-k8s.io/admission"


def _deployment(name: str, queue: str) -> dict[str, Any]:
    return {
        "apiVersion": "fleetserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "m", "source": {"uri": "/models/m"}},
            "engine": {"cpu": "1", "memory": "1Gi"},
            "kvTransfer": {"connector": "none"},
            # One group of two 8-GPU pods (tensor 16).
            "roles": {"unified": {"gpusPerPod": 8, "parallelism": {"tensor": 16}}},
            "router": {"replicas": 0},
            "scheduling": {"gangAdmission": "kueue", "queueName": queue},
        },
    }


def _queues(ns: str) -> list[dict[str, Any]]:
    api = "kueue.x-k8s.io/v1beta2"
    quota = {"cpu": "2", "memory": "2Gi", "nvidia.com/gpu": "16"}
    return [
        {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": f"{ns}-flavor"}},
        {
            "apiVersion": api,
            "kind": "ClusterQueue",
            "metadata": {"name": ns},
            "spec": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "resourceGroups": [
                    {
                        "coveredResources": list(quota),
                        "flavors": [
                            {
                                "name": f"{ns}-flavor",
                                "resources": [
                                    {"name": r, "nominalQuota": q} for r, q in quota.items()
                                ],
                            }
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": api,
            "kind": "LocalQueue",
            "metadata": {"name": "gpus", "namespace": ns},
            "spec": {"clusterQueue": ns},
        },
    ]


def _pods(env: OperatorEnv, ns: str, name: str) -> list[dict[str, Any]]:
    sel = f"fleetserve.io/deployment={name}"
    items: list[dict[str, Any]] = (env.get("pod", ns, selector=sel) or {"items": []})["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def _gated(pod: dict[str, Any]) -> bool:
    return any(g["name"] == GATE for g in pod["spec"].get("schedulingGates") or [])


def _placed(pods: list[dict[str, Any]]) -> bool:
    """Both pods of the group exist, none gated, each bound to a node."""
    return len(pods) == 2 and all(p["spec"].get("nodeName") and not _gated(p) for p in pods)


def _condition(env: OperatorEnv, ns: str, name: str) -> dict[str, Any]:
    live = env.get("inferencedeployment", ns, name) or {}
    conditions = (live.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "AwaitingAdmission"), {})


def test_a_group_is_admitted_whole_or_holds_no_gpu(
    kueue: DevCluster, operator_env: OperatorEnv
) -> None:
    env = operator_env
    ns = env.new_namespace("gang")
    env.kubectl("apply", "-f", str(ROOT / "manifests" / "operator" / "rbac-kueue.yaml"))
    try:
        for doc in _queues(ns):
            env.apply(ns, doc)
        env.apply(ns, _deployment("first", "gpus"))
        poll("the first group placed whole", lambda: _placed(_pods(env, ns, "first")), timeout_s=60)
        poll(
            "the first deployment reports its admission",
            lambda: _condition(env, ns, "first").get("status") == "False",
            timeout_s=30,
        )

        env.apply(ns, _deployment("second", "gpus"))
        poll(
            "Kueue's reason in the second deployment's status",
            lambda: "insufficient unused quota" in _condition(env, ns, "second").get("message", ""),
            timeout_s=45,
        )
        condition = _condition(env, ns, "second")
        assert condition["status"] == "True", condition
        assert "unified group 0" in condition["message"], condition
        assert "nvidia.com/gpu" in condition["message"], condition
        # Both of its pods exist, and not one holds a node (or a GPU): gated by Kueue.
        second = _pods(env, ns, "second")
        assert len(second) == 2, second
        assert all(_gated(p) and not p["spec"].get("nodeName") for p in second), second
        assert _placed(_pods(env, ns, "first"))

        events = env.kubectl(
            "get", "events", "-n", ns, "--field-selector",
            "involvedObject.name=second,reason=AwaitingAdmission", "-o", "json",
        )  # fmt: skip
        assert json.loads(events.stdout)["items"], "a Warning event said the group waits"
        # The operator read Kueue's Workloads as its ServiceAccount, and was never refused.
        mine = [
            e
            for e in kueue.audit_events(username=SA_USER)
            if e.get("objectRef", {}).get("namespace") == ns
        ]
        assert any(e["objectRef"]["resource"] == "workloads" for e in mine)
        assert [e["requestURI"] for e in mine if e["responseStatus"]["code"] == 403] == []
        # NOTE: not proven here: the second group admitted once the first is deleted. On kwok
        # nodes a deleted pod is never terminated (no kubelet ends it), so Kueue's
        # `kueue.x-k8s.io/managed` finalizer keeps it Running and its group's Workload admitted.
    finally:
        env.kubectl("delete", "inferencedeployment", "--all", "-n", ns, "--wait=false")
        # kwok never terminates a deleted pod, so Kueue's `kueue.x-k8s.io/managed` finalizer
        # would keep the placed group Running on two whole nodes the later tests need.
        for _ in range(50):
            pods = (env.get("pod", ns) or {"items": []})["items"]
            if not pods:
                break
            for pod in pods:
                env.kubectl(
                    "patch", "pod", pod["metadata"]["name"], "-n", ns, "--type=merge",
                    "-p", '{"metadata": {"finalizers": null}}', check=False,
                )  # fmt: skip
            time.sleep(0.2)
        env.delete_namespace(ns)
        for kind, name in (("clusterqueue", ns), ("resourceflavor", f"{ns}-flavor")):
            env.kubectl("delete", kind, name, "--wait=false", check=False)


@pytest.mark.parametrize(
    ("scheduling", "message"),
    [
        ({"gangAdmission": "kueue"}, "is required with gangAdmission kueue, and only then"),
        ({"queueName": "gpus"}, "is required with gangAdmission kueue, and only then"),
        (
            {"gangAdmission": "kueue", "queueName": "GPUs_A"},
            "spec.scheduling.queueName in body should match",
        ),
        ({"gangAdmission": "volcano", "queueName": "gpus"}, 'Unsupported value: "volcano"'),
    ],
)
def test_the_api_server_refuses_bad_scheduling(
    operator_env: OperatorEnv, scheduling: dict[str, Any], message: str
) -> None:
    doc = _deployment("bad", "gpus")
    doc["spec"]["scheduling"] = scheduling
    out = operator_env.kubectl(
        "apply", "-n", "default", "-f", "-", stdin=yaml.safe_dump(doc), check=False
    )
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert operator_env.get("inferencedeployment", "default", "bad") is None
