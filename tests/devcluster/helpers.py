"""Polling helper shared by the k8s tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def poll(
    what: str, fn: Callable[[], T | None], timeout_s: float = 30.0, interval_s: float = 0.2
) -> T:
    """Call `fn` until it returns something truthy; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}; last: {last!r}")
