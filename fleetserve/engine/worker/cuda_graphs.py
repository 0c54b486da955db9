"""CUDA graphs for uniform decode batches (seed notes part 2 §2.11).

A decode step launches hundreds of small kernels whose CPU launch cost exceeds their GPU time at
small batches. The runner pads every uniform decode batch (each request computes exactly one
token) up to the nearest capture size and replays a graph recorded once for that size; any other
batch (prefill chunks, mixed, larger than the largest size) runs eagerly. Dispatch is by batch
composition, so a mixed batch never replays a decode-only graph.

Contract with the caller (the model runner): the forward callable given for a size reads only the
persistent step buffers, sliced to that size, and the caller fills those buffers before `run`.
Padding rows carry block 0 (the null block, always finite) with length 1 and slot -1 (writes
nothing), so they can neither corrupt the KV cache nor produce NaNs that leak into real rows.

`DecodeGraphs(capture=False)` runs the very same padded batches eagerly: that is the CPU (and
`enforce_eager`-free) way to test the padding without a GPU.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
"""Largest decode batch captured; bigger batches are launch-bound no more and run eagerly."""


def cuda_graph_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8, up to max_num_seqs (itself included) or 512."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = {s for s in (1, 2, 4) if s <= limit}
    sizes.update(range(8, limit + 1, 8))
    sizes.add(limit)
    return tuple(sorted(sizes))


@dataclass
class _CapturedGraph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor
    """The graph's static output: overwritten by every replay of this graph."""


class DecodeGraphs:
    """Padded uniform-decode execution, captured as one CUDA graph per size when `capture`.

    Args:
        sizes: batch sizes to pad to (ascending, distinct).
        capture: record and replay CUDA graphs (CUDA only); False runs the padded batch eagerly.
    """

    def __init__(self, sizes: tuple[int, ...], *, capture: bool) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"sizes must be distinct positive ascending ints, got {sizes!r}")
        self.sizes = sizes
        self.capture = capture
        self._graphs: dict[int, _CapturedGraph] = {}
        self._pool: _POOL_HANDLE | None = None
        self.num_runs = 0
        """Padded batches run so far (replays, or eager runs without capture)."""

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def padded_size(self, num_reqs: int, uniform_decode: bool) -> int | None:
        """The size to pad this batch to, or None when it must run eagerly."""
        if not uniform_decode or num_reqs > self.max_size:
            return None
        return next(s for s in self.sizes if s >= num_reqs)

    def run(self, size: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run the padded batch of `size`: replay its graph (capturing it on first use)."""
        self.num_runs += 1
        if not self.capture:
            return forward()
        entry = self._graphs.get(size)
        if entry is None:
            entry = self._capture(size, forward)
        entry.graph.replay()
        return entry.output

    def capture_all(self, forward_for: Callable[[int], Callable[[], torch.Tensor]]) -> None:
        """Capture every size up front, largest first so smaller graphs reuse its memory pool."""
        if not self.capture:
            return
        for size in reversed(self.sizes):
            if size not in self._graphs:
                self._capture(size, forward_for(size))

    def clear(self) -> None:
        """Free every graph and its memory pool (e.g. before reloading weights)."""
        self._graphs.clear()
        self._pool = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _capture(self, size: int, forward: Callable[[], torch.Tensor]) -> _CapturedGraph:
        # NOTE: one eager run first: Triton compiles and cuBLAS picks its kernels outside the
        # capture (neither may happen while recording). It recomputes the same K/V into the same
        # slots, so running it on a live batch is harmless.
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # NOTE: collecting garbage mid-capture could free tensors the graph refers to.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                output = forward()
        finally:
            if gc_was_enabled:
                gc.enable()
        if self._pool is None:
            self._pool = graph.pool()
        entry = _CapturedGraph(graph=graph, output=output)
        self._graphs[size] = entry
        logger.debug("captured a CUDA graph for decode batches of %d", size)
        return entry
