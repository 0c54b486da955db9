"""fleetserve: disaggregated LLM inference on Kubernetes.

`LLM` and `SamplingParams` are imported lazily so that the operator and the router, which never
load torch, can import the package cheaply.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fleetserve.common.cpu_threads import apply_threading_env, read_cpu_budget

# NOTE: torch's OpenMP workers spin while waiting by default. On a shared or CPU-limited node
# (a Kubernetes pod under a CFS quota, a 2-core CI box running other processes) spinning burns
# the quota and small matmuls become 10-100x slower; measured here: a tiny-model generate took
# 18.6 s with spinning and 1.4 s with passive waiting under load. The price of passive waiting on
# an idle machine with dedicated cores: SmolLM2 decode steps ~25% slower (0.48 vs 0.37 s at batch
# 64). So the policy follows what this process has (`common.cpu_threads`: quota, affinity,
# load), spinning only briefly when it spins. libgomp reads this once, when torch loads, so it
# must be set before torch is imported; a user's own setting wins, and a child process chooses
# again rather than inherit its parent's choice.
apply_threading_env(os.environ, read_cpu_budget())

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from fleetserve.engine.llm import LLM
    from fleetserve.engine.request_output import RequestOutput
    from fleetserve.engine.sampling_params import SamplingParams

_LAZY = {
    "LLM": "fleetserve.engine.llm",
    "RequestOutput": "fleetserve.engine.request_output",
    "SamplingParams": "fleetserve.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fleetserve' has no attribute {name!r}")
