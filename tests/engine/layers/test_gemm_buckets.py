"""oneDNN's primitives are per input shape and cached (about 0.6 MiB each), so the CPU GEMM pads
its rows to a bounded set of buckets (`fleetserve.engine.layers.gemm.onednn_rows`): the padding
changes no real row, every row count up to a budget needs only the buckets' primitives (built
once by `warm_up_gemms`, shared by the layers of one shape), and a serving engine's memory stops
growing with the token counts it meets (what the soak measures)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from fleetserve.engine.layers.gemm import (
    EXACT_ROWS,
    WARM_UP_MAX_ROWS,
    DenseGemm,
    onednn_buckets,
    onednn_linear,
    onednn_rows,
    warm_up_gemms,
)

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


def test_buckets_are_exact_for_small_batches_and_at_most_a_quarter_larger_above() -> None:
    assert [onednn_rows(r) for r in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    assert [onednn_rows(r) for r in (17, 20, 21, 33, 64, 65, 2047, 2048, 2049)] == [
        20, 20, 24, 40, 64, 80, 2048, 2048, 2560,
    ]  # fmt: skip
    previous = 0
    for rows in range(1, 9000):
        bucket = onednn_rows(rows)
        assert rows <= bucket <= max(rows, int(rows * 1.25))
        assert bucket >= previous and onednn_rows(bucket) == bucket
        previous = bucket
    # Four an octave: the default token budget (2048) needs 44 primitives a GEMM shape.
    assert len(onednn_buckets(2048)) == 44
    assert onednn_buckets(40) == [*range(1, 17), 20, 24, 28, 32, 40]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _heap_in_use_mib() -> float:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return float(info.uordblks + info.hblkhd) / 2**20


@needs_onednn
def test_the_buckets_bound_the_heap_and_after_the_warm_up_no_row_count_grows_it() -> None:
    # A shape no other test uses, so its primitives are built here: 34 buckets' (about 20 MiB).
    # Unbucketed, each of the 300 row counts built its own: about 170 MiB.
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(40, 72, generator=gen), torch.randn(40, generator=gen)
    gemms = [DenseGemm(CPU, torch.float32) for _ in range(3)]
    for gemm in gemms:
        gemm.prepack(weight, bias)
    unpacked = DenseGemm(CPU, torch.float32)
    start = _heap_in_use_mib()
    assert warm_up_gemms([(g, 300) for g in gemms] + [(unpacked, 300)]) == 1
    before = _heap_in_use_mib()
    with torch.inference_mode():
        for rows in range(1, 301):
            x = torch.randn(rows, 72, generator=gen)
            out = gemms[rows % 3](x, weight, bias)
            assert out.shape == (rows, 40)
    assert _heap_in_use_mib() - before < 8
    assert _heap_in_use_mib() - start < 48


@needs_onednn
def test_padding_changes_no_real_row() -> None:
    gen = torch.Generator().manual_seed(4)
    gemm = DenseGemm(CPU, torch.float32)
    weight = torch.randn(96, 64, generator=gen)
    gemm.prepack(weight)
    x = torch.randn(37, 64, generator=gen)
    whole = gemm(x, weight, None)
    # 37 rows run as 40; the same rows inside a 40-row input give the same bits.
    padded = torch.cat([x, torch.randn(3, 64, generator=gen)])
    assert torch.equal(onednn_linear(padded, weight)[:37], onednn_linear(x, weight))
    assert torch.equal(whole, gemm(padded, weight, None)[:37])
    torch.testing.assert_close(whole, x @ weight.t(), atol=2e-4, rtol=1e-5)


class _RecordingGemm(DenseGemm):
    def __init__(self) -> None:
        super().__init__(CPU, torch.float32)
        self.warmed: list[int] = []

    def warm_up(self, max_rows: int) -> None:
        self.warmed.append(max_rows)


@needs_onednn
def test_the_warm_up_takes_each_shape_once_with_its_largest_rows_up_to_the_cap() -> None:
    small, large, other = _RecordingGemm(), _RecordingGemm(), _RecordingGemm()
    small.prepack(torch.zeros(8, 16))
    large.prepack(torch.zeros(8, 16))
    other.prepack(torch.zeros(8, 16), torch.zeros(8))  # a bias: other primitives
    assert warm_up_gemms([(small, 40), (large, 4096), (other, 100)]) == 2
    # The largest wanted rows of a shape, capped: bigger buckets are built on first use.
    assert (small.warmed, large.warmed, other.warmed) == ([], [WARM_UP_MAX_ROWS], [100])
