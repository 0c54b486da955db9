"""Run Kueue (gang admission of pod groups) on a running dev cluster.

`start_kueue` adds it to a cluster `up` started (`up --kueue` calls it; the `kueue` test
fixture calls it on the session cluster):
  1. its namespace, and a webhook CA and serving certificate (DNS name of Kueue's webhook
     Service and 127.0.0.1) seeded as the Secret Kueue's certificate rotator reads, and as
     files in its certificate folder (in a pod, that Secret would be mounted there);
  2. its CRDs (conversion through its webhook) and webhook configurations, all at
     https://127.0.0.1:PORT (`kueue_manifests`);
  3. the manager process, waited for until a dry-run ResourceFlavor passes its webhooks
     (TLS, serving, and certificates accepted);
  4. with `default_queues`, a ResourceFlavor, a ClusterQueue whose quota is the nodes'
     allocatable cpu, memory and GPUs, and a LocalQueue `fleetserve` in namespace `default`.
The process is recorded in the cluster's state, so `down` stops it with the rest.
"""

from __future__ import annotations

import base64
import os
import signal
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from fleetserve.common.ports import free_ports
from fleetserve.devcluster import kube
from fleetserve.devcluster.binaries import Binaries
from fleetserve.devcluster.kueue_manifests import (
    DEFAULT_CLUSTER_QUEUE,
    DEFAULT_LOCAL_QUEUE,
    KUEUE_NAMESPACE,
    WEBHOOK_SECRET,
    WEBHOOK_SERVICE,
    cluster_queue,
    crds_with_conversion,
    kueue_configuration,
    local_queue,
    node_quota,
    resource_flavor,
    webhook_configurations,
)
from fleetserve.devcluster.pki import WebhookPki, create_webhook_pki
from fleetserve.devcluster.processes import spawn, wait_for, wait_http_ok
from fleetserve.devcluster.state import ClusterState, save_state

__all__ = ["KUEUE_PROCESS", "create_default_queues", "start_kueue"]

KUEUE_PROCESS = "kueue"
_CERT_DAYS = 365
"""Kueue's rotator replaces certificates that expire within 90 days."""


def _load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _secret(pki: WebhookPki) -> dict[str, Any]:
    files = {
        "ca.crt": pki.ca_crt,
        "ca.key": pki.ca_key,
        "tls.crt": pki.tls_crt,
        "tls.key": pki.tls_key,
    }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {"name": WEBHOOK_SECRET, "namespace": KUEUE_NAMESPACE},
        "data": {k: base64.b64encode(p.read_bytes()).decode() for k, p in files.items()},
    }


def _wait_established(api: client.ApiClient, names: list[str], timeout_s: float) -> None:
    ext = client.ApiextensionsV1Api(api)

    def established() -> bool:
        for name in names:
            crd = ext.read_custom_resource_definition(name)
            conditions = (crd.status and crd.status.conditions) or []
            if not any(c.type == "Established" and c.status == "True" for c in conditions):
                return False
        return True

    wait_for("Kueue CRDs Established", established, timeout_s=timeout_s)


def create_default_queues(api: client.ApiClient, *, namespace: str = "default") -> None:
    """The `up --kueue` queues: a flavor, ClusterQueue `fleetserve` with every node's
    allocatable cpu, memory and GPUs as quota, and LocalQueue `fleetserve` in `namespace`."""
    nodes = client.CoreV1Api(api).list_node().to_dict()["items"]
    quota = node_quota([{"status": n["status"]} for n in nodes])
    kube.apply_manifest(api, resource_flavor())
    kube.apply_manifest(api, cluster_queue(DEFAULT_CLUSTER_QUEUE, quota))
    kube.apply_manifest(api, local_queue(DEFAULT_LOCAL_QUEUE, namespace, DEFAULT_CLUSTER_QUEUE))


def start_kueue(
    state: ClusterState,
    binaries: Binaries,
    *,
    die_with_caller: bool = False,
    timeout_s: float = 120.0,
    default_queues: bool = True,
) -> ClusterState:
    """Start Kueue on the cluster of `state` (module docstring); returns the state with its
    process recorded (and saved).

    Raises:
        FileNotFoundError: Kueue is not built.
        TimeoutError / RuntimeError: it did not come up (its log is in the cluster's logs/).
    """
    binaries.require_kueue()
    d = state.dir / "kueue"
    pki = create_webhook_pki(
        d / "certs",
        ca_name="kueue-ca",
        dns_name=f"{WEBHOOK_SERVICE}.{KUEUE_NAMESPACE}.svc",
        days=_CERT_DAYS,
    )
    ports = dict(zip(("kueue-webhook", "kueue-health"), free_ports(2), strict=True))
    state = ClusterState(
        dir=state.dir,
        server=state.server,
        ports={**state.ports, **ports},
        processes=state.processes,
        local_node=state.local_node,
    )
    config = kueue_configuration(
        cert_dir=str(pki.dir),
        webhook_port=ports["kueue-webhook"],
        health_port=ports["kueue-health"],
    )
    (d / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    ca = pki.ca_crt.read_bytes()
    with kube.api_client(state.kubeconfig) as api:
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NAMESPACE}}
        kube.apply_manifest(api, namespace)
        kube.apply_manifest(api, _secret(pki))
        crds = crds_with_conversion(
            _load_all(binaries.kueue_crds), port=ports["kueue-webhook"], ca_bundle=ca
        )
        for crd in crds:
            kube.apply_manifest(api, crd)
        _wait_established(api, [c["metadata"]["name"] for c in crds], timeout_s)
        hooks = _load_all(binaries.kueue_webhooks)
        for hook in webhook_configurations(hooks, port=ports["kueue-webhook"], ca_bundle=ca):
            kube.apply_manifest(api, hook)
    env = {**os.environ, "KUBECONFIG": str(state.kubeconfig)}
    record = spawn(
        KUEUE_PROCESS,
        [binaries.kueue, f"--config={d / 'config.yaml'}", "--zap-log-level=info"],
        log=state.logs_dir / f"{KUEUE_PROCESS}.log",
        cwd=d,
        env=env,
        die_with_parent=signal.SIGKILL if die_with_caller else None,
    )
    state = state.with_process(record)
    save_state(state)
    wait_http_ok(
        f"http://127.0.0.1:{ports['kueue-health']}/readyz", timeout_s=timeout_s, alive=record
    )
    with kube.api_client(state.kubeconfig) as api:

        def webhooks_answer() -> bool:
            try:
                kube.apply_manifest(api, resource_flavor(), dry_run=True)
                return True
            except ApiException as e:
                if e.status in (500, 503):  # "failed calling webhook": not serving yet
                    return False
                raise

        wait_for("Kueue's webhooks", webhooks_answer, timeout_s=timeout_s, alive=record)
        if default_queues:
            create_default_queues(api)
    return state
