"""Shared engine fixtures: tiny random-weight HF models saved once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.engine.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models"), "qwen2")


def _force_async_scheduling(value: str | None) -> None:
    """`FS_TEST_ASYNC_SCHEDULING=1` (or 0) runs every engine these tests build through
    `EngineArgs` with async scheduling on (off) at every optimization level, wherever the
    engine can run it (tests only: the variable means nothing to the engine itself)."""
    if value not in ("0", "1"):
        return
    import dataclasses

    from fleetserve.engine.compilation import levels

    levels._DEFAULTS = {
        level: dataclasses.replace(defaults, async_scheduling=value == "1")
        for level, defaults in levels._DEFAULTS.items()
    }


_force_async_scheduling(os.environ.get("FS_TEST_ASYNC_SCHEDULING"))
