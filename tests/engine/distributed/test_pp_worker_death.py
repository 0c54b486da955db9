"""A worker of a pipeline-parallel engine killed while batches are in flight: the engine core's
wait for the oldest batch notices within seconds, every in-flight batch is abandoned, the
surviving workers are stopped, and nothing hangs (whichever stage dies)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.worker.executor import ExecutorDeadError
from fleetserve.engine.worker.multiproc_executor import MultiprocExecutor
from tests.engine.distributed.test_mp_executor import _exited_within
from tests.engine.tiny_models import make_prompts

SETTINGS = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "block_size": 8}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("killed_rank", [0, 1], ids=["first-stage", "last-stage"])
def test_a_worker_killed_with_batches_in_flight_ends_the_engine(
    killed_rank: int, tiny_llama_dir: Path
) -> None:
    config = EngineConfig.create(
        str(tiny_llama_dir), pipeline_parallel_size=2, max_num_batched_tokens=16, **SETTINGS
    )
    core = EngineCore(config)
    executor = core.executor
    assert isinstance(executor, MultiprocExecutor) and core.batch_queue is not None
    try:
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        for i, prompt in enumerate(make_prompts(512, [30, 30, 30, 30], seed=1)):
            core.add_request(f"r{i}", prompt, params, eos_token_ids=())
        for _ in range(100):
            core.step()
            if len(core.batch_queue) == 2:
                break
        assert len(core.batch_queue) == 2, "two batches were never in flight"
        # A call to every rank between steps in flight: the driver's step results that arrive
        # before its reply are kept for the steps' futures.
        assert executor.collective_rpc("get_kv_cache_block_bytes") == [2 * 1 * 8 * 2 * 32 * 4] * 2
        assert sum(len(out.new_token_ids) for _ in range(6) for out in core.step()) > 0
        pids = executor.worker_pids
        os.kill(pids[killed_rank], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(ExecutorDeadError, match=f"worker rank {killed_rank}"):
            for _ in range(1000):
                core.step()
        assert time.monotonic() - killed_at < 5.0, "the death took more than 5 s to notice"
        assert _exited_within(pids, 5.0), "a surviving worker was not stopped"
        with pytest.raises(ExecutorDeadError):
            core.check_health()
    finally:
        core.shutdown()
