"""Tests here run the Triton backend and custom ops too: on the GPU when there is one, else in
Triton's CPU interpreter (see `tests.kernels.interpreter`)."""

from __future__ import annotations

from tests.kernels.interpreter import device, use_interpreter_without_cuda

__all__ = ["device"]

use_interpreter_without_cuda()
