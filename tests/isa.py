"""Skips for a CPU instruction set the machine lacks, marked `cpu_isa` so that CI allows them
(tests/conftest.py): the CI machine's CPU decides which of the AVX-512, AMX and AVX2-only kernel
paths run, and each machine runs the ones it has."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest

Test = TypeVar("Test", bound=Callable[..., object])
ISA_REASON_PREFIX = "CPU instruction set"
"""How such a skip's reason starts (.ci/run's summary check allows these lines)."""


def isa_skipif(condition: bool, *, reason: str) -> Callable[[Test], Test]:
    """`pytest.mark.skipif(condition, reason=reason)` for a missing instruction set."""

    def apply(test: Test) -> Test:
        skip = pytest.mark.skipif(condition, reason=f"{ISA_REASON_PREFIX}: {reason}")
        marked: Test = pytest.mark.cpu_isa(skip(test))
        return marked

    return apply
