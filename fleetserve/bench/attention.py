"""`fleetserve bench attention`: one layer's attention of a prefill step and of a decode step on
the CPU, the fused kernel's backend against the torch one.

A model shape's heads (`bench decode`'s shapes) over a paged float32 cache whose blocks are
scattered, as an engine's are after a while: a prefill step of fresh prompts (lengths uniform in
[--min-prompt, --max-prompt], up to --prefill-tokens in all) and a decode step of --decode-rows
requests with --decode-context cached tokens each. Each backend computes the same step
(`attend`, the K/V already written); each line prints the median call time, the ratio to the
torch backend, and the rate: GFLOP/s of the logits and values for prefill, GB/s of K/V read for
decode, against the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetserve.engine.models.arch import ModelArch

_BACKENDS = ("cpu_paged", "torch")


@dataclass(frozen=True)
class AttentionStep:
    """One step's query lengths and cached context per request."""

    name: str
    query_lens: list[int]
    context_lens: list[int]

    def flops(self, num_heads: int, head_size: int) -> int:
        """Logits and values, causal: each query row over its own context."""
        rows = sum(
            c + i + 1
            for q, c in zip(self.query_lens, self.context_lens, strict=True)
            for i in range(q)
        )
        return 4 * rows * num_heads * head_size

    def kv_bytes(self, num_kv_heads: int, head_size: int) -> int:
        """K and V of every request's whole sequence, float32, read once."""
        tokens = sum(q + c for q, c in zip(self.query_lens, self.context_lens, strict=True))
        return 2 * tokens * num_kv_heads * head_size * 4


def prefill_step(total: int, min_prompt: int, max_prompt: int, seed: int) -> AttentionStep:
    """Fresh prompts of random lengths in [min_prompt, max_prompt], `total` tokens in all (the
    last one cut to fit)."""
    if not 1 <= min_prompt <= max_prompt:
        raise ValueError(
            f"--min-prompt and --max-prompt must satisfy 1 <= min <= max, got "
            f"{min_prompt} and {max_prompt}"
        )
    if total < 1:
        raise ValueError(f"--prefill-tokens must be >= 1, got {total}")
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(min(rng.randint(min_prompt, max_prompt), total - sum(lens)))
    return AttentionStep("prefill", lens, [0] * len(lens))


def time_step(
    backend_name: str,
    step: AttentionStep,
    arch: ModelArch,
    reps: int,
    seed: int,
    block_size: int = 16,
) -> float | None:
    """Median seconds of one `attend` call of `backend_name` (None: not available here)."""
    import torch

    from fleetserve.engine.layers.attention.cpu_backend import CpuPagedAttentionBackend
    from fleetserve.engine.layers.attention.metadata import build_attention_metadata
    from fleetserve.engine.layers.attention.torch_backend import TorchAttentionBackend

    cls = {"cpu_paged": CpuPagedAttentionBackend, "torch": TorchAttentionBackend}[backend_name]
    if cls.is_available() is not None:
        return None
    heads, kv_heads, head_size = arch.num_attention_heads, arch.num_key_value_heads, arch.head_size
    seq_lens = [q + c for q, c in zip(step.query_lens, step.context_lens, strict=True)]
    blocks_of = [-(-s // block_size) for s in seq_lens]
    ids = list(range(1, sum(blocks_of) + 1))
    random.Random(seed).shuffle(ids)
    table = torch.zeros(len(seq_lens), max(blocks_of), dtype=torch.int32)
    slots: list[int] = []
    for r, (n, context, q) in enumerate(
        zip(blocks_of, step.context_lens, step.query_lens, strict=True)
    ):
        row = [ids.pop() for _ in range(n)]
        table[r, :n] = torch.tensor(row, dtype=torch.int32)
        slots += [row[p // block_size] * block_size + p % block_size for p in range(context, context + q)]  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, sum(blocks_of) + 1, block_size, kv_heads, head_size, generator=gen)
    query = torch.randn(sum(step.query_lens), heads, head_size, generator=gen)
    metadata = build_attention_metadata(
        step.query_lens, seq_lens, table, torch.tensor(slots, dtype=torch.int64), block_size,
        torch.device("cpu"),
    )  # fmt: skip
    backend = cls(heads, kv_heads, head_size)
    scale = head_size**-0.5
    samples = []
    with torch.inference_mode():
        for rep in range(reps + 1):  # the first call warms caches and allocations
            start = time.perf_counter()
            backend.attend(query, cache, metadata, scale)
            if rep:
                samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fleetserve.bench.decode import SHAPES

    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--decode-rows", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=336)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--backends", default=",".join(_BACKENDS))
    parser.add_argument("--seed", type=int, default=0)


def run_from_args(args: argparse.Namespace) -> int:
    import torch

    from fleetserve.bench.decode import SHAPES
    from fleetserve.bench.roofline import measure_roofline
    from fleetserve.engine.models.arch import ModelArch

    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    unknown = sorted(set(names) - set(_BACKENDS))
    if unknown or not names:
        raise ValueError(f"--backends must list some of {_BACKENDS}, got {args.backends!r}")
    for flag in ("decode_rows", "decode_context", "reps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    arch = ModelArch.from_hf_config(SHAPES[args.shape])
    heads, kv_heads, head_size = arch.num_attention_heads, arch.num_key_value_heads, arch.head_size
    steps = [
        prefill_step(args.prefill_tokens, args.min_prompt, args.max_prompt, args.seed),
        AttentionStep(
            "decode", [1] * args.decode_rows, [args.decode_context - 1] * args.decode_rows
        ),
    ]
    roofline = measure_roofline(torch.device("cpu"), torch.float32)
    print(
        f"attention: {args.shape} ({heads} heads, {kv_heads} KV heads of {head_size}), float32, "
        f"one layer, {torch.get_num_threads()} threads; {roofline.describe()}"
    )
    print(f"{'step':<8} {'backend':<10} {'ms':>8} {'vs torch':>9} {'rate':>14}")
    for step in steps:
        timings = {name: time_step(name, step, arch, args.reps, args.seed) for name in names}
        base = timings.get("torch")
        for name, seconds in timings.items():
            if seconds is None:
                print(f"{step.name:<8} {name:<10} not available here")
                continue
            ratio = f"{base / seconds:8.2f}x" if base else f"{'':>9}"
            if step.name == "prefill":
                rate = f"{step.flops(heads, head_size) / seconds / 1e9:8.1f} GFLOP/s"
            else:
                rate = f"{step.kv_bytes(kv_heads, head_size) / seconds / 1e9:9.1f} GB/s"
            print(f"{step.name:<8} {name:<10} {seconds * 1e3:8.3f} {ratio} {rate:>14}")
    return 0
