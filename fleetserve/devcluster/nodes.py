"""Manifests of the fake nodes kwok manages: N GPU nodes and one CPU-only node.

A Node keeps the `status` it is created with (updates ignore it), and kwok's node-initialize
stage keeps the capacity it finds, so the real kube-scheduler sees `nvidia.com/gpu` capacity
exactly as written here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "GPU_RESOURCE",
    "KWOK_ANNOTATION",
    "LOCAL_NODE_KEY",
    "NodeTopology",
    "build_cpu_node",
    "build_fake_nodes",
    "build_gpu_node",
    "build_local_node",
]

GPU_RESOURCE = "nvidia.com/gpu"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
"""kwok is started with `--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake`."""


@dataclass(frozen=True, slots=True)
class NodeTopology:
    """The fake part of the cluster."""

    gpu_nodes: int = 4
    """Number of GPU nodes, named gpu-node-0 … gpu-node-{N-1}."""
    gpus_per_node: int = 8
    """`nvidia.com/gpu` capacity of each GPU node."""
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    """Value of the `nvidia.com/gpu.product` label (what GPU feature discovery would set)."""
    cpu_nodes: int = 1
    """CPU-only nodes, named cpu-node-0 …; they prove GPU pods avoid them."""

    def __post_init__(self) -> None:
        if self.gpu_nodes < 0 or self.gpu_nodes > 1000:
            raise ValueError(f"gpu_nodes must be in [0, 1000], got {self.gpu_nodes}")
        if self.gpus_per_node < 1 or self.gpus_per_node > 64:
            raise ValueError(f"gpus_per_node must be in [1, 64], got {self.gpus_per_node}")
        if self.cpu_nodes < 0:
            raise ValueError(f"cpu_nodes must be >= 0, got {self.cpu_nodes}")


def _fake_node(name: str, labels: dict[str, str], capacity: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            # ttl 0: the kubelet object cache hint; kwokctl sets it on its fake nodes too.
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                **labels,
            },
        },
        "spec": {},
        "status": {
            "capacity": dict(capacity),
            "allocatable": dict(capacity),
        },
    }


def build_gpu_node(index: int, topology: NodeTopology) -> dict[str, Any]:
    """A GPU node with `topology.gpus_per_node` GPUs and the labels GPU feature discovery sets."""
    labels = {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.count": str(topology.gpus_per_node),
        "nvidia.com/gpu.product": topology.gpu_product,
        "node.kubernetes.io/instance-type": f"fake-gpu-{topology.gpus_per_node}x",
    }
    capacity = {
        "cpu": "96",
        "memory": "1024Gi",
        "pods": "110",
        GPU_RESOURCE: str(topology.gpus_per_node),
    }
    return _fake_node(f"gpu-node-{index}", labels, capacity)


def build_cpu_node(index: int) -> dict[str, Any]:
    """A CPU-only node (no GPU capacity)."""
    labels = {"node.kubernetes.io/instance-type": "fake-cpu"}
    return _fake_node(f"cpu-node-{index}", labels, {"cpu": "32", "memory": "128Gi", "pods": "110"})


def build_fake_nodes(topology: NodeTopology) -> list[dict[str, Any]]:
    """All kwok-managed nodes of `topology`, GPU nodes first."""
    gpu = [build_gpu_node(i, topology) for i in range(topology.gpu_nodes)]
    return gpu + [build_cpu_node(i) for i in range(topology.cpu_nodes)]


LOCAL_NODE_KEY = "fleetserve.io/local-node"
"""Label and taint key of the local node: only pods that tolerate the taint run there."""


def build_local_node(
    name: str, *, cpus: int, memory_bytes: int, kubelet_version: str, gpus: int = 0
) -> dict[str, Any]:
    """The Node the local node agent registers (status included: a Node keeps it on create).

    `gpus` > 0 advertises that many `nvidia.com/gpu`, so pods rendered for GPU nodes can be
    pointed at the local node unchanged (their engines then run on the CPU).
    """
    capacity = {
        "cpu": str(cpus),
        "memory": str(memory_bytes),
        "pods": "110",
        "ephemeral-storage": "100Gi",
    }
    if gpus > 0:
        capacity[GPU_RESOURCE] = str(gpus)
    now = _now()
    conditions = [
        {"type": kind, "status": "False", "reason": f"KubeletHas{reason}", "lastHeartbeatTime": now,
         "lastTransitionTime": now}
        for kind, reason in (("MemoryPressure", "SufficientMemory"), ("DiskPressure", "NoDiskPressure"),
                             ("PIDPressure", "SufficientPID"))
    ]  # fmt: skip
    conditions.append(
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "fleetserve local node agent",
         "lastHeartbeatTime": now, "lastTransitionTime": now}
    )  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                LOCAL_NODE_KEY: "true",
            },
        },
        "spec": {"taints": [{"key": LOCAL_NODE_KEY, "value": "true", "effect": "NoSchedule"}]},
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": kubelet_version,
                "kubeProxyVersion": "",
                "osImage": "fleetserve local node",
                "containerRuntimeVersion": "local://",
                "kernelVersion": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        },
    }


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
