"""A local Kubernetes control plane for tests and local trials (`fleetserve dev-cluster`).

Modules, bottom up: binaries (where the built binaries are, pinned versions), pki (openssl CA
and certs, kubeconfigs), processes (spawn/stop/wait), state (`<dir>/state.json`), kube (client
helpers), nodes (fake GPU/CPU and local Node manifests), cluster (`up`/`down`). The local node
agent: podspec (pure pod translations), pod_launch (pod -> process launches), pod_runtime
(containers, probes, restarts, status), pod_records, ip_pool, node_heartbeat, local_node (the
agent process). Then cli, and testing (the `dev_cluster` pytest fixture).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetserve.devcluster.cluster import ClusterConfig, down, up
    from fleetserve.devcluster.nodes import NodeTopology
    from fleetserve.devcluster.state import ClusterState

__all__ = ["ClusterConfig", "ClusterState", "NodeTopology", "down", "up"]

# Lazy, so that `fleetserve --help` (which registers the dev-cluster command) does not import
# the kubernetes client.
_LAZY = {
    "ClusterConfig": "fleetserve.devcluster.cluster",
    "down": "fleetserve.devcluster.cluster",
    "up": "fleetserve.devcluster.cluster",
    "NodeTopology": "fleetserve.devcluster.nodes",
    "ClusterState": "fleetserve.devcluster.state",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
