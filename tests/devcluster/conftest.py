"""Fixtures of the dev-cluster tests. The session `dev_cluster` fixture comes from the plugin
`fleetserve.devcluster.testing`, which tests/conftest.py loads for the whole suite
(`pytest_plugins = ["fleetserve.devcluster.testing"]`); `pytest_configure` below loads it when
only this folder is collected without that line, so there is never a second session cluster."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from kubernetes import client

from fleetserve.devcluster import kube

if TYPE_CHECKING:  # imported by pytest_configure below, not here: pytest rewrites its asserts
    from fleetserve.devcluster.testing import DevCluster


PLUGIN = "fleetserve.devcluster.testing"


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(PLUGIN):
        config.pluginmanager.import_plugin(PLUGIN)


@pytest.fixture
def api(dev_cluster: DevCluster) -> Iterator[client.ApiClient]:
    with dev_cluster.api_client() as api:
        yield api


@pytest.fixture
def namespace(api: client.ApiClient) -> Iterator[str]:
    core = client.CoreV1Api(api)
    ns = core.create_namespace({"metadata": {"generateName": "t-"}}).metadata.name
    kube.wait_default_service_account(api, namespace=ns, timeout_s=30)
    yield ns
    core.delete_namespace(ns)
