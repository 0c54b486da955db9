"""Acceptance tests of the dev cluster against the session `dev_cluster` (4 GPU nodes × 8 GPUs,
one CPU-only node, the local node). Each test works in its own namespace and deletes it."""

from __future__ import annotations

import http.client
import sys
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from fleetserve.devcluster import kube
from fleetserve.devcluster.nodes import GPU_RESOURCE, LOCAL_NODE_KEY
from fleetserve.devcluster.processes import is_port_open, process_start_time
from fleetserve.devcluster.testing import DevCluster
from tests.devcluster.helpers import poll

pytestmark = pytest.mark.k8s


def test_nodes_ready(dev_cluster: DevCluster, api: client.ApiClient) -> None:
    readiness = kube.node_readiness(api)
    expected = {f"gpu-node-{i}" for i in range(4)} | {"cpu-node-0", dev_cluster.local_node}
    assert set(readiness) == expected
    assert all(readiness.values()), readiness
    gpus = {
        n.metadata.name: n.status.allocatable.get(GPU_RESOURCE)
        for n in client.CoreV1Api(api).list_node().items
    }
    assert gpus == {
        **{f"gpu-node-{i}": "8" for i in range(4)},
        "cpu-node-0": None,
        dev_cluster.local_node: None,
    }


def _gpu_deployment(replicas: int) -> dict[str, Any]:
    container = {
        "name": "engine", "image": "fleetserve:fake", "command": ["sleep", "infinity"],
        "resources": {"limits": {GPU_RESOURCE: "8"}, "requests": {GPU_RESOURCE: "8", "cpu": "1"}},
    }  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gpu"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "gpu"}},
            "template": {
                "metadata": {"labels": {"app": "gpu"}},
                "spec": {"containers": [container]},
            },
        },
    }


def test_gpu_deployment_one_pod_per_gpu_node_then_gc(api: client.ApiClient, namespace: str) -> None:
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    apps.create_namespaced_deployment(namespace, _gpu_deployment(replicas=5))

    def placed() -> tuple[list[client.V1Pod], list[client.V1Pod]] | None:
        pods = core.list_namespaced_pod(namespace, label_selector="app=gpu").items
        running = [p for p in pods if p.status.phase == "Running"]
        unschedulable = [
            p for p in pods
            if p.status.phase == "Pending"
            and any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in p.status.conditions or [])
        ]  # fmt: skip
        return (running, unschedulable) if len(running) == 4 and len(unschedulable) == 1 else None

    running, pending = poll("4 Running GPU pods and 1 unschedulable", placed)
    assert sorted(p.spec.node_name for p in running) == [f"gpu-node-{i}" for i in range(4)]
    assert pending[0].spec.node_name is None
    assert all(p.status.pod_ip and not p.status.pod_ip.startswith("127.") for p in running)
    # The scheduler records its event asynchronously, after the PodScheduled condition.
    selector = f"involvedObject.name={pending[0].metadata.name}"
    poll(
        "a FailedScheduling event naming the GPUs",
        lambda: any(
            "Insufficient nvidia.com/gpu" in (e.message or "")
            for e in core.list_namespaced_event(namespace, field_selector=selector).items
        ),
        timeout_s=10,
    )

    apps.delete_namespaced_deployment("gpu", namespace, propagation_policy="Background")
    poll(
        "ReplicaSet and pods garbage-collected",
        lambda: (
            not apps.list_namespaced_replica_set(namespace).items
            and not core.list_namespaced_pod(namespace).items
        ),
    )


_SERVER = """
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/exit":
            os._exit(1)
        body = (os.environ["POD_NAME"] + " " + os.environ["POD_IP"]).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args):
        sys.stdout.write("request\\n"); sys.stdout.flush()
print("listening", flush=True)
http.server.ThreadingHTTPServer((os.environ["POD_IP"], 8080), H).serve_forever()
"""


