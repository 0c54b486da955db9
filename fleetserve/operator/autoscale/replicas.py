"""The one place the reconcile learns how many groups a role should have.

With `autoscaling.enabled`, a role that has an autoscaling block runs the autoscaler's
`status.roles.<role>.desiredReplicas` (bounded by min..max; the spec's replicas until the first
decision); otherwise, and for every other role, `spec.roles.<role>.replicas`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleetserve.api.models import InferenceDeploymentSpec, RoleScaling

__all__ = ["autoscaled_roles", "effective_replicas", "with_effective_replicas"]


def autoscaled_roles(spec: InferenceDeploymentSpec) -> dict[str, RoleScaling]:
    """Roles the autoscaler drives: present in the spec and with a block, when enabled."""
    a = spec.autoscaling
    if not a.enabled:
        return {}
    blocks: dict[str, RoleScaling | None] = {"prefill": a.prefill, "decode": a.decode}
    return {
        name: scaling for name, _ in spec.roles.items() if (scaling := blocks.get(name)) is not None
    }


def effective_replicas(
    spec: InferenceDeploymentSpec, status: Mapping[str, Any] | None
) -> dict[str, int]:
    """Groups per role the reconcile should run now."""
    roles_status = (status or {}).get("roles") or {}
    scaled = autoscaled_roles(spec)
    out: dict[str, int] = {}
    for name, role in spec.roles.items():
        out[name] = role.replicas
        scaling = scaled.get(name)
        wanted = (roles_status.get(name) or {}).get("desiredReplicas")
        if scaling is not None and isinstance(wanted, int):
            out[name] = min(scaling.max, max(scaling.min, wanted))
    return out


def with_effective_replicas(
    spec: InferenceDeploymentSpec, status: Mapping[str, Any] | None
) -> InferenceDeploymentSpec:
    """`spec` with each role's replicas replaced by `effective_replicas` (no other change)."""
    replicas = effective_replicas(spec, status)
    if all(role.replicas == replicas[name] for name, role in spec.roles.items()):
        return spec
    roles = spec.roles.model_copy(
        update={
            name: role.model_copy(update={"replicas": replicas[name]})
            for name, role in spec.roles.items()
        }
    )
    return spec.model_copy(update={"roles": roles})
