"""`fleetserve bench gemm`: one decode step's dense GEMMs, library against library, on the CPU.

A model shape's GEMMs (fused q/k/v, o, fused gate/up and down a layer, then the LM head) are
built with seeded random weights in `--dtype` (float32 or bfloat16), every layer its own (so the
weights come from memory, as in a real step), and timed for each row count through each
implementation in turn: `F.linear` on the plain weight (MKL in float32), oneDNN on the plain
weight, oneDNN prepacked, and the dtype's small-row kernel where it runs
(`fleetserve/kernels/cpu/small_gemm.cpp` in float32 on AVX-512 or AVX2, `small_gemm_bf16.cpp` in
bfloat16 on AMX). Each line prints the median step time, the GFLOP/s, the ratio to oneDNN
prepacked, and the step's roofline measured in the same run: max(weight bytes / bandwidth,
FLOPs / GEMM rate).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from fleetserve.bench.offline import layer_shapes

_IMPLEMENTATIONS = ("mkl", "onednn-plain", "onednn", "small")
_DTYPES = ("float32", "bfloat16")


def _implementation(
    name: str, dtype: Any
) -> tuple[Callable[[Any], Any], Callable[[Any, Any], Any]] | None:
    """(prepare the weight, compute x Wᵀ) of one implementation in `dtype`; None where it cannot
    run."""
    import torch
    import torch.nn.functional as F

    from fleetserve.engine.layers.gemm import (
        onednn_linear,
        onednn_supports,
        small_gemm_pack,
        small_linear,
    )
    from fleetserve.kernels.cpu.ops import small_gemm_supported

    if name == "mkl":
        return (lambda w: w), (lambda x, w: F.linear(x, w))
    if name in ("onednn-plain", "onednn") and not onednn_supports(dtype):
        return None
    if name == "onednn-plain":
        return (lambda w: w), (lambda x, w: onednn_linear(x, w))
    if name == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight, (lambda x, w: onednn_linear(x, w))
    if not small_gemm_supported(dtype):
        return None
    return (
        lambda w: (small_gemm_pack(w), w.shape[0]),
        lambda x, w: small_linear(x, w[0], w[1]),
    )


def time_step(
    name: str,
    shapes: list[tuple[int, int]],
    rows: list[int],
    reps: int,
    seed: int,
    dtype: Any = None,
) -> dict[int, float] | None:
    """Median seconds of one step's GEMMs in `dtype` (default float32) at each row count (None:
    not available here)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    impl = _implementation(name, dtype)
    if impl is None:
        return None
    prepare, compute = impl
    gen = torch.Generator().manual_seed(seed)
    weights = [prepare(torch.randn(n, k, generator=gen).to(dtype)) for n, k in shapes]
    result = {}
    with torch.inference_mode():
        for m in rows:
            # One input per width, as a step's activations are in cache when a GEMM reads them.
            inputs = {k: torch.randn(m, k, generator=gen).to(dtype) for _, k in set(shapes)}
            calls = [(inputs[k], w) for (_, k), w in zip(shapes, weights, strict=True)]
            samples = []
            for rep in range(reps + 1):  # the first one builds oneDNN's primitives
                start = time.perf_counter()
                for x, w in calls:
                    compute(x, w)
                if rep:
                    samples.append(time.perf_counter() - start)
            result[m] = statistics.median(samples)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fleetserve.bench.decode import SHAPES

    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,4,16,32,64,128", help="comma-separated row counts")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--implementations", default=",".join(_IMPLEMENTATIONS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=_DTYPES)


def run_from_args(args: argparse.Namespace) -> int:
    import torch

    from fleetserve.bench.decode import SHAPES
    from fleetserve.bench.roofline import measure_roofline

    names = [n.strip() for n in args.implementations.split(",") if n.strip()]
    unknown = sorted(set(names) - set(_IMPLEMENTATIONS))
    if unknown or not names:
        raise ValueError(f"--implementations must list some of {_IMPLEMENTATIONS}, got {unknown}")
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if not rows or min(rows) < 1:
        raise ValueError(f"--rows must be positive integers, got {args.rows!r}")
    config = SHAPES[args.shape]
    layers = config["num_hidden_layers"] if args.layers is None else args.layers
    if layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    shapes = layer_shapes(config) * layers + [(config["vocab_size"], config["hidden_size"])]
    weight_count = sum(n * k for n, k in shapes)
    dtype = getattr(torch, args.dtype)
    weight_bytes = weight_count * dtype.itemsize
    roofline = measure_roofline(torch.device("cpu"), dtype)
    print(
        f"gemm: {args.shape}, {layers} layers + LM head, {len(shapes)} GEMMs, "
        f"{weight_bytes / 1e6:.0f} MB of {args.dtype} weights; {roofline.describe()}"
    )
    timings = {}
    for name in names:
        timing = time_step(name, shapes, rows, args.reps, args.seed, dtype)
        if timing is None:
            print(f"{name}: not available here")
        else:
            timings[name] = timing
    print(
        f"{'rows':>5} {'impl':<13} {'step ms':>9} {'GFLOP/s':>9} {'vs onednn':>10} {'roofline':>9}"
    )
    for m in rows:
        bound = roofline.step_seconds(weight_bytes, weight_count, m)
        base = timings.get("onednn", {}).get(m)
        for name, timing in timings.items():
            seconds = timing[m]
            ratio = f"{base / seconds:9.2f}x" if base else f"{'':>10}"
            print(
                f"{m:5d} {name:<13} {seconds * 1e3:9.2f} "
                f"{2 * weight_count * m / seconds / 1e9:9.1f} {ratio} {100 * bound / seconds:8.1f}%"
            )
    return 0
