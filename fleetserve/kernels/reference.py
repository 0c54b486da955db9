"""Pure-torch references for every kernel in this package (the tests' ground truth).

Each `<op>_ref` has the same signature and contract as its kernel wrapper `<op>` but is written
for clarity, not speed: per-request loops and dense masks. Where the engine already has the
operation (RMSNorm, SiLU-and-mul, neox rotary), the reference reproduces the engine layer's
arithmetic exactly, dtype roundings included (the tests check both agree), so a kernel that
matches the reference matches the engine. `reshape_and_cache_ref` is also the engine's own KV
write in the torch attention backend. Like the rest of `kernels`, this module imports only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = write nothing
) -> None:
    """Scatter key/value into the paged cache in place (memory: read 2*T*Hkv*D, write the same)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    flat[0, slot_mapping[valid]] = key[valid].to(kv_cache.dtype)
    flat[1, slot_mapping[valid]] = value[valid].to(kv_cache.dtype)


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of every request's query rows over its cached K/V, computed in float64.

    Query row j of a request with `query_len` rows sits at position `seq_len - query_len + j` and
    attends to key positions `p <= its position` (and `position - p < sliding_window` if set).

    Returns:
        [num_tokens, num_heads, head_size] in the query dtype; rows past the last request are 0.
    """
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        positions = torch.arange(seq_len)
        blocks = block_table[i, positions // block_size].long().cpu()
        offsets = positions % block_size
        k = kv_cache[0, blocks, offsets].double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = kv_cache[1, blocks, offsets].double().repeat_interleave(group, dim=1)
        q = query[start:end].double()
        scores = torch.einsum("lhd,shd->hls", q, k.to(q.device)) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        allowed = positions[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            allowed &= q_pos[:, None] - positions[None, :] < sliding_window
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        attn = torch.einsum("hls,shd->lhd", scores.softmax(-1), v.to(q.device))
        out[start:end] = attn.reshape(end - start, num_heads, head_size).to(query.dtype)
    return out


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The engine's `RMSNorm`: normed(x) or (normed(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    x32 = x.to(torch.float32)
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


def rotary_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    cos_cache: torch.Tensor,  # [max_position, rotary_dim], halves duplicated (engine layout)
    sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of query and key; dims past `rotary_dim` pass through unchanged.

    Neox style rotates the pairs (i, i + rotary_dim / 2), like the engine's `RotaryEmbedding`;
    gpt-j style rotates the interleaved pairs (2i, 2i + 1). Pair i uses frequency i in both.
    """
    rotary_dim = cos_cache.shape[-1]
    half = rotary_dim // 2
    cos = cos_cache[positions].unsqueeze(1)  # [T, 1, rotary_dim]
    sin = sin_cache[positions].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        if is_neox:
            rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
            return torch.cat(((x_rot * cos) + (rotated * sin), x_pass), dim=-1)
        # gpt-j: frequency i sits at column i of the (duplicated) table.
        c = cos[..., :half].repeat_interleave(2, dim=-1)
        s = sin[..., :half].repeat_interleave(2, dim=-1)
        rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), dim=-1).flatten(-2)
        return torch.cat(((x_rot * c) + (rotated * s), x_pass), dim=-1)

    return rotate(query), rotate(key)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The engine's `SiluAndMul`: silu(x[..., :d]) * x[..., d:] for x [..., 2d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def fused_moe_ref(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden] (gate rows, then up rows)
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """Softmax top-k routing, a SwiGLU expert MLP per (token, expert), routing-weighted sum."""
    weights, experts = torch.topk(router_logits.float().softmax(-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for t in range(hidden.shape[0]):
        for j in range(top_k):
            e = int(experts[t, j])
            h = w13[e].float() @ hidden[t].float()
            act = silu_and_mul_ref(h)
            out[t] += weights[t, j] * (w2[e].float() @ act)
    return out.to(hidden.dtype)
