"""Suite-wide pytest setup: marker auto-skips, the session's shared fixtures, and under CI a
session that fails when anything but a GPU test was skipped (a skip there hides a set-up gap)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

# The session-scoped `dev_cluster` fixture (real control plane; k8s-marked tests).
# NOTE: a GPU machine used only for the kernel and engine checks (`gpu_check.sh`) may carry the
# engine's dependencies alone; without the kubernetes client there is no dev-cluster to offer.
pytest_plugins = ["fleetserve.devcluster.testing"] if importlib.util.find_spec("kubernetes") else []

# Tests never reach a model hub; transformers must only read local folders.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


class _CISkipGuard:
    """Under CI, any skip but a GPU test's fails the session, listing the skipped tests."""

    def __init__(self) -> None:
        self.skipped: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and "gpu" not in report.keywords:
            self.skipped.append(report.nodeid)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.skipped:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.skipped:
            return
        terminalreporter.section("CI: skipped tests that are not GPU-only", red=True)
        terminalreporter.write_line(
            f"{len(self.skipped)} test(s) skipped; under CI a skip fails the run, since it hides "
            "a missing set-up step:",
            red=True,
        )
        for nodeid in self.skipped:
            terminalreporter.write_line(f"  {nodeid}", red=True)


def pytest_configure(config: pytest.Config) -> None:
    if _in_ci():
        config.pluginmanager.register(_CISkipGuard(), "ci-skip-guard")


def _group_for_workers(items: list[pytest.Item]) -> None:
    """Under `pytest -n N --dist loadgroup`, which tests must share a worker.

    Every k8s-marked test shares one worker: they share the session's one dev cluster, and two
    control planes at once would only slow both. Every other module stays whole on one worker, so
    its module-scoped engines start once, not once per worker; a module that sets `XDIST_GROUP`
    shares a worker with the other modules that set the same name (they bind the same fixed
    ports, e.g. the multi-pod groups' engine and rendezvous ports, which the dev cluster's local
    pods use too: those modules name "k8s").
    """
    for item in items:
        module = getattr(item, "module", None)
        group = getattr(module, "XDIST_GROUP", None) or item.nodeid.split("::", 1)[0]
        if "k8s" in item.keywords:
            group = "k8s"
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") == "loadgroup":
        _group_for_workers(items)
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
