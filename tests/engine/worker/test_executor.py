"""The Executor interface: the class chosen from the parallel config, collective_rpc, the KV block
count as the minimum over ranks, and a shutdown that really releases the model and caches."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

from fleetserve.engine.config import EngineConfig, ParallelConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from fleetserve.engine.worker.executor import Executor, UniProcExecutor
from fleetserve.engine.worker.worker import Worker


def _config(model_dir: Path, **kwargs: Any) -> EngineConfig:
    settings: dict[str, Any] = {"dtype": "float32", "device": "cpu", "block_size": 4}
    settings |= {"max_num_seqs": 2, "max_model_len": 64, **kwargs}
    return EngineConfig.create(str(model_dir), **settings)


def test_get_class_picks_the_uniproc_executor_for_one_rank() -> None:
    assert Executor.get_class(ParallelConfig()) is UniProcExecutor


def test_get_class_follows_the_executor_backend() -> None:
    from fleetserve.engine.worker.multiproc_executor import MultiprocExecutor

    assert Executor.get_class(ParallelConfig(tensor_parallel_size=2)) is MultiprocExecutor
    assert Executor.get_class(ParallelConfig(distributed_executor_backend="mp")) is (
        MultiprocExecutor
    )
    with pytest.raises(ValueError, match="distributed_executor_backend must be 'mp' or 'auto'"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        ParallelConfig(distributed_executor_backend="ray")


def test_engine_core_takes_its_executor_from_get_class(tiny_llama_dir: Path) -> None:
    config = _config(tiny_llama_dir, num_kv_blocks=16)
    core = EngineCore(config)
    assert type(core.executor) is UniProcExecutor
    core.shutdown()


def test_collective_rpc_calls_the_worker_and_returns_one_result_per_rank(
    tiny_llama_dir: Path,
) -> None:
    executor = UniProcExecutor(_config(tiny_llama_dir))
    assert executor.initialize() == 2 * 16 + 1
    assert executor.collective_rpc("determine_num_kv_blocks") == [33]
    # 2 layers x (K + V) x 4 tokens x 2 kv heads x 32 dims x 4 bytes
    assert executor.collective_rpc("get_kv_cache_block_bytes") == [2 * 2 * 4 * 2 * 32 * 4]
    assert executor.collective_rpc("initialize_kv_cache", num_blocks=9) == [None]
    assert executor.worker.model_runner.kv_caches[0].shape[1] == 9
    for bad in ("_activation_bytes", "model_runner", "no_such_method"):
        with pytest.raises(ValueError, match="collective_rpc method must be a public Worker"):
            executor.collective_rpc(bad)
    executor.shutdown()


class _TwoWorkers(Executor):
    """Two real workers in this process (each a full rank-0 engine), to exercise the interface's
    `initialize` across ranks whose memory budgets differ."""

    def __init__(self, config: EngineConfig, second: EngineConfig) -> None:
        super().__init__(config)
        self.workers = [Worker(config), Worker(second)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        outputs = [w.execute_model(scheduler_output) for w in self.workers]
        return outputs[0]

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(w, method)(*args, **kwargs) for w in self.workers]

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()


def test_initialize_allocates_the_minimum_over_ranks(tiny_llama_dir: Path) -> None:
    executor = _TwoWorkers(_config(tiny_llama_dir, num_kv_blocks=20), _config(tiny_llama_dir))
    assert executor.initialize() == 20  # the second rank alone could hold 33
    assert [w.model_runner.kv_caches[0].shape[1] for w in executor.workers] == [20, 20]
    executor.shutdown()


def test_shutdown_releases_the_model_and_the_kv_caches(tiny_llama_dir: Path) -> None:
    executor = UniProcExecutor(_config(tiny_llama_dir))
    executor.initialize()
    runner = executor.worker.model_runner
    assert runner.model is not None
    model = weakref.ref(runner.model)
    caches = [weakref.ref(cache) for cache in runner.kv_caches]
    del runner
    executor.shutdown()
    gc.collect()
    assert model() is None
    assert all(cache() is None for cache in caches)
    with pytest.raises(AssertionError, match="init_device"):
        _ = executor.worker.model_runner
    executor.shutdown()  # idempotent
