"""The `Attention` layer: named like its module, and the seam for per-layer KV hooks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.layers.attention.cpu_backend import CpuPagedAttentionBackend
from fleetserve.engine.layers.attention.layer import Attention, attention_layers
from fleetserve.engine.layers.attention.metadata import AttentionMetadata, build_attention_metadata
from fleetserve.engine.layers.attention.torch_backend import TorchAttentionBackend
from fleetserve.engine.layers.forward_context import ForwardContext, KVLayerHooks
from fleetserve.kernels.cpu.build import load_cpu_kernels
from tests.engine.tiny_models import TINY_CONFIG, load_engine_model

BLOCK_SIZE = 4
PROMPT = [5, 17, 300, 42, 9, 77, 128, 3, 250]
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(TINY_CONFIG["num_hidden_layers"])]


class RecordingHooks:
    """Records every hook call, and what the cache held at that moment."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.saved: list[tuple[torch.Tensor, AttentionMetadata, bool]] = []

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(
        self, layer_name: str, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        self.calls.append(("save_kv_layer", layer_name))
        slots = attn_metadata.slot_mapping[: attn_metadata.num_actual_tokens]
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        self.saved.append((kv_cache, attn_metadata, bool(flat[:, slots].ne(0).all())))


def _step(model: Any, hooks: KVLayerHooks | None) -> tuple[torch.Tensor, ForwardContext]:
    """One prefill of PROMPT on fresh caches; returns the logits and the context used."""
    attn = model.model.layers[0].self_attn
    shape = (2, 8, BLOCK_SIZE, attn.num_kv_heads, attn.head_size)
    kv_caches = {layer.layer_name: torch.zeros(shape) for layer in attention_layers(model)}
    block_ids = [3, 1, 6]
    positions = list(range(len(PROMPT)))
    slots = [block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
    metadata = build_attention_metadata(
        [len(PROMPT)],
        [len(PROMPT)],
        torch.tensor([block_ids], dtype=torch.int32),
        torch.tensor(slots, dtype=torch.int64),
        BLOCK_SIZE,
        torch.device("cpu"),
    )
    context = ForwardContext(metadata, kv_caches, kv_hooks=hooks)
    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), torch.tensor(positions), context)
        return model.compute_logits(hidden), context


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> Any:
    config = EngineConfig.create(
        str(tiny_llama_dir), dtype="float32", device="cpu", block_size=BLOCK_SIZE
    )
    return load_engine_model(config)


def test_attention_layers_are_named_by_their_module_path(model: Any) -> None:
    layers = attention_layers(model)
    assert [layer.layer_name for layer in layers] == LAYER_NAMES
    named = dict(model.named_modules())
    assert all(named[layer.layer_name] is layer for layer in layers)
    expected = CpuPagedAttentionBackend if load_cpu_kernels().available else TorchAttentionBackend
    assert all(type(layer.impl) is expected for layer in layers)  # 'auto' on the CPU


def test_hooks_run_once_per_layer_in_layer_order_around_the_backend(model: Any) -> None:
    hooks = RecordingHooks()
    logits, context = _step(model, hooks)
    assert hooks.calls == [
        (hook, name) for name in LAYER_NAMES for hook in ("wait_for_layer_load", "save_kv_layer")
    ]
    for name, (kv_cache, metadata, written) in zip(LAYER_NAMES, hooks.saved, strict=True):
        assert kv_cache is context.kv_caches[name]  # the layer's own cache, not a copy
        assert metadata is context.attn_metadata
        assert written, f"{name}: save_kv_layer ran before this step's K/V was in the cache"
    # Hooks observe; they change nothing the model computes.
    without, _ = _step(model, None)
    assert torch.equal(logits, without)


def test_a_misnamed_layer_is_refused() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention(
                4, 2, 32, backend_cls=TorchAttentionBackend, layer_name="model.layers.0.attn"
            )

    with pytest.raises(ValueError, match="layer_name must be its module name 'attn'"):
        attention_layers(Wrapper())
