"""The torch MoE path: pairs sorted by expert, one gate/up and one down GEMM per expert hit.

The T×k (token, slot) pairs are sorted by their local expert id with one stable argsort; each
expert's pairs are then a contiguous segment of the sorted rows (offsets from one bincount), so
the per-expert GEMMs read slices, and the weighted rows go back to their pair's place. The only
Python loop is over the experts that received tokens (one host read of the segment lengths per
layer); there is none over tokens. Pairs whose expert is not local (another expert-parallel
rank's, id outside [0, num_local)) are sorted past the end and skipped (they add zero).

Combine: each row is multiplied by its routing weight (in the weight's dtype: float32, or the
activation dtype for routings that round their weights), and a token's k rows are summed in
float32, in slot order, before one cast to the activation dtype, as transformers' grouped-GEMM
experts do (so bfloat16 rounds once per token, not once per expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sort_by_expert", "torch_experts"]


def sort_by_expert(local_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the flattened pairs by expert.

    Args:
        local_ids: [T, k] expert ids; ids outside [0, num_experts) are not this rank's.
        num_experts: the local experts.

    Returns:
        (order, counts): `order` [T*k] int64 pair indices (token * k + slot) sorted by expert,
        stable, the pairs of non-local experts last; `counts` [num_experts] pairs per expert.
    """
    flat = local_ids.flatten()
    local = (flat >= 0) & (flat < num_experts)
    key = torch.where(local, flat, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    return order, counts


def torch_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    local_ids: torch.Tensor,
) -> torch.Tensor:
    """Sum over each token's local experts of weight × down(silu(gate) × up).

    Args:
        hidden: [T, H].
        w13: [E, 2I, H], gate rows then up rows.
        w2: [E, H, I].
        topk_weights: [T, k] float32 (or hidden's dtype).
        local_ids: [T, k] int64 local expert ids (others: not this rank's, contribute 0).

    Returns:
        [T, H] in hidden's dtype (zeros for tokens with no local expert).
    """
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = local_ids.shape[1]
    order, counts = sort_by_expert(local_ids, num_experts)
    sizes = counts.tolist()  # NOTE: the one host read per layer (segment lengths)
    order = order[: sum(sizes)]
    tokens = order // top_k
    rows = hidden.index_select(0, tokens)
    down = torch.empty_like(rows)
    start = 0
    for expert, size in enumerate(sizes):
        if size == 0:
            continue
        segment = rows[start : start + size]
        gate_up = F.linear(segment, w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down[start : start + size] = F.linear(act, w2[expert])
        start += size
    num_tokens, hidden_size = hidden.shape
    pairs = torch.zeros(num_tokens * top_k, hidden_size, dtype=torch.float32, device=hidden.device)
    pairs[order] = (down * topk_weights.flatten()[order].unsqueeze(1)).float()
    return pairs.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
