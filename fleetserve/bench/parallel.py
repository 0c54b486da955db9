"""`fleetserve bench parallel`: what running the model across worker processes costs.

Prints, side by side, the wall time of one decode step through `EngineCore` with the in-process
executor (`uni`) and with worker processes (`mp`: the step pickled once and sent to every rank
over local ZMQ, the driver's result back), at tensor-parallel sizes 1 and 2, so the mp column
minus the uni column is the executor's per-step overhead. The model is the shape `--shape` of
`fleetserve bench decode` with seeded random weights (`load_format="dummy"`), on the CPU by
default; the second table times a bare all-reduce of decode-sized tensors over gloo and over
the shared-memory communicator. With `--throughput-tp 1,3` a third table gives the output
tokens/s of a fixed greedy workload on a real model (default: the bundled SmolLM2) at each
tensor-parallel size, TP 1 (the in-process executor) being the baseline. With `--pp-batches 1,2`
a fourth table gives the output tokens/s of that workload at pipeline-parallel size 2 (two
worker processes, `--shape`'s model with random weights, or `--model`'s) with 1 batch in flight
(the synchronous pipeline: one stage idles while the other computes) and with 2 (the engine
core's batch queue), 1 being the baseline. `--steps 0` skips the step-time table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fleetserve.bench.decode import SHAPES, write_shape_folder
from fleetserve.common.ports import free_port

__all__ = ["add_arguments", "run_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed per run")
    parser.add_argument("--batch-size", type=int, default=1, help="requests decoding together")
    parser.add_argument(
        "--allreduce-iters", type=int, default=500, help="all-reduces timed per size (0: skip)"
    )
    parser.add_argument(
        "--throughput-tp", default="", help="tensor-parallel sizes for the throughput table, "
        "e.g. 1,3 (default: no table; SmolLM2's 9 heads allow 1, 3 and 9)",
    )  # fmt: skip
    parser.add_argument("--model", default=None, help="throughput model (default: bundled)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--pp-batches", default="", help="batches in flight for the PP=2 throughput table, "
        "e.g. 1,2 (default: no table)",
    )  # fmt: skip
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="token budget per step of the PP table (a smaller one spreads prefills over batches)",
    )  # fmt: skip


def step_time_us(
    model_dir: Path, args: argparse.Namespace, *, backend: str, tp: int, gloo_only: bool
) -> float:
    """Median µs of one decode step of `args.batch_size` requests."""
    from fleetserve.engine.config import EngineConfig
    from fleetserve.engine.core.engine_core import EngineCore
    from fleetserve.engine.sampling_params import SamplingParams

    config = EngineConfig.create(
        str(model_dir), dtype="float32", device=args.device, load_format="dummy",
        max_model_len=args.steps + 16, max_num_seqs=args.batch_size, block_size=16,
        tensor_parallel_size=tp, distributed_executor_backend=backend, enforce_eager=True,
        disable_custom_all_reduce=gloo_only,
    )  # fmt: skip
    core = EngineCore(config)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
        for i in range(args.batch_size):
            core.add_request(f"r{i}", [3 + i, 5, 7, 11], params, eos_token_ids=())
        core.step()  # the prefill
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e6
    finally:
        core.shutdown()


def throughput_tokens_s(args: argparse.Namespace, tp: int) -> float:
    """Output tokens/s of `num_prompts` random prompts, greedy, EOS ignored, through `LLM`."""
    import random

    from fleetserve import LLM, SamplingParams

    llm = LLM(
        args.model, dtype="float32", device=args.device, tensor_parallel_size=tp,
        max_model_len=args.input_len + args.output_len + 8, max_num_seqs=args.num_prompts,
    )  # fmt: skip
    try:
        rng = random.Random(0)
        vocab = llm.config.model.vocab_size
        prompts = [
            {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]}
            for _ in range(args.num_prompts)
        ]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    finally:
        llm.engine_core.shutdown()


def pp_throughput_tokens_s(model_dir: Path, args: argparse.Namespace, num_batches: int) -> float:
    """Output tokens/s of `num_prompts` random prompts, greedy, EOS ignored, through an
    `EngineCore` at pipeline-parallel size 2 with at most `num_batches` batches in flight."""
    import random

    from fleetserve.engine.config import EngineConfig
    from fleetserve.engine.core.engine_core import EngineCore
    from fleetserve.engine.sampling_params import SamplingParams

    budget = {}
    if args.max_num_batched_tokens is not None:
        budget["max_num_batched_tokens"] = args.max_num_batched_tokens
    config = EngineConfig.create(
        str(model_dir), dtype="float32", device=args.device,
        load_format="safetensors" if args.model else "dummy", pipeline_parallel_size=2,
        max_model_len=args.input_len + args.output_len + 8, max_num_seqs=args.num_prompts,
        enforce_eager=True, **budget,
    )  # fmt: skip
    core = EngineCore(config, max_concurrent_batches=num_batches)
    try:
        rng = random.Random(0)
        vocab = config.model.vocab_size
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        warm_up = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        core.add_request("warm-up", [rng.randrange(3, vocab) for _ in range(8)], warm_up,
                         eos_token_ids=())  # fmt: skip
        while core.has_unfinished_requests():
            core.step()
        for i in range(args.num_prompts):
            prompt = [rng.randrange(3, vocab) for _ in range(args.input_len)]
            core.add_request(f"r{i}", prompt, params, eos_token_ids=())
        num_tokens = 0
        started = time.perf_counter()
        while core.has_unfinished_requests():
            num_tokens += sum(len(out.new_token_ids) for out in core.step())
        elapsed = time.perf_counter() - started
        assert num_tokens == args.num_prompts * args.output_len, num_tokens
        return num_tokens / elapsed
    finally:
        core.shutdown()


def _allreduce_rank(rank: int, port: int, sizes: list[int], iters: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    from fleetserve.engine.config import ParallelConfig
    from fleetserve.engine.distributed.parallel_state import ParallelState

    state = ParallelState.create(
        ParallelConfig(tensor_parallel_size=2), rank=rank,
        init_method=f"tcp://127.0.0.1:{port}", device=torch.device("cpu"),
    )  # fmt: skip
    tp = state.tensor
    shm = tp.shm
    results: dict[int, tuple[float, float | None]] = {}

    def mean_us(reduce: Any) -> float:
        for _ in range(10):
            reduce()
        tp.barrier()
        started = time.perf_counter()
        for _ in range(iters):
            reduce()
        return (time.perf_counter() - started) / iters * 1e6

    for size in sizes:
        tensor = torch.ones(size)
        gloo_us = mean_us(lambda t=tensor: dist.all_reduce(t, group=tp.device_group))
        shm_us = None if shm is None else mean_us(lambda t=tensor: shm.all_reduce(t))
        results[size] = (gloo_us, shm_us)
    state.destroy()
    if rank == 0:
        queue.put(results)


def allreduce_us(sizes: list[int], iters: int) -> dict[int, tuple[float, float | None]]:
    """Mean µs of one 2-rank all-reduce of `size` float32 elements over gloo and over the
    shared-memory communicator (None when it is unavailable here), per size."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_allreduce_rank, args=(r, port, sizes, iters, queue)) for r in range(2)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[float, float | None]] = queue.get(timeout=300)
    for proc in procs:
        proc.join(30)
    return results


