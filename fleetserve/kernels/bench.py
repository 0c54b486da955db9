"""Kernel benchmark: achieved GB/s and TFLOP/s per kernel against this device's own roofline.

`python -m fleetserve.kernels.bench [--smoke] [--json PATH]`

The run first measures the device's roofline (device-to-device copy bandwidth, bf16 matmul rate),
then times every kernel and its torch baseline (the torch backend's scatter + gather + SDPA
for attention, the eager references elsewhere) and flash-attn when it imports, and prints one table. Bytes and FLOPs per kernel
are the algorithmic minimum (each input read once, each output written once), so "% of roofline"
is a lower bound on how well a kernel uses the device. On a host without CUDA the kernels run in
Triton's interpreter: only the tiny smoke configuration is run, and its figures mean nothing
beyond "it runs".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Roofline:
    copy_gb_s: float
    """Measured device copy bandwidth (bytes read + written per second / 1e9)."""
    matmul_tflop_s: float
    """Measured bf16 matmul rate."""


@dataclass(frozen=True, slots=True)
class BenchCase:
    name: str
    config: str
    bytes_moved: int
    flops: int
    triton: Callable[[], object]
    torch: Callable[[], object]
    flash: Callable[[], object] | None = None


@dataclass(frozen=True, slots=True)
class BenchRow:
    name: str
    config: str
    triton_ms: float
    torch_ms: float
    flash_ms: float | None
    gb_s: float
    tflop_s: float
    pct_copy_bw: float
    pct_matmul: float


def time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median wall time of `fn` in milliseconds (CUDA: Triton's do_bench, with L2 flushes)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=max(reps, 25), return_mode="median"))
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[len(samples) // 2]


def measure_roofline(device: torch.device, smoke: bool) -> Roofline:
    """Copy bandwidth of a large tensor clone and the rate of a square bf16 matmul."""
    numel = (1 << 18) if smoke else (1 << 28)  # 256 Mi elements: 1 GiB of fp32 on a GPU
    src = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device, reps=5)
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    mm_ms = time_ms(lambda: a @ b, device, reps=5)
    return Roofline(
        copy_gb_s=2 * numel * 4 / (copy_ms * 1e-3) / 1e9,
        matmul_tflop_s=2 * n**3 / (mm_ms * 1e-3) / 1e12,
    )


def _sdpa_paged(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    gather_slots: list[torch.Tensor],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """The torch way (what the engine's torch backend does): scatter, gather, SDPA per request."""
    from fleetserve.kernels.reference import reshape_and_cache_ref

    reshape_and_cache_ref(key, value, kv_cache, slot_mapping)
    flat = kv_cache.flatten(1, 2)
    out = torch.empty_like(query)
    start = 0
    for slots, query_len in zip(gather_slots, query_lens, strict=True):
        q = query[start : start + query_len].transpose(0, 1)
        k, v = flat[0, slots].transpose(0, 1), flat[1, slots].transpose(0, 1)
        seq_len = k.shape[1]
        mask = (
            torch.arange(seq_len, device=q.device)[None, :]
            <= torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        )
        out[start : start + query_len] = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        ).transpose(0, 1)
        start += query_len
    return out


def _flash_varlen(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    gather_slots: list[torch.Tensor],
    query_start_loc: torch.Tensor,
    query_lens: list[int],
    scale: float,
) -> Callable[[], object] | None:
    """flash-attn 2 over K/V packed from the cache (the engine's flash_attn backend's approach)."""
    if query.device.type != "cuda" or query.dtype == torch.float32:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    packed = torch.cat(gather_slots)
    seq_lens = torch.tensor([s.numel() for s in gather_slots], device=query.device)
    cu_k = torch.zeros(len(gather_slots) + 1, dtype=torch.int32, device=query.device)
    cu_k[1:] = torch.cumsum(seq_lens, 0)
    flat = kv_cache.flatten(1, 2)

    def call() -> object:
        return flash_attn_varlen_func(
            query,
            flat[0, packed],
            flat[1, packed],
            query_start_loc,
            cu_k,
            max(query_lens),
            int(seq_lens.max()),
            softmax_scale=scale,
            causal=True,
        )

    return call


