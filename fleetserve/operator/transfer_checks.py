"""Whether the cluster can meet what KV transfer needs from the engine pods (pure checks).

The builders render what transfers need (`IPC_LOCK`, a memory-backed `/dev/shm`, the RDMA
device, a thread cap; `fleetserve.operator.builders`). Some of it the cluster may refuse or be
unable to give, and the pods would then fail late and far from the cause: rejected at admission
or Pending forever. `transfer_warnings` says so up front, from the spec and what the operator
read about the cluster; the reconcile turns the warnings into the `TransferReady` condition and
a Warning event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from fleetserve.api.models import InferenceDeploymentSpec

__all__ = [
    "ClusterFacts",
    "cluster_facts",
    "cpu_cores",
    "transfer_warnings",
]

POD_SECURITY_ENFORCE = "pod-security.kubernetes.io/enforce"
"""The namespace label of Pod Security Admission; `baseline` and `restricted` reject added
capabilities other than the runtime defaults (IPC_LOCK is not one of them)."""


@dataclass(frozen=True, slots=True)
class ClusterFacts:
    """What the operator could read about the cluster (None: unknown, nothing is claimed)."""

    pod_security_enforce: str | None = None
    """The namespace's Pod Security enforce level (`privileged` when unlabelled)."""
    node_resources: frozenset[str] | None = None
    """Extended resources some schedulable node has allocatable (read only for rdma)."""


def cluster_facts(
    namespace: dict[str, Any] | None, nodes: list[dict[str, Any]] | None
) -> ClusterFacts:
    """Facts from the live Namespace and Node objects (None where they could not be read)."""
    enforce = None
    if namespace is not None:
        labels = namespace.get("metadata", {}).get("labels") or {}
        enforce = labels.get(POD_SECURITY_ENFORCE, "privileged")
    resources = None
    if nodes is not None:
        resources = frozenset(
            name
            for node in nodes
            if not (node.get("spec") or {}).get("unschedulable")
            for name, amount in ((node.get("status") or {}).get("allocatable") or {}).items()
            if str(amount) not in ("0", "")
        )
    return ClusterFacts(pod_security_enforce=enforce, node_resources=resources)


def cpu_cores(quantity: str) -> float:
    """A Kubernetes CPU quantity in cores: every form the CRD admits ("4", "500m", "1.5", "1k",
    "1e3"), read by the Kubernetes client's own parser.

    Raises:
        ValueError: not a quantity.
    """
    try:
        return float(parse_quantity(quantity.strip()))
    except ValueError:
        raise ValueError(
            f"engine.cpu must be a CPU quantity such as '4' or '500m', got {quantity!r}"
        ) from None


def transfer_warnings(spec: InferenceDeploymentSpec, facts: ClusterFacts) -> list[str]:
    """Each requirement of KV transfer the cluster or the spec cannot meet, in words (empty
    when all can be met, or when the spec moves no KV)."""
    kv = spec.kv_transfer
    if kv.connector == "none":
        return []
    warnings = []
    if facts.pod_security_enforce in ("baseline", "restricted"):
        warnings.append(
            f"the namespace enforces Pod Security '{facts.pod_security_enforce}', which rejects"
            " the IPC_LOCK capability engine pods need to pin KV memory: label the namespace"
            f" {POD_SECURITY_ENFORCE}=privileged"
        )
    if (
        kv.protocol == "rdma"
        and facts.node_resources is not None
        and kv.rdma_resource not in facts.node_resources
    ):
        warnings.append(
            f"kvTransfer.protocol is rdma but no schedulable node advertises"
            f" {kv.rdma_resource!r}: engine pods stay Pending until an RDMA device plugin"
            " offers it (or set kvTransfer.rdmaResource to the name it uses)"
        )
    cores = cpu_cores(spec.engine.cpu)
    if kv.num_threads > max(1.0, cores):
        warnings.append(
            f"kvTransfer.numThreads {kv.num_threads} exceeds engine.cpu {spec.engine.cpu}:"
            " transfer threads would contend with the engine for the pod's CPUs"
        )
    return warnings
