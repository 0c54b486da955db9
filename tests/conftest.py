"""Suite-wide pytest setup: marker auto-skips, the session's shared fixtures, and under CI a
session that fails when anything but a GPU test was skipped (a skip there hides a set-up gap)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

from fleetserve.common.ports import parse_port_range
from fleetserve.envs import env_name

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


ALLOWED_SKIP_MARKERS = frozenset({"gpu", "cpu_isa"})
"""Markers of tests whose skip under CI is the machine's hardware, not a set-up gap."""


class _CISkipGuard:
    """Under CI, any skip but a GPU test's or a missing instruction set's (`cpu_isa`: the CI
    machine's CPU decides which of AVX-512, AMX or AVX2-only paths run) fails the session,
    listing the skipped tests."""

    def __init__(self) -> None:
        self.skipped: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not ALLOWED_SKIP_MARKERS & set(report.keywords):
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


SUITE_PORT_RANGE = "20000-28999"
"""The ports the suite's processes choose free ones from (`FLEETSERVE_PORT_RANGE`, unless set
already), split between the xdist workers. It lies below the kernel's ephemeral ports (32768 up
here), so no outgoing connection takes a chosen port before its server binds it (CI failed so: an
engine's port was taken in the seconds before it bound), and clear of the fixed ports the tests
bind (8000-9443, 18481, 29499-29613)."""


def worker_port_range(base: str, worker: str | None, workers: int) -> str:
    """Worker `gwN`'s share of `base` (`LOW-HIGH`): the Nth of `workers` equal slices; all of it
    without xdist (`worker` None), so two workers never choose the same port."""
    low, high = parse_port_range(base)
    if worker is None or workers < 2:
        return base
    index = int(worker.removeprefix("gw"))
    size = (high - low + 1) // workers
    if size < 1 or not 0 <= index < workers:
        raise ValueError(f"{base} cannot be split into {workers} worker ranges (worker {worker})")
    return f"{low + index * size}-{low + (index + 1) * size - 1}"


def pytest_configure(config: pytest.Config) -> None:
    variable = env_name("port_range")
    os.environ[variable] = worker_port_range(
        os.environ.get(variable) or SUITE_PORT_RANGE,
        os.environ.get("PYTEST_XDIST_WORKER"),
        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
    )
    if _in_ci():
        config.pluginmanager.register(_CISkipGuard(), "ci-skip-guard")


SHARED_PORT_MODULES = (
    "tests/engine/distributed/test_diag_comm.py",
    "tests/engine/distributed/test_multipod.py",
)
"""Modules that are not k8s tests but whose processes bind the fixed ports the dev cluster's
local pods use (8000, 29499-29503 on pod-like loopback addresses, as the operator renders them)."""
K8S_SCOPE = "k8s"


def worker_scope(nodeid: str) -> str:
    """The unit of tests `pytest -n N --dist loadgroup` hands to one worker.

    Every k8s test (their modules are named `*_k8s.py`) and the `SHARED_PORT_MODULES` share one
    worker: the k8s tests share the session's one dev cluster (two control planes at once would
    only slow both), and all of them bind the same fixed ports. Every other module stays whole on
    one worker, so its module-scoped engines start once, not once per worker.

    NOTE: this works from the node id alone because the scheduler runs in the controller, which
    sees node ids, not markers; xdist's own `xdist_group` marker cannot carry the groups there
    under pytest 9.2 (xdist 3.8 appends them to `item._nodeid`, which pytest 9.2 no longer reads),
    so tests of one group were spread over both workers and their pods' ports clashed.
    """
    path = nodeid.split("::", 1)[0]
    if path.endswith("_k8s.py") or path in SHARED_PORT_MODULES:
        return K8S_SCOPE
    return path


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where xdist is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkerScope(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid)

    return ByWorkerScope(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The scheduler groups k8s tests by their module's name: a k8s test elsewhere would run
    # beside the dev cluster's pods under `pytest -n`.
    misplaced = [
        i.nodeid for i in items if "k8s" in i.keywords and worker_scope(i.nodeid) != K8S_SCOPE
    ]
    if misplaced:
        raise pytest.UsageError(f"k8s tests must live in modules named *_k8s.py: {misplaced}")
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
