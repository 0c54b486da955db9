"""Fixtures of the in-process server tests: the bundled model's config and tokenizer (no
weights are loaded) and a factory of apps over a `FakeEngineClient`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.tokenizer import load_tokenizer
from fleetserve.server.app import ServerConfig, create_app
from tests.server.fake_engine import IN_PROCESS_MAX_MODEL_LEN, MODEL_NAME, FakeEngineClient


@pytest.fixture(scope="session")
def engine_config() -> EngineConfig:
    from fleetserve.engine.models.bundled import bundled_model_path

    return EngineConfig.create(
        str(bundled_model_path()), device="cpu", max_model_len=IN_PROCESS_MAX_MODEL_LEN
    )


@pytest.fixture(scope="session")
def tokenizer(engine_config: EngineConfig) -> Any:
    return load_tokenizer(engine_config.model.model)


@pytest.fixture
def fake_engine(engine_config: EngineConfig, tokenizer: Any) -> FakeEngineClient:
    return FakeEngineClient(engine_config, tokenizer)


@pytest.fixture
def make_app(
    engine_config: EngineConfig, fake_engine: FakeEngineClient
) -> Callable[..., web.Application]:
    """`make_app(api_key=...)`: an app serving `fake_engine` (stats log off)."""

    def make(**server_fields: Any) -> web.Application:
        config = ServerConfig(
            engine=engine_config,
            served_model_name=MODEL_NAME,
            stats_log_interval_s=0,
            **server_fields,
        )
        return create_app(config, engine_client=fake_engine)

    return make
