"""Small helpers over the official `kubernetes` client used by `up`, `status` and tests."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from fleetserve.devcluster.processes import ProcessRecord, wait_for

__all__ = [
    "FIELD_MANAGER",
    "api_client",
    "apply_manifest",
    "create_nodes",
    "is_node_ready",
    "node_readiness",
    "service_account_token",
    "wait_default_service_account",
    "wait_nodes_ready",
]


FIELD_MANAGER = "fleetserve-dev-cluster"

_PLURALS = {
    "Namespace": ("namespaces", False),
    "Secret": ("secrets", True),
    "CustomResourceDefinition": ("customresourcedefinitions", False),
    "MutatingWebhookConfiguration": ("mutatingwebhookconfigurations", False),
    "ValidatingWebhookConfiguration": ("validatingwebhookconfigurations", False),
    "ResourceFlavor": ("resourceflavors", False),
    "ClusterQueue": ("clusterqueues", False),
    "LocalQueue": ("localqueues", True),
}
"""The kinds the dev cluster applies from manifests: plural and whether namespaced."""


def apply_manifest(
    api: client.ApiClient, obj: dict[str, Any], *, dry_run: bool = False
) -> dict[str, Any]:
    """Server-side apply `obj` (a manifest of a kind in `_PLURALS`) as FIELD_MANAGER.

    Raises:
        ValueError: a kind not in `_PLURALS`.
        ApiException: the API refused it.
    """
    kind = obj["kind"]
    if kind not in _PLURALS:
        raise ValueError(f"kind must be one of {sorted(_PLURALS)}, got {kind!r}")
    plural, namespaced = _PLURALS[kind]
    version = obj["apiVersion"]
    prefix = "/api/v1" if version == "v1" else f"/apis/{version}"
    meta = obj["metadata"]
    ns = f"/namespaces/{quote(meta['namespace'])}" if namespaced else ""
    query = f"fieldManager={FIELD_MANAGER}&force=true" + ("&dryRun=All" if dry_run else "")
    path = f"{prefix}{ns}/{plural}/{quote(meta['name'])}?{query}"
    headers = {"Accept": "application/json", "Content-Type": "application/apply-patch+yaml"}
    # NOTE: through call_api, not the generated client, which validates dict bodies against
    # its models (and has none for custom resources).
    _, url, headers, _, _ = api.param_serialize(
        "PATCH", path, header_params=headers, auth_settings=["BearerToken"]
    )
    resp = api.call_api("PATCH", url, header_params=headers, body=obj, _request_timeout=30)
    resp.read()
    if resp.status >= 300:
        ApiException.from_response(http_resp=resp, body=None, data=None)
    data = resp.data
    return dict(json.loads(data)) if data else {}


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
