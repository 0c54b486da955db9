"""Executors drive the workers of one engine: the EngineCore's only view of them.

`Executor.get_class(parallel_config)` picks the implementation for the topology; today that is
`UniProcExecutor` (one worker, called directly in this process). A multi-process executor for
tensor/pipeline parallelism implements the same four methods: `initialize` and `shutdown` once,
`execute_model` per step, and `collective_rpc` for anything every rank must run (weight
reloads, EPLB's expert rearrangement between steps, ...).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from fleetserve.engine.config import EngineConfig, ParallelConfig
from fleetserve.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from fleetserve.engine.worker.worker import Worker


class Executor(ABC):
    """Runs the engine's workers (one per rank) in lockstep.

    Lifecycle: `initialize()` once, then `execute_model(so)` per step, then `shutdown()`.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @staticmethod
    def get_class(parallel_config: ParallelConfig) -> type[Executor]:
        """The executor class for this parallel topology.

        Raises:
            ValueError: a topology with more than one rank (the multi-process executor is not
                built yet); the message names the tensor and pipeline sizes.
        """
        if parallel_config.world_size == 1:
            return UniProcExecutor
        raise ValueError(
            "tensor_parallel_size and pipeline_parallel_size must both be 1 until the "
            f"multi-process executor is built, got {parallel_config.tensor_parallel_size} and "
            f"{parallel_config.pipeline_parallel_size} (world size {parallel_config.world_size})"
        )

    def initialize(self) -> int:
        """Bring every worker up: device, model, KV cache, CUDA graphs.

        Returns:
            The number of KV blocks (the null block 0 included), the minimum over the ranks'
            own `determine_num_kv_blocks`, so that one block id means the same on every rank;
            every rank allocates exactly this many.
        """
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")
        num_blocks = min(self.collective_rpc("determine_num_kv_blocks"))
        self.collective_rpc("initialize_kv_cache", num_blocks)
        self.collective_rpc("capture_cuda_graphs")
        return int(num_blocks)

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step on every rank.

        Args:
            scheduler_output: the step's schedule (the same object for every rank).

        Returns:
            The sampled tokens (and logprobs) of the scheduled requests, from the rank that
            samples (the last pipeline stage; rank 0 when there is one rank).

        Side effects:
            every worker's persistent batch, KV caches and seeded generators advance by the step.
        """

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call the public `Worker` method `method(*args, **kwargs)` on every rank.

        Returns:
            One result per rank, in rank order.

        Raises:
            ValueError: `method` is not a public Worker method.
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Release every worker's graphs, model and KV cache (the process may keep running)."""


def _worker_method(worker: Worker, method: str) -> Any:
    if method.startswith("_") or not callable(getattr(type(worker), method, None)):
        raise ValueError(f"collective_rpc method must be a public Worker method, got {method!r}")
    return getattr(worker, method)


class UniProcExecutor(Executor):
    """One worker in this process, called directly (no RPC)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config, rank=0)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [_worker_method(self.worker, method)(*args, **kwargs)]

    def shutdown(self) -> None:
        self.worker.shutdown()