def _print_step_times(model_dir: Path, args: argparse.Namespace) -> None:
    runs = (("uni", 1, False), ("mp", 1, False), ("mp", 2, True), ("mp", 2, False))
    rows = [(backend, tp, gloo, step_time_us(model_dir, args, backend=backend, tp=tp,
                                             gloo_only=gloo))
            for backend, tp, gloo in runs]  # fmt: skip
    base = rows[0][3]
    print(f"decode step, shape {args.shape}, batch {args.batch_size}, {args.steps} steps, "
          f"{args.device} (median µs per step)")  # fmt: skip
    print(f"{'executor':<10}{'TP':>4}{'all-reduce':>12}{'µs/step':>12}{'vs uni TP1':>14}")
    for backend, tp, gloo, us in rows:
        reduce = "-" if tp == 1 else ("gloo" if gloo else "shm+gloo")
        print(f"{backend:<10}{tp:>4}{reduce:>12}{us:>12.0f}{us - base:>+14.0f}")


def run_from_args(args: argparse.Namespace) -> int:
    hidden = int(SHAPES[args.shape]["hidden_size"])
    with tempfile.TemporaryDirectory(prefix="fleetserve-parallel-") as tmp:
        model_dir = write_shape_folder(args.shape, Path(tmp))
        if args.steps > 0:
            _print_step_times(model_dir, args)
        pp_batches = [int(n) for n in args.pp_batches.split(",") if n]
        if pp_batches:
            pp_dir = Path(args.model) if args.model else model_dir
            pp_rates = [(n, pp_throughput_tokens_s(pp_dir, args, n)) for n in pp_batches]
            print(f"\nthroughput at PP=2, {args.model or 'shape ' + args.shape}, "
                  f"{args.num_prompts} prompts × {args.input_len} in / {args.output_len} out, "
                  f"greedy, {args.device} (output tokens/s)")  # fmt: skip
            print(f"{'in flight':>10}{'tok/s':>10}{'vs first':>10}")
            for n, rate in pp_rates:
                print(f"{n:>10}{rate:>10.1f}{rate / pp_rates[0][1]:>10.2f}")
            # NOTE: repeat the sizes interleaved (e.g. 1,2,1,2,1,2) on a noisy machine: the
            # medians' ratio is the figure, not one run.
            medians = {n: statistics.median(r for m, r in pp_rates if m == n) for n in pp_batches}
            first = medians[pp_batches[0]]
            print("median tok/s: " + ", ".join(
                f"{n} in flight {rate:.1f} ({rate / first:.2f}×)" for n, rate in medians.items()
            ))  # fmt: skip
    if args.allreduce_iters > 0:
        sizes = [hidden * n for n in (1, 8, 64)]
        timings = allreduce_us(sizes, args.allreduce_iters)
        print(f"\nall-reduce over 2 ranks, float32 [n, {hidden}] (mean µs)")
        print(f"{'rows':>6}{'bytes':>10}{'gloo':>10}{'shm':>10}")
        for size in sizes:
            gloo_us, shm_us = timings[size]
            shm_text = "n/a" if shm_us is None else f"{shm_us:.1f}"
            print(f"{size // hidden:>6}{size * 4:>10}{gloo_us:>10.1f}{shm_text:>10}")
    sizes_tp = [int(t) for t in args.throughput_tp.split(",") if t]
    if sizes_tp:
        rates = [(tp, throughput_tokens_s(args, tp)) for tp in sizes_tp]
        print(f"\nthroughput, {args.num_prompts} prompts × {args.input_len} in / "
              f"{args.output_len} out, greedy (output tokens/s)")  # fmt: skip
        print(f"{'TP':>4}{'tok/s':>10}{'vs first':>10}")
        for tp, rate in rates:
            print(f"{tp:>4}{rate:>10.1f}{rate / rates[0][1]:>10.2f}")
    return 0
