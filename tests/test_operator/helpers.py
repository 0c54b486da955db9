"""The operator under test as a subprocess, and what the k8s tests do with it (`OperatorEnv`).

A helper module, not the conftest, so the k8s test modules import it by name; the conftest
builds the `operator_env` fixture from it. The operator authenticates with the
`fleetserve-operator` ServiceAccount token (not admin), so the RBAC in
manifests/operator/rbac.yaml is what these tests exercise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetserve.devcluster.testing import DevCluster

SA_NAME = "fleetserve-operator"
SA_NAMESPACE = "fleetserve-system"
SA_USER = f"system:serviceaccount:{SA_NAMESPACE}:{SA_NAME}"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
GET_RETRIES = 5
TRANSIENT_KUBECTL_ERRORS = (
    "Unable to connect to the server",
    "TLS handshake timeout",
    "connection refused",
    "i/o timeout",
    "the server is currently unable to handle the request",
    "the server was unable to return a response in the time allotted",
    "etcdserver: request timed out",
    "Client.Timeout exceeded",
)
"""kubectl's messages when the API server did not answer (under a loaded machine's control
plane), as opposed to an answer such as NotFound."""


@dataclass
class OperatorEnv:
    dc: DevCluster
    kubectl_bin: Path
    sa_kubeconfig: Path
    log_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = field(default=0)
    metrics_address: str = ""
    """`fleetserve operator --metrics` (the autoscaler's /metrics; empty: not served)."""

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.kubectl_bin), "--kubeconfig", str(self.dc.kubeconfig), *args]
        out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)
        if check and out.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} failed: {out.stderr}")
        return out

    def get(self, kind: str, ns: str, name: str | None = None, selector: str | None = None) -> Any:
        """The object (or list) as JSON; None when kubectl fails for another reason than an
        unreachable or overloaded API server, which is retried (GET changes nothing) for up to
        `GET_RETRIES` tries and then fails the test with kubectl's message, so that a busy
        machine's slow control plane never reads as "not found"."""
        args = ["get", kind, "-n", ns, "-o", "json"]
        if name:
            args.insert(2, name)
        if selector:
            args += ["-l", selector]
        for _ in range(GET_RETRIES):
            out = self.kubectl(*args, check=False)
            if out.returncode == 0:
                return json.loads(out.stdout)
            if not any(sign in out.stderr for sign in TRANSIENT_KUBECTL_ERRORS):
                return None
            time.sleep(1.0)
        pytest.fail(f"kubectl {' '.join(args)} failed {GET_RETRIES} times: {out.stderr}")

    def apply(self, ns: str, doc: dict[str, Any]) -> None:
        self.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(doc))

    def install(self) -> None:
        """Every CRD of the install (the InferenceDeployment and its per-role scale adapter),
        the namespace and the operator's RBAC from manifests/, and its ServiceAccount's
        kubeconfig (the operator runs with exactly those grants)."""
        root = Path(__file__).resolve().parents[2]
        self.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(root / "crds"))
        self.kubectl("apply", "-f", str(root / "manifests" / "namespace.yaml"))
        self.kubectl("apply", "-f", str(root / "manifests" / "operator" / "rbac.yaml"))
        self.kubectl(
            "wait", "--for=condition=Established", "crd/inferencedeployments.fleetserve.io"
        )
        self.sa_kubeconfig = self.dc.service_account_kubeconfig(SA_NAME, SA_NAMESPACE)

    def start(self) -> None:
        assert self.proc is None, "operator already running"
        env = {**os.environ, "KUBECONFIG": str(self.sa_kubeconfig)}
        # As its pod runs it (manifests/operator/deployment.yaml), logging at INFO.
        cmd = [sys.executable, "-m", "fleetserve", "operator", "--liveness", "",
               "--metrics", self.metrics_address]  # fmt: skip
        self.starts += 1
        log = (self.log_dir / f"operator-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def log_text(self) -> str:
        """Everything the operator processes of this module logged so far."""
        return "".join(
            p.read_text(errors="replace") for p in sorted(self.log_dir.glob("operator-*.log"))
        )

    def writes(self, namespace: str) -> list[dict[str, Any]]:
        """Mutating requests the operator made in `namespace` (events excluded)."""
        return [
            e
            for e in self.dc.audit_events(username=SA_USER)
            if e["verb"] in WRITE_VERBS
            and e.get("objectRef", {}).get("namespace") == namespace
            and e.get("objectRef", {}).get("resource") != "events"
        ]

    def rbac_denials(self, *, username: str = SA_USER, namespace: str | None = None) -> list[str]:
        """`verb requestURI` of each request by `username` (in `namespace`, if given) that RBAC
        refused. The audit log is the whole test session's, so a 403 the authorizer allowed is
        left out: that is admission, e.g. an earlier module's operator posting an event into a
        namespace its test was already deleting, not a missing grant."""
        return [
            f"{e['verb']} {e['requestURI']}"
            for e in self.dc.audit_events(username=username)
            if e["responseStatus"]["code"] == 403
            and e.get("annotations", {}).get("authorization.k8s.io/decision") != "allow"
            and (namespace is None or e.get("objectRef", {}).get("namespace") == namespace)
        ]

    def new_namespace(self, name: str) -> str:
        self.kubectl("create", "namespace", name)
        # A statically bound read-only volume for the samples' `pvc://models/...` sources.
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"models-{name}"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": "/tmp"},
                "claimRef": {"namespace": name, "name": "models"},
            },
        }
        pvc = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", "namespace": name},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": f"models-{name}",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
        self.apply(name, pv)
        self.apply(name, pvc)
        return name

    def delete_namespace(self, name: str) -> None:
        self.kubectl("delete", "namespace", name, "--wait=false")
        self.kubectl("delete", "pv", f"models-{name}", "--wait=false", check=False)
