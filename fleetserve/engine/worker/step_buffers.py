"""Persistent step-input buffers: host staging (pinned on CUDA) and their device copies.

The runner writes each step's flat inputs into the host side through numpy views, then copies
only the used prefix to the device. Reusing the same device storage every step is what lets a
CUDA graph, captured once on slices of these buffers, replay with new inputs; pinned host memory
makes the copies asynchronous. Before the host side is rewritten, `wait_for_copies` blocks
until the previous step's copies have finished (a step whose requests all stop mid-prefill never
synchronises through the sampler, so nothing else guarantees it).

On the CPU the "device" tensor is the host tensor itself and `to_device` copies nothing.
"""

from __future__ import annotations

import numpy as np
import torch


class StagedBuffer:
    """One input of fixed capacity: `host` (+ `np`, its numpy view) and `device`."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np: np.ndarray = self.host.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.host

    def to_device(self, *sizes: int) -> torch.Tensor:
        """Copy the leading `sizes` (one per dimension given) to the device; return that view."""
        index = tuple(slice(0, n) for n in sizes)
        target = self.device[index]
        if self.device is not self.host:
            target.copy_(self.host[index], non_blocking=True)
        return target


class StepBuffers:
    """Every per-step input the model and attention read, sized for the largest step.

    Args:
        max_num_tokens: tokens of the largest step (the scheduler's token budget, or the largest
            padded decode batch when that is bigger).
        max_num_reqs: rows (max_num_seqs).
        max_num_blocks_per_req: block-table width.
        device: where the model runs.
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        device: torch.device,
    ) -> None:
        self.input_ids = StagedBuffer((max_num_tokens,), torch.int64, device)
        self.positions = StagedBuffer((max_num_tokens,), torch.int64, device)
        self.slot_mapping = StagedBuffer((max_num_tokens,), torch.int64, device)
        self.query_start_loc = StagedBuffer((max_num_reqs + 1,), torch.int32, device)
        self.seq_lens = StagedBuffer((max_num_reqs,), torch.int32, device)
        self.block_table = StagedBuffer((max_num_reqs, max_num_blocks_per_req), torch.int32, device)
        self._copies_done: torch.cuda.Event | None = None

    def wait_for_copies(self) -> None:
        """Block until the copies issued before `record_copies` have read the host buffers."""
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None

    def record_copies(self) -> None:
        """Mark the end of this step's copies (CUDA only; the CPU copies nothing)."""
        if self.input_ids.device is not self.input_ids.host:
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()
