"""What the dev cluster gives Kueue (pure): webhooks on 127.0.0.1 scoped to queued pods, CRD
conversion, quota from the nodes."""

from __future__ import annotations

import base64
from typing import Any

from fleetserve.devcluster.kueue_manifests import (
    cluster_queue,
    crds_with_conversion,
    kueue_configuration,
    node_quota,
    webhook_configurations,
)
from fleetserve.devcluster.nodes import NodeTopology, build_fake_nodes, build_local_node

CA = b"-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n"


def _hook(name: str, group: str, resource: str, path: str) -> dict[str, Any]:
    return {
        "name": name,
        "admissionReviewVersions": ["v1"],
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": path}},
        "rules": [
            {"apiGroups": [group], "apiVersions": ["v1"], "operations": ["CREATE"],
             "resources": [resource]}
        ],
    }  # fmt: skip


# The shape of Kueue's config/components/webhook/manifests.yaml.
MANIFESTS = [
    {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "mutating-webhook-configuration"},
        "webhooks": [
            _hook("mjob.kb.io", "batch", "jobs", "/mutate-batch-v1-job"),
            _hook("mpod.kb.io", "", "pods", "/mutate--v1-pod"),
            _hook("mstatefulset.kb.io", "apps", "statefulsets", "/mutate-apps-v1-statefulset"),
            _hook("mworkload.kb.io", "kueue.x-k8s.io", "workloads", "/mutate-workload"),
        ],
    },
    {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "validating-webhook-configuration"},
        "webhooks": [_hook("vpod.kb.io", "", "pods", "/validate--v1-pod")],
    },
]


def test_only_kueues_kinds_and_queued_pods_reach_its_webhooks_on_loopback() -> None:
    mutating, validating = webhook_configurations(MANIFESTS, port=9443, ca_bundle=CA)
    # The names Kueue's certificate rotator injects its CA into.
    assert mutating["metadata"]["name"] == "kueue-mutating-webhook-configuration"
    assert validating["metadata"]["name"] == "kueue-validating-webhook-configuration"
    assert [h["name"] for h in mutating["webhooks"]] == ["mpod.kb.io", "mworkload.kb.io"]
    pod, workload = mutating["webhooks"]
    assert pod["clientConfig"] == {
        "url": "https://127.0.0.1:9443/mutate--v1-pod",
        "caBundle": base64.b64encode(CA).decode(),
    }
    assert pod["objectSelector"] == {
        "matchExpressions": [{"key": "kueue.x-k8s.io/queue-name", "operator": "Exists"}]
    }
    assert "kube-system" in str(pod["namespaceSelector"])
    assert "objectSelector" not in workload
    assert workload["clientConfig"]["url"] == "https://127.0.0.1:9443/mutate-workload"
    assert [h["name"] for h in validating["webhooks"]] == ["vpod.kb.io"]
    assert validating["webhooks"][0]["failurePolicy"] == "Fail"


def test_versioned_crds_convert_through_kueues_webhook() -> None:
    crds = [
        {"metadata": {"name": n}, "spec": {"group": "kueue.x-k8s.io"}}
        for n in ("workloads.kueue.x-k8s.io", "topologies.kueue.x-k8s.io")
    ]
    workloads, topologies = crds_with_conversion(crds, port=9443, ca_bundle=CA)
    conversion = workloads["spec"]["conversion"]
    assert conversion["strategy"] == "Webhook"
    assert conversion["webhook"]["clientConfig"]["url"] == "https://127.0.0.1:9443/convert"
    assert workloads["spec"]["group"] == "kueue.x-k8s.io"
    assert "conversion" not in topologies["spec"]


def test_quota_is_what_the_nodes_hold() -> None:
    nodes = build_fake_nodes(NodeTopology(gpu_nodes=2, gpus_per_node=8))  # + cpu-node-0
    local = build_local_node("l", cpus=2, memory_bytes=4 * 1024**3, kubelet_version="v1", gpus=1)
    quota = node_quota([*nodes, local])
    assert quota == {
        "cpu": str(2 * 96 + 32 + 2),
        "memory": str((2 * 1024 + 128 + 4) * 1024**3),
        "nvidia.com/gpu": "17",
    }
    queue = cluster_queue("q", quota)
    (group,) = queue["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["cpu", "memory", "nvidia.com/gpu"]
    assert group["flavors"][0]["resources"][2] == {"name": "nvidia.com/gpu", "nominalQuota": "17"}


def test_configuration_keeps_kueue_on_loopback_with_the_pod_integration_only() -> None:
    cfg = kueue_configuration(cert_dir="/c", webhook_port=1, health_port=2)
    assert cfg["webhook"] == {"host": "127.0.0.1", "port": 1, "certDir": "/c"}
    assert cfg["health"]["healthProbeBindAddress"] == "127.0.0.1:2"
    assert cfg["metrics"]["bindAddress"] == "0"
    assert cfg["integrations"] == {"frameworks": ["pod"]}
    assert cfg["featureGates"] == {"VisibilityOnDemand": False}
