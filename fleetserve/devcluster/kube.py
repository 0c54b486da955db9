"""Small helpers over the official `kubernetes` client used by `up`, `status` and tests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from fleetserve.devcluster.processes import ProcessRecord, wait_for

__all__ = [
    "api_client",
    "create_nodes",
    "is_node_ready",
    "node_readiness",
    "service_account_token",
    "wait_default_service_account",
    "wait_nodes_ready",
]


def api_client(kubeconfig: Path) -> client.ApiClient:
    """A fresh ApiClient for `kubeconfig` (never touches the process-wide default config)."""
    return config.new_client_from_config(config_file=str(kubeconfig))


def create_nodes(api: client.ApiClient, manifests: Iterable[dict[str, Any]]) -> None:
    """Create each Node (with its status: a Node keeps the status it is created with)."""
    core = client.CoreV1Api(api)
    for body in manifests:
        try:
            core.create_node(body)  # type: ignore[arg-type]  # dicts are accepted
        except ApiException as e:
            if e.status != 409:
                raise


def is_node_ready(node: client.V1Node) -> bool:
    conditions = (node.status and node.status.conditions) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def node_readiness(api: client.ApiClient) -> dict[str, bool]:
    """{node name: Ready} for every node."""
    nodes = client.CoreV1Api(api).list_node().items
    return {str(n.metadata.name if n.metadata else ""): is_node_ready(n) for n in nodes}


def wait_nodes_ready(
    api: client.ApiClient,
    names: Iterable[str],
    *,
    timeout_s: float,
    alive: Sequence[ProcessRecord] = (),
) -> None:
    """Wait until every node in `names` exists and is Ready (fail early if one of `alive` dies)."""
    wanted = set(names)

    def ready() -> bool:
        return wanted <= {name for name, ok in node_readiness(api).items() if ok}

    wait_for(f"nodes {sorted(wanted)} Ready", ready, timeout_s=timeout_s, alive=alive)


def wait_default_service_account(
    api: client.ApiClient,
    *,
    namespace: str = "default",
    timeout_s: float,
    alive: Sequence[ProcessRecord] = (),
) -> None:
    """Wait for kube-controller-manager to create `default` in `namespace`.

    ServiceAccount admission rejects pods until it exists, so `up` waits for it.
    """
    core = client.CoreV1Api(api)

    def exists() -> bool:
        try:
            core.read_namespaced_service_account("default", namespace)
            return True
        except ApiException as e:
            if e.status != 404:
                raise
            return False

    wait_for(f"ServiceAccount {namespace}/default", exists, timeout_s=timeout_s, alive=alive)


def service_account_token(
    api: client.ApiClient,
    name: str,
    namespace: str,
    *,
    expiration_s: int = 3600,
    request: client.AuthenticationV1TokenRequest | None = None,
) -> str:
    """Mint a token for ServiceAccount `namespace/name` through the TokenRequest API.

    `request` overrides the default (unbound token valid `expiration_s`), e.g. to bind it to a pod.
    """
    request = request or client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=expiration_s)
    )
    response = client.CoreV1Api(api).create_namespaced_service_account_token(
        name, namespace, request, _request_timeout=10
    )
    assert response.status is not None, "TokenRequest returned no status"
    return str(response.status.token)
