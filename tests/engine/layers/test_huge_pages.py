"""Memory on transparent huge pages for the weights decode steps stream
(`fleetserve.engine.layers.huge_pages`): zeroed views back to back in one advised mapping, the
kernel's mode read from sysfs, and the bytes the kernel reports on huge pages; the engine's
small-row GEMMs gathered there compute the same bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fleetserve.engine.layers import gemm as gemm_module
from fleetserve.engine.layers.gemm import DenseGemm, gather_small_panels
from fleetserve.engine.layers.huge_pages import (
    HUGE_PAGE_BYTES,
    huge_page_bytes,
    huge_page_views,
    thp_mode,
)
from fleetserve.kernels.cpu.ops import small_gemm_supported
from tests.isa import isa_skipif

CPU = torch.device("cpu")
THP_HERE = thp_mode() in ("always", "madvise")


def test_views_are_zeroed_aligned_and_disjoint() -> None:
    layouts = [
        (torch.Size([3, 5]), torch.float32),
        (torch.Size([7]), torch.bfloat16),
        (torch.Size([0]), torch.float32),
        (torch.Size([2, 2, 2]), torch.int32),
    ]
    views = huge_page_views(layouts)
    assert [(v.shape, v.dtype) for v in views] == layouts
    assert all(v.is_contiguous() and not v.any() for v in views)
    assert views[0].data_ptr() % HUGE_PAGE_BYTES == 0
    assert all(v.data_ptr() % 4096 == 0 for v in views)
    for i, view in enumerate(views):
        view.fill_(i + 1)
    assert [v.unique().tolist() for v in views] == [[1.0], [2.0], [], [4]]


def test_bad_alignments_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="align must be a power of two, got 3"):
        huge_page_views([(torch.Size([4]), torch.float32)], align=3)
    with pytest.raises(ValueError, match="dimensions >= 0"):
        huge_page_views([((2, -1), torch.float32)])  # type: ignore[list-item]


def test_the_mode_is_the_bracketed_word_of_sysfs(tmp_path: Path) -> None:
    enabled = tmp_path / "enabled"
    enabled.write_text("always [madvise] never\n")
    assert thp_mode(enabled) == "madvise"
    enabled.write_text("[never] always madvise\n")
    assert thp_mode(enabled) == "never"
    enabled.write_text("nonsense\n")
    assert thp_mode(enabled) == "unavailable"
    assert thp_mode(tmp_path / "missing") == "unavailable"


def test_written_views_are_on_huge_pages_where_the_kernel_gives_them() -> None:
    (view,) = huge_page_views([(torch.Size([3 * HUGE_PAGE_BYTES]), torch.uint8)])
    view.fill_(1)  # resident now
    if THP_HERE:
        assert huge_page_bytes(view) >= 2 * HUGE_PAGE_BYTES
    else:
        assert huge_page_bytes(view) == 0


def test_huge_page_bytes_reads_the_mapping_that_holds_the_tensor(tmp_path: Path) -> None:
    tensor = torch.zeros(4)
    low = tensor.data_ptr() - 4096
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"{low - 8192:x}-{low:x} rw-p 00000000 00:00 0\nAnonHugePages:      999 kB\n"
        f"{low:x}-{low + 65536:x} rw-p 00000000 00:00 0\nRss:   64 kB\n"
        "AnonHugePages:     2048 kB\nVmFlags: rd wr mr mw me ac\n"
    )
    assert huge_page_bytes(tensor, smaps) == 2048 * 1024
    assert huge_page_bytes(tensor, tmp_path / "missing") == 0


@isa_skipif(
    not small_gemm_supported(),
    reason="the small-row GEMM needs the CPU kernels and AVX-512 or AVX2",
)
def test_gathered_small_gemms_compute_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    shapes = [(2048, 576), (96, 64), (40, 24)]  # the first one 4.5 MiB packed: whole huge pages
    gemms, inputs = [], []
    for n, k in shapes:
        gemm = DenseGemm(CPU, torch.float32)
        weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        gemm.prepack(weight, bias)
        gemms.append(gemm)
        inputs.append((torch.randn(5, k, generator=gen), weight, bias))
    before = [gemm(*args) for gemm, args in zip(gemms, inputs, strict=True)]

    monkeypatch.setattr(gemm_module, "thp_mode", lambda: "never")
    assert gather_small_panels(gemms) == 0  # nothing to gain: nothing moves

    monkeypatch.undo()
    monkeypatch.setattr(gemm_module, "GATHER_RELEASE_BYTES", 1)  # release after every weight
    released: list[int] = []
    moved = gather_small_panels([*gemms, gemms[0]], release=lambda: released.append(1))
    after = [gemm(*args) for gemm, args in zip(gemms, inputs, strict=True)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    if THP_HERE:
        # Each GEMM's panels moved once, each original released as soon as it was copied.
        assert moved == sum((n + 31) // 32 * 32 * k * 4 for n, k in shapes)
        assert len(released) == len(shapes)
        assert huge_page_bytes(gemms[0]._small) >= HUGE_PAGE_BYTES  # type: ignore[arg-type]
    else:
        assert (moved, released) == (0, [])
