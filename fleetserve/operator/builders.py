"""Pure builders: InferenceDeployment spec → the child objects (plain dicts) the operator applies.

Per role, `replicas` groups of `group_size` pods: one StatefulSet + headless Service per group
(pod 0 leads); then the router: its ServiceAccount, a Role that lets it watch the namespace's pods
(its Kubernetes discovery, and nothing more) bound to that account, its Deployment and Service.
Labels come from `fleetserve.api.labels`.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from fleetserve.api.compat import compatibility_hash, role_compatibility_hashes
from fleetserve.api.labels import (
    ANNOTATION_TEMPLATE_HASH,
    LABEL_COMPAT,
    LABEL_DEPLOYMENT,
    LABEL_GROUP,
    LABEL_POD_INDEX,
    LABEL_ROLE,
    ROUTER_ROLE,
    role_selector,
)
from fleetserve.api.models import API_VERSION, KIND, InferenceDeploymentSpec, Role
from fleetserve.api.router_config import RouterConfig
from fleetserve.envs import env_name
from fleetserve.operator.gang import gang_pod_metadata
from fleetserve.operator.placement import pack_affinity
from fleetserve.operator.render import ENGINE_PORT, MODEL_MOUNT, engine_args, engine_env

__all__ = [
    "ROUTER_POD_RULES",
    "ROUTER_PORT",
    "Owner",
    "build_children",
    "build_group",
    "build_group_service",
    "build_group_statefulset",
    "build_router_children",
    "build_router_config",
    "build_router_deployment",
    "build_router_role",
    "build_router_role_binding",
    "build_router_service",
    "build_router_service_account",
    "group_name",
    "router_name",
]

ROUTER_PORT = 8080
ROUTER_SHUTDOWN_DELAY_S = 10.0
"""How long a stopping router stays unready but serving, so the Service's endpoints (and the
clients that resolved it) stop sending before its listener closes. Endpoint updates reach
kube-proxy and ingress controllers in seconds, more on a busy control plane (3 s let clients of
a loaded 2-core dev cluster meet a closed listener during a roll)."""

ROUTER_POD_RULES: tuple[dict[str, list[str]], ...] = (
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
)
"""The router's whole RBAC, in its own namespace: read and watch the engine pods (their IPs,
readiness, role and compatibility-hash labels). EndpointSlices are not read: the dev cluster's
loopback pod IPs get none (docs/dev-cluster.md)."""


@dataclass(frozen=True, slots=True)
class Owner:
    """The InferenceDeployment that owns the children."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def meta(self, name: str, labels: dict[str, str]) -> dict[str, Any]:
        return {
            "name": name,
            "namespace": self.namespace,
            "labels": {LABEL_DEPLOYMENT: self.name, **labels},
            "ownerReferences": [self.reference()],
        }


def group_name(deployment: str, role: str, index: int) -> str:
    return f"{deployment}-{role}-{index}"


def router_name(deployment: str) -> str:
    return f"{deployment}-router"


def _transfers(spec: InferenceDeploymentSpec) -> bool:
    """The engine pods move KV between roles (prefill/decode with a connector)."""
    return spec.kv_transfer.connector != "none"


def _resources(spec: InferenceDeploymentSpec, role: Role) -> dict[str, Any]:
    req = {"cpu": spec.engine.cpu, "memory": spec.engine.memory}
    lim = {"memory": spec.engine.memory}
    if role.gpus_per_pod:
        req["nvidia.com/gpu"] = lim["nvidia.com/gpu"] = str(role.gpus_per_pod)
    if _transfers(spec) and spec.kv_transfer.protocol == "rdma":
        # NOTE: one device of the RDMA plugin's pool per pod; the transport spreads its lanes
        # over the ports that device exposes.
        req[spec.kv_transfer.rdma_resource] = lim[spec.kv_transfer.rdma_resource] = "1"
    return {"requests": req, "limits": lim}


def _transfer_pod_parts(spec: InferenceDeploymentSpec, pod_spec: dict[str, Any]) -> None:
    """What KV transfer needs from the pod (seed part 3 §2.9): `IPC_LOCK`, so the transport can
    pin the registered KV memory, and a memory-backed `/dev/shm` as large as the pod's memory,
    where the tcp connector keeps its KV arena for the same-host path (the default 64 MiB of a
    container runtime holds no KV cache)."""
    container = pod_spec["containers"][0]
    container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    container.setdefault("volumeMounts", []).append({"name": "dshm", "mountPath": "/dev/shm"})
    pod_spec.setdefault("volumes", []).append(
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.engine.memory}}
    )


