"""Controller-made workloads on the local node, as the operator renders them: a StatefulSet whose
pods use an init container, an emptyDir, a ConfigMap volume and their ServiceAccount's token."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from fleetserve.devcluster.nodes import LOCAL_NODE_KEY
from fleetserve.devcluster.testing import DevCluster
from tests.devcluster.helpers import poll

pytestmark = pytest.mark.k8s

# The main container proves each feature in its log, then serves until it is deleted.
_MAIN = """
cat /etc/engine/engine.yaml /work/ready
echo "ip=$POD_IP name=$POD_NAME"
kubectl_user=$(python3 -c "import yaml,os; print(yaml.safe_load(open(os.environ['KUBECONFIG']))['users'][0]['name'])")
echo "kubeconfig user=$kubectl_user"
exec python3 -m http.server 8000 --bind "$POD_IP"
"""


def _statefulset() -> dict[str, Any]:
    volume_mounts = [
        {"name": "work", "mountPath": "/work"},
        {"name": "cfg", "mountPath": "/etc/engine", "readOnly": True},
    ]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "eng"},
        "spec": {
            "replicas": 2,
            "serviceName": "eng",
            "selector": {"matchLabels": {"app": "eng"}},
            "template": {
                "metadata": {"labels": {"app": "eng"}},
                "spec": {
                    "serviceAccountName": "engine",
                    "terminationGracePeriodSeconds": 5,
                    "nodeSelector": {LOCAL_NODE_KEY: "true"},
                    "tolerations": [{"key": LOCAL_NODE_KEY, "operator": "Exists"}],
                    "initContainers": [
                        {
                            "name": "prep",
                            "image": "ignored",
                            "volumeMounts": volume_mounts,
                            "command": ["sh", "-c", "echo prepared > /work/ready"],
                        }
                    ],
                    "containers": [
                        {
                            "name": "main",
                            "image": "ignored",
                            "command": ["sh", "-c", _MAIN],
                            "env": [
                                {
                                    "name": "POD_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                }
                            ],
                            "volumeMounts": volume_mounts,
                            "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1},
                        }
                    ],
                    "volumes": [
                        {"name": "work", "emptyDir": {}},
                        {"name": "cfg", "configMap": {"name": "engine"}},
                    ],
                },
            },
        },
    }


def test_statefulset_with_init_container_volumes_and_token(
    dev_cluster: DevCluster, api: client.ApiClient, namespace: str
) -> None:
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "engine"}})
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "engine"}, "data": {"engine.yaml": "tensor: 2"}}
    )
    apps.create_namespaced_stateful_set(namespace, _statefulset())

    def all_ready() -> list[client.V1Pod] | None:
        pods = core.list_namespaced_pod(namespace, label_selector="app=eng").items
        ready = [
            p for p in pods
            if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        ]  # fmt: skip
        return ready if len(ready) == 2 else None

    pods = poll("both StatefulSet pods Ready", all_ready, timeout_s=60)
    for pod in pods:
        name = pod.metadata.name
        assert pod.status.init_container_statuses[0].state.terminated.exit_code == 0
        log = dev_cluster.state.logs_dir / "pods" / f"{namespace}_{name}_main.log"
        text = log.read_text()
        assert "tensor: 2" in text and "prepared" in text
        assert f"ip={pod.status.pod_ip} name={name}" in text
        assert "kubeconfig user=engine" in text

    apps.delete_namespaced_stateful_set("eng", namespace)
    poll(
        "StatefulSet pods gone",
        lambda: not core.list_namespaced_pod(namespace, label_selector="app=eng").items,
        timeout_s=30,
    )


def test_pod_without_command_reports_config_error_and_deletes(
    api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    pod = {
        "metadata": {"name": "no-command"},
        "spec": {
            "nodeSelector": {LOCAL_NODE_KEY: "true"},
            "tolerations": [{"key": LOCAL_NODE_KEY, "operator": "Exists"}],
            "containers": [{"name": "main", "image": "needs-its-entrypoint"}],
        },
    }
    core.create_namespaced_pod(namespace, pod)

    def waiting_reason() -> str | None:
        statuses = core.read_namespaced_pod("no-command", namespace).status.container_statuses
        return statuses[0].state.waiting.reason if statuses and statuses[0].state.waiting else None

    assert poll("a config error", waiting_reason, timeout_s=20) == "CreateContainerConfigError"
    core.delete_namespaced_pod("no-command", namespace)
    poll("the pod gone", lambda: not core.list_namespaced_pod(namespace).items, timeout_s=20)
