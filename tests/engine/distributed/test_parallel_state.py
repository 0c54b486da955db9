"""Process groups from the shared rank layout: the seed's example, the operator's multi-node
sample rendered and joined by the engine's groups, and real gloo groups in 4 processes."""

from __future__ import annotations

import argparse
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

import fleetserve.api.topology as topology
from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.common.ports import free_port
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.config import ParallelConfig
from fleetserve.engine.distributed import parallel_state
from fleetserve.engine.distributed.parallel_state import ParallelState, layout_of
from fleetserve.envs import env_name

SAMPLES_DIR = Path(__file__).resolve().parents[3] / "manifests" / "samples"


def test_world_8_tp2_pp4_gives_the_seed_groups() -> None:
    layout = layout_of(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=4))
    assert layout.pipeline == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_of("pipeline", 5) == [1, 3, 5, 7]
    assert layout.group_of("tensor", 5) == [4, 5]


def test_operator_sample_and_engine_groups_come_from_one_function() -> None:
    """The operator renders multinode-decode.yaml's decode group (TP8 × PP2, two 8-GPU pods);
    the engine parses the rendered flags and env into its layout with the same function."""
    import yaml

    from fleetserve.operator.builders import Owner, build_children

    doc = yaml.safe_load((SAMPLES_DIR / "multinode-decode.yaml").read_text())
    spec = InferenceDeploymentSpec.model_validate(doc["spec"])
    owner = Owner(name="d", namespace="ns", uid="u")
    sts = next(
        c for c in build_children(spec, owner)
        if c["kind"] == "StatefulSet" and c["metadata"]["name"] == "d-decode-0"
    )  # fmt: skip
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    namespace, _server_flags = parser.parse_known_args(container["args"][1:])
    args = EngineArgs.from_cli_args(namespace)
    assert parallel_state.rank_layout is topology.rank_layout  # one function, not two
    engine = layout_of(
        ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            data_parallel_size=args.data_parallel_size,
        )
    )
    world = int(env[env_name("world_size")] or 0)
    assert engine == topology.rank_layout(world, tensor=8, pipeline=2)
    assert engine.world_size == world == 16
    pods = sts["spec"]["replicas"]
    ranks_per_pod = world // pods
    assert (pods, ranks_per_pod) == (2, 8)
    # Every TP group lives inside one pod (NVLink); the PP groups cross the two pods.
    for group in engine.tensor:
        assert len({r // ranks_per_pod for r in group}) == 1
    assert engine.pipeline == [[t, t + 8] for t in range(8)]


def _rank_main(rank: int, port: int, queue: Any) -> None:
    parallel = ParallelConfig(
        tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp"
    )
    state = ParallelState.create(
        parallel, rank=rank, init_method=f"tcp://127.0.0.1:{port}", device=torch.device("cpu")
    )
    tp_sum = state.tensor.all_reduce(torch.tensor([float(rank)])).item()
    pp_sum = state.pipeline.all_reduce(torch.tensor([float(rank)])).item()
    gathered = state.tensor.all_gather(torch.tensor([[rank]]), dim=-1).tolist()
    obj = state.pipeline.broadcast_object({"from": rank} if state.pipeline.is_first else None)
    state.world.barrier()
    result = {
        "rank": rank,
        "tp": state.tensor.ranks,
        "pp": state.pipeline.ranks,
        "dp": state.data.ranks,
        "tp_sum": tp_sum,
        "pp_sum": pp_sum,
        "gathered": gathered,
        "obj": obj,
        "expert": state.expert,
    }
    state.destroy()
    state.destroy()  # idempotent
    queue.put(result)


@pytest.mark.timeout(120)
def test_gloo_groups_in_four_processes_follow_the_layout() -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, queue)) for r in range(4)]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=90) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    layout = topology.rank_layout(4, tensor=2, pipeline=2)
    for r in results:
        rank = r["rank"]
        assert r["tp"] == layout.group_of("tensor", rank)
        assert r["pp"] == layout.group_of("pipeline", rank)
        assert r["dp"] == [rank]
        assert r["tp_sum"] == sum(r["tp"]) and r["pp_sum"] == sum(r["pp"])
        assert r["gathered"] == [r["tp"]]
        assert r["obj"] == {"from": r["pp"][0]}
        assert r["expert"] is None  # a dense model has no EP group
