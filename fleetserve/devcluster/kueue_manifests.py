"""What the dev cluster gives Kueue (pure): its Configuration, its webhooks pointed at
127.0.0.1, its CRDs with their conversion webhook, and the default queue objects.

Kueue normally runs in a pod behind a Service; here it is a process on loopback, so every
webhook and conversion endpoint is a `url: https://127.0.0.1:PORT/...`. Only the webhooks of
what the dev cluster enables are registered: Kueue's own kinds, and pods that name a queue
(`kueue.x-k8s.io/queue-name`, `LABEL_KUEUE_QUEUE_NAME`). Kueue ignores other pods anyway (`manageJobsWithoutQueueName`
is false), and scoping the webhook by that label means nothing else in the cluster needs
Kueue to be up to be created. The batch/apps integrations (Job, Deployment, StatefulSet, ...)
are not enabled, so their webhooks are left out: a multi-pod group is a plain Kueue pod group.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from fleetserve.api.labels import LABEL_KUEUE_QUEUE_NAME

__all__ = [
    "CONVERSION_CRDS",
    "DEFAULT_CLUSTER_QUEUE",
    "DEFAULT_FLAVOR",
    "DEFAULT_LOCAL_QUEUE",
    "KUEUE_API",
    "KUEUE_NAMESPACE",
    "QUOTA_RESOURCES",
    "WEBHOOK_SECRET",
    "WEBHOOK_SERVICE",
    "cluster_queue",
    "crds_with_conversion",
    "kueue_configuration",
    "local_queue",
    "node_quota",
    "resource_flavor",
    "webhook_configurations",
]

KUEUE_API = "kueue.x-k8s.io/v1beta2"
KUEUE_NAMESPACE = "kueue-system"
WEBHOOK_SERVICE = "kueue-webhook-service"
"""Kueue names its webhook configurations and its serving certificate's DNS name after this
Service (`kueue-{validating,mutating}-webhook-configuration`,
`kueue-webhook-service.kueue-system.svc`); no such Service exists here."""
WEBHOOK_SECRET = "kueue-webhook-server-cert"
DEFAULT_FLAVOR = "default-flavor"
DEFAULT_CLUSTER_QUEUE = "fleetserve"
DEFAULT_LOCAL_QUEUE = "fleetserve"
"""The LocalQueue `up --kueue` creates in namespace `default`."""
QUOTA_RESOURCES = ("cpu", "memory", "nvidia.com/gpu")
"""What the engine pods request; Kueue admits a pod only if its ClusterQueue covers every
resource it asks for."""
CONVERSION_CRDS = (
    "localqueues.kueue.x-k8s.io",
    "clusterqueues.kueue.x-k8s.io",
    "workloads.kueue.x-k8s.io",
    "cohorts.kueue.x-k8s.io",
    "multikueueclusters.kueue.x-k8s.io",
)
"""The CRDs Kueue serves in two versions through its /convert webhook (its kustomize
patches), and whose CA bundle its certificate rotator keeps."""

_SYSTEM_NAMESPACES = {
    "matchExpressions": [
        {
            "key": "kubernetes.io/metadata.name",
            "operator": "NotIn",
            "values": ["kube-system", KUEUE_NAMESPACE],
        }
    ]
}


def kueue_configuration(*, cert_dir: str, webhook_port: int, health_port: int) -> dict[str, Any]:
    """Kueue's `Configuration` for a process on loopback.

    Its own certificate management stays on (with it off, Kueue insists on a metrics
    certificate at a fixed /etc path): it finds the Secret `start_kueue` seeded, valid for
    127.0.0.1, keeps it, and injects its CA into the webhooks. The visibility API server is
    off (it would bind a fixed port on every interface), so is leader election.
    """
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": cert_dir},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": WEBHOOK_SERVICE,
            "webhookSecretName": WEBHOOK_SECRET,
        },
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": _SYSTEM_NAMESPACES,
        "integrations": {"frameworks": ["pod"]},
        "featureGates": {"VisibilityOnDemand": False},
        "clientConnection": {"qps": 50, "burst": 100},
    }


def _url(port: int, path: str) -> str:
    return f"https://127.0.0.1:{port}{path}"


def _wanted(hook: Mapping[str, Any]) -> bool:
    for rule in hook.get("rules") or []:
        groups = rule.get("apiGroups") or []
        if "kueue.x-k8s.io" in groups:
            return True
        if groups == [""] and "pods" in (rule.get("resources") or []):
            return True
    return False


def webhook_configurations(
    manifests: Iterable[Mapping[str, Any]], *, port: int, ca_bundle: bytes
) -> list[dict[str, Any]]:
    """Kueue's webhook configurations (its `config/components/webhook/manifests.yaml`),
    renamed as Kueue's certificate rotator expects, reduced to the webhooks of Kueue's kinds
    and of pods, each pointed at `https://127.0.0.1:port` and trusting `ca_bundle` (PEM)."""
    out = []
    bundle = base64.b64encode(ca_bundle).decode()
    for doc in manifests:
        kind = doc["kind"]
        prefix = "mutating" if kind == "MutatingWebhookConfiguration" else "validating"
        hooks = []
        for hook in doc.get("webhooks") or []:
            if not _wanted(hook):
                continue
            path = hook["clientConfig"]["service"]["path"]
            new = {k: v for k, v in hook.items() if k != "clientConfig"}
            new["clientConfig"] = {"url": _url(port, path), "caBundle": bundle}
            if any("pods" in (r.get("resources") or []) for r in hook.get("rules") or []):
                new["namespaceSelector"] = _SYSTEM_NAMESPACES
                new["objectSelector"] = {
                    "matchExpressions": [{"key": LABEL_KUEUE_QUEUE_NAME, "operator": "Exists"}]
                }
            hooks.append(new)
        out.append(
            {
                "apiVersion": doc["apiVersion"],
                "kind": kind,
                "metadata": {"name": f"kueue-{prefix}-webhook-configuration"},
                "webhooks": hooks,
            }
        )
    return out


def crds_with_conversion(
    crds: Iterable[Mapping[str, Any]], *, port: int, ca_bundle: bytes
) -> list[dict[str, Any]]:
    """Kueue's CRDs, those of `CONVERSION_CRDS` converted by its webhook at 127.0.0.1."""
    out = []
    bundle = base64.b64encode(ca_bundle).decode()
    for crd in crds:
        new = dict(crd)
        if crd["metadata"]["name"] in CONVERSION_CRDS:
            new["spec"] = {
                **crd["spec"],
                "conversion": {
                    "strategy": "Webhook",
                    "webhook": {
                        "clientConfig": {"url": _url(port, "/convert"), "caBundle": bundle},
                        "conversionReviewVersions": ["v1"],
                    },
                },
            }
        out.append(new)
    return out


