"""Suite-wide pytest setup: marker auto-skips and the session's shared fixtures."""

from __future__ import annotations

import importlib.util
import os

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
