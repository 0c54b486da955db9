"""Kernel tests run on the GPU when there is one, else in Triton's CPU interpreter.

NOTE: Triton decides between compiling and interpreting when a kernel is decorated, i.e. when a
`fleetserve.kernels.<op>` module is first imported; nothing imports those modules before this
conftest (the package and the attention backend import them lazily), so setting the variable
here, at collection time, is early enough.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    """Where the small (CPU-interpretable) kernel tests run."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
