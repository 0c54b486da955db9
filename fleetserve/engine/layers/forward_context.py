"""The per-step forward context: what every layer of one forward pass shares.

The model runner builds one `ForwardContext` per step (and one per captured CUDA graph) and hands
it explicitly down the model: `model(input_ids, positions, context)` → each decoder layer → its
`Attention` layer, which looks up its own KV cache by layer name and reads the step's attention
metadata. Nothing lives in module-level state, so two engines in one process (or a test next to
an engine) never see each other's steps. MoE layers will record their expert load here too.

Per-layer KV hooks (`kv_hooks`) are the KV connector's worker side: `wait_for_layer_load` runs
before a layer's attention reads its cache, `save_kv_layer` after the layer's K/V were written.
They are None by default: nothing is called and the cost is one `is None` test per layer.

Rule: a step whose context carries hooks runs eagerly (no CUDA graph replay). Hooks are host-side
calls; a replayed graph repeats only the recorded device work and would silently skip them. The
runner therefore never pads or replays a step with hooks, and capture records with hooks=None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from fleetserve.engine.layers.attention.metadata import AttentionMetadata


class KVLayerHooks(Protocol):
    """What the `Attention` layer calls around its backend, once per layer per step."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this layer's externally loaded K/V is in its cache (before attention).

        Args:
            layer_name: the attention layer's qualified module name, e.g.
                "model.layers.3.self_attn.attn".
        """
        ...

    def save_kv_layer(
        self, layer_name: str, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        """Start saving this layer's K/V (this step's tokens are written); may return before the
        save completes.

        Args:
            layer_name: as for `wait_for_layer_load`.
            kv_cache: the layer's [2, num_blocks, block_size, num_kv_heads, head_size] cache.
            attn_metadata: the step's metadata (its slot mapping says where this step wrote).
        """
        ...


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """One step's shared forward state (see the module docstring)."""

    attn_metadata: AttentionMetadata
    kv_caches: Mapping[str, torch.Tensor]
    """Attention layer name → that layer's KV cache (the runner's tensors, never copied)."""
    kv_hooks: KVLayerHooks | None = None
    """Per-layer KV connector hooks; None = none (and a step with hooks runs eagerly)."""
