"""This machine's roofline, measured in the run that uses it: a bandwidth and a GEMM-rate probe.

A decode step must read every weight once (memory-bound at small batches) and do two FLOPs per
weight per token (compute-bound at large ones), so its fastest possible time is
max(weight bytes / bandwidth, 2 · weights · batch / GEMM rate). Both rates are measured here, on
the device and dtype of the engine, with the best of a few repetitions (the box is shared: the
best is the closest to what the hardware can do).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fleetserve.engine.layers.gemm import (
    onednn_linear,
    onednn_supports,
    small_gemm_pack,
    small_linear,
)
from fleetserve.kernels.cpu.ops import small_gemm_supported


@dataclass(frozen=True, slots=True)
class Roofline:
    bandwidth_gb_s: float
    """Copy bandwidth (bytes read + written per second), 1e9 units."""
    gemm_gflop_s: float
    """Square-matmul rate in the engine's dtype, 1e9 FLOP/s: the faster of torch's `mm` and, on
    the CPU, oneDNN with the weight prepacked (`fleetserve.engine.layers.gemm`); where oneDNN
    cannot compute the dtype and the small-row kernel can (bfloat16 on AVX2), that kernel."""

    def step_seconds(self, weight_bytes: int, weight_count: int, tokens: int) -> float:
        """The fastest possible step that reads `weight_bytes` once and multiplies `tokens` rows
        through `weight_count` weights."""
        read = weight_bytes / (self.bandwidth_gb_s * 1e9)
        compute = 2 * weight_count * tokens / (self.gemm_gflop_s * 1e9)
        return max(read, compute)

    def serving_seconds(
        self,
        weight_bytes: int,
        weight_count: int,
        tokens: int,
        num_requests: int,
        concurrency: int,
        output_len: int,
    ) -> float:
        """The fastest possible time to serve `num_requests` requests of `output_len` tokens at
        most `concurrency` at a time, `tokens` prompt + output tokens in all: every token
        multiplies through the weights once (GEMM-bound), and each of at least
        ceil(num_requests / concurrency) × (output_len - 1) decode steps reads every weight
        (bandwidth-bound; the first output token comes from the prefill). Attention is not
        counted, so this bound is below what any engine can reach."""
        gemm = 2 * weight_count * tokens / (self.gemm_gflop_s * 1e9)
        waves = -(-num_requests // concurrency)
        steps = waves * max(output_len - 1, 0)
        read = steps * weight_bytes / (self.bandwidth_gb_s * 1e9)
        return max(gemm, read)

    def describe(self) -> str:
        return (
            f"roofline probes: copy bandwidth {self.bandwidth_gb_s:.1f} GB/s, "
            f"GEMM {self.gemm_gflop_s:.1f} GFLOP/s"
        )


def _best_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_roofline(
    device: torch.device, dtype: torch.dtype = torch.float32, reps: int = 5
) -> Roofline:
    """Bandwidth of a 256 MiB copy (far past the caches) and the rate of a square matmul
    (1024 on the CPU, 8192 on a GPU) in `dtype`, by whichever GEMM library is faster here (the
    roofline is what the machine can do, not what one library reaches)."""
    numel = 64 << 20  # 64 Mi fp32 = 256 MiB
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), device, reps)
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    if device.type == "cpu" and not onednn_supports(dtype) and small_gemm_supported(dtype):
        # bfloat16 on AVX2: the FMA kernel widening bfloat16 is what computes it. Torch's matmul
        # there is its fallback GEMM (under 1 GFLOP/s on an AVX2 EPYC, 2.4 s a repetition), no
        # measure of the machine, so it is not timed.
        panels = small_gemm_pack(b)
        mm_s = _best_seconds(lambda: small_linear(a, panels, n), device, reps)
    else:
        mm_s = _best_seconds(lambda: a @ b, device, reps)
    if device.type == "cpu" and onednn_supports(dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(b)
        mm_s = min(mm_s, _best_seconds(lambda: onednn_linear(a, packed), device, reps))
    return Roofline(bandwidth_gb_s=2 * numel * 4 / copy_s / 1e9, gemm_gflop_s=2 * n**3 / mm_s / 1e9)