def node_quota(nodes: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The sum of the nodes' allocatable `QUOTA_RESOURCES` (memory in bytes): a queue with
    this quota admits at most what the cluster's nodes can hold."""
    totals = dict.fromkeys(QUOTA_RESOURCES, Decimal(0))
    for node in nodes:
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        for name in QUOTA_RESOURCES:
            if name in allocatable:
                totals[name] += parse_quantity(allocatable[name])
    return {name: str(int(value)) for name, value in totals.items()}


def resource_flavor(name: str = DEFAULT_FLAVOR) -> dict[str, Any]:
    """A flavor with no node labels: any node (the dev cluster's nodes are one kind)."""
    return {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": name}}


def cluster_queue(
    name: str, quota: Mapping[str, str], *, flavor: str = DEFAULT_FLAVOR
) -> dict[str, Any]:
    """A ClusterQueue open to every namespace with `quota` (resource → nominal quota) in
    `flavor`; no cohort, no borrowing, no preemption."""
    return {
        "apiVersion": KUEUE_API,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": list(quota),
                    "flavors": [
                        {
                            "name": flavor,
                            "resources": [{"name": r, "nominalQuota": q} for r, q in quota.items()],
                        }
                    ],
                }
            ],
        },
    }


def local_queue(name: str, namespace: str, cluster_queue_name: str) -> dict[str, Any]:
    """A LocalQueue: what a pod's `kueue.x-k8s.io/queue-name` names, in its namespace."""
    return {
        "apiVersion": KUEUE_API,
        "kind": "LocalQueue",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterQueue": cluster_queue_name},
    }
