"""Data parallel's pure parts (issue 16): the ranks' configs and devices, the balancing rule,
the front end's wave bookkeeping, the per-rank metric series and the engine flags' refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.outputs import SchedulerStats
from fleetserve.engine.distributed.data_parallel import (
    DPCoreSpec,
    WaveTracker,
    pick_rank,
    rank_config,
    visible_devices,
)
from fleetserve.engine.metrics import EngineMetrics, MetricFamilies
from fleetserve.envs import Env


def test_the_least_loaded_rank_wins_and_ties_go_round_robin() -> None:
    assert pick_rank([3, 1, 2], cursor=0) == 1
    assert pick_rank([0, 0, 0], cursor=0) == 0
    assert pick_rank([0, 0, 0], cursor=1) == 1
    assert pick_rank([0, 0, 0], cursor=5) == 2
    assert pick_rank([1, 0, 0], cursor=0) == 1
    assert pick_rank([0, 1, 0], cursor=1) == 2  # the tie after the cursor, wrapping
    with pytest.raises(ValueError, match="loads"):
        pick_rank([], cursor=0)


def test_waves_start_once_per_wave_from_requests_or_cores() -> None:
    waves = WaveTracker()
    assert not waves.running
    assert waves.on_request() == 0  # the first request starts wave 0
    assert waves.on_request() is None  # it runs
    waves.on_complete(0)
    waves.on_complete(0)  # every rank reports it
    assert not waves.running and waves.completed == 1
    assert waves.on_request() == 1
    # Wave 1 ended on the cores, and a request reached one before the front end heard: the
    # core asks for wave 2, once, though both the report and the ask arrive.
    assert waves.on_core_request(2) == 2
    assert waves.on_core_request(2) is None
    waves.on_complete(1)
    assert waves.running and waves.on_request() is None
    # A stale ask (for a wave already started) starts nothing.
    assert waves.on_core_request(1) is None


def test_each_rank_sees_its_own_slice_of_the_devices() -> None:
    assert visible_devices(0, 2, None) == "0,1"
    assert visible_devices(1, 2, None) == "2,3"
    assert visible_devices(1, 1, "4,5,6") == "5"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='4,5' lists 2 devices"):
        visible_devices(1, 2, "4,5")


def test_a_lockstep_core_spec_needs_its_wave_group() -> None:
    with pytest.raises(ValueError, match="rank must be in"):
        DPCoreSpec(rank=2, size=2, lockstep=False)
    with pytest.raises(ValueError, match="wave_address"):
        DPCoreSpec(rank=0, size=2, lockstep=True)


def test_replica_and_lockstep_rank_configs(tiny_llama_dir: Path) -> None:
    import dataclasses

    config = EngineConfig.create(str(tiny_llama_dir), device="cpu", data_parallel_size=2)
    assert not config.parallel.needs_dp_lockstep
    replica = rank_config(config, 1, None).parallel
    assert (replica.data_parallel_size, replica.data_parallel_rank) == (1, 0)
    assert replica.world_size_across_dp == 1  # an engine of its own
    lockstep = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, force_dp_lockstep=True)
    )
    rank = rank_config(lockstep, 1, "tcp://127.0.0.1:1234").parallel
    assert (rank.data_parallel_size, rank.data_parallel_rank) == (2, 1)
    assert rank.data_parallel_init_method == "tcp://127.0.0.1:1234"
    assert rank.world_size_across_dp == 2
    with pytest.raises(ValueError, match="init_method"):
        rank_config(lockstep, 0, None)
    with pytest.raises(ValueError, match="rank must be in"):
        rank_config(config, 2, None)


def test_data_parallel_flags_are_refused_where_not_built(tiny_llama_dir: Path) -> None:
    model = str(tiny_llama_dir)
    cases = [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2 is not implemented"),
        ({"kv_transfer_config": {"connector": "tcp"}}, "KV transfer between data-parallel"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=rf"^data_parallel_size=2 .*{message}"):
            EngineArgs(
                model=model, device="cpu", data_parallel_size=2, **kwargs
            ).create_engine_config()
    with pytest.raises(ValueError, match=r"in a group of 2 pods .* not implemented"):
        EngineArgs(model=model, device="cpu", data_parallel_size=2).create_engine_config(
            Env(world_size=2, group_size=2, rank=0)
        )
    # A lone engine core (the offline LLM) runs one rank; `fleetserve serve` runs them all.
    from fleetserve import LLM

    with pytest.raises(ValueError, match="runs one engine core per rank"):
        LLM(model, device="cpu", data_parallel_size=2)


def test_ranks_metrics_are_one_series_per_rank() -> None:
    registry = CollectorRegistry()
    families = MetricFamilies(registry, per_engine=True)
    ranks = [
        EngineMetrics(registry, "m", families=families, engine=str(r), spec_decode=True)
        for r in range(2)
    ]
    ranks[0].record_scheduler_stats(SchedulerStats(num_running_reqs=3))
    ranks[1].record_scheduler_stats(SchedulerStats(num_running_reqs=1))
    text = generate_latest(registry).decode()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 3.0' in text
    assert 'vllm:num_requests_running{engine="1",model_name="m"} 1.0' in text
    with pytest.raises(ValueError, match="engine must be given"):
        EngineMetrics(registry, "m", families=families)
    # Without data parallel the series carry no engine label (unchanged).
    single = CollectorRegistry()
    EngineMetrics(single, "m").record_scheduler_stats(SchedulerStats(num_running_reqs=2))
    assert 'vllm:num_requests_running{model_name="m"} 2.0' in generate_latest(single).decode()


def test_the_crd_keeps_data_parallel_in_one_unified_pod() -> None:
    """What the engine serves (one pod's server over its ranks, no KV transfer, pipeline 1),
    admitted by the same rules in Python as in CEL (`fleetserve.api.models`)."""
    from pydantic import ValidationError

    from fleetserve.api.models import InferenceDeploymentSpec

    def spec(roles: dict, connector: str = "none") -> InferenceDeploymentSpec:
        return InferenceDeploymentSpec.model_validate(
            {
                "model": {"name": "m", "source": {"uri": "/m"}},
                "roles": roles,
                "kvTransfer": {"connector": connector},
            }
        )

    ok = spec({"unified": {"gpusPerPod": 4, "parallelism": {"tensor": 2, "data": 2}}})
    assert ok.roles.unified is not None and ok.roles.unified.group_size == 1
    with pytest.raises(ValidationError, match="data > 1 runs every data-parallel rank in one pod"):
        spec({"unified": {"gpusPerPod": 2, "parallelism": {"tensor": 2, "data": 2}}})
    with pytest.raises(ValidationError, match="with pipeline 1"):
        spec({"unified": {"gpusPerPod": 4, "parallelism": {"pipeline": 2, "data": 2}}})
    with pytest.raises(ValidationError, match="data > 1 needs a unified role"):
        spec({"prefill": {}, "decode": {"gpusPerPod": 2, "parallelism": {"data": 2}}}, "tcp")


def test_lockstep_data_parallel_refuses_what_it_does_not_build(tiny_llama_dir: Path) -> None:
    args = {"model": str(tiny_llama_dir), "device": "cpu", "data_parallel_size": 2,
            "enable_expert_parallel": True}  # fmt: skip
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 is not implemented yet"):
        EngineArgs(**args, tensor_parallel_size=2).create_engine_config()
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    with pytest.raises(ValueError, match=r"speculative_config is not implemented yet"):
        EngineArgs(**args, speculative_config=spec).create_engine_config()


def test_the_autoscaler_reads_a_data_parallel_pods_kv_usage_as_the_mean_of_its_ranks() -> None:
    from fleetserve.operator.autoscale.load import parse_engine_metrics

    registry = CollectorRegistry()
    families = MetricFamilies(registry, per_engine=True)
    for rank, usage in enumerate((0.2, 0.6)):
        metrics = EngineMetrics(registry, "m", families=families, engine=str(rank))
        metrics.record_scheduler_stats(
            SchedulerStats(num_running_reqs=rank + 1, kv_cache_usage=usage)
        )
    counters = parse_engine_metrics(generate_latest(registry).decode(), time_s=0.0)
    assert counters.kv_usage == pytest.approx(0.4)
    assert counters.requests_running == 3  # counts are summed over the ranks
