"""Executors drive the workers of one engine: the EngineCore's only view of them.

`Executor.get_class(parallel_config)` picks the implementation named by
`distributed_executor_backend`: `UniProcExecutor` ('uni': one worker, called directly in this
process) or `MultiprocExecutor` ('mp': one worker process per rank, in
`multiproc_executor.py`). Both implement the same methods: `initialize` and `shutdown` once,
`execute_model` per step (or `execute_model_async`, which returns a `StepFuture`, so that up to
`max_concurrent_batches` steps are in flight), `collective_rpc` for anything every rank must run
(weight reloads, EPLB's expert rearrangement between steps, ...), and `check_health`, which the
engine core calls between steps so that a dead worker ends the engine even while it is idle.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fleetserve.engine.config import EngineConfig, ParallelConfig
from fleetserve.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from fleetserve.engine.worker.cpu_malloc import tune_cpu_malloc
from fleetserve.engine.worker.cpu_threads import configure_cpu_threads
from fleetserve.engine.worker.worker import Worker
from fleetserve.envs import read_env


class ExecutorDeadError(RuntimeError):
    """A worker died, hung or diverged from its peers: the executor cannot run another step
    (no request-level recovery applies; the engine must end)."""


class StepFuture:
    """The pending result of one step submitted with `Executor.execute_model_async`.

    `result()` blocks until the step's output is back (bounded by the executor's liveness
    checks: a dead worker raises `ExecutorDeadError`, never a hang) and caches it, or its error.
    Results must be taken in submission order (every stage runs steps in that order).
    """

    def __init__(self, wait: Callable[[], ModelRunnerOutput]) -> None:
        self._wait: Callable[[], ModelRunnerOutput] | None = wait
        self._output: ModelRunnerOutput | None = None
        self._error: BaseException | None = None

    @classmethod
    def completed(cls, output: ModelRunnerOutput) -> StepFuture:
        future = cls(lambda: output)
        future.result()
        return future

    def result(self) -> ModelRunnerOutput:
        """The step's output.

        Raises:
            ExecutorDeadError: a worker died (or hung) before the step's output came back.
            Exception: the step's own error (e.g. `WorkerError`), raised again on each call.
        """
        if self._wait is not None:
            wait, self._wait = self._wait, None
            try:
                self._output = wait()
            except Exception as error:
                self._error = error
        if self._error is not None:
            raise self._error
        assert self._output is not None
        return self._output


class Executor(ABC):
    """Runs the engine's workers (one per rank) in lockstep.

    Lifecycle: `initialize()` once, then `execute_model(so)` per step, then `shutdown()`.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @staticmethod
    def get_class(parallel_config: ParallelConfig) -> type[Executor]:
        """The executor class `parallel_config.distributed_executor_backend` names.

        Raises:
            ValueError: 'uni' for more than one rank (ParallelConfig refuses it too).
        """
        backend = parallel_config.executor_backend
        if backend == "mp":
            from fleetserve.engine.worker.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        if parallel_config.world_size != 1:
            raise ValueError(
                "distributed_executor_backend must be 'mp' for more than one rank, got "
                f"{backend!r} with world size {parallel_config.world_size}"
            )
        return UniProcExecutor

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

    @property
    def max_concurrent_batches(self) -> int:
        """Steps that may be in flight at once (`execute_model_async` before the oldest result
        is taken); 1 when execution is synchronous."""
        return 1

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Submit one step without waiting for it (see `execute_model`); at most
        `max_concurrent_batches` may be pending, and their results are taken oldest first.

        The base implementation runs the step now (the in-process executor has nothing to
        overlap), so its errors raise here; a pipelined executor raises them from `result()`.
        """
        return StepFuture.completed(self.execute_model(scheduler_output))

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call the public `Worker` method `method(*args, **kwargs)` on every rank.

        Returns:
            One result per rank, in rank order.

        Raises:
            ValueError: `method` is not a public Worker method.
        """

    def check_health(self) -> None:  # noqa: B027 - in-process workers: nothing to check
        """Cheap liveness check between steps.

        Raises:
            ExecutorDeadError: a worker is gone (the in-process worker never is).
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Release every worker's graphs, model and KV cache (the process may keep running)."""


def check_worker_method(method: str) -> None:
    """Raises ValueError unless `method` is a public method of `Worker`."""
    if method.startswith("_") or not callable(getattr(Worker, method, None)):
        raise ValueError(f"collective_rpc method must be a public Worker method, got {method!r}")


def _worker_method(worker: Worker, method: str) -> Any:
    check_worker_method(method)
    return getattr(worker, method)


class UniProcExecutor(Executor):
    """One worker in this process, called directly (no RPC).

    Under async scheduling every call to the worker, from `initialize` on, runs on one worker
    thread, in submission order: `execute_model_async` returns at once (two steps may be
    queued), so the engine core schedules the next step while this one runs, and
    `collective_rpc` waits behind the steps already submitted (it never sees a half-run step).
    One thread for everything also keeps thread-bound state (the CUDA device and streams,
    graphs, compiled code) on the thread that runs the steps.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._worker_thread: threading.Thread | None = None
        """The thread that runs every worker call under async scheduling (set on its start)."""
        self._stopped = False
        self._thread: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(
                1, thread_name_prefix="fleetserve-worker", initializer=self._on_worker_thread
            )
            if config.scheduler.async_scheduling
            else None
        )
        parallel = config.parallel
        if config.device.device == "cpu":
            configure_cpu_threads(1)
            tune_cpu_malloc(read_env().cpu_malloc_tuning != 0)
        # NOTE: a lockstep data-parallel rank's one worker is rank `data_parallel_rank` of the
        # world all DP ranks share (tensor × pipeline is 1 here).
        self.worker = Worker(
            config,
            rank=parallel.data_parallel_rank if parallel.needs_dp_lockstep else 0,
            distributed_init_method=parallel.data_parallel_init_method,
        )

    @property
    def max_concurrent_batches(self) -> int:
        return 1 if self._thread is None else 2

    def _on_worker_thread(self) -> None:
        self._worker_thread = threading.current_thread()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._thread is not None and threading.current_thread() is not self._worker_thread:
            # NOTE: behind the steps already submitted, never beside one.
            return self.execute_model_async(scheduler_output).result()
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        if self._thread is None:
            return super().execute_model_async(scheduler_output)
        # NOTE: `self.execute_model` looked up now and called on the worker thread, where it
        # runs the worker directly (a wrapper set on the instance, e.g. a test's, applies too).
        future = self._thread.submit(self.execute_model, scheduler_output)
        return StepFuture(future.result)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        call = _worker_method(self.worker, method)
        if self._thread is not None:
            return [self._thread.submit(call, *args, **kwargs).result()]
        return [call(*args, **kwargs)]

    def shutdown(self) -> None:
        if self._thread is None:
            self.worker.shutdown()
            return
        if self._stopped:
            return  # NOTE: idempotent, as the worker's own shutdown
        self._stopped = True
        # NOTE: after the steps still queued (their results are dropped), on the worker thread.
        try:
            self._thread.submit(self.worker.shutdown).result()
        finally:
            self._thread.shutdown(wait=True)
