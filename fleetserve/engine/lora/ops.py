"""The batched LoRA matmul of a step that mixes adapters (torch; runs on the CPU and GPU).

Each wrapped layer holds every slot's A and B stacked: A `[slots * w, in]` and B `[slots * w,
out]` (B transposed, w = sub-projections × max rank). One step computes, for all tokens,

    xa = x @ A^T                      # [T, slots * w]: every slot's shrink, one matmul
    xa *= onehot(token_slot)          # keep the token's own slot's w columns (base: none)
    delta = xa @ B                    # [T, out]: the expand, one matmul

so the shapes depend only on T (nothing data-dependent: a CUDA graph can replay it), the cost
is the base matmul's times slots·w / out, and a base-model token (slot -1) gets exactly 0.

`lora_delta_segmented` (the CPU's) does exact work instead: per slot, its tokens' rows are
gathered, shrunk by that slot's A, expanded part by part by that slot's B (a fused layer's
zero off-diagonal blocks are skipped) and added back; base-model tokens cost nothing.
"""

from __future__ import annotations

import torch

__all__ = ["lora_delta", "lora_delta_segmented"]


def lora_delta(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """The LoRA term of every token under its own slot's adapter.

    Args:
        x: [T, in] the layer's input.
        lora_a: [slots, w, in] the slots' A matrices (zero where a slot has none).
        lora_b: [slots, w, out] the slots' B matrices, transposed and pre-scaled.
        token_slots: [T] int64, each token's slot, -1 for the base model.
        slot_ids: [slots] int64, 0 .. slots - 1.

    Returns:
        [T, out] in x's dtype (rows of base-model tokens are exactly zero).
    """
    num_slots, width, _ = lora_a.shape
    num_tokens = x.shape[0]
    xa = x @ lora_a.reshape(num_slots * width, -1).t()
    mask = (token_slots[:, None] == slot_ids[None, :]).to(x.dtype)
    xa = (xa.view(num_tokens, num_slots, width) * mask[:, :, None]).view(num_tokens, -1)
    return xa @ lora_b.reshape(num_slots * width, -1)


def lora_delta_segmented(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: list[tuple[int, torch.Tensor]],
    parts: list[tuple[int, int]],
    max_rank: int,
) -> None:
    """Add each token's LoRA term to `out` in place, slot by slot.

    Args:
        out: [T, out] the base output (modified).
        x: [T, in] the layer's input.
        lora_a, lora_b: as in `lora_delta` (w = len(parts) × max_rank).
        segments: (slot, token indices) for each slot that has tokens this step.
        parts: per fused part, (first output column, width).
    """
    for slot, rows in segments:
        xa = x.index_select(0, rows) @ lora_a[slot].t()
        delta = torch.empty((rows.shape[0], out.shape[1]), dtype=out.dtype, device=out.device)
        for index, (offset, size) in enumerate(parts):
            ranks = slice(index * max_rank, (index + 1) * max_rank)
            cols = slice(offset, offset + size)
            delta[:, cols] = xa[:, ranks] @ lora_b[slot, ranks, cols]
        out.index_add_(0, rows, delta)
