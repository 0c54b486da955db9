"""Minimal raw Kubernetes client for the operator: get, list, server-side apply, merge patch,
delete.

# NOTE: the generated client validates dict bodies against its models; server-side apply goes
# through `call_api` with `application/apply-patch+yaml` (JSON is YAML) to avoid that.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fleetserve.api.models import API_VERSION, PLURAL
from fleetserve.api.role_adapter import ROLE_KIND, ROLE_PLURAL

__all__ = ["FIELD_MANAGER", "Kube", "resource_path"]

FIELD_MANAGER = "fleetserve-operator"

_RESOURCES: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "Service": ("/api/v1", "services"),
        "Pod": ("/api/v1", "pods"),
        "StatefulSet": ("/apis/apps/v1", "statefulsets"),
        "Deployment": ("/apis/apps/v1", "deployments"),
        "ServiceAccount": ("/api/v1", "serviceaccounts"),
        "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
        "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
        "InferenceDeployment": (f"/apis/{API_VERSION}", PLURAL),
        ROLE_KIND: (f"/apis/{API_VERSION}", ROLE_PLURAL),
        # Kueue's record of a pod group (read only, under gang admission: fleetserve.operator.gang).
        "Workload": ("/apis/kueue.x-k8s.io/v1beta2", "workloads"),
    }
)


_CLUSTER_RESOURCES: Mapping[str, str] = MappingProxyType(
    {"Namespace": "/api/v1/namespaces", "Node": "/api/v1/nodes"}
)


def resource_path(kind: str, namespace: str, name: str | None = None) -> str:
    """URL path of a namespaced object (or its collection when `name` is None).

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in _RESOURCES:
        raise ValueError(f"kind must be one of {sorted(_RESOURCES)}, got {kind!r}")
    prefix, plural = _RESOURCES[kind]
    path = f"{prefix}/namespaces/{quote(namespace)}/{plural}"
    return f"{path}/{quote(name)}" if name else path


@dataclass
class Kube:
    """Thin synchronous API wrapper that counts the writes it issues.

    A missing object reads (and deletes) as None; any other error response raises
    `ApiException` with the response's status, body and headers.
    """

    api: client.ApiClient
    writes: list[str] = field(default_factory=list)
    """`VERB kind/name` of every mutating request, in order (tests assert on it)."""

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        content_type: str | None = None,
    ) -> dict[str, Any] | None:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        _, url, headers, _, _ = self.api.param_serialize(
            method, path, header_params=headers, auth_settings=["BearerToken"]
        )
        resp = self.api.call_api(method, url, header_params=headers, body=body)
        resp.read()
        if resp.status == 404 and method in ("GET", "DELETE"):
            return None
        if resp.status >= 300:
            # NOTE: `call_api` returns error responses; raise them as the typed ApiException
            # (status, reason, body, headers) that the error policy classifies.
            ApiException.from_response(http_resp=resp, body=None, data=None)
        data = resp.data
        return json.loads(data) if data else {}

    def get_cluster(self, kind: str, name: str) -> dict[str, Any] | None:
        """A cluster-scoped object (Namespace, Node), None when missing.

        Raises:
            ValueError: an unknown cluster-scoped kind.
        """
        return self._call("GET", f"{self._cluster_path(kind)}/{quote(name)}")

    def list_cluster(self, kind: str) -> list[dict[str, Any]]:
        """Every object of a cluster-scoped kind."""
        result = self._call("GET", self._cluster_path(kind))
        assert result is not None, f"list {kind} returned nothing"
        return list(result.get("items", []))

    @staticmethod
    def _cluster_path(kind: str) -> str:
        if kind not in _CLUSTER_RESOURCES:
            raise ValueError(f"kind must be one of {sorted(_CLUSTER_RESOURCES)}, got {kind!r}")
        return _CLUSTER_RESOURCES[kind]

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call("GET", resource_path(kind, namespace, name))

    def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        path = resource_path(kind, namespace) + "?" + urlencode({"labelSelector": selector})
        result = self._call("GET", path)
        assert result is not None, f"list {kind} returned nothing"
        items: list[dict[str, Any]] = result.get("items", [])
        return items

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` as FIELD_MANAGER (force: the operator owns its children)."""
        meta = obj["metadata"]
        self.writes.append(f"APPLY {obj['kind']}/{meta['name']}")
        query = urlencode({"fieldManager": FIELD_MANAGER, "force": "true"})
        path = resource_path(obj["kind"], meta["namespace"], meta["name"]) + "?" + query
        out = self._call("PATCH", path, body=obj, content_type="application/apply-patch+yaml")
        assert out is not None, f"apply {obj['kind']}/{meta['name']} returned nothing"
        return out

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.writes.append(f"STATUS {kind}/{name}")
        path = resource_path(kind, namespace, name) + "/status"
        self._call(
            "PATCH",
            path,
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """JSON merge patch (None values remove keys) of an object's main resource (not its
        status), as FIELD_MANAGER: marks the applied objects do not carry (a drain's label and
        annotations, which the next apply leaves alone) and a role adapter's scale carried into
        the deployment's spec."""
        self.writes.append(f"PATCH {kind}/{name}")
        query = urlencode({"fieldManager": FIELD_MANAGER})
        self._call(
            "PATCH",
            resource_path(kind, namespace, name) + "?" + query,
            body=patch,
            content_type="application/merge-patch+json",
        )

    def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        """Delete an object (dependents in the background).

        With `uid`, only that incarnation of `name`: the API server refuses (409 Conflict) to
        delete an object recreated under the same name since it was read, as a StatefulSet
        recreates its pods. The kubelet deletes its pods this way for the same reason.

        Returns:
            Whether an object was deleted: False when it is missing or, with `uid`, replaced.
        """
        self.writes.append(f"DELETE {kind}/{name}")
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            out = self._call(
                "DELETE",
                resource_path(kind, namespace, name),
                body=body,
                content_type="application/json",
            )
        except ApiException as exc:
            if uid is not None and exc.status == 409:
                return False
            raise
        return out is not None
