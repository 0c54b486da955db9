"""Operator k8s fixtures: the CRD and RBAC from manifests/, and the operator as a subprocess
(`OperatorEnv`, in helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetserve.devcluster.binaries import find_binaries
from fleetserve.devcluster.testing import DevCluster
from tests.test_operator.helpers import SA_NAME, SA_NAMESPACE, OperatorEnv

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def operator_env(
    dev_cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorEnv]:
    kubectl_bin = find_binaries().bin_dir / "kubectl"
    env = OperatorEnv(dev_cluster, kubectl_bin, Path(), tmp_path_factory.mktemp("operator"))
    # Every CRD of the install (the InferenceDeployment and its per-role scale adapter).
    env.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(ROOT / "crds"))
    env.kubectl("apply", "-f", str(ROOT / "manifests" / "namespace.yaml"))
    env.kubectl("apply", "-f", str(ROOT / "manifests" / "operator" / "rbac.yaml"))
    env.kubectl("wait", "--for=condition=Established", "crd/inferencedeployments.fleetserve.io")
    env.sa_kubeconfig = dev_cluster.service_account_kubeconfig(SA_NAME, SA_NAMESPACE)
    env.start()
    try:
        yield env
    finally:
        env.stop()
