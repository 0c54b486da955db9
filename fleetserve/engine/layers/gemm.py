"""Dense GEMM for the linear layers and the LM head: `F.linear`, or oneDNN's on the CPU.

On x86 CPUs torch's float32 `F.linear` calls MKL's sgemm, which on this project's AMD EPYC
machines runs its AVX2 code path: about 210 GFLOP/s on 2 cores, where oneDNN's AVX-512 brgemm
(`torch.ops.mkldnn._linear_pointwise`, what Inductor's CPU lowering and vLLM's CPU backend call)
reaches about 490. oneDNN computes in float32 at full precision (no bf16 or TF32
down-conversion); its results differ from MKL's only in summation order.

After loading, `DenseGemm.prepack` reorders the weight once into oneDNN's blocked layout: at
decode batch sizes oneDNN otherwise re-blocks the plain [out, in] weight on every call (the
GEMMs of a batch-16 SmolLM2 decode step took 34 ms a step that way, 21 ms prepacked).
The packed copy is held beside the plain weight (the weight's memory twice on the CPU): the
plain one stays the parameter that checkpoints, LoRA and the MoE shared expert read. Only the
loader rewrites weights, and it prepacks after it has written them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DenseGemm", "onednn_linear"]

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x Wᵀ + b through oneDNN (CPU tensors of one dtype, float32 or bfloat16; `weight` plain
    [out, in] or prepacked by `torch.ops.mkldnn._reorder_linear_weight`)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class DenseGemm:
    """x Wᵀ + b for one layer's weight of `dtype` on `device`: oneDNN on a CPU torch was built
    with it (float32, bfloat16), `F.linear` everywhere else (CUDA: cuBLAS). Chosen once per layer,
    so every layer of an engine computes the same way."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.uses_onednn = (
            device.type == "cpu"
            and dtype in _ONEDNN_DTYPES
            and torch.backends.mkldnn.is_available()
        )
        self._packed: torch.Tensor | None = None

    @property
    def prepacked(self) -> bool:
        return self._packed is not None

    def prepack(self, weight: torch.Tensor) -> None:
        """Reorder `weight` for oneDNN (no-op elsewhere); later calls must pass this weight,
        unchanged since."""
        if self.uses_onednn:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self._packed is not None:
            return onednn_linear(x, self._packed, bias)
        if self.uses_onednn:
            return onednn_linear(x, weight, bias)
        return F.linear(x, weight, bias)
