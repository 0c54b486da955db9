"""Unit tests of the fake and local node manifests and small helpers (no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.devcluster.cluster import ClusterConfig, pod_ip_prefix
from fleetserve.devcluster.ip_pool import IpPool
from fleetserve.devcluster.nodes import (
    GPU_RESOURCE,
    KWOK_ANNOTATION,
    LOCAL_NODE_KEY,
    NodeTopology,
    build_fake_nodes,
    build_local_node,
)


def test_fake_nodes_topology() -> None:
    nodes = build_fake_nodes(NodeTopology(gpu_nodes=2, gpus_per_node=4))
    assert [n["metadata"]["name"] for n in nodes] == ["gpu-node-0", "gpu-node-1", "cpu-node-0"]
    assert all(n["metadata"]["annotations"][KWOK_ANNOTATION] == "fake" for n in nodes)
    assert nodes[0]["status"]["capacity"][GPU_RESOURCE] == "4"
    assert nodes[0]["status"]["allocatable"] == nodes[0]["status"]["capacity"]
    assert GPU_RESOURCE not in nodes[2]["status"]["capacity"]


def test_topology_validation() -> None:
    with pytest.raises(ValueError, match="gpus_per_node"):
        NodeTopology(gpus_per_node=0)
    with pytest.raises(ValueError, match="gpu_nodes"):
        NodeTopology(gpu_nodes=-1)


def test_local_node_is_tainted_and_not_kwok_managed() -> None:
    node = build_local_node("local", cpus=2, memory_bytes=1024, kubelet_version="v1.36.1")
    assert KWOK_ANNOTATION not in node["metadata"].get("annotations", {})
    assert node["metadata"]["labels"][LOCAL_NODE_KEY] == "true"
    assert node["spec"]["taints"] == [
        {"key": LOCAL_NODE_KEY, "value": "true", "effect": "NoSchedule"}
    ]
    assert node["status"]["capacity"]["cpu"] == "2"
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
    assert GPU_RESOURCE not in node["status"]["capacity"]
    with_gpus = build_local_node("local", cpus=2, memory_bytes=1024, kubelet_version="v", gpus=8)
    assert with_gpus["status"]["allocatable"][GPU_RESOURCE] == "8"


def test_ip_pool_allocates_lowest_free() -> None:
    pool = IpPool(first=10, last=12)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == ("127.0.0.10", "127.0.0.11", "127.0.0.12")
    with pytest.raises(RuntimeError, match="no free loopback"):
        pool.allocate()
    pool.release(b)
    pool.release(a)
    assert pool.allocate() == "127.0.0.10"


def test_pod_ip_prefix_unique_per_apiserver_port(tmp_path: Path) -> None:
    assert pod_ip_prefix(ClusterConfig(dir=tmp_path), 45678) == "127.0.0"
    unique = ClusterConfig(dir=tmp_path, unique_pod_ips=True)
    assert pod_ip_prefix(unique, 45678) == "127.178.110"
    assert pod_ip_prefix(unique, 45679) == "127.178.111"
    assert IpPool(prefix="127.178.110").allocate() == "127.178.110.10"