def _attention_cases(device: torch.device, dtype: torch.dtype, smoke: bool) -> list[BenchCase]:
    from fleetserve.kernels.paged_attention import paged_attention
    from fleetserve.kernels.reshape_and_cache import reshape_and_cache

    heads, kv_heads, head_size, block_size = (4, 2, 32, 4) if smoke else (32, 8, 128, 16)
    shapes: dict[str, list[tuple[int, int]]] = (
        {"mixed": [(5, 3), (0, 4), (9, 1)], "decode": [(12, 1), (7, 1)]}
        if smoke
        else {
            "prefill": [(0, 2048), (0, 2048)],
            "mixed": [(1024, 512)] + [(2000, 1)] * 64,
            "decode": [(1023, 1)] * 128,
            "decode-4k": [(4095, 1)] * 32,
            "long-decode": [(32767, 1)] * 4,
        }
    )
    # NOTE: the acceptance shape (context >= 4k, batch >= 32) is also run at fixed split counts,
    # so one GPU run shows whether the split heuristic leaves bandwidth on the table.
    split_sweeps: dict[str, tuple[int | None, ...]] = (
        {"decode": (None, 1, 2)} if smoke else {"decode-4k": (None, 1, 2, 4, 8)}
    )
    elt = torch.finfo(dtype).bits // 8
    scale = head_size**-0.5
    cases = []
    for label, requests in shapes.items():
        seq_lens = [c + q for c, q in requests]
        query_lens = [q for _, q in requests]
        blocks = [math.ceil(s / block_size) for s in seq_lens]
        num_blocks = sum(blocks) + 1
        ids = (torch.randperm(num_blocks - 1) + 1).tolist()
        table = torch.zeros(len(requests), max(blocks), dtype=torch.int32)
        slots: list[int] = []
        gather: list[torch.Tensor] = []
        for i, ((context_len, query_len), n) in enumerate(zip(requests, blocks, strict=True)):
            row = [ids.pop() for _ in range(n)]
            table[i, :n] = torch.tensor(row, dtype=torch.int32)
            seq_len = context_len + query_len
            req_slots = [row[p // block_size] * block_size + p % block_size for p in range(seq_len)]
            slots.extend(req_slots[context_len:])
            gather.append(torch.tensor(req_slots, device=device))
        num_tokens = sum(query_lens)
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)
        query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        table = table.to(device)
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        cache = torch.randn(2, num_blocks, block_size, kv_heads, head_size, device=device)
        cache = cache.to(dtype)
        q = torch.randn(num_tokens, heads, head_size, device=device).to(dtype)
        k = torch.randn(num_tokens, kv_heads, head_size, device=device).to(dtype)
        v = torch.randn_like(k)
        pairs = sum(q_len * (c + (q_len + 1) / 2) for c, q_len in requests)
        for num_kv_splits in split_sweeps.get(label, (None,)):

            def triton_step(
                q: torch.Tensor = q,
                k: torch.Tensor = k,
                v: torch.Tensor = v,
                cache: torch.Tensor = cache,
                slot_mapping: torch.Tensor = slot_mapping,
                query_start_loc: torch.Tensor = query_start_loc,
                seq_lens_t: torch.Tensor = seq_lens_t,
                table: torch.Tensor = table,
                max_query_len: int = max(query_lens),
                max_seq_len: int = max(seq_lens),
                num_kv_splits: int | None = num_kv_splits,
            ) -> object:
                reshape_and_cache(k, v, cache, slot_mapping)
                return paged_attention(
                    q,
                    cache,
                    query_start_loc,
                    seq_lens_t,
                    table,
                    max_query_len,
                    scale,
                    max_seq_len=max_seq_len,
                    num_kv_splits=num_kv_splits,
                )

            splits = "" if num_kv_splits is None else f" splits={num_kv_splits}"
            config = f"{label} T={num_tokens} reqs={len(requests)}{splits} {dtype}"
            cases.append(
                BenchCase(
                    name="attention",
                    config=config.replace("torch.", ""),
                    bytes_moved=elt
                    * head_size
                    * (2 * num_tokens * heads + 2 * kv_heads * (sum(seq_lens) + num_tokens)),
                    flops=int(4 * pairs * heads * head_size),
                    triton=triton_step,
                    torch=partial(
                        _sdpa_paged, q, k, v, cache, slot_mapping, gather, query_lens, scale
                    ),
                    flash=_flash_varlen(q, cache, gather, query_start_loc, query_lens, scale),
                )
            )
    return cases


def _elementwise_cases(device: torch.device, dtype: torch.dtype, smoke: bool) -> list[BenchCase]:
    from fleetserve.kernels.fused_moe import fused_moe
    from fleetserve.kernels.reference import (
        reshape_and_cache_ref,
        rms_norm_ref,
        rotary_ref,
        silu_and_mul_ref,
    )
    from fleetserve.kernels.reshape_and_cache import reshape_and_cache
    from fleetserve.kernels.rms_norm import rms_norm
    from fleetserve.kernels.rotary import rotary_embedding
    from fleetserve.kernels.silu_and_mul import silu_and_mul

    elt = torch.finfo(dtype).bits // 8
    tokens, hidden, inter = (8, 64, 96) if smoke else (8192, 4096, 14336)
    heads, kv_heads, head_size = (4, 2, 32) if smoke else (32, 8, 128)
    cases = []

    x = torch.randn(tokens, hidden, device=device).to(dtype)
    residual = torch.randn_like(x)
    weight = torch.ones(hidden, device=device, dtype=dtype)
    cases.append(
        BenchCase(
            "rms_norm+residual",
            f"T={tokens} hidden={hidden}",
            4 * tokens * hidden * elt,
            0,
            partial(rms_norm, x, weight, 1e-6, residual),
            partial(rms_norm_ref, x, weight, 1e-6, residual),
        )
    )
    gate_up = torch.randn(tokens, 2 * inter, device=device).to(dtype)
    cases.append(
        BenchCase(
            "silu_and_mul",
            f"T={tokens} d={inter}",
            3 * tokens * inter * elt,
            0,
            partial(silu_and_mul, gate_up),
            partial(silu_and_mul_ref, gate_up),
        )
    )
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq).repeat(1, 2)
    cos, sin = freqs.cos().to(device, dtype), freqs.sin().to(device, dtype)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    q = torch.randn(tokens, heads, head_size, device=device).to(dtype)
    k = torch.randn(tokens, kv_heads, head_size, device=device).to(dtype)
    cases.append(
        BenchCase(
            "rotary (neox)",
            f"T={tokens} H={heads}/{kv_heads} D={head_size}",
            2 * tokens * (heads + kv_heads) * head_size * elt,
            0,
            partial(rotary_embedding, positions, q, k, cos, sin),
            partial(rotary_ref, positions, q, k, cos, sin, True),
        )
    )
    num_blocks, block_size = tokens // 16 + 2, 16
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_size, device=device).to(dtype)
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    cases.append(
        BenchCase(
            "reshape_and_cache",
            f"T={tokens} Hkv={kv_heads} D={head_size}",
            4 * tokens * kv_heads * head_size * elt,
            0,
            partial(reshape_and_cache, k, k, cache, slots),
            partial(reshape_and_cache_ref, k, k, cache, slots),
        )
    )
    experts, top_k, moe_tokens, moe_hidden, moe_inter = (
        (4, 2, 8, 64, 48) if smoke else (8, 2, 512, 4096, 14336 // 8)
    )
    h = torch.randn(moe_tokens, moe_hidden, device=device).to(dtype)
    w13 = (torch.randn(experts, 2 * moe_inter, moe_hidden, device=device) * 0.02).to(dtype)
    w2 = (torch.randn(experts, moe_hidden, moe_inter, device=device) * 0.02).to(dtype)
    logits = torch.randn(moe_tokens, experts, device=device)
    cases.append(
        BenchCase(
            "fused_moe",
            f"T={moe_tokens} E={experts} k={top_k} K={moe_hidden} I={moe_inter}",
            elt * (w13.numel() + w2.numel() + 2 * h.numel()),
            6 * moe_tokens * top_k * moe_hidden * moe_inter,
            partial(fused_moe, h, w13, w2, logits, top_k),
            partial(_moe_torch_eager, h, w13, w2, logits, top_k),
        )
    )
    return cases


def _moe_torch_eager(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor, top_k: int
) -> torch.Tensor:
    """The usual eager MoE: loop over experts, gather their tokens, two matmuls each."""
    weights, ids = torch.topk(logits.float().softmax(-1), top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(w13.shape[0]):
        token_idx, slot = torch.where(ids == expert)
        if token_idx.numel() == 0:
            continue
        gate_up = hidden[token_idx] @ w13[expert].t()
        d = gate_up.shape[-1] // 2
        act = F.silu(gate_up[:, :d]) * gate_up[:, d:]
        contrib = (act @ w2[expert].t()).float() * weights[token_idx, slot, None]
        out.index_add_(0, token_idx, contrib)
    return out.to(hidden.dtype)


def run(device: torch.device, smoke: bool) -> tuple[Roofline, list[BenchRow]]:
    """Measure the roofline, then every kernel case; returns the table's rows."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reps = 3 if smoke else 50
    roof = measure_roofline(device, smoke)
    rows = []
    for case in _attention_cases(device, dtype, smoke) + _elementwise_cases(device, dtype, smoke):
        triton_ms = time_ms(case.triton, device, reps)
        torch_ms = time_ms(case.torch, device, reps)
        flash_ms = time_ms(case.flash, device, reps) if case.flash is not None else None
        gb_s = case.bytes_moved / (triton_ms * 1e-3) / 1e9
        tflop_s = case.flops / (triton_ms * 1e-3) / 1e12
        rows.append(
            BenchRow(
                name=case.name,
                config=case.config,
                triton_ms=triton_ms,
                torch_ms=torch_ms,
                flash_ms=flash_ms,
                gb_s=gb_s,
                tflop_s=tflop_s,
                pct_copy_bw=100 * gb_s / roof.copy_gb_s,
                pct_matmul=100 * tflop_s / roof.matmul_tflop_s,
            )
        )
    return roof, rows


def format_table(device_name: str, roof: Roofline, rows: list[BenchRow]) -> str:
    """One fixed-width table: the roofline header, then a line per kernel case."""
    lines = [
        f"device: {device_name}  copy {roof.copy_gb_s:.1f} GB/s  "
        f"bf16 matmul {roof.matmul_tflop_s:.2f} TFLOP/s",
        f"{'kernel':<18} {'config':<44} {'triton ms':>10} {'GB/s':>8} {'%bw':>5} "
        f"{'TFLOP/s':>8} {'%mm':>5} {'torch ms':>10} {'x torch':>7} {'flash ms':>9}",
    ]
    for r in rows:
        flash = f"{r.flash_ms:9.3f}" if r.flash_ms is not None else f"{'-':>9}"
        lines.append(
            f"{r.name:<18} {r.config:<44} {r.triton_ms:10.3f} {r.gb_s:8.1f} "
            f"{r.pct_copy_bw:5.1f} {r.tflop_s:8.2f} {r.pct_matmul:5.1f} {r.torch_ms:10.3f} "
            f"{r.torch_ms / r.triton_ms:7.2f} {flash}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (forced without CUDA)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        # NOTE: must be set before any kernel module is imported (they are imported lazily).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if cuda else "cpu")
    smoke = args.smoke or not cuda
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)"
    roof, rows = run(device, smoke)
    print(format_table(device_name, roof, rows))
    if args.json:
        with open(args.json, "w") as f:
            payload = {"device": device_name, "roofline": asdict(roof)}
            json.dump({**payload, "rows": [asdict(r) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
