"""pytest plugin: the session-scoped `dev_cluster` fixture (a real control plane for k8s tests).

Enable with `pytest_plugins = ["fleetserve.devcluster.testing"]` in tests/conftest.py and mark
tests `@pytest.mark.k8s`. The fixture starts one cluster per test session (4 GPU nodes × 8 GPUs,
one CPU-only node, the local node) and skips its tests when the binaries are not built (under
CI the suite's conftest turns any such skip into a failed session). Tests share the cluster: each
must clean up what it creates (use its own namespace).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from fleetserve.devcluster import kube
from fleetserve.devcluster.binaries import Binaries, find_binaries
from fleetserve.devcluster.cluster import ClusterConfig, down, up
from fleetserve.devcluster.kueue import start_kueue
from fleetserve.devcluster.nodes import NodeTopology
from fleetserve.devcluster.pki import write_kubeconfig
from fleetserve.devcluster.state import ClusterState

__all__ = ["DevCluster", "dev_cluster", "kueue", "require_binaries"]

_START_KEY = pytest.StashKey[float]()


@dataclass(frozen=True, slots=True)
class DevCluster:
    """Handle on the running session cluster."""

    state: ClusterState
    start_s: float
    """Wall time `up` took."""

    @property
    def dir(self) -> Path:
        return self.state.dir

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (system:masters)."""
        return self.state.kubeconfig

    @property
    def server(self) -> str:
        return self.state.server

    @property
    def local_node(self) -> str:
        assert self.state.local_node is not None, "the session cluster runs a local node"
        return self.state.local_node

    def api_client(self) -> client.ApiClient:
        """A new admin ApiClient; close it (or use `with`) when done."""
        return kube.api_client(self.kubeconfig)

    def service_account_kubeconfig(
        self, name: str, namespace: str, *, path: Path | None = None
    ) -> Path:
        """Write a kubeconfig authenticating as ServiceAccount `namespace/name` (TokenRequest token)."""
        with self.api_client() as api:
            token = kube.service_account_token(api, name, namespace)
        path = path or self.dir / f"sa-{namespace}-{name}.kubeconfig"
        return write_kubeconfig(
            path, server=self.server, ca_crt=self.state.pki_dir / "ca.crt", token=token, user=name
        )

    def audit_events(self, *, username: str | None = None) -> list[dict[str, Any]]:
        """ServiceAccount requests from the audit log (Metadata level), optionally of one user.

        e.g. `[e for e in dc.audit_events(username=u) if e["responseStatus"]["code"] == 403]`
        proves an operator never hit a forbidden call.
        """
        path = self.state.logs_dir / "audit.log"
        if not path.exists():
            return []
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [
            e for e in events if username is None or e.get("user", {}).get("username") == username
        ]


def require_binaries() -> Binaries:
    """The dev-cluster binaries, or a skip naming what is missing and how to build it."""
    try:
        return find_binaries()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def dev_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DevCluster]:
    """Start the session's dev cluster; skip when the binaries are missing."""
    require_binaries()
    d = tmp_path_factory.mktemp("dev-cluster")
    t0 = time.monotonic()
    topology = NodeTopology(gpu_nodes=4, gpus_per_node=8)
    cfg = ClusterConfig(dir=d, topology=topology, die_with_caller=True, unique_pod_ips=True)
    state = up(cfg, log=False)
    start_s = time.monotonic() - t0
    request.config.stash[_START_KEY] = start_s
    try:
        yield DevCluster(state=state, start_s=start_s)
    finally:
        down(d)


@pytest.fixture(scope="session")
def kueue(dev_cluster: DevCluster) -> DevCluster:
    """The session cluster with Kueue running (started on first use; it stops with the
    cluster). No queues: each test makes its own ClusterQueue and LocalQueue. Skips, naming
    the build command, when Kueue is not built."""
    binaries = require_binaries()
    try:
        binaries.require_kueue()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    state = start_kueue(dev_cluster.state, binaries, die_with_caller=True, default_queues=False)
    return DevCluster(state=state, start_s=dev_cluster.start_s)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "k8s: needs the dev-cluster binaries (fleetserve dev-cluster)"
    )


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    start_s = config.stash.get(_START_KEY, None)
    if start_s is not None:
        terminalreporter.write_line(f"dev-cluster: session cluster started in {start_s:.1f}s")
