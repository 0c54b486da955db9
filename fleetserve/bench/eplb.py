"""`fleetserve bench eplb`: what EPLB buys on a skewed load, and what one rearrangement costs.

Two worker processes (EP = 2 over gloo, on the CPU by default) each build the engine's real MoE
layer (`FusedMoE`, `--experts` logical experts + `--redundant` slots, seeded random weights
identical on both ranks) and route `--tokens` tokens per step whose router logits favour a few
experts that the load-time placement puts on rank 0 only (`--hot`, `--skew`). Printed side by side:

1. the MoE layer's forward time (median over `--iters`, the slower rank's: the all-reduce makes
   both wait for it), as wall time and as the rank's own CPU time (what the layer costs a rank
   that has its device to itself: on a shared CPU the two ranks also compete for cores), and
   the measured balancedness, before and after one EPLB rebalance;
2. the step-time spike of one rearrangement (that step's time minus the median step) in sync
   mode (the rebalance step moves the weights) and async mode (staged in the background while
   steps go on, committed at a step boundary), and the time the step loop was blocked.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import statistics
import time
from datetime import timedelta
from typing import Any

from fleetserve.common.ports import free_port

__all__ = ["add_arguments", "run_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, default=16, help="logical experts")
    parser.add_argument("--redundant", type=int, default=2, help="redundant expert slots")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--skew", type=float, default=4.0, help="router logit bonus of hot experts")
    parser.add_argument(
        "--hot", type=int, default=4, help="hot experts (the first ones only rank 0 holds)"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed forwards per measurement")
    parser.add_argument("--device", default="cpu", choices=("cpu",))


def _build(args: argparse.Namespace, rank: int, port: int) -> tuple[Any, Any, Any]:
    import torch

    from fleetserve.engine.config import ParallelConfig
    from fleetserve.engine.distributed.parallel_state import ParallelState
    from fleetserve.engine.layers.layer_context import LayerContext

    parallel = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
    state = ParallelState.create(
        parallel, rank=rank, init_method=f"tcp://127.0.0.1:{port}", device=torch.device("cpu"),
        custom_all_reduce=False,
    )  # fmt: skip
    assert state.expert is not None
    context = LayerContext(
        dtype=torch.float32, device=torch.device(args.device), tp_rank=rank, tp_size=2,
        tp_group=state.tensor, ep_rank=rank, ep_size=2, ep_group=state.expert,
        num_redundant_experts=args.redundant,
    )  # fmt: skip
    layer = _build_layer_only(args, context)
    return state, layer, context


def _inputs(args: argparse.Namespace, step: int) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    logits = torch.randn(args.tokens, args.experts, generator=gen)
    # NOTE: the hot experts are those rank 0 alone holds at load (slots p % E: experts
    # 0..redundant-1 have a second replica on rank 1).
    logits[:, args.redundant : args.redundant + args.hot] += args.skew
    return x, logits


def _layer_ms(layer: Any, args: argparse.Namespace, barrier: Any) -> tuple[float, float]:
    """Median ms of one forward, wall and this thread's CPU time, each the slower rank's (every
    rank returns the same figures)."""
    import torch
    import torch.distributed as dist

    x, logits = _inputs(args, 0)
    wall, cpu = [], []
    recording, layer.expert_load = layer.expert_load, None  # timing runs are not load
    with torch.inference_mode():
        layer(x, logits)  # warm-up
        for _ in range(args.iters):
            barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            layer(x, logits)
            wall.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
    layer.expert_load = recording
    medians = torch.tensor([statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return float(medians[0]), float(medians[1])


def _rearrangement(
    layer: Any, args: argparse.Namespace, use_async: bool, barrier: Any
) -> dict[str, float]:
    """Steps of forward + EPLB bookkeeping through one rebalance; the spike and blocked time."""
    import torch
    import torch.distributed as dist

    from fleetserve.engine.eplb.state import EplbGroup, EplbSettings, EplbState

    interval = 8
    group = EplbGroup.create([[0, 1]], dist.get_rank(), "gloo")
    settings = EplbSettings(window_size=4, step_interval=interval, use_async=use_async)
    eplb = EplbState([layer], settings, group)
    times, commit_step = [], -1
    with torch.inference_mode():
        for step in range(1, interval + 12):
            x, logits = _inputs(args, step)
            barrier()
            start = time.perf_counter()
            layer(x, logits)
            eplb.after_step()
            times.append(time.perf_counter() - start)
            if commit_step < 0 and eplb.stats.rebalances:
                commit_step = step
    slowest = torch.tensor(times)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    step_ms = [t * 1e3 for t in slowest.tolist()]
    median = statistics.median(step_ms)
    spike = max(step_ms[interval - 1 :]) - median
    return {
        "median_ms": median,
        "spike_ms": spike,
        "blocked_ms": eplb.stats.last_rearrange_s * 1e3,
        "steps_to_commit": float(commit_step - interval),
    }


def _worker(args: argparse.Namespace, rank: int, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from fleetserve.engine.eplb.state import EplbGroup, EplbSettings, EplbState

    torch.set_num_threads(1)
    state, layer, context = _build(args, rank, port)
    cpu = dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=120))

    def barrier() -> None:
        dist.barrier(group=cpu)

    # The load-time placement's maps, then one rebalance from a window of the skewed load
    # (sync), then the layer time again.
    group = EplbGroup.create([[0, 1]], rank, "gloo")
    eplb = EplbState([layer], EplbSettings(window_size=2, step_interval=2), group)
    result: dict[str, Any] = {"before": _layer_ms(layer, args, barrier)}
    with torch.inference_mode():
        for step in range(2):
            x, logits = _inputs(args, step)
            layer(x, logits)
            eplb.after_step()
    result["balancedness_before"] = eplb.stats.balancedness
    result["rebalanced"] = eplb.stats.rebalances
    result["after"] = _layer_ms(layer, args, barrier)
    # Measured balancedness of the new placement: one more window.
    with torch.inference_mode():
        for step in range(2, 4):
            x, logits = _inputs(args, step)
            layer(x, logits)
            eplb.after_step()
    result["balancedness_after"] = eplb.stats.balancedness
    layer.eplb_maps = None
    layer.expert_load = None
    # Fresh layers at the load-time placement for the rearrangement cost.
    for mode in ("sync", "async"):
        fresh = _build_layer_only(args, context)
        result[mode] = _rearrangement(fresh, args, mode == "async", barrier)
    if rank == 0:
        out.put(result)
    state.destroy()


def _build_layer_only(args: argparse.Namespace, context: Any) -> Any:
    import torch

    from fleetserve.engine.layers.fused_moe.layer import FusedMoE
    from fleetserve.engine.layers.fused_moe.routing import RoutingConfig

    layer = FusedMoE(
        args.experts, args.hidden, args.intermediate,
        RoutingConfig(top_k=args.top_k, renormalize=True), context,
        num_redundant_experts=args.redundant,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    w13 = 0.02 * torch.randn(args.experts, 2 * args.intermediate, args.hidden, generator=gen)
    w2 = 0.02 * torch.randn(args.experts, args.hidden, args.intermediate, generator=gen)
    local = [layer.physical_to_logical[p] for p in layer.local_physical_experts]
    layer.w13_weight.data.copy_(w13[local])
    layer.w2_weight.data.copy_(w2[local])
    return layer


def run_from_args(args: argparse.Namespace) -> int:
    if (args.experts + args.redundant) % 2:
        raise SystemExit("--experts + --redundant must be even (EP = 2)")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(args, r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 600
    while True:
        try:
            result = out.get(timeout=1.0)
            break
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit(f"the EPLB bench's ranks failed (exit codes {failed})") from None
    for p in procs:
        p.join(timeout=60)
    mb = 3 * args.hidden * args.intermediate * 4 / 2**20
    print(
        f"EPLB, EP=2 over gloo ({args.device}): {args.experts} experts + {args.redundant} "
        f"redundant, {mb:.1f} MiB each; {args.tokens} tokens/step, top-{args.top_k}, "
        f"experts {args.redundant}..{args.redundant + args.hot - 1} favoured by +{args.skew} logits"
    )
    if not result["rebalanced"]:
        print("(the rebalance was skipped: the plan gained too little; raise --skew)")
    print(f"{'':32}{'before':>12}{'after':>12}")
    print(
        f"{'balancedness (measured)':32}{result['balancedness_before']:>12.3f}"
        f"{result['balancedness_after']:>12.3f}"
    )
    (wall_before, cpu_before), (wall_after, cpu_after) = result["before"], result["after"]
    print(
        f"{'MoE layer ms, wall (slowest)':32}{wall_before:>12.2f}{wall_after:>12.2f}"
        f"   (x{wall_before / wall_after:.2f})"
    )
    print(
        f"{'MoE layer ms, rank CPU (slowest)':32}{cpu_before:>12.2f}{cpu_after:>12.2f}"
        f"   (x{cpu_before / cpu_after:.2f})"
    )
    print()
    sync, asyn = result["sync"], result["async"]
    print(f"{'one rearrangement':32}{'sync':>12}{'async':>12}")
    print(f"{'median step ms':32}{sync['median_ms']:>12.2f}{asyn['median_ms']:>12.2f}")
    print(f"{'step spike ms (max - median)':32}{sync['spike_ms']:>12.2f}{asyn['spike_ms']:>12.2f}")
    print(f"{'step loop blocked ms':32}{sync['blocked_ms']:>12.2f}{asyn['blocked_ms']:>12.2f}")
    print(
        f"{'steps from rebalance to commit':32}{sync['steps_to_commit']:>12.0f}"
        f"{asyn['steps_to_commit']:>12.0f}"
    )
    return 0
