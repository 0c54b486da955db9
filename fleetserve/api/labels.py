"""Label and annotation keys on an InferenceDeployment's children: one definition.

The operator writes them; the router (which never imports operator code) and the tests select by
them. Values are documented where they are set (`fleetserve.operator.builders`).
"""

from __future__ import annotations

__all__ = [
    "ANNOTATION_TEMPLATE_HASH",
    "LABEL_COMPAT",
    "LABEL_DEPLOYMENT",
    "LABEL_GROUP",
    "LABEL_POD_INDEX",
    "LABEL_ROLE",
    "ROUTER_ROLE",
    "role_selector",
]

LABEL_DEPLOYMENT = "fleetserve.io/deployment"
"""Every child: the name of the owning InferenceDeployment."""
LABEL_ROLE = "fleetserve.io/role"
"""Engine groups and their pods: `prefill`, `decode` or `unified`; the router: `router`."""
LABEL_GROUP = "fleetserve.io/group"
"""Engine groups and their pods: the replica group's index within its role (0, 1, ...)."""
LABEL_COMPAT = "fleetserve.io/compatibility-hash"
"""Engine pods: their role's KV compatibility hash (`fleetserve.api.compat`)."""
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"
"""Set by the StatefulSet controller on each pod: its ordinal, i.e. its rank within the group."""
ANNOTATION_TEMPLATE_HASH = "fleetserve.io/template-hash"
"""Group StatefulSets: digest of the rendered pod template (a change rolls the group)."""

ROUTER_ROLE = "router"
"""The `LABEL_ROLE` value of the router Deployment and Service."""


def role_selector(deployment: str, role: str) -> str:
    """Label selector of one role's pods (or the router's) of one InferenceDeployment."""
    return f"{LABEL_DEPLOYMENT}={deployment},{LABEL_ROLE}={role}"
