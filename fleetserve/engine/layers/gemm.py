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

oneDNN builds (and torch's ideep layer caches, 1024 entries each) one primitive per input shape,
about 0.6 MiB and 0.3-3 ms apiece: a token count it has not seen costs a primitive, and a serving
engine sees every count up to its token budget (an engine core grew by hundreds of MiB that way
under a soak). So the rows go to oneDNN padded to a bucket (`onednn_rows`: exact up to
`EXACT_ROWS`, then four buckets an octave, at most 25% padding): the primitives are bounded by
the buckets up to the budget, and `warm_up_gemms` builds those up to `WARM_UP_MAX_ROWS` at start-up
(a larger bucket is built when first used, a few ms beside a GEMM that long). Rows are computed
independently, so the padding changes no real row; it costs little at decode sizes (the weight
read dominates) and nothing at a full chunked-prefill budget (a bucket).

Decode steps are the exception. GEMMs of at most `SMALL_GEMM_MAX_ROWS[dtype]` rows run a
small-row kernel that streams its own packing of the weight while it computes: in float32 on a
CPU with AVX-512 or AVX2 `fleetserve/kernels/cpu/small_gemm.cpp`, in bfloat16 on one with AMX-BF16
`small_gemm_bf16.cpp` (oneDNN's kernels leave the memory idle while they compute: a batch-32
SmolLM2 decode step's GEMMs took 53 ms with oneDNN, 38 ms with it in float32, and 21.4 against
12.4 ms in bfloat16). Its packed copy takes the place of oneDNN's, so the weights still take
twice their size, and oneDNN then computes longer steps from the plain weight, re-blocking it
per call (in float32 3.6-7% slower than prepacked at 512-2048 rows, in bfloat16 1-4%; the
bfloat16 kernel takes steps up to 256 rows, where re-blocking cost 40-50%).
`FLEETSERVE_CPU_SMALL_GEMM=0` keeps oneDNN prepacked for every row count.

At start-up `gather_small_panels` moves every packed copy into one mapping on transparent huge
pages (`fleetserve.engine.layers.huge_pages`): a decode step streams all of them, and on 4 KiB
pages it paid a page walk every 4 KiB of the stream (batch-1 steps 3-5% slower).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from fleetserve.engine.layers.huge_pages import huge_page_bytes, huge_page_views, thp_mode
from fleetserve.envs import read_env
from fleetserve.kernels.cpu.ops import amx_gemm_supported, small_gemm_supported

__all__ = [
    "DenseGemm",
    "gather_small_panels",
    "onednn_linear",
    "onednn_rows",
    "onednn_supports",
    "small_gemm_pack",
    "small_linear",
    "warm_up_gemms",
]

logger = logging.getLogger(__name__)

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
EXACT_ROWS = 16
"""Row counts up to this go to oneDNN as they are (decode batches: one primitive each)."""
GATHER_RELEASE_BYTES = 256 << 20
"""`gather_small_panels` gives freed originals back to the OS after this many bytes of them:
those from the heap stay resident otherwise (`cpu_malloc`'s trim threshold), and a model's
packed weights twice over could exceed the machine's memory."""
WARM_UP_MAX_ROWS = 512
"""`warm_up_gemms` builds the buckets up to this many rows. The warm-up computes each bucket's GEMM
once: for a 7B model's four layer shapes, every bucket up to a 2048-token budget is about 5 TFLOP
(10 s on 2 cores), up to 512 about 1.4; above 512 rows building a primitive (at most 3.6 ms seen)
is small beside the step's own GEMMs."""
SMALL_GEMM_MAX_ROWS = {torch.float32: 96, torch.bfloat16: 256}
"""GEMMs of at most this many rows run the small-row kernel of their dtype where it is available.

Bfloat16 (AMX), `fleetserve bench gemm --dtype bfloat16` on SmolLM2's shapes (a step's 121
GEMMs, weights from memory) on the Intel box, the kernel / oneDNN prepacked / oneDNN on the plain
weight (which takes the longer steps once the kernel's packing replaces oneDNN's): 1 row 11.5 /
16.7 / 21.9 ms, 16 rows 11.1 / 20.0 / 26.2, 32 rows 12.4 / 21.4 / 29.7, 96 rows 21.5 / 32.0 /
36.7, 128 rows 27.3 / 38.6 / 38.8, 256 rows 49.3 / 43.7 / 59.4, 512 rows 111.9 / 98.7 / 89.1: the
kernel beats the plain weight up to 256 rows.

Float32:
`fleetserve bench gemm` on SmolLM2's shapes (a step's 121 GEMMs, weights from memory), oneDNN
prepacked against the kernel, on the Intel box: 1 row 28.0 / 22.0 ms, 16 rows 40.8 / 27.9,
32 rows 54.0 / 38.7, 64 rows 84.5 / 68.5, 128 rows 133.8 / 130.9. With the weights in cache the
kernel's simple blocking loses sooner: level with oneDNN prepacked at 65 rows, 5% behind oneDNN
on the plain weight at 128, 1.3-1.4x slower at 512-2048."""


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs `dtype` on this CPU: float32 wherever torch has oneDNN;
    bfloat16 only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT. Without them (AVX2 CPUs such as
    AMD's Zen 2 and 3) oneDNN refuses to reorder a bfloat16 weight, so `F.linear` computes it."""
    if dtype not in _ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_rows(rows: int) -> int:
    """The bucket `rows` is padded to: `rows` itself up to `EXACT_ROWS`, above it the next of
    four evenly spaced sizes an octave (16, 20, 24, 28, 32, 40, ..., 2048, 2560, ...)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def onednn_buckets(max_rows: int) -> list[int]:
    """Every bucket a row count up to `max_rows` is padded to, ascending."""
    return sorted({onednn_rows(r) for r in range(1, max_rows + 1)})


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x Wᵀ + b through oneDNN (CPU tensors of one dtype, float32 or bfloat16; `weight` plain
    [out, in] or prepacked by `torch.ops.mkldnn._reorder_linear_weight`), the rows padded to
    their bucket (`onednn_rows`) and the padding dropped from the result."""
    in_features = x.shape[-1]
    flat = x.reshape(-1, in_features)
    rows = flat.shape[0]
    padded = onednn_rows(rows)
    if padded != rows:
        buffer = flat.new_empty((padded, in_features))
        buffer[:rows].copy_(flat)
        buffer[rows:].zero_()
        flat = buffer
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


def small_gemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] packed for `small_linear` in its dtype's layout (float32, or bfloat16
    for AMX tiles where they run, else in float32's layout)."""
    if weight.dtype == torch.bfloat16 and amx_gemm_supported():
        packed: torch.Tensor = torch.ops.fleetserve_cpu.small_gemm_bf16_pack(weight)
    else:
        packed = torch.ops.fleetserve_cpu.small_gemm_pack(weight)
    return packed


def small_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x Wᵀ + b through the small-row kernel of x's dtype (CPU tensors; `packed` from
    `small_gemm_pack(W)`): in float32 every output is one FMA chain over the input features in
    order, in bfloat16 one chain of AMX steps of 32 features, each rounded to bfloat16 once. Either
    way a row's result does not depend on the rows beside it."""
    # A step's activations are already [tokens, features] rows: those skip the reshape and the
    # view back, which cost about 8 us a call from Python (a decode step makes 121 of these calls;
    # the kernel itself takes about 10 us on a cache-resident 128 x 576 weight).
    rows = x.dim() == 2
    flat = x if rows else x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if packed.dim() == 4:  # AMX tiles' layout
        out = torch.ops.fleetserve_cpu.small_gemm_bf16(flat, packed, out_features, bias)
    else:
        out = torch.ops.fleetserve_cpu.small_gemm(flat, packed, out_features, bias)
    return out if rows else out.view(*x.shape[:-1], out_features)


