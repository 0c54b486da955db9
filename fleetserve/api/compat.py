"""The KV compatibility hash: prefill and decode pods may be paired only when theirs match."""

from __future__ import annotations

import hashlib
import json

from fleetserve.api.models import InferenceDeploymentSpec

__all__ = ["compatibility_hash"]


def compatibility_hash(spec: InferenceDeploymentSpec) -> str:
    """16 hex chars over model source, dtype, block size, KV layout, connector and engine version.

    Parallel sizes are excluded: the connector reshapes KV between TP sizes.
    """
    key = {
        "model": spec.model.source.uri,
        "dtype": spec.model.dtype,
        "block_size": spec.model.block_size,
        "kv_layout": "paged-v1",
        "connector": spec.kv_transfer.connector,
        "protocol": spec.kv_transfer.protocol,
        "engine": spec.engine.version,
        "image": spec.engine.image,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
