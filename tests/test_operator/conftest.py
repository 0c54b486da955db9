"""Operator k8s fixtures: the CRD and RBAC from manifests/, and the operator as a subprocess
(`OperatorEnv`, in helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetserve.devcluster.binaries import find_binaries
from fleetserve.devcluster.testing import DevCluster
from tests.test_operator.helpers import OperatorEnv


@pytest.fixture(scope="module")
def operator_env(
    dev_cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorEnv]:
    kubectl_bin = find_binaries().bin_dir / "kubectl"
    env = OperatorEnv(dev_cluster, kubectl_bin, Path(), tmp_path_factory.mktemp("operator"))
    env.install()
    env.start()
    try:
        yield env
    finally:
        env.stop()