class DenseGemm:
    """x Wᵀ + b for one layer's weight of `dtype` on `device`: on a CPU torch was built with
    oneDNN for (float32, bfloat16), oneDNN, and the small-row kernel of the dtype for up to
    `SMALL_GEMM_MAX_ROWS[dtype]` rows where it runs; `F.linear` everywhere else (CUDA: cuBLAS).
    Chosen once per layer, so every layer of an engine computes the same way."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.uses_onednn = device.type == "cpu" and onednn_supports(dtype)
        self.uses_small_gemm = (
            device.type == "cpu"
            and read_env().cpu_small_gemm != 0
            and small_gemm_supported(dtype)
            and (self.uses_onednn or dtype == torch.bfloat16)
        )
        self.small_max_rows = SMALL_GEMM_MAX_ROWS.get(dtype, 0) if self.uses_onednn else sys.maxsize
        """The most rows the small-row kernel takes (more go to oneDNN). Every row count where
        oneDNN cannot run the dtype (bfloat16 on AVX2: the kernel against torch's fallback)."""
        self._packed: torch.Tensor | None = None
        """oneDNN's blocked weight (without the small-row kernel)."""
        self._small: torch.Tensor | None = None
        """The small-row kernel's panels (with it; oneDNN then takes the plain weight)."""
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None

    @property
    def slow_bf16(self) -> bool:
        """Bfloat16 on a CPU where neither oneDNN nor the kernel runs it: `F.linear` is 3-4x
        slower than in float32 there (an AVX2 EPYC: 32 rows 6.0 against 1.7 ms, 2048 rows 317
        against 75)."""
        return (
            self.device.type == "cpu"
            and self.dtype == torch.bfloat16
            and not (self.uses_onednn or self.uses_small_gemm)
        )

    @property
    def prepacked(self) -> bool:
        return self._packed is not None or self._small is not None

    def prepack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Pack `weight` for the small-row kernel or reorder it for oneDNN (no-op elsewhere);
        later calls must pass this weight, unchanged since (and `bias`, which `warm_up`
        computes with)."""
        if not (self.uses_onednn or self.uses_small_gemm):
            return
        self._weight = weight.detach()
        self._bias = None if bias is None else bias.detach()
        if self.uses_small_gemm:
            self._small = small_gemm_pack(self._weight)
        elif self.uses_onednn:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self._weight)

    def _onednn_weight(self) -> torch.Tensor | None:
        if not self.uses_onednn:
            return None
        return self._packed if self._packed is not None else self._weight

    def warm_key(self) -> tuple[object, ...] | None:
        """What oneDNN's primitives for this GEMM depend on (None: not prepacked)."""
        weight = self._onednn_weight()
        if weight is None:
            return None
        return (tuple(weight.shape), weight.dtype, self._packed is not None, self._bias is not None)

    def warm_up(self, max_rows: int) -> None:
        """Build oneDNN's primitive of every bucket up to `max_rows` rows that goes to oneDNN
        (prepacked GEMMs only)."""
        weight = self._onednn_weight()
        if weight is None:
            return
        smallest = self.small_max_rows + 1 if self._small is not None else 1
        for rows in onednn_buckets(max_rows):
            if rows >= smallest:
                x = torch.zeros(rows, weight.shape[1], dtype=weight.dtype)
                onednn_linear(x, weight, self._bias)

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self._small is not None and x.numel() <= self.small_max_rows * x.shape[-1]:
            return small_linear(x, self._small, weight.shape[0], bias)
        if self._packed is not None:
            return onednn_linear(x, self._packed, bias)
        if self.uses_onednn:
            return onednn_linear(x, weight, bias)
        return F.linear(x, weight, bias)


def warm_up_gemms(gemms: Iterable[tuple[DenseGemm, int]]) -> int:
    """Build the oneDNN primitives of every bucket of each distinct prepacked GEMM shape, each
    up to its row count (at most `WARM_UP_MAX_ROWS`), once (layers of one shape share
    primitives), so that no decode or short step pays for one and the engine's memory holds
    them from the start. Returns the shapes warmed."""
    largest: dict[tuple[object, ...], tuple[DenseGemm, int]] = {}
    gemms = list(gemms)
    if any(gemm.slow_bf16 for gemm, _ in gemms):
        logger.warning(
            "bfloat16 on a CPU without AVX-512 or AVX-NE-CONVERT: oneDNN cannot compute it, and "
            "torch's fallback GEMMs are 3-4x slower than float32 here; --dtype float32 is faster"
        )
    for gemm, wanted in gemms:
        max_rows = min(wanted, WARM_UP_MAX_ROWS)
        key = gemm.warm_key()
        if key is not None and (key not in largest or largest[key][1] < max_rows):
            largest[key] = (gemm, max_rows)
    start = time.perf_counter()
    with torch.inference_mode():
        for gemm, max_rows in largest.values():
            gemm.warm_up(max_rows)
    if largest:
        logger.info(
            "oneDNN GEMMs: %d shapes warmed for their row buckets in %.2f s",
            len(largest),
            time.perf_counter() - start,
        )
    return len(largest)


def gather_small_panels(
    gemms: Iterable[DenseGemm], release: Callable[[], object] | None = None
) -> int:
    """Move the small-row kernel's packed weights of `gemms` into one mapping on transparent huge
    pages (`fleetserve.engine.layers.huge_pages`), from which decode steps stream them with
    fewer page walks. The copies hold the same values, so every product stays the same bits.
    Each original is freed as soon as it is copied, and `release` (which gives freed memory back
    to the OS, e.g. `cpu_malloc.release_free_heap`) runs after every `GATHER_RELEASE_BYTES` of
    them and at the end, so memory peaks at the packed weights and that much more. Returns the
    bytes moved: 0 where the kernel gives no huge pages (then nothing moves)."""
    owners = [gemm for gemm in dict.fromkeys(gemms) if gemm._small is not None]
    mode = thp_mode()
    if not owners or mode not in ("always", "madvise"):
        return 0
    layouts = []
    for gemm in owners:
        assert gemm._small is not None
        layouts.append((gemm._small.shape, gemm._small.dtype))
    views = huge_page_views(layouts)
    unreleased = 0
    for gemm, view in zip(owners, views, strict=True):
        assert gemm._small is not None
        view.copy_(gemm._small)
        gemm._small = view  # the original's last reference
        unreleased += view.nbytes
        if release is not None and unreleased >= GATHER_RELEASE_BYTES:
            release()
            unreleased = 0
    if release is not None and unreleased:
        release()
    moved = sum(view.nbytes for view in views)
    logger.info(
        "small-row GEMMs: %d packed weights (%d MiB) gathered for huge pages, %d MiB on them "
        "(transparent huge pages: %s)",
        len(views),
        moved >> 20,
        huge_page_bytes(views[0]) >> 20,
        mode,
    )
    return moved
