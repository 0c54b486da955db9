"""Backend selection: the registry of known backends and the choice for one model.

The selector is the only module that imports the concrete backends; the backends import only
`base` and `metadata`, never this module, so adding a backend means one import and one list
entry here and no change to the model code.
"""

from __future__ import annotations

import logging

import torch

from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.attention.cpu_backend import CpuPagedAttentionBackend
from fleetserve.engine.layers.attention.flash_backend import FlashAttentionBackend
from fleetserve.engine.layers.attention.torch_backend import TorchAttentionBackend
from fleetserve.engine.layers.attention.triton_backend import TritonAttentionBackend

logger = logging.getLogger(__name__)


def attention_backend_registry() -> dict[str, type[AttentionBackend]]:
    """Known backends, best first ('auto' tries them in this order).

    Each backend guards its own optional imports in `is_available`, so listing one here never
    requires its libraries.
    """
    kernels: list[type[AttentionBackend]] = [FlashAttentionBackend, TritonAttentionBackend]
    # NOTE: without CUDA the kernels run only in Triton's interpreter, far slower than torch:
    # the fused C++ kernel and then torch are the best there, so they go first (and the Triton
    # kernels decline 'auto' on the CPU). The C++ kernel declines CUDA devices itself.
    cpu: list[type[AttentionBackend]] = [CpuPagedAttentionBackend, TorchAttentionBackend]
    ordered = [*kernels, *cpu] if torch.cuda.is_available() else [*cpu, *kernels]
    return {backend.name: backend for backend in ordered}


def select_attention_backend(
    requested: str,
    head_size: int,
    dtype: torch.dtype,
    block_size: int,
    device: torch.device,
) -> type[AttentionBackend]:
    """Pick the backend for a model.

    Args:
        requested: 'auto' or a backend name from the registry.

    Raises:
        ValueError: unknown name, or the requested backend cannot serve the configuration
            (the message carries the backend's reason), or no backend can serve it under 'auto'.
    """
    registry = attention_backend_registry()
    if requested != "auto":
        if requested not in registry:
            allowed = ["auto", *registry]
            raise ValueError(f"attention_backend must be one of {allowed}, got {requested!r}")
        reason = registry[requested].validate_configuration(head_size, dtype, block_size, device)
        if reason is not None:
            raise ValueError(f"attention_backend {requested!r} cannot serve this model: {reason}")
        return registry[requested]
    reasons: list[str] = []
    for name, backend in registry.items():
        reason = backend.validate_configuration(head_size, dtype, block_size, device)
        if reason is None:
            reason = backend.auto_selectable(device)
        if reason is None:
            return backend
        logger.info("attention backend %r skipped: %s", name, reason)
        reasons.append(f"{name}: {reason}")
    raise ValueError(f"no attention backend can serve this model ({'; '.join(reasons)})")
