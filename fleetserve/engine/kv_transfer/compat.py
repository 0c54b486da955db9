"""The KV compatibility hash of an engine: two engines may exchange KV blocks only when theirs
are equal. It covers everything that changes what a block's bytes mean, from resolved values
(never the literal "auto"):

- the model: its config.json (canonical JSON) and a fingerprint of its weights (the size and the
  first and last MiB of every safetensors file: cheap, and different fine-tunes of one
  architecture differ there), and the weight source (checkpoint or seeded dummy weights);
- the KV layout: dtype, block size, layers, KV heads, head size, the layout name;
- the connector, its transfer mode (push and pull engines never pair) and the engine version.

Parallel sizes are not in it: the connector works block by block and maps the KV heads between
ranks of different tensor-parallel sizes (`head_map`); a pair whose heads do not map is refused
by the handshake, which compares the layouts themselves.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fleetserve.engine.config import EngineConfig

__all__ = ["KV_LAYOUT", "compatibility_hash", "compatibility_key"]

KV_LAYOUT = "paged-v1:[2,num_blocks,block_size,num_kv_heads,head_size]"
_FINGERPRINT_BYTES = 1 << 20


def _weights_fingerprint(model_dir: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(_FINGERPRINT_BYTES))
            if size > 2 * _FINGERPRINT_BYTES:
                f.seek(size - _FINGERPRINT_BYTES)
                digest.update(f.read(_FINGERPRINT_BYTES))
    return digest.hexdigest()[:16]


def compatibility_key(config: EngineConfig, engine_version: str) -> dict[str, Any]:
    """What the hash covers, readable (the handshake error shows both sides' keys)."""
    from fleetserve.engine.models.arch import ModelArch

    arch = ModelArch.from_hf_config(config.model.hf_config)
    kv = config.kv_transfer
    return {
        "model_config": hashlib.sha256(
            json.dumps(config.model.hf_config, sort_keys=True).encode()
        ).hexdigest()[:16],
        "weights": (
            f"dummy:{config.model.seed}"
            if config.model.load_format == "dummy"
            else _weights_fingerprint(config.model.model)
        ),
        "dtype": config.model.dtype,
        "block_size": config.cache.block_size,
        "num_layers": arch.num_hidden_layers,
        "num_kv_heads": arch.num_key_value_heads,
        "head_size": arch.head_size,
        "kv_layout": KV_LAYOUT,
        "connector": kv.connector if kv is not None else None,
        "transfer_mode": kv.transfer_mode if kv is not None else None,
        "engine_version": engine_version,
    }


def compatibility_hash(config: EngineConfig, engine_version: str) -> str:
    """16 hex characters over `compatibility_key`."""
    key = compatibility_key(config, engine_version)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
