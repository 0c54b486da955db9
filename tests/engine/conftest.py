"""Shared engine fixtures: tiny random-weight HF models saved once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models"), "qwen2")
