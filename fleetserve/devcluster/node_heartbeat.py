"""Register the local Node and keep it alive (node Lease + Ready condition), as a kubelet does.

kube-controller-manager marks a node NotReady (and later evicts its pods) when neither the Lease
in `kube-node-lease` nor the Ready condition's heartbeat moved within the node monitor grace
period (40-50 s), so `renew` must run every ~10 s.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

__all__ = ["register_node", "renew"]

LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40


def register_node(api: client.ApiClient, body: dict[str, Any], *, timeout_s: float) -> None:
    """Create the Node with its status; if it exists (agent restarted), rewrite its status."""
    core = client.CoreV1Api(api)
    try:
        core.create_node(body, _request_timeout=timeout_s)  # type: ignore[arg-type]  # dicts are accepted
    except ApiException as e:
        if e.status != 409:
            raise
        name = body["metadata"]["name"]
        core.patch_node_status(name, {"status": body["status"]}, _request_timeout=timeout_s)


def renew(api: client.ApiClient, node_name: str, *, timeout_s: float) -> None:
    """Renew the node Lease (creating it the first time) and the Ready condition's heartbeat."""
    coord = client.CoordinationV1Api(api)
    # Patch bodies go out verbatim; a typed create would re-serialize renewTime without the
    # microseconds the API's MicroTime format demands. So: create bare once, then patch.
    renew_time = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    patch = {"spec": {"renewTime": renew_time}}
    try:
        coord.patch_namespaced_lease(node_name, LEASE_NAMESPACE, patch, _request_timeout=timeout_s)
    except ApiException as e:
        if e.status != 404:
            raise
        lease = client.V1Lease(
            metadata=client.V1ObjectMeta(name=node_name, namespace=LEASE_NAMESPACE),
            spec=client.V1LeaseSpec(
                holder_identity=node_name, lease_duration_seconds=LEASE_DURATION_S
            ),
        )
        coord.create_namespaced_lease(LEASE_NAMESPACE, lease, _request_timeout=timeout_s)
        coord.patch_namespaced_lease(node_name, LEASE_NAMESPACE, patch, _request_timeout=timeout_s)
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "lastHeartbeatTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    client.CoreV1Api(api).patch_node_status(
        node_name, {"status": {"conditions": [ready]}}, _request_timeout=timeout_s
    )
