"""Keeps each role's `InferenceDeploymentRole` (its scale subresource) and the deployment agreeing.

Per role of a deployment, with S = `spec.roles.<role>.replicas`, A = the adapter's
`spec.replicas` and O = the value both last agreed on (the adapter's `status.observedReplicas`):
  - autoscaled role (`autoscaling.enabled` and a block for it): the autoscaler decides; A
    mirrors its decision, and a scale through the adapter is undone (a Warning says so);
  - otherwise, A ≠ O with S = O: something scaled the adapter (HPA, KEDA, `kubectl scale`): S := A;
  - S ≠ O: the deployment was edited: A := S (the deployment wins when both changed at once).
Every read is live and the caller holds the deployment's lock, so a scale is never lost to a
pass that started from an older object. `sync_role_adapters` also creates missing adapters
(owned by the deployment, so garbage collection deletes them with it) and deletes those of
roles the spec no longer has.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from fleetserve.api.labels import LABEL_DEPLOYMENT, LABEL_ROLE
from fleetserve.api.models import API_VERSION, InferenceDeploymentSpec
from fleetserve.api.role_adapter import ROLE_KIND, role_adapter_name, role_leader_selector
from fleetserve.operator.autoscale.replicas import autoscaled_roles, effective_replicas
from fleetserve.operator.builders import Owner
from fleetserve.operator.kube import Kube

__all__ = ["build_role_adapter", "sync_role_adapters"]


def build_role_adapter(owner: Owner, role: str, replicas: int) -> dict[str, Any]:
    """A new adapter for `role` of `owner` at `replicas` groups."""
    return {
        "apiVersion": API_VERSION,
        "kind": ROLE_KIND,
        "metadata": owner.meta(role_adapter_name(owner.name, role), {LABEL_ROLE: role}),
        "spec": {"deployment": owner.name, "role": role, "replicas": replicas},
    }


def sync_role_adapters(kube: Kube, namespace: str, name: str) -> list[tuple[str, str, str]]:
    """Bring the adapters and the deployment `namespace/name` into agreement (see the module).

    Returns:
        Events to post on the deployment: (type, reason, message).

    Raises:
        ApiException, urllib3 errors: API failures (the caller retries).
    """
    body = kube.get("InferenceDeployment", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return []
    try:
        spec = InferenceDeploymentSpec.model_validate(body["spec"])
    except ValueError:
        return []  # the reconcile reports it
    owner = Owner(name=name, namespace=namespace, uid=body["metadata"]["uid"])
    status = body.get("status") or {}
    current = effective_replicas(spec, status)
    scaled = autoscaled_roles(spec)
    events: list[tuple[str, str, str]] = []
    present = {role for role, _ in spec.roles.items()}
    try:
        adapters = kube.list(ROLE_KIND, namespace, f"{LABEL_DEPLOYMENT}={name}")
    except ApiException as exc:
        if exc.status == 404:
            # NOTE: an install without the InferenceDeploymentRole CRD (crds/ applied before it
            # existed): everything works, only the roles have no scale subresource.
            return []
        raise
    for adapter in adapters:
        if adapter["spec"].get("role") not in present:
            kube.delete(ROLE_KIND, namespace, adapter["metadata"]["name"])
    for role_name, role in spec.roles.items():
        adapter_name = role_adapter_name(name, role_name)
        live = kube.get(ROLE_KIND, namespace, adapter_name)
        s = role.replicas
        if live is None:
            live = kube.apply(build_role_adapter(owner, role_name, current[role_name]))
            observed, a = s, current[role_name]
        else:
            a = int(live["spec"]["replicas"])
            observed = int((live.get("status") or {}).get("observedReplicas", s))
        if role_name in scaled:
            if a != current[role_name]:
                if a != observed:
                    events.append(
                        (
                            "Warning",
                            "ScaleIgnored",
                            f"{adapter_name}: autoscaling.enabled drives"
                            f" {role_name}; its scale to {a} is undone",
                        )
                    )
                kube.patch(
                    ROLE_KIND, namespace, adapter_name, {"spec": {"replicas": current[role_name]}}
                )
                a = current[role_name]
            observed = a
        elif a != observed and s == observed:
            kube.patch(
                "InferenceDeployment",
                namespace,
                name,
                {"spec": {"roles": {role_name: {"replicas": a}}}},
            )
            events.append(("Normal", "ScaledRole", f"{role_name} {s}→{a} through {adapter_name}"))
            observed = a
        elif s != observed:
            kube.patch(ROLE_KIND, namespace, adapter_name, {"spec": {"replicas": s}})
            observed = a = s
        ready = int(((status.get("roles") or {}).get(role_name) or {}).get("readyReplicas", 0))
        want = {
            "replicas": ready,
            "selector": role_leader_selector(name, role_name),
            "observedReplicas": observed,
            "autoscaled": role_name in scaled,
        }
        if (live.get("status") or {}) != want:
            kube.patch_status(ROLE_KIND, namespace, adapter_name, want)
    return events