def _model_volume(uri: str) -> dict[str, Any] | None:
    if uri.startswith("pvc://"):
        claim = uri.removeprefix("pvc://").split("/", 1)[0]
        return {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    if uri.startswith("hostpath://"):
        path = uri.removeprefix("hostpath://")
        return {"name": "model", "hostPath": {"path": path, "type": "Directory"}}
    return None


def build_group_service(owner: Owner, role_name: str, index: int) -> dict[str, Any]:
    """Headless Service of one group: stable pod DNS for the leader address."""
    name = group_name(owner.name, role_name, index)
    labels = {LABEL_ROLE: role_name, LABEL_GROUP: str(index)}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.meta(name, labels),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_DEPLOYMENT: owner.name, **labels},
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": ENGINE_PORT}],
        },
    }


def build_group_statefulset(
    spec: InferenceDeploymentSpec, owner: Owner, role_name: str, role: Role, index: int
) -> dict[str, Any]:
    """StatefulSet of one replica group (`group_size` pods, pod 0 the leader).

    Raises:
        ValueError: an unsupported model URI.
    """
    name = group_name(owner.name, role_name, index)
    labels = {LABEL_ROLE: role_name, LABEL_GROUP: str(index)}
    leader = f"{name}-0.{name}.{owner.namespace}.svc"
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.engine.image,
        "command": list(spec.engine.command),
        "args": engine_args(spec, role_name, role),
        "env": engine_env(spec, role, leader),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT}],
        "resources": _resources(spec, role),
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": ENGINE_PORT},
            "periodSeconds": 5,
        },
    }
    pod_spec: dict[str, Any] = {"containers": [container]}
    model_volume = _model_volume(spec.model.source.uri)
    if model_volume is not None:
        pod_spec["volumes"] = [model_volume]
        container["volumeMounts"] = [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}]
    if _transfers(spec):
        _transfer_pod_parts(spec, pod_spec)
    pod_labels = {
        LABEL_DEPLOYMENT: owner.name,
        **labels,
        LABEL_COMPAT: role_compatibility_hashes(spec)[role_name],
    }
    if role.node_selector:
        pod_spec["nodeSelector"] = dict(role.node_selector)
    if role.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in role.tolerations]
    if role.gpus_per_pod:  # partial-node pods pack, keeping whole nodes free for large groups
        pod_spec["affinity"] = pack_affinity(owner.name, role_name)
    gang_labels, gang_annotations = gang_pod_metadata(spec, role, name)  # one Kueue pod group
    template: dict[str, Any] = {
        "metadata": {"labels": {**pod_labels, **gang_labels}},
        "spec": pod_spec,
    }
    if gang_annotations:
        template["metadata"]["annotations"] = gang_annotations
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:12]
    meta = owner.meta(name, labels)
    meta["annotations"] = {ANNOTATION_TEMPLATE_HASH: digest}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "replicas": role.group_size,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {LABEL_DEPLOYMENT: owner.name, **labels}},
            "template": template,
        },
    }


def _router_labels() -> dict[str, str]:
    return {LABEL_ROLE: ROUTER_ROLE}


def build_router_service_account(owner: Owner) -> dict[str, Any]:
    """The router pods' ServiceAccount (named like the Deployment), bound by the Role below."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": owner.meta(router_name(owner.name), _router_labels()),
    }


def build_router_role(owner: Owner) -> dict[str, Any]:
    """Role of the router: `ROUTER_POD_RULES` in the deployment's namespace."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": owner.meta(router_name(owner.name), _router_labels()),
        "rules": [{k: list(v) for k, v in rule.items()} for rule in ROUTER_POD_RULES],
    }


def build_router_role_binding(owner: Owner) -> dict[str, Any]:
    """Binds the router's Role to its ServiceAccount (same name, same namespace)."""
    name = router_name(owner.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": owner.meta(name, _router_labels()),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
    }


def build_router_config(spec: InferenceDeploymentSpec, owner: Owner) -> RouterConfig:
    """The router's config: the spec's routing fields and how to find this deployment's pods.

    Raises:
        ValueError: the roles' compatibility hashes differ (`compatibility_hash`).
    """
    compatibility_hash(spec)  # roles that can never pair are a spec problem
    r = spec.router
    present = {name for name, _ in spec.roles.items()}

    def selector(role: str) -> str | None:
        # NOTE: only a group's pod 0 serves; the other pods of a multi-pod group run workers.
        leaders = f"{role_selector(owner.name, role)},{LABEL_POD_INDEX}=0"
        return leaders if role in present else None

    return RouterConfig(
        shutdown_delay_s=ROUTER_SHUTDOWN_DELAY_S,
        # NOTE: as long as an engine group's drain by default: a stream through a stopping
        # router is as long as one through a draining engine (the router's own default, 25 s,
        # cut answers of a few hundred tokens on a busy machine during a roll).
        shutdown_grace_s=float(r.drain_timeout_seconds),
        mode=r.disaggregation.mode,
        min_uncached_tokens=r.disaggregation.min_uncached_tokens,
        prefix_aware=r.prefix_aware,
        load_aware=r.load_aware,
        discovery="kubernetes",
        namespace=owner.namespace,
        prefill_selector=selector("prefill"),
        decode_selector=selector("decode"),
        unified_selector=selector("unified"),
        # NOTE: no single hash: during a roll that changes it, both revisions' pods must stay
        # visible (the router pairs prefill and decode only within one hash), or a router
        # would lose its engines when the old revision drains.
        compatibility_hash=None,
        # The router hashes prompts in the engines' blocks; another size would match no prefix.
        block_size=spec.model.block_size,
        engine_port=ENGINE_PORT,
        # NOTE: the pod IP, like the engines: on the dev cluster's local node pods share the
        # host network, each with its own loopback address.
        host=f"$({env_name('pod_ip')})",
        port=ROUTER_PORT,
    )


