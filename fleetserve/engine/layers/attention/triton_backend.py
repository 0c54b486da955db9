"""The Triton attention backend: our own paged-attention kernels behind `AttentionBackend`.

One `reshape_and_cache` launch writes the step's K/V, one `paged_attention` launch attends for the
whole mixed batch (prefill chunks and decodes together; split-KV for long decodes). It runs on a
CUDA device, or on the CPU inside Triton's interpreter (`TRITON_INTERPRET=1`), which exists for
tests: it is far slower than the torch backend, so 'auto' never picks it for a CPU model
(`auto_selectable`); naming it explicitly still works there.
"""

from __future__ import annotations

import importlib.util

import torch

from fleetserve.engine.layers.attention.base import AttentionBackend, CudaGraphSupport
from fleetserve.engine.layers.attention.metadata import AttentionMetadata
from fleetserve.kernels import is_interpreter


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with the kernels of `fleetserve.kernels` (GQA, varlen, any block size)."""

    name = "triton"
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    supported_head_sizes: tuple[int, ...] | None = (32, 64, 128)
    # NOTE: the kernel gathers every key position through the block table on its own, so any
    # block size works (block size and kernel tile are independent).
    supported_block_sizes: tuple[int, ...] | None = None
    # NOTE: both launches read lengths from device tensors; the grid depends only on the padded
    # batch and on max_seq_len, which graph capture fixes at max_model_len (the kernel stops at
    # each row's own length, so empty splits cost a launch slot, not work).
    cuda_graph_support = CudaGraphSupport.UNIFORM_DECODE

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_size)
        # NOTE: imported here, not at module level: Triton decides between compiling and
        # interpreting when a kernel is decorated, so the kernel modules must be imported only
        # once TRITON_INTERPRET has its final value (tests set it late).
        from fleetserve.kernels.paged_attention import paged_attention
        from fleetserve.kernels.reshape_and_cache import reshape_and_cache

        self._paged_attention = paged_attention
        self._reshape_and_cache = reshape_and_cache

    @classmethod
    def is_available(cls) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed"
        if not torch.cuda.is_available() and not is_interpreter():
            return "triton needs a CUDA device, or TRITON_INTERPRET=1 to run in the CPU interpreter"
        return None

    @classmethod
    def validate_device(cls, device: torch.device) -> str | None:
        if device.type == "cpu" and not is_interpreter():
            return "triton runs on device 'cpu' only in the interpreter (set TRITON_INTERPRET=1)"
        if device.type not in ("cpu", "cuda"):
            return (
                f"triton cannot run on device {device.type!r} (only 'cuda', or 'cpu' interpreted)"
            )
        return None

    @classmethod
    def auto_selectable(cls, device: torch.device) -> str | None:
        if device.type == "cpu":
            return (
                "on the CPU triton runs in the interpreter, far slower than torch; "
                "request attention_backend='triton' explicitly to use it"
            )
        return None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._reshape_and_cache(key, value, kv_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return self._paged_attention(
            query,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            metadata.max_query_len,
            scale,
            max_seq_len=metadata.max_seq_len,
        )
