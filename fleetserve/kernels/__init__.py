"""Triton kernels for the engine, each with a pure-torch reference in `reference.py`.

One module per kernel: `_<op>_kernel` (the `@triton.jit` function) and `<op>()` (the wrapper that
checks its inputs, allocates the output and launches). This package imports without a GPU and
without a working triton: the wrappers are resolved lazily on first attribute access, because
Triton chooses between compiling and interpreting (`TRITON_INTERPRET=1`) when a kernel module is
imported, and importers (tests) may set that variable after importing `fleetserve.kernels`.
"""

from __future__ import annotations

import importlib
import os
from types import MappingProxyType
from typing import Any

__all__ = [
    "fused_moe",
    "is_interpreter",
    "lora_delta_triton",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]

_MODULE_OF: MappingProxyType[str, str] = MappingProxyType(
    {
        "fused_moe": "fused_moe",
        "lora_delta_triton": "lora",
        "paged_attention": "paged_attention",
        "reshape_and_cache": "reshape_and_cache",
        "rms_norm": "rms_norm",
        "rotary_embedding": "rotary",
        "silu_and_mul": "silu_and_mul",
    }
)


def is_interpreter() -> bool:
    """Whether Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_MODULE_OF[name]}")
    return getattr(module, name)