def build_router_deployment(spec: InferenceDeploymentSpec, owner: Owner) -> dict[str, Any]:
    """Router Deployment running `fleetserve router` with `build_router_config`'s arguments.

    Its pods run as the router's ServiceAccount (Kubernetes discovery watches the engine pods
    with it) and are ready once `/health` answers 200, which the router does only after one
    real generation went through an engine. A roll (an image change) starts the new router and
    waits for it to be ready before stopping an old one (`maxUnavailable: 0`), and an old one
    finishes its streams before it exits (`fleetserve.router.serve`; the grace period covers
    its unready delay and its wait for requests in flight).
    """
    labels = _router_labels()
    config = build_router_config(spec, owner)
    grace_s = math.ceil(config.shutdown_delay_s + config.shutdown_grace_s) + 5
    container = {
        "name": "router",
        "image": spec.engine.image,
        "command": list(spec.engine.command),
        "args": ["router", *config.to_args()],
        "env": [
            {"name": env_name("pod_ip"), "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        ],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
        # NOTE: requests keep the router out of BestEffort, the first class evicted under node
        # pressure; like the engines, memory is limited at its request and CPU not at all.
        "resources": {
            "requests": {"cpu": spec.router.cpu, "memory": spec.router.memory},
            "limits": {"memory": spec.router.memory},
        },
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": ROUTER_PORT},
            "periodSeconds": 2,
            "failureThreshold": 3,
        },
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": router_name(owner.name),
        "terminationGracePeriodSeconds": grace_s,
        "containers": [container],
    }
    if spec.router.node_selector:
        pod_spec["nodeSelector"] = dict(spec.router.node_selector)
    if spec.router.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.router.tolerations]
    selector = {LABEL_DEPLOYMENT: owner.name, **labels}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owner.meta(router_name(owner.name), labels),
        "spec": {
            "replicas": spec.router.replicas,
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": selector}, "spec": pod_spec},
        },
    }


def build_router_service(owner: Owner) -> dict[str, Any]:
    """ClusterIP Service, port 80 → the router."""
    labels = _router_labels()
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.meta(owner.name, labels),
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL_DEPLOYMENT: owner.name, **labels},
            "ports": [{"name": "http", "port": 80, "targetPort": ROUTER_PORT}],
        },
    }


def build_group(
    spec: InferenceDeploymentSpec, owner: Owner, role_name: str, role: Role, index: int
) -> list[dict[str, Any]]:
    """One replica group's objects: its headless Service, then its StatefulSet.

    Raises:
        ValueError: an unsupported model URI.
    """
    return [
        build_group_service(owner, role_name, index),
        build_group_statefulset(spec, owner, role_name, role, index),
    ]


def build_router_children(spec: InferenceDeploymentSpec, owner: Owner) -> list[dict[str, Any]]:
    """The router's objects, in apply order (identity and RBAC, Deployment, Service)."""
    return [
        build_router_service_account(owner),
        build_router_role(owner),
        build_router_role_binding(owner),
        build_router_deployment(spec, owner),
        build_router_service(owner),
    ]


def build_children(spec: InferenceDeploymentSpec, owner: Owner) -> list[dict[str, Any]]:
    """Every child of a fresh deployment, in apply order: groups 0..replicas-1 of each role,
    then the router. (Live deployments keep the group indices they have:
    `fleetserve.operator.roll` picks the indices of new groups.)

    Raises:
        ValueError: a spec the operator cannot realise (an unsupported model URI, or roles whose
            compatibility hashes differ); the message says what to change.
    """
    compatibility_hash(spec)  # fail before anything is built when the roles cannot pair
    children: list[dict[str, Any]] = []
    for role_name, role in spec.roles.items():
        for i in range(role.replicas):
            children += build_group(spec, owner, role_name, role, i)
    return children + build_router_children(spec, owner)
