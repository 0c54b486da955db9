"""Fixtures: a local transport in the test process and a peer engine in another process (the
helpers behind them are in `pairs.py`)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.engine.kv_transfer.pairs import KINDS, Pair, start_pair, stop_pair


@pytest.fixture(scope="session", autouse=True)
def _mooncake_on_loopback() -> None:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


@pytest.fixture(scope="module", params=KINDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    started = start_pair(request.param)
    yield started
    stop_pair(started)
