"""The `Attention` layer: the module models call, between them and an attention backend.

It carries its layer name (its qualified module name, e.g. "model.layers.3.self_attn.attn") and
holds the backend instance. Per step it takes its KV cache and the metadata from the forward
context and calls the backend's CUDA-graph-safe `forward` (write K/V, then attend); the context's
per-layer KV hooks, when set, run here, around that call and outside the backend (see
`fleetserve.engine.layers.forward_context` for why such steps run eagerly).
"""

from __future__ import annotations

import torch
from torch import nn

from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.forward_context import ForwardContext


class Attention(nn.Module):
    """Paged attention of one decoder layer (no parameters: the projections are the model's).

    Args:
        num_heads, num_kv_heads, head_size: the layer's query/KV head layout (GQA when they differ).
        backend_cls: the attention backend chosen for the model; one instance per layer.
        layer_name: this module's qualified name in the model (`attention_layers` checks it).
        scale: softmax scale; head_size ** -0.5 when None.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        *,
        backend_cls: type[AttentionBackend],
        layer_name: str,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = head_size**-0.5 if scale is None else scale
        self.impl: AttentionBackend = backend_cls(num_heads, num_kv_heads, head_size)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        context: ForwardContext,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] (rotated) → attention output [T, H, D]."""
        kv_cache = context.kv_caches[self.layer_name]
        hooks = context.kv_hooks
        if hooks is not None:
            hooks.wait_for_layer_load(self.layer_name)
        output = self.impl.forward(query, key, value, kv_cache, context.attn_metadata, self.scale)
        if hooks is not None:
            hooks.save_kv_layer(self.layer_name, kv_cache, context.attn_metadata)
        return output

    def extra_repr(self) -> str:
        return f"layer_name={self.layer_name!r}, backend={self.impl.name!r}"


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers in forward order (module registration order).

    Raises:
        ValueError: a layer's `layer_name` is not its qualified module name (the name the KV
            caches and the connector key it by would then disagree with the model's own).
    """
    layers: list[Attention] = []
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            if module.layer_name != name:
                raise ValueError(
                    f"Attention layer_name must be its module name {name!r}, "
                    f"got {module.layer_name!r}"
                )
            layers.append(module)
    return layers
