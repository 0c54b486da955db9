"""Paged attention, one module per responsibility.

- `metadata`: `AttentionMetadata`, one per step, shared by every layer (and its builder).
- `base`: the `AttentionBackend` interface (capabilities, validation, the write-then-attend
  template method) and `CudaGraphSupport`.
- `torch_backend`, `triton_backend`, `flash_backend`: the implementations.
- `selector`: the registry and `select_attention_backend`; the only importer of the backends.
- `layer`: the `Attention` module models call; it holds a backend instance per layer.

Imports point one way: selector → backends → base → metadata. This package re-exports nothing,
so importing any one module never drags in the others.
"""
