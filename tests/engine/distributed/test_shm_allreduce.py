"""The shared-memory all-reduce of the tensor-parallel group on the CPU: bitwise equal to gloo's
for decode-sized tensors of every supported dtype, declining (gloo takes over) above its size
threshold, and off when disabled."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fleetserve.common.ports import free_ports
from fleetserve.engine.config import ParallelConfig
from fleetserve.engine.distributed.parallel_state import ParallelState
from fleetserve.engine.distributed.shm_allreduce import DEFAULT_MAX_BYTES


def _rank_main(rank: int, ports: tuple[int, int], queue: Any) -> None:
    state = ParallelState.create(
        ParallelConfig(tensor_parallel_size=2),
        rank=rank,
        init_method=f"tcp://127.0.0.1:{ports[0]}",
        device=torch.device("cpu"),
    )
    tp = state.tensor
    assert tp.shm is not None
    report: dict[str, Any] = {"equal": [], "declined": None}
    generator = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((1, 64), (8, 576), (3, 7, 5), (DEFAULT_MAX_BYTES // 4,)):
            x = torch.randn(shape, generator=generator).to(dtype)
            if x.numel() * x.element_size() > DEFAULT_MAX_BYTES:
                continue
            ours = tp.all_reduce(x.clone())
            reference = x.clone()
            dist.all_reduce(reference, group=tp.device_group)
            report["equal"].append(bool(torch.equal(ours, reference)))
    big = torch.ones(DEFAULT_MAX_BYTES // 4 + 1)
    summed = tp.all_reduce(big.clone())
    report["declined"] = not tp.shm.accepts(big) and bool(torch.equal(summed, big * 2))
    for _ in range(50):  # many calls in a row: banks alternate, nothing overwritten early
        y = torch.full((4, 64), float(rank + 1))
        report["equal"].append(bool(torch.equal(tp.all_reduce(y), torch.full((4, 64), 3.0))))
    state.destroy()
    gloo_only = ParallelState.create(
        ParallelConfig(tensor_parallel_size=2),
        rank=rank,
        init_method=f"tcp://127.0.0.1:{ports[1]}",
        device=torch.device("cpu"),
        custom_all_reduce=False,
    )
    report["off"] = gloo_only.tensor.shm is None
    gloo_only.destroy()
    queue.put((rank, report))


@pytest.mark.timeout(120)
def test_shm_allreduce_equals_gloo_and_declines_large_tensors() -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    ports = tuple(free_ports(2))
    procs = [ctx.Process(target=_rank_main, args=(r, ports, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=90) for _ in procs]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    for _rank, report in results:
        assert report["equal"] and all(report["equal"])
        assert report["declined"] is True
        assert report["off"] is True
