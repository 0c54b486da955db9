"""fleetserve: disaggregated LLM inference on Kubernetes.

`LLM` and `SamplingParams` are imported lazily so that the operator and the router, which never
load torch, can import the package cheaply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from fleetserve.engine.llm import LLM
    from fleetserve.engine.outputs import RequestOutput
    from fleetserve.engine.sampling_params import SamplingParams

_LAZY = {
    "LLM": "fleetserve.engine.llm",
    "RequestOutput": "fleetserve.engine.outputs",
    "SamplingParams": "fleetserve.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fleetserve' has no attribute {name!r}")
