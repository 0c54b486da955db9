"""`fleetserve bench moe`: one `FusedMoE` layer's time per forward, EP=1 beside EP=2.

The layer (seeded random experts, softmax top-k routing) runs on the CPU with `--backend`'s
expert GEMMs: once in this process with every expert (EP=1, the baseline), then on two gloo
ranks with expert parallelism (EP=2: each rank holds half of the experts, computes its tokens'
contributions and the all-reduce combines them), both on the same tokens and weights. Printed
side by side: mean ms per forward, and for EP=2 also the rank's compute without the all-reduce
and the largest difference from the EP=1 output (0 up to float rounding). Every process uses
`--threads` torch threads, so EP=2 uses twice the cores of EP=1.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from typing import Any

from fleetserve.common.ports import free_port

__all__ = ["add_arguments", "run_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=256, help="tokens per forward")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024, help="each expert's width")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--backend", choices=("torch", "triton"), default="torch")


def _inputs(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    h, i, e = args.hidden, args.intermediate, args.experts
    w13 = torch.randn(e, 2 * i, h, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, i, generator=gen) * i**-0.5
    x = torch.randn(args.tokens, h, generator=gen)
    logits = torch.randn(args.tokens, e, generator=gen)
    return w13, w2, x, logits


def _layer(args: argparse.Namespace, context: Any, w13: Any, w2: Any) -> Any:
    from fleetserve.engine.layers.fused_moe import FusedMoE, RoutingConfig

    layer = FusedMoE(
        args.experts, args.hidden, args.intermediate,
        RoutingConfig(top_k=args.top_k, renormalize=True), context,
    )  # fmt: skip
    for expert in range(args.experts):
        for part, tensor in (("gate", w13[expert, : args.intermediate]),
                             ("up", w13[expert, args.intermediate :]), ("down", w2[expert])):  # fmt: skip
            layer.load_expert_weight(expert, part, tensor, f"experts.{expert}.{part}")
    return layer


def _mean_ms(fn: Any, iters: int, barrier: Any = None) -> float:
    for _ in range(3):
        fn()
    if barrier is not None:
        barrier()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) / iters * 1e3


def _ep_rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    import torch

    from fleetserve.engine.config import ParallelConfig
    from fleetserve.engine.distributed.parallel_state import ParallelState
    from fleetserve.engine.layers.layer_context import LayerContext

    torch.set_num_threads(args.threads)
    state = ParallelState.create(
        ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True), rank=rank,
        init_method=f"tcp://127.0.0.1:{port}", device=torch.device("cpu"),
    )  # fmt: skip
    assert state.expert is not None
    context = LayerContext(
        dtype=torch.float32, device=torch.device("cpu"), tp_rank=rank, tp_size=2,
        tp_group=state.tensor, ep_rank=state.expert.rank_in_group, ep_size=2,
        ep_group=state.expert, moe_backend=args.backend,
    )  # fmt: skip
    w13, w2, x, logits = _inputs(args)
    layer = _layer(args, context, w13, w2)
    with torch.inference_mode():
        out = layer(x, logits)
        total_ms = _mean_ms(lambda: layer(x, logits), args.iters, state.tensor.barrier)
        reduce_group, layer.reduce_group = layer.reduce_group, None
        compute_ms = _mean_ms(lambda: layer(x, logits), args.iters, state.tensor.barrier)
        layer.reduce_group = reduce_group
    state.destroy()
    if rank == 0:
        queue.put((total_ms, compute_ms, out))


def run_from_args(args: argparse.Namespace) -> int:
    import torch

    from fleetserve.engine.layers.layer_context import LayerContext

    torch.set_num_threads(args.threads)
    w13, w2, x, logits = _inputs(args)
    context = LayerContext(
        dtype=torch.float32, device=torch.device("cpu"), moe_backend=args.backend
    )
    layer = _layer(args, context, w13, w2)
    with torch.inference_mode():
        expected = layer(x, logits)
        ep1_ms = _mean_ms(lambda: layer(x, logits), args.iters)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ep_rank, args=(r, port, args, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    ep2_ms, ep2_compute_ms, ep2_out = queue.get(timeout=600)
    for proc in procs:
        proc.join(60)
    diff = float((ep2_out - expected).abs().max())
    print(
        f"FusedMoE forward, {args.backend} experts, CPU float32: T={args.tokens} "
        f"H={args.hidden} I={args.intermediate} E={args.experts} k={args.top_k}, "
        f"{args.threads} thread(s)/process, mean of {args.iters}"
    )
    print(f"{'':>6}{'ms/forward':>12}{'compute ms':>12}{'speedup':>10}{'max |diff|':>12}")
    print(f"{'EP=1':>6}{ep1_ms:>12.2f}{ep1_ms:>12.2f}{1.0:>10.2f}{0.0:>12.1e}")
    print(f"{'EP=2':>6}{ep2_ms:>12.2f}{ep2_compute_ms:>12.2f}{ep1_ms / ep2_ms:>10.2f}{diff:>12.1e}")
    return 0
