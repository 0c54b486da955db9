"""Label and annotation keys on an InferenceDeployment's children: one definition.

The operator writes them; the router (which never imports operator code) and the tests select by
them. Values are documented where they are set (`fleetserve.operator.builders`).
"""

from __future__ import annotations

__all__ = [
    "ANNOTATION_DRAINING_SINCE",
    "ANNOTATION_DRAIN_REASON",
    "ANNOTATION_KUEUE_POD_GROUP_SERVING",
    "ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT",
    "ANNOTATION_TEMPLATE_HASH",
    "LABEL_COMPAT",
    "LABEL_DEPLOYMENT",
    "LABEL_DRAINING",
    "LABEL_GROUP",
    "LABEL_KUEUE_POD_GROUP_NAME",
    "LABEL_KUEUE_QUEUE_NAME",
    "LABEL_POD_INDEX",
    "LABEL_ROLE",
    "ROUTER_ROLE",
    "group_selector",
    "role_selector",
]

LABEL_DEPLOYMENT = "fleetserve.io/deployment"
"""Every child: the name of the owning InferenceDeployment."""
LABEL_ROLE = "fleetserve.io/role"
"""Engine groups and their pods: `prefill`, `decode` or `unified`; the router: `router`."""
LABEL_GROUP = "fleetserve.io/group"
"""Engine groups and their pods: the replica group's index, unique among its role's live groups.
A new group (scale-up, or a roll's surge) takes the lowest free index, so after a roll the
indices need not be 0..n-1."""
LABEL_COMPAT = "fleetserve.io/compatibility-hash"
"""Engine pods: their role's KV compatibility hash (`fleetserve.api.compat`)."""
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"
"""Set by the StatefulSet controller on each pod: its ordinal, i.e. its rank within the group."""
ANNOTATION_TEMPLATE_HASH = "fleetserve.io/template-hash"
"""Group StatefulSets: digest of the rendered pod template. A group whose digest is not the one
the spec renders now is replaced: a new group is surged, then the old one drained."""
LABEL_DRAINING = "fleetserve.io/draining"
"""Engine pods of a draining group: `true`. The router sends such a pod no new request; the
operator deletes its group once nothing is in flight there (`fleetserve.operator.drain`)."""
ANNOTATION_DRAINING_SINCE = "fleetserve.io/draining-since"
"""Group StatefulSets being drained: when the drain began (RFC 3339, UTC). The drain's state
lives here, so an operator that restarts resumes it, timeout included."""
ANNOTATION_DRAIN_REASON = "fleetserve.io/drain-reason"
"""Group StatefulSets being drained: why, `scale-down` or `roll` (events and status say it)."""

# Kueue's keys (its plain-pod integration), set on engine pods under gang admission
# (`fleetserve.operator.gang`); the dev cluster scopes Kueue's pod webhooks by the queue label.
LABEL_KUEUE_QUEUE_NAME = "kueue.x-k8s.io/queue-name"
"""Engine pods under gang admission: the LocalQueue (`spec.scheduling.queueName`)."""
LABEL_KUEUE_POD_GROUP_NAME = "kueue.x-k8s.io/pod-group-name"
"""Engine pods under gang admission: their replica group's StatefulSet name (one Workload)."""
ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
"""Engine pods under gang admission: the group's pod count, all admitted together."""
ANNOTATION_KUEUE_POD_GROUP_SERVING = "kueue.x-k8s.io/pod-group-serving"
"""Engine pods under gang admission: `true`, a group that never finishes and whose recreated
pods rejoin it."""

ROUTER_ROLE = "router"
"""The `LABEL_ROLE` value of the router Deployment and Service."""


def role_selector(deployment: str, role: str) -> str:
    """Label selector of one role's pods (or the router's) of one InferenceDeployment."""
    return f"{LABEL_DEPLOYMENT}={deployment},{LABEL_ROLE}={role}"


def group_selector(deployment: str, role: str, index: int) -> str:
    """Label selector of one replica group's pods (or its StatefulSet and Service)."""
    return f"{role_selector(deployment, role)},{LABEL_GROUP}={index}"
