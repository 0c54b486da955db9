"""The KV compatibility hash: prefill and decode pods may be paired only when theirs match.

Each role's pods carry their role's hash as a label. It covers what a pod will really run, so
`dtype: auto` is resolved per role: on a CPU role (gpusPerPod 0) the engine runs float32; on a GPU
role it runs the checkpoint's bf16/fp16, which only the engine can see, so it is hashed as "auto"
on "cuda" (the engines' own handshake compares the fully resolved values).
"""

from __future__ import annotations

import hashlib
import json

from fleetserve.api.models import InferenceDeploymentSpec, Role

__all__ = ["compatibility_hash", "resolved_dtype", "role_compatibility_hashes"]


def resolved_dtype(dtype: str, role: Role) -> str:
    """The KV dtype a role's pods run, as far as the spec decides it.

    `auto` is float32 on a CPU role and "auto@cuda" (the checkpoint's dtype, on CUDA) on a GPU
    role; an explicit dtype is itself.
    """
    if dtype != "auto":
        return dtype
    return "float32" if role.gpus_per_pod == 0 else "auto@cuda"


def _hash(spec: InferenceDeploymentSpec, role: Role) -> str:
    """16 hex chars over model source, resolved dtype, block size, KV layout, connector, transfer
    mode, engine.

    Parallel sizes are excluded: the connector maps KV head slices between TP sizes (pull mode;
    the CRD's rules refuse the other combinations, the engines' handshake a head layout that
    does not map).
    """
    key = {
        "model": spec.model.source.uri,
        "dtype": resolved_dtype(spec.model.dtype, role),
        "block_size": spec.model.block_size,
        "kv_layout": "paged-v1",
        "connector": spec.kv_transfer.connector,
        "protocol": spec.kv_transfer.protocol,
        "transfer_mode": spec.kv_transfer.transfer_mode,
        "engine": spec.engine.version,
        "image": spec.engine.image,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def role_compatibility_hashes(spec: InferenceDeploymentSpec) -> dict[str, str]:
    """Role name → the hash its pods carry, for every role present."""
    return {name: _hash(spec, role) for name, role in spec.roles.items()}


def compatibility_hash(spec: InferenceDeploymentSpec) -> str:
    """The hash every role shares (what the router pairs by).

    Raises:
        ValueError: the roles resolve to different KV formats, so the router could never pair
            them; the message names the roles and the fix.
    """
    hashes = role_compatibility_hashes(spec)
    if len(set(hashes.values())) == 1:
        return next(iter(hashes.values()))
    dtypes = {name: resolved_dtype(spec.model.dtype, role) for name, role in spec.roles.items()}
    detail = ", ".join(f"roles.{name} runs {dtype}" for name, dtype in dtypes.items())
    raise ValueError(
        f"the roles' KV compatibility hashes differ, so no prefill pod could hand its KV cache to a"
        f" decode pod ({detail}; model.dtype auto is float32 on a CPU role, gpusPerPod 0, and the"
        f" checkpoint's dtype on a GPU role): set model.dtype explicitly, or give the roles"
        f" matching devices (all gpusPerPod 0, or all > 0)"
    )