def _local_pod(name: str) -> dict[str, Any]:
    container = {
        "name": "web", "image": "ignored", "command": [sys.executable, "-c", _SERVER],
        "ports": [{"name": "http", "containerPort": 8080}],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
    }  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "web"}},
        "spec": {
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 5,
            "nodeSelector": {LOCAL_NODE_KEY: "true"},
            "tolerations": [{"key": LOCAL_NODE_KEY, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [container],
        },
    }


def _get(ip: str, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection(ip, 8080, timeout=2)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def _ready(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod | None:
    pod = core.read_namespaced_pod(name, namespace)
    conditions = {c.type: c.status for c in pod.status.conditions or []}
    return pod if pod.status.phase == "Running" and conditions.get("Ready") == "True" else None


def _pid(pod: client.V1Pod) -> int:
    return int(pod.status.container_statuses[0].container_id.removeprefix("local://"))


def test_local_pods_run_as_processes(
    dev_cluster: DevCluster, api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    for name in ("web-a", "web-b"):
        core.create_namespaced_pod(namespace, _local_pod(name))
    pods = {
        name: poll(f"{name} Running and Ready", lambda n=name: _ready(core, namespace, n))
        for name in ("web-a", "web-b")
    }

    # Two pods, same port, each on its own loopback address.
    ips = {name: pod.status.pod_ip for name, pod in pods.items()}
    port = int(dev_cluster.server.rsplit(":", 1)[1])  # the session cluster's unique pod IP prefix
    assert sorted(ips.values()) == [f"127.{port // 256}.{port % 256}.{n}" for n in (10, 11)]
    for name, ip in ips.items():
        assert pods[name].spec.node_name == dev_cluster.local_node
        assert _get(ip, "/") == (200, f"{name} {ip}")

    # The process exits: restartPolicy Always restarts it and it becomes Ready again.
    first_pid = _pid(pods["web-a"])
    with pytest.raises((http.client.HTTPException, OSError)):
        _get(ips["web-a"], "/exit")

    def restarted() -> client.V1Pod | None:
        pod = _ready(core, namespace, "web-a")
        return pod if pod and pod.status.container_statuses[0].restart_count >= 1 else None

    pod = poll("web-a restarted and Ready", restarted)
    assert _pid(pod) != first_pid and process_start_time(first_pid) is None
    assert _get(ips["web-a"], "/")[0] == 200
    assert pod.status.container_statuses[0].last_state.terminated.exit_code == 1

    # Deletion: the process tree goes away, then the API object.
    pid, start = _pid(pod), process_start_time(_pid(pod))
    core.delete_namespaced_pod("web-a", namespace)

    def gone() -> bool:
        try:
            core.read_namespaced_pod("web-a", namespace)
            return False
        except ApiException as e:
            return e.status == 404

    poll("web-a deleted", gone, timeout_s=15)
    assert process_start_time(pid) != start
    assert not is_port_open(8080, ips["web-a"])
    log = (dev_cluster.state.logs_dir / "pods" / f"{namespace}_web-a_web.log").read_text()
    assert log.count("listening") == 2
    core.delete_namespaced_pod("web-b", namespace)
    poll("web-b deleted", lambda: not core.list_namespaced_pod(namespace).items, timeout_s=15)


def test_service_account_rbac(
    dev_cluster: DevCluster, api: client.ApiClient, namespace: str
) -> None:
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "reader"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    kubeconfig = dev_cluster.service_account_kubeconfig("reader", namespace)
    with kube.api_client(kubeconfig) as sa_api:
        sa_core = client.CoreV1Api(sa_api)

        def allowed() -> bool:
            try:
                sa_core.list_namespaced_pod(namespace)
                return True
            except ApiException as e:
                assert e.status == 403  # the RBAC cache may lag the binding by a moment
                return False

        poll("the Role to take effect", allowed, timeout_s=10)
        for forbidden in (
            lambda: sa_core.list_namespaced_secret(namespace),
            lambda: sa_core.list_namespaced_pod("default"),
            lambda: sa_core.create_namespaced_pod(namespace, _local_pod("nope")),
        ):
            with pytest.raises(ApiException) as err:
                forbidden()
            assert err.value.status == 403
    user = f"system:serviceaccount:{namespace}:reader"
    codes = [e["responseStatus"]["code"] for e in dev_cluster.audit_events(username=user)]
    assert codes.count(403) >= 3 and 200 in codes
