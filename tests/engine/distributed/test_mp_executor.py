"""The 'mp' executor against real worker processes: one rank equals the in-process executor,
worker errors name their rank, and a dead worker ends the engine (idle or busy) without
orphans or hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetserve import LLM, SamplingParams
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.core.outputs import CachedRequestData, SchedulerOutput
from fleetserve.engine.worker.executor import ExecutorDeadError
from fleetserve.engine.worker.multiproc_executor import MultiprocExecutor, WorkerError

SETTINGS = {"dtype": "float32", "device": "cpu", "max_model_len": 64, "block_size": 4}
PROMPTS = [{"prompt_token_ids": [1, 7, 42, 99, 300]}, {"prompt_token_ids": [5, 6, 200]}]


def _ids(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6))
    return [o.outputs[0].token_ids for o in outs]


def _exited_within(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.timeout(300)
def test_one_rank_in_a_worker_process_equals_the_in_process_executor(
    tiny_llama_dir: Path,
) -> None:
    expected = _ids(LLM(str(tiny_llama_dir), **SETTINGS))
    llm = LLM(str(tiny_llama_dir), distributed_executor_backend="mp", **SETTINGS)
    executor = llm.engine_core.executor
    assert isinstance(executor, MultiprocExecutor) and executor.world_size == 1
    assert _ids(llm) == expected
    pids = executor.worker_pids
    llm.engine_core.shutdown()
    assert _exited_within(pids, 1.0)
    llm.engine_core.shutdown()  # idempotent


@pytest.mark.timeout(300)
def test_worker_errors_name_their_rank_and_a_dead_worker_ends_the_engine(
    tiny_llama_dir: Path,
) -> None:
    core = EngineCore(EngineConfig.create(str(tiny_llama_dir), tensor_parallel_size=2, **SETTINGS))
    executor = core.executor
    assert isinstance(executor, MultiprocExecutor)
    with pytest.raises(WorkerError, match=r"initialize_kv_cache failed on rank 0: .*; rank 1: "):
        executor.collective_rpc("initialize_kv_cache", -1)
    with pytest.raises(ValueError, match="collective_rpc method must be a public Worker"):
        executor.collective_rpc("_activation_bytes")
    assert executor.collective_rpc("get_kv_cache_block_bytes") == [2 * 2 * 4 * 1 * 32 * 4] * 2
    # A step every rank fails alike (a request no runner holds) is a step error, not a death:
    # the engine's step isolation may retry; the executor goes on serving.
    ghost = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(["ghost"], [[]], [[]], [0]),
        num_scheduled_tokens={"ghost": 1},
        total_num_scheduled_tokens=1,
        finished_req_ids=set(),
    )
    for _ in range(2):
        with pytest.raises(WorkerError, match="KeyError"):
            executor.execute_model(ghost)
    empty = SchedulerOutput([], CachedRequestData(), {}, 0, set())
    assert executor.execute_model(empty).req_ids == []
    core.check_health()
    # Idle: no step runs, yet the health check notices the death within seconds.
    pids = executor.worker_pids
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    while True:
        try:
            core.check_health()
        except ExecutorDeadError as exc:
            assert "worker rank 1" in str(exc)
            break
        assert time.monotonic() - killed_at < 5.0, "the dead worker went unnoticed for 5 s"
        time.sleep(0.05)
    assert _exited_within(pids, 5.0), "the surviving worker was not stopped"
    # A step after the death ends the engine instead of being isolated and retried.
    core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2), eos_token_ids=(2,))
    with pytest.raises(ExecutorDeadError):
        core.step()
    core.shutdown()


_ORPHAN_SCRIPT = """
import sys, time
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.worker.multiproc_executor import MultiprocExecutor
config = EngineConfig.create(sys.argv[1], dtype="float32", device="cpu", max_model_len=64,
                             tensor_parallel_size=2)
executor = MultiprocExecutor(config)
executor.collective_rpc("init_device")
print(*executor.worker_pids, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(300)
def test_workers_exit_when_the_engine_core_is_killed(tiny_llama_dir: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT, str(tiny_llama_dir)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        parent.kill()
        parent.wait()
        # NOTE: a worker polls its parent every second; 10 s leaves room for a loaded machine.
        assert _exited_within(pids, 10.0), "worker processes outlived their engine core"
    finally:
        parent.kill()
