"""Where kernel-running tests execute: the GPU when there is one, else Triton's CPU interpreter.

NOTE: Triton decides between compiling and interpreting when a kernel is decorated, i.e. when a
`fleetserve.kernels.<op>` module is first imported; nothing imports those modules before the
conftests that call `use_interpreter_without_cuda` (the package and the attention backend import
them lazily), so setting the variable there, at collection time, is early enough.
"""

from __future__ import annotations

import os

import pytest
import torch


def use_interpreter_without_cuda() -> None:
    """Run Triton kernels in the interpreter when torch sees no CUDA device."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    """Where the small (CPU-interpretable) kernel tests run."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
